"""The entry of the command line (:func:`main`): ``train`` runs the fine-tune job
(rpcompile.finetune); ``plan``, ``models`` and ``hardware`` build their report and print it. A
user error (a ValueError) prints one line naming what to change and exits 2."""

from __future__ import annotations

import argparse
import sys

from rpcompile.cli.parser import _parser
from rpcompile.cli.plan import _plan
from rpcompile.cli.reports import HardwareReport, ModelsReport, _print_report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "models":
            report = _models()
        elif args.command == "hardware":
            report = _hardware()
        else:
            report = _plan(args)
        _print_report(report, args.json)
        return 0
    except ValueError as err:  # user errors: say what to change, no traceback
        print(f"rpcompile: error: {err}", file=sys.stderr)
        return 2


def _models() -> ModelsReport:
    from rpcompile.workloads.models import list_models

    return ModelsReport(models=list(list_models()))


def _hardware() -> HardwareReport:
    from rpcompile.hardware import get_hardware, get_link, list_hardware, list_links

    profiles = []
    for name in list_hardware():
        hw = get_hardware(name)
        profiles.append({"name": name, "gpus": hw.gpus, "gpu": hw.gpu,
                         "memory_gib": hw.memory_gib, "matmul_tflops": hw.matmul_tflops,
                         "h2d_gbps": hw.h2d_gbps, "d2h_gbps": hw.d2h_gbps,
                         "pageable_h2d_gbps": hw.pageable_h2d_gbps,
                         "pageable_d2h_gbps": hw.pageable_d2h_gbps,
                         "host_ram_gib": hw.host_ram_gib})
    links = []
    for name in list_links():
        link = get_link(name)
        links.append({"name": name, "link": link.name, "efficiency": link.efficiency,
                      "latency_us": link.latency_us})
    return HardwareReport(profiles=profiles, links=links)


def _train(args: argparse.Namespace) -> int:
    from rpcompile.finetune import run

    return run(args)
