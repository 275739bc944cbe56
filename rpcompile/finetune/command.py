"""The entry of ``rpcompile train`` (:func:`run`): the options resolved and checked, the ranks
joined under ``torchrun``, the signal handlers installed, then the job."""

from __future__ import annotations

import argparse
import functools

from rpcompile.finetune.config import _check, option_origin, resolve_options
from rpcompile.finetune.job import _Job


def run(args: argparse.Namespace) -> int:
    """Run ``rpcompile train`` (see the module doc); returns the exit status: 0, or 130 / 143
    when SIGINT / SIGTERM stopped it (rpcompile.interrupts)."""
    from transformers.utils import logging as hf_logging

    from rpcompile.interrupts import Interrupts

    opts, checkpoint = resolve_options(args)
    origin = functools.partial(option_origin, args)
    _check(opts, origin)
    hf_logging.disable_progress_bar()  # one bar: ours
    rank, world, started = _join_ranks()
    stop = Interrupts()
    try:
        # Data parallel: a signal stops every rank at once (torchrun forwards it to each); the
        # ranks would not stop after the same step, so no checkpoint is written then.
        with stop.installed(world == 1):
            return _Job(opts, checkpoint, rank, world, origin, stop).run()
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()


def _join_ranks() -> tuple[int, int, bool]:
    """(rank, world size, whether this call started the process group). Under ``torchrun``
    (``WORLD_SIZE`` > 1 in the environment) every rank joins the default gloo group and the
    run is data parallel (rpcompile.runtime.distributed); otherwise (0, 1, False)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), True
