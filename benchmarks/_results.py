"""Where a benchmark's figures go: one JSON file under ``benchmarks/results/``, stamped with
the commit and the machine that made it. ``benchmarks/report.py`` renders every such file
into ``docs/results.md``, so a figure in the docs is regenerated, never typed. Not a
benchmark itself.

A result file is ``{"stamp": {...}, "figures": ...}``. The stamp holds the script, its
command line, the commit (``git rev-parse HEAD``) and whether the code that runs
(``rpcompile/``, ``benchmarks/`` but its results, ``tests/``, ``pyproject.toml``) differed
from that commit, the machine (CPU, cores, RAM, GPUs, Python and torch versions), the UTC
time the run started and its wall time. The commit, the code check and the start time are
taken when this module is imported, which is when the script starts: what ran is the code of
that moment, whatever is committed while it runs. The stamp names this repository's commit,
so a result is written only when the ``rpcompile`` the script imported is this repository's
(a ``PYTHONPATH`` or install pointing at another checkout would credit its figures to the
wrong code)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
# The paths whose content decides a figure (docs and results do not).
CODE_PATHS = ("rpcompile", "benchmarks", "tests", "pyproject.toml")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def source() -> dict[str, Any]:
    """``{"commit": sha or None, "code_changed": bool or None}``: the checked-out commit, and
    whether the code that runs differs from it (uncommitted edits or new files under
    ``CODE_PATHS``, results excluded). None where git or the repository is not there."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", *CODE_PATHS, ":(exclude)benchmarks/results")
    return {"commit": sha.strip() if sha else None,
            "code_changed": None if status is None else bool(status.strip())}


# The stamp's time and source are taken here, when the script starts: a commit made while a
# long benchmark runs must not be credited with figures the older code produced.
_STARTED = time.perf_counter()
_STARTED_AT = datetime.datetime.now(datetime.timezone.utc)
_SOURCE = source()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, logical cores, RAM, GPUs (names; empty
    without CUDA), operating system, Python and torch versions."""
    import torch

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "gpus": gpus, "system": platform.platform(terse=True),
            "python": platform.python_version(), "torch": torch.__version__}


def _command() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        shown = script.relative_to(ROOT).as_posix()
    except ValueError:
        shown = sys.argv[0]
    return " ".join(["python", shown, *sys.argv[1:]])


def stamp() -> dict[str, Any]:
    """The stamp of this run (see the module docstring)."""
    return {"script": Path(sys.argv[0]).name, "command": _command(), **_SOURCE,
            "machine": machine(),
            "started_utc": _STARTED_AT.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - _STARTED, 1)}


def foreign_package() -> Path | None:
    """Where the imported ``rpcompile`` lives when that is outside this repository (None when
    it is this repository's, or not imported)."""
    module = sys.modules.get("rpcompile")
    where = getattr(module, "__file__", None)
    if where is None:
        return None
    package = Path(where).resolve().parent
    return None if package.is_relative_to(ROOT) else package


def write_result(path: str | Path, figures: Any) -> Path:
    """Write ``figures`` (anything JSON can hold) to ``path`` as a stamped result file, making
    its folder; returns the path. Raises RuntimeError when the script ran another
    checkout's ``rpcompile`` (:func:`foreign_package`): the stamp would name code that did
    not run."""
    if (foreign := foreign_package()) is not None:
        raise RuntimeError(
            f"this run imported rpcompile from {foreign}, not from {ROOT}, whose commit the "
            f"result would be stamped with; run it with PYTHONPATH={ROOT}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stamp": stamp(), "figures": figures}, indent=1) + "\n")
    return path
