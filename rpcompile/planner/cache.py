"""The plan cache: a searched plan kept on disk, so the same job never searches twice.

A plan is a pure function of the partitioner's inputs: the unit profiles (the model's structure,
dtypes and costs at the batch shape, on the hardware), the hardware profile, the microbatch
shape, the stage costing, the plan options, the device capacity and the gradient check's
passes. The cache key is a hash of exactly those, plus rpcompile's version and a hash of the
source of every module a plan's search reads (the planner, the passes, the simulator, the IR,
the hardware and option definitions), so a changed search never serves an old plan.

An entry is one JSON file (``<key>.json``: the plan as data, and the key's inputs for a person
to read). A file that cannot be read, does not parse, or parses to a plan that fails its own
checks or was made for other units, is skipped with a warning and searched again; a write that
fails (a read-only folder) warns and the run goes on with the plan it searched.

Where: ``PlanOptions.plan_cache`` (``True``: ``$RPCOMPILE_CACHE_DIR``, else
``$XDG_CACHE_HOME/rpcompile/plans``, else ``~/.cache/rpcompile/plans``, and off when
``RPCOMPILE_PLAN_CACHE=0``; a folder; ``False``: off).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import Plan, Stage, UnitProfile
from rpcompile.options import PlanOptions

__all__ = ["FORMAT", "cache_folder", "cached_plan", "plan_from_dict", "plan_key", "plan_to_dict"]

FORMAT = 1
# Plan options that decide nothing of the plan (how planning reports and where it keeps
# plans), left out of the key.
_NOT_IN_KEY = {"dynamic": True, "plan_cache": True, "progress": None, "hardware": None}


def cache_folder(option: Any) -> Path | None:
    """The folder ``PlanOptions.plan_cache`` names; None when the cache is off."""
    if option is False:
        return None
    if option is True:
        if os.environ.get("RPCOMPILE_PLAN_CACHE", "").lower() in ("0", "off", "false", "no"):
            return None
        env = os.environ.get("RPCOMPILE_CACHE_DIR")
        if env:
            return Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "rpcompile" / "plans"
    return Path(option).expanduser()


@functools.cache
def _source_digest() -> str:
    """A hash of the source the search reads: any edit to it makes every entry stale."""
    root = Path(__file__).resolve().parent.parent
    files = [root / name for name in ("hardware.py", "options.py", "choices.py")]
    for package in ("ir", "planner", "passes", "sim"):
        files += sorted((root / package).rglob("*.py"))
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rpcompile")
    except PackageNotFoundError:
        return "unknown"


def plan_key(units: Sequence[UnitProfile], hardware: Hardware, microbatch_size: int,
             seq_len: int, costing: Any, options: PlanOptions, capacity_bytes: int | None,
             grad_check_passes: int) -> tuple[str, dict[str, str]]:
    """The key of a search (a hex digest) and what went into it, readably."""
    inputs = {
        "rpcompile": _version(),
        "source": _source_digest(),
        "units": repr(tuple(units)),
        "hardware": repr(hardware),
        "shape": f"{microbatch_size} x {seq_len}",
        "costing": repr(costing),
        "options": repr(dataclasses.replace(options, **_NOT_IN_KEY)),
        "capacity_bytes": repr(capacity_bytes),
        "grad_check_passes": repr(grad_check_passes),
    }
    text = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32], inputs


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """``plan`` as JSON-ready data (tuples as lists)."""
    return dataclasses.asdict(plan)


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """The :class:`Plan` of :func:`plan_to_dict`'s data: every list back to a tuple, the units
    and stages back to their dataclasses. Raises on data of another shape."""
    def frozen(value: Any) -> Any:
        return tuple(frozen(v) for v in value) if isinstance(value, list) else value

    def build(cls: type, fields: dict[str, Any]) -> Any:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise InvalidInput(f"unknown {cls.__name__} fields {sorted(unknown)}")
        return cls(**{k: frozen(v) for k, v in fields.items()})

    fields = dict(data)
    fields["units"] = [build(UnitProfile, u) for u in fields["units"]]
    fields["stages"] = [build(Stage, s) for s in fields["stages"]]
    return build(Plan, fields)


def cached_plan(search: Callable[[], Plan], key: str, inputs: dict[str, str],
                units: Sequence[UnitProfile], folder: Path | None,
                notice: Callable[[str], None]) -> tuple[Plan, bool]:
    """The plan of ``key`` from ``folder`` when a sound entry is there, else ``search()``'s
    (then stored). Returns the plan and whether it came from the cache."""
    if folder is None:
        return search(), False
    path = folder / f"{key}.json"
    if path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != FORMAT or doc.get("key") != key:
                raise InvalidInput("written for another key or format")
            plan = plan_from_dict(doc["plan"])
            plan.validate()
            if tuple(plan.units) != tuple(units):
                raise InvalidInput("made for other units")
            notice(f"rpcompile: plan from the cache ({path}); the search was skipped")
            return plan, True
        except Exception as exc:  # any unreadable entry is searched again, never used
            warnings.warn(f"rpcompile: ignoring the cached plan {path} ({type(exc).__name__}: "
                          f"{exc}); searching again", RuntimeWarning, stacklevel=3)
    plan = search()
    _store(path, {"format": FORMAT, "key": key, "inputs": inputs, "plan": plan_to_dict(plan)})
    return plan, False


def _store(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(f"rpcompile: could not write the plan cache {path} ({exc}); the plan is "
                      "used, not kept (plan_cache=False turns the cache off)", RuntimeWarning,
                      stacklevel=4)
