"""Checkpoint files: a trainer's whole state in safetensors plus a small JSON manifest, written
atomically; a manager that keeps the last K.

    compiled.save_checkpoint("runs/ckpt", extra={"loader": {"epoch": 1, "index": 40}})
    extra = compiled.load_checkpoint("runs/ckpt")          # in a new process, after compile()

    manager = CheckpointManager("runs/ckpts", keep_last=3)
    manager.save(compiled, step=compiled.trainer().steps_done, extra={...})
    latest = manager.latest()                               # Path | None

Sections, in reading order:
  1. the format       - what a checkpoint folder holds, how state maps to tensors and JSON
  2. save()           - write aside, fsync files and folder, rename into place
  3. load()           - verify the files, rebuild the state, validate all of it, then apply
  4. CheckpointManager

**Format.** A checkpoint is a folder with two files. ``state.safetensors`` holds every tensor:
``master/<name>`` (fp32 masters), ``shadow/<name>`` (async mode: the trainable shadows the next
step computes with), ``optim/<param index>/<key>`` (optimizer state tensors),
``optim_group/<group>/<key>`` (tensor hyperparameters), ``rng/torch`` and ``rng/cuda/<i>``
(generator states). ``manifest.json`` holds the rest: format and version, step counter, mode,
the executor's schedule-step counter, the plan's summary and its sha256 (the plan identity),
the dropout base seed, the optimizer's class and its non-tensor state and hyperparameters, the
name of the parameter behind each optimizer index (``optimizer.param_names``), how many ranks
wrote it and whether they were sharded (``ranks``, ``sharded``), the loss scaler's state, the
caller's ``extra`` dict, and the size and sha256 of the tensor file. No pickle anywhere:
loading runs no code from the file.

**Sharded data parallel** (``shard_optimizer``): the ranks' shards are gathered to rank 0,
which writes this same format, the whole state as one process holds it; a sharded trainer on
any number of ranks loads it by reading the whole state and keeping its own shard, by
parameter name (:mod:`rpcompile.runtime.distributed`). With ``per_rank=True`` each rank
writes its own shard instead, ``shard-RRRRR-of-NNNNN.safetensors`` (its masters, optimizer
state indexed as its own optimizer indexes it, RNG), and rank 0 a manifest that lists every
file with its size and sha256 and each rank's optimizer JSON part (``shards``, ``bounds``);
a load reads and checks every file and merges the shards as one process holds the state
(``merge_shards``), so it resumes on any number of ranks as the one-file format does. Under data parallel (sharded or not)
a save and a load are collectives that end the same way on every rank: each rank does its
local part, then every rank enters one agreement (``DataParallel.settle``) whether its part
raised or not, and a failure anywhere is a :class:`CheckpointFailed` everywhere (a save:
nothing written; a load: nothing applied, and the ranks must have read the same file).

**Optimizer state is matched by parameter name** (:func:`match_optimizer_state`) wherever
the state records ``param_names``, not by position; a state without names loads by position.

**Atomicity.** ``save`` writes both files into a hidden temporary folder beside the target,
fsyncs them and the folder, renames the folder to the target name and fsyncs the parent; the
manifest, which ``load`` reads first, is written last. A process killed at any moment leaves
either no folder of the target name (only a ``.<name>.tmp-*`` one, which the manager sweeps)
or a complete checkpoint. Overwriting an existing folder moves it aside first (two renames);
:class:`CheckpointManager` never overwrites: each step gets its own folder. A write the file
system refuses (read-only, full, over quota) removes its temporary folder and raises a
:class:`CheckpointError` that names the folder, the bytes it needs and those free: the target
folder and every other checkpoint are as they were.

**Loading** (:func:`prepare`, then :func:`apply`) verifies the manifest, the tensor file's
size and checksum, rebuilds the state and hands it to ``Trainer.prepare_state``, which
matches and validates everything (names, shapes, finiteness, optimizer structure, mode)
before anything changes; only then are the state, the RNG states, the loss scale and the
dropout seed applied. Every refusal is a
:class:`CheckpointError` naming the offending key or file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rpcompile.errors import InvalidInput
from rpcompile.runtime.errors import RuntimeFault

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointFailed",
    "CheckpointManager",
    "Prepared",
    "apply",
    "load",
    "match_optimizer_state",
    "merge_shards",
    "optimizer_param_names",
    "prepare",
    "read_manifest",
    "replace_folder",
    "save",
    "validate_state",
]

FORMAT = "rpcompile-checkpoint"
VERSION = 1
TENSORS = "state.safetensors"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeFault, ValueError):
    """A checkpoint is refused (or cannot be written); ``key`` names what is wrong."""

    def __init__(self, message: str, key: str | None = None) -> None:
        self.key = key
        super().__init__(message)


class CheckpointFailed(CheckpointError):
    """Data parallel: a save or load failed on one or more ranks, so it failed on every rank
    (nothing was saved, or nothing was loaded, anywhere, unless ``restart``: below). ``failures`` maps each rank that
    failed to what it raised; a rank that failed itself has its own error as the cause.
    ``restart``: a rank could not take part in the agreement (its data-parallel state was
    already broken by a failed step, or it was interrupted) and announced it instead, so
    the ranks' collectives are out of step and every rank must be restarted; then the
    outcome is not the same everywhere: rank 0's write of a save may have been committed
    (a complete checkpoint of the target name may exist), and a load may have been applied
    on some ranks and not others. Resume from the latest checkpoint on disk."""

    def __init__(self, what: str, failures: Mapping[int, str], world: int, *,
                 restart: bool = False) -> None:
        self.failures = dict(failures)
        self.world = world
        self.restart = restart
        listed = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        end = ("the ranks' collectives are now out of step: restart every rank (torchrun "
               "restarts them) and resume from the last checkpoint" if restart else
               "every rank stopped at the same point, nothing changed")
        super().__init__(f"{what} failed on {len(self.failures)} of {world} ranks ({listed}); "
                         + end, "ranks")


# ============================================================================================
# 1. the format
# ============================================================================================


def _encode(value: Any, key: str) -> Any:
    """A JSON value for a hyperparameter or state entry (tuples are tagged to come back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{key}.{k}") for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {key!r}: a {type(value).__name__} is neither a tensor nor a JSON value "
        "(checkpoints hold no pickle)", key)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def plan_identity(summary: Mapping[str, Any]) -> str:
    """sha256 of the plan summary's canonical JSON."""
    text = json.dumps(_encode(dict(summary), "plan"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _split_state(trainer: Any, extra: Mapping[str, Any] | None,
                 state: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, manifest) of ``state`` (default: the trainer's current state)."""
    if state is None:
        state = trainer.state_dict()  # copies, once every queued update has run
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state["masters"].items():
        tensors[f"master/{name}"] = value
    for name, value in state.get("shadow", {}).items():
        tensors[f"shadow/{name}"] = value
    optim = state["optimizer"]
    optim_state: dict[str, dict[str, Any]] = {}
    for index, entry in optim["state"].items():
        plain: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                plain[key] = _encode(value, f"optimizer.state.{index}.{key}")
        optim_state[str(index)] = plain
    groups = []
    for g, group in enumerate(optim["param_groups"]):
        plain = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim_group/{g}/{key}"] = value
            else:
                plain[key] = _encode(value, f"optimizer.param_groups.{g}.{key}")
        groups.append(plain)
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = rng
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}", "extra")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"extra is not JSON-serializable: {exc}", "extra") from None
    scaler = trainer.loss_scaler
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(state["step"]),
        "mode": state["mode"],
        "executor_steps": int(state["executor_steps"]),
        "plan": _encode(state["plan"], "plan"),
        "plan_id": plan_identity(state["plan"]),
        "dropout_seed": int(getattr(trainer.compiled.capture, "dropout_seed", 0)),
        "optimizer": {"class": type(trainer.optimizer).__name__, "state": optim_state,
                      "param_groups": groups, "param_names": list(state["param_names"])},
        "ranks": 1 if getattr(trainer, "dp", None) is None else int(trainer.dp.world),
        "sharded": bool(getattr(trainer, "sharded", False)),
        "loss_scale": None if scaler is None else _encode(scaler.state_dict(), "loss_scale"),
        "extra": dict(extra) if extra is not None else None,
        "torch_version": torch.__version__,
    }
    # safetensors stores each tensor on its own storage, contiguous, on the CPU.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return tensors, manifest


# ============================================================================================
# 2. save()
# ============================================================================================


def save(trainer: Any, path: str | os.PathLike, *, extra: Mapping[str, Any] | None = None,
         state: Mapping[str, Any] | None = None) -> Path:
    """Write ``trainer``'s state (or ``state``, a ``Trainer.state_dict()`` already taken) to
    the folder ``path`` atomically (see the module doc). One process: data parallel goes
    through ``Trainer.save_checkpoint``, where the ranks agree on the outcome."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    final = Path(path)
    tensors, manifest = _split_state(trainer, extra, state)
    tmp = None
    try:
        tmp = begin_folder(final)
        save_file(tensors, str(tmp / TENSORS))
        size, digest = _fsync_and_hash(tmp / TENSORS)
        manifest["files"] = {TENSORS: {"bytes": size, "sha256": digest}}
        _commit(tmp, final, manifest)
    except (OSError, SafetensorError) as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(final, exc, sum(t.numel() * t.element_size()
                                            for t in tensors.values())) from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_failed(final: Path, exc: BaseException, needed: int) -> CheckpointError:
    """A checkpoint write that the file system refused (read-only, full, quota): what it
    needed, what is free, and that nothing of it was kept."""
    where = final.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f"{shutil.disk_usage(where).free:,} bytes are free there"
    except OSError:
        free = "the free space there is unknown"
    why = getattr(exc, "strerror", None) or str(exc)
    kept = (f"{final} still holds the checkpoint it held before" if final.exists()
            else f"{final} was not created")
    return CheckpointError(
        f"could not write the checkpoint {final}: {why}. It needs about {needed:,} bytes on "
        f"the file system of {where} ({free}). Nothing of it was kept: {kept}, and every "
        "other checkpoint is untouched", str(final))


def begin_folder(final: Path) -> Path:
    """A new hidden temporary folder beside ``final`` to write the checkpoint into."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, final: Path, manifest: Mapping[str, Any]) -> None:
    """Write the manifest last, fsync, and rename ``tmp`` into place (see the module doc)."""
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    replace_folder(tmp, final)


def replace_folder(tmp: Path, final: Path) -> None:
    """Put the complete folder ``tmp`` in the place of ``final`` (fsynced): a folder of that
    name is moved aside first and deleted after, so at any moment ``final`` is either the old
    folder or the new one, never a mix of both."""
    parent = final.parent
    _fsync_dir(tmp)
    if final.exists():
        old = parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(parent)


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def write_shard(trainer: Any, tmp: Path, state: Mapping[str, Any],
                extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A per-rank checkpoint's part written by this rank (sharded data parallel): its own
    state's tensors in its own file in the folder ``tmp`` (fsynced). Returns (its entry for
    the manifest: file, size, sha256 and the JSON part of its optimizer state; this rank's
    manifest, of which rank 0's becomes the checkpoint's)."""
    from safetensors.torch import save_file

    dp = trainer.dp
    tensors, manifest = _split_state(trainer, extra, state)
    name = shard_file(dp.rank, dp.world)
    # A refused write raises as it is: the ranks' agreement names the rank, its error and
    # that the folder must be one every rank can write.
    save_file(tensors, str(tmp / name))
    size, digest = _fsync_and_hash(tmp / name)
    # This rank's RNG in its manifest (rank 0's becomes the checkpoint's), so that a rank
    # that loads reads the RNG without reading rank 0's file.
    manifest["rng"] = {key[len("rng/"):]: value.numpy().tobytes().hex()
                       for key, value in tensors.items() if key.startswith("rng/")}
    return {"rank": dp.rank, "file": name, "bytes": size, "sha256": digest,
            "masters": sorted(state["masters"]), "optimizer": manifest["optimizer"]}, manifest


def finish_shards(tmp: Path, final: Path, manifest: dict[str, Any],
                  parts: list[dict[str, Any]], bounds: list[tuple[int, int]]) -> None:
    """Rank 0 ends a per-rank checkpoint: the manifest lists every rank's file (and its
    optimizer state's JSON part, indexed by that rank), written last; then the rename."""
    if sorted(p["rank"] for p in parts) != list(range(len(parts))):
        raise CheckpointError("the shards written are not one set of ranks", "shards")
    parts = sorted(parts, key=lambda p: p["rank"])
    manifest = dict(manifest)
    manifest["files"] = {p["file"]: {"bytes": p["bytes"], "sha256": p["sha256"]} for p in parts}
    manifest["shards"] = [{"rank": p["rank"], "file": p["file"], "masters": p["masters"],
                           "optimizer": p["optimizer"]} for p in parts]
    manifest["bounds"] = [list(b) for b in bounds]
    manifest["optimizer"] = {"class": manifest["optimizer"]["class"]}
    _commit(tmp, final, manifest)


def _fsync_and_hash(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ============================================================================================
# 3. load()
# ============================================================================================


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path``; raises :class:`CheckpointError`."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a checkpoint folder (it does not exist or is a "
                              "file)", str(folder))
    try:
        with open(folder / MANIFEST) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: {MANIFEST} is missing (an incomplete or foreign "
                              "folder)", MANIFEST) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {MANIFEST} is unreadable or truncated: {exc}",
                              MANIFEST) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: {MANIFEST} is not an rpcompile checkpoint manifest",
                              "format")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{folder}: checkpoint format version {manifest.get('version')!r}, "
                              f"this rpcompile reads version {VERSION}", "version")
    for key in ("step", "mode", "executor_steps", "plan", "optimizer", "files"):
        if key not in manifest:
            raise CheckpointError(f"{folder}: {MANIFEST} lacks {key!r}", key)
    return manifest


def _read_tensors(folder: Path, manifest: Mapping[str, Any], name: str = TENSORS
                  ) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    expected = manifest["files"].get(name, {})
    file = folder / name
    if not file.is_file():
        raise CheckpointError(f"{folder}: {name} is missing", name)
    size, digest = file.stat().st_size, None
    if size != expected.get("bytes"):
        raise CheckpointError(f"{folder}: {name} has {size} bytes, the manifest says "
                              f"{expected.get('bytes')} (truncated or replaced)", name)
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected.get("sha256"):
        raise CheckpointError(f"{folder}: {name} does not match the manifest's sha256 "
                              "(corrupt)", name)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {name} cannot be read: {exc}", name) from None


def shards_to_read(manifest: Mapping[str, Any], owned: set[str] | None) -> list[int]:
    """The ranks whose files a load of the per-rank checkpoint ``manifest`` reads: all of
    them (``owned`` None: a trainer that holds every parameter), else those whose masters
    include one of ``owned`` (a sharded trainer's own parameters). A manifest written before
    it listed each file's masters and rank 0's RNG: all of them."""
    shards = manifest["shards"]
    if owned is None or "rng" not in manifest or any("masters" not in s for s in shards):
        return [s["rank"] for s in shards]
    return [s["rank"] for s in shards if owned.intersection(s["masters"])]


def _check_listed_masters(manifest: Mapping[str, Any], store: Any, *, strict: bool) -> None:
    """Refuse a per-rank checkpoint whose files' listed masters (all of them, read or not)
    lack a trainable parameter of ``store``'s model, or (``strict``) name a parameter it
    does not have: a partial load never sees the files it skips, so it checks here."""
    shards = manifest["shards"]
    if any("masters" not in s for s in shards):
        return  # an older manifest: every file is read and merge_shards checks the set
    listed = {n for s in shards for n in s["masters"]}
    trainable = {s.name for s in store.trainable_slots}
    missing = sorted(trainable - listed)
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks the masters of {len(missing)} trainable parameters of this "
            f"model ({missing[:3]}): it was saved from another model, or with other "
            "parameters trainable (load it into the model it was saved from)", "masters")
    unknown = sorted(listed - trainable)
    if unknown and strict:
        raise CheckpointError(
            f"the checkpoint holds masters of {len(unknown)} parameters that are not trainable "
            f"parameters of this model ({unknown[:3]}): pass strict=False to ignore them",
            "masters")


def _rebuild_shards(folder: Path, manifest: Mapping[str, Any], store: Any,
                    owned: set[str] | None = None, *, strict: bool = True
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], bool]:
    """(the state, rank 0's RNG tensors, whether the state is partial) of a per-rank
    checkpoint: the files :func:`shards_to_read` names read and checked, and their shards
    merged as one process would hold the state (:func:`merge_shards`, which refuses an
    incomplete set unless only the files holding ``owned`` were read). The masters every
    file lists are checked against the model first (:func:`_check_listed_masters`), read
    or not; ``strict=False`` ignores parameters this model does not have."""
    shards = manifest["shards"]
    bounds = [tuple(b) for b in manifest.get("bounds", ())]
    _check_listed_masters(manifest, store, strict=strict)
    wanted = set(shards_to_read(manifest, owned))
    if not wanted:
        raise CheckpointError(
            f"{folder}: no file of this per-rank checkpoint holds this rank's parameters "
            f"({sorted(owned)[:3]}): it was saved from another model", "shards")
    partial = len(wanted) < len(shards)
    parts, rng = [], {}
    for shard in shards:
        if shard["rank"] not in wanted:
            continue
        tensors = _read_tensors(folder, manifest, shard["file"])
        state, shard_rng = _rebuild_state({**manifest, "optimizer": shard["optimizer"]}, tensors)
        if shard["rank"] == 0:
            rng = shard_rng
        parts.append({"rank": shard["rank"], "world": len(shards), "bounds": bounds,
                      "state": state, "names": dict(enumerate(state.get("param_names", ())))})
    if "rng" in manifest:  # rank 0's, written into the manifest
        try:
            rng = {key: torch.frombuffer(bytearray(bytes.fromhex(value)), dtype=torch.uint8)
                   for key, value in manifest["rng"].items()}
        except (TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{folder}: the manifest's RNG state is malformed",
                                  "rng") from None
    return merge_shards(store, parts, complete=not partial, strict=strict), rng, partial


def _rebuild_state(manifest: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(trainer state dict, RNG tensors) from the files; unknown tensor names are refused."""
    masters: dict[str, torch.Tensor] = {}
    shadow: dict[str, torch.Tensor] = {}
    optim = manifest["optimizer"]
    opt_state: dict[int, dict[str, Any]] = {int(i): _decode(v) for i, v in optim["state"].items()}
    groups = [_decode(g) for g in optim["param_groups"]]
    rng: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "master":
            masters[rest] = value
        elif kind == "shadow":
            shadow[rest] = value
        elif kind == "optim":
            index, _, name = rest.partition("/")
            if not index.isdigit() or not name:
                raise CheckpointError(f"tensor {key!r}: not an optimizer state entry", key)
            opt_state.setdefault(int(index), {})[name] = value
        elif kind == "optim_group":
            g, _, name = rest.partition("/")
            if not g.isdigit() or int(g) >= len(groups) or not name:
                raise CheckpointError(f"tensor {key!r}: no such optimizer group", key)
            groups[int(g)][name] = value
        elif kind == "rng":
            rng[rest] = value
        else:
            raise CheckpointError(f"tensor {key!r} is not part of an rpcompile checkpoint", key)
    state: dict[str, Any] = {
        "masters": masters,
        "optimizer": {"state": opt_state, "param_groups": groups},
        "step": manifest["step"],
        "mode": manifest["mode"],
        "plan": _decode(manifest["plan"]),
        "executor_steps": manifest["executor_steps"],
    }
    if "param_names" in optim:
        state["param_names"] = list(optim["param_names"])
    if manifest["mode"] == "async" or shadow:
        state["shadow"] = shadow
    return state, rng


@dataclass(frozen=True)
class Prepared:
    """A checkpoint read and checked against a trainer (:func:`prepare`), not yet applied:
    ``state`` as ``Trainer.load_state_dict`` applies it (sharded: cut to this rank's shard),
    and ``digest`` a sha256 over the whole manifest as read (its files' sizes and sha256s,
    and the step, extra, RNG, executor steps and loss scale it holds itself: what
    data-parallel ranks compare before any applies)."""

    state: dict[str, Any]
    rng: dict[str, torch.Tensor]
    scaler_state: Any
    extra: dict[str, Any]
    dropout_seed: int | None
    digest: str


def prepare(trainer: Any, path: str | os.PathLike, *, strict: bool = True,
            allow_nonfinite: bool = False) -> Prepared:
    """Read the checkpoint folder ``path`` and check all of it against ``trainer`` (the files,
    the optimizer class, the RNG and loss-scale state, then ``Trainer.prepare_state``: names,
    shapes, finiteness, optimizer structure matched by parameter name, mode), changing
    nothing; raises :class:`CheckpointError` naming what is wrong."""
    folder = Path(path)
    manifest = read_manifest(folder)
    partial = False
    if "shards" in manifest:  # one file per rank (Trainer.save_checkpoint(per_rank=True))
        # A sharded trainer reads only the files that hold its own parameters.
        owned = ({s.name for s in trainer.store.owned_slots}
                 if getattr(trainer, "sharded", False) else None)
        state, rng, partial = _rebuild_shards(folder, manifest, trainer.store, owned,
                                              strict=strict)
    else:
        state, rng = _rebuild_state(manifest, _read_tensors(folder, manifest))
    saved_class = manifest["optimizer"].get("class")
    if saved_class != type(trainer.optimizer).__name__:
        raise CheckpointError(f"the checkpoint's optimizer is {saved_class}, this trainer's "
                              f"{type(trainer.optimizer).__name__}", "optimizer.class")
    torch_rng = rng.get("torch")
    if torch_rng is None or torch_rng.dtype != torch.uint8 or torch_rng.dim() != 1:
        raise CheckpointError("the checkpoint's torch RNG state is missing or malformed",
                              "rng/torch")
    scaler_state = manifest.get("loss_scale")
    if (scaler_state is None) != (trainer.loss_scaler is None):
        raise CheckpointError(
            "the checkpoint was saved " + ("without" if scaler_state is None else "with")
            + " loss scaling and this trainer runs " + ("with" if scaler_state is None else
                                                        "without") + " it", "loss_scale")
    extra = manifest.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError("the checkpoint's extra is not a dict", "extra")
    state = trainer.prepare_state(state, strict=strict, allow_nonfinite=allow_nonfinite,
                                  **({"partial": True} if partial else {}))
    seed = manifest.get("dropout_seed")
    # The manifest as parsed, in one canonical form: what this load applies from it.
    read = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return Prepared(state, rng, scaler_state, dict(extra or {}),
                    None if seed is None else int(seed), hashlib.sha256(read).hexdigest())


def apply(trainer: Any, prepared: Prepared) -> dict[str, Any]:
    """Apply a :func:`prepare`-d checkpoint (it was checked; this cannot be refused); returns
    its ``extra`` dict."""
    trainer.apply_state(prepared.state)
    torch.set_rng_state(prepared.rng["torch"])
    rng = prepared.rng
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda/")),
                                   key=lambda k: int(k.split("/")[1]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if prepared.scaler_state is not None:
        trainer.loss_scaler.load_state_dict(_decode(prepared.scaler_state))
    capture = trainer.compiled.capture
    if hasattr(capture, "dropout_seed") and prepared.dropout_seed is not None:
        capture.dropout_seed = prepared.dropout_seed
    return dict(prepared.extra)


def load(trainer: Any, path: str | os.PathLike, *, strict: bool = True,
         allow_nonfinite: bool = False) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save` into ``trainer``; returns its ``extra``
    dict ({} when none was stored). Nothing changes unless every check passes. Data
    parallel (``trainer.dp``): a collective; every rank prepares, then the ranks agree (on
    success, and that they read the same checkpoint: the sha256 of its manifest) before any
    applies, so a refusal on any rank is a :class:`CheckpointFailed` on every rank."""
    dp = getattr(trainer, "dp", None)
    prepared, error = None, None
    try:
        prepared = prepare(trainer, path, strict=strict, allow_nonfinite=allow_nonfinite)
    except Exception as exc:  # every failure must reach the agreement
        if dp is None:
            raise
        error = exc
    except BaseException as exc:  # an interrupt: announced, so the others stop at once
        if dp is not None:
            dp.interrupted(exc, f"loading the checkpoint {Path(path)}")
        raise
    if dp is not None:
        what = f"loading the checkpoint {Path(path)}"
        notes = dp.settle(error, what, note="" if prepared is None else prepared.digest)
        if len(set(notes.values())) > 1:
            raise CheckpointFailed(what, {r: f"read a checkpoint of manifest sha256 {d[:12]}..."
                                          for r, d in notes.items()}, dp.world)
    return apply(trainer, prepared)


def optimizer_param_names(store: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of the parameter behind each of ``optimizer``'s indexes (group by group)."""
    by_id = {id(p): name for name, p in store.named_masters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def match_optimizer_state(store: Any, state: Mapping[str, Any],
                          optimizer: torch.optim.Optimizer, *, strict: bool = True,
                          require_names: bool = False, partial: bool = False) -> dict[str, Any]:
    """``state`` with its optimizer part indexed as ``optimizer`` indexes its parameters,
    matched by the parameter names the state records (``param_names``), not by position;
    only the parameters this store owns are kept (sharded: this rank's shard). Refused with
    a :class:`CheckpointError` naming the parameters: a group holding other parameters than
    this optimizer's group, a name recorded twice, a trainable parameter without masters,
    and (``strict``) a name that is not a trainable parameter here. A state without names
    (written before they were recorded) is returned as it is, matched by position, unless
    ``require_names``. ``partial``: the state holds only some ranks' shards (the files of a
    per-rank checkpoint that hold this store's parameters): only the parameters this store
    owns must have masters."""
    names = state.get("param_names")
    if names is None:
        if require_names:
            raise CheckpointError(
                "this checkpoint does not name its optimizer's parameters (written before "
                "sharded training existed): load it without shard_optimizer, save it again, "
                "then resume sharded", "param_names")
        return dict(state)
    optim = state.get("optimizer")
    if (not isinstance(optim, Mapping) or not isinstance(optim.get("param_groups"), (list, tuple))
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                       for g in optim["param_groups"])
            or not isinstance(optim.get("state"), Mapping)):
        return dict(state)  # validate_state names the malformed part
    theirs_groups = optim["param_groups"]
    count = sum(len(g["params"]) for g in theirs_groups)
    if (not isinstance(names, (list, tuple)) or len(names) != count
            or not all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"param_names must name each of the optimizer's {count} "
                              "parameters once", "param_names")
    ids = [i for g in theirs_groups for i in g["params"]]
    if sorted(ids, key=str) != sorted(range(count), key=str):
        raise CheckpointError("the checkpoint's optimizer groups do not index its parameters "
                              f"0..{count - 1} once each", "optimizer.param_groups")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CheckpointError(f"param_names names {twice[:3]} more than once", "param_names")
    trainable = {s.name for s in store.trainable_slots}
    masters = state.get("masters", {})
    required = {s.name for s in store.owned_slots} if partial else trainable
    missing = [n for n in sorted(required) if n not in masters]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks the masters of {len(missing)} trainable parameters "
            f"({missing[:3]}): an incomplete set of shards, or another model", "masters")
    # Names with masters of their own are refused by validate_state, naming the master.
    unknown = sorted(set(names) - trainable - set(masters))
    if unknown and strict:
        raise CheckpointError(
            f"the checkpoint's optimizer holds state for {unknown[:3]}, which are not "
            "trainable parameters of this model (pass strict=False to ignore them)",
            "optimizer.param_names")
    owned = {s.name for s in store.owned_slots}
    ours_names = optimizer_param_names(store, optimizer)
    index_of = {name: i for i, name in enumerate(ours_names)}
    if len(theirs_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(theirs_groups)} parameter groups, this "
            f"one {len(optimizer.param_groups)}", "optimizer.param_groups")
    by_id = {id(p): name for name, p in store.named_masters()}
    groups = []
    for g, (theirs, ours) in enumerate(zip(theirs_groups, optimizer.param_groups)):
        wanted = {names[i] for i in theirs["params"]} & owned
        have = [by_id[id(p)] for p in ours["params"]]
        if set(have) != wanted:
            lack = sorted(set(have) - wanted)
            more = sorted(wanted - set(have))
            raise CheckpointError(
                f"optimizer group {g} holds other parameters than the checkpoint's group {g}"
                + (f": the checkpoint's lacks {lack[:3]}" if lack else "")
                + (f"{';' if lack else ':'} it has {more[:3]} in addition" if more else "")
                + " (build the optimizer's groups the same way)",
                f"optimizer.param_groups.{g}")
        groups.append({**{k: v for k, v in theirs.items() if k != "params"},
                       "params": [index_of[n] for n in have]})
    entries = {}
    for i, entry in optim["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(names):
            raise CheckpointError(f"optimizer state entry {i!r} has no parameter name",
                                  "optimizer.state")
        if names[i] in owned:
            entries[index_of[names[i]]] = entry
    out = dict(state)
    # Unknown names stay, for validate_state to refuse (strict) or ignore.
    out["masters"] = {n: v for n, v in masters.items() if n in owned or n not in trainable}
    out["optimizer"] = {"state": entries, "param_groups": groups}
    out["param_names"] = ours_names
    return out


def merge_shards(store: Any, parts: list[dict[str, Any]], *,
                 complete: bool = True, strict: bool = True) -> dict[str, Any]:
    """One state, as one process would hold it, from every rank's shard (``gather_state``).
    Optimizer parameters are indexed group by group, each group's parameters in the store's
    order (what one process's optimizer over the same factory indexes). Raises
    ``CheckpointError`` on a set of shards that is empty, incomplete, overlaps, or
    disagrees, and (``strict``) on a parameter that is not trainable in ``store``'s model;
    ``strict=False`` leaves such parameters out (masters and optimizer state).
    ``complete=False``: some ranks' shards only (a per-rank checkpoint's files that a rank
    needs); the state then holds their parameters alone."""
    if not parts:
        raise CheckpointError("no shards to merge (no file of the checkpoint was read)",
                              "shards")
    order = {s.name: s.master_offset for s in store.trainable_slots}
    named = {n for p in parts for n in [*p["state"]["masters"], *p["names"].values()]}
    unknown = sorted(named - set(order))
    if unknown and strict:
        raise CheckpointError(
            f"the shards hold {len(unknown)} parameters that are not trainable parameters of "
            f"this model ({unknown[:3]}): pass strict=False to ignore them", "shards")
    world = parts[0]["world"]
    ranks = sorted(p["rank"] for p in parts)
    if (ranks != list(range(world)) if complete else len(set(ranks)) != len(ranks)) or any(
            p["world"] != world or p["bounds"] != parts[0]["bounds"] for p in parts):
        raise CheckpointError("the shards gathered for the checkpoint are not one set (ranks "
                              f"{sorted(p['rank'] for p in parts)} of {world}, or their bounds "
                              "differ)", "shards")
    masters: dict[str, torch.Tensor] = {}
    for p in parts:
        for name, value in p["state"]["masters"].items():
            if name in masters:
                raise CheckpointError(f"parameter {name!r} is in two shards", "shards")
            if name in order:
                masters[name] = value
    missing = [n for n in order if n not in masters]
    if missing and complete:
        raise CheckpointError(f"the shards lack {len(missing)} trainable parameters "
                              f"({missing[:3]})", "shards")
    first = parts[0]["state"]
    ngroups = len(first["optimizer"]["param_groups"])
    if any(len(p["state"]["optimizer"]["param_groups"]) != ngroups for p in parts):
        raise CheckpointError("the ranks' optimizers have different numbers of parameter "
                              "groups", "optimizer.param_groups")
    members: list[list[str]] = [[] for _ in range(ngroups)]
    entries: dict[str, Any] = {}
    for p in parts:
        optim = p["state"]["optimizer"]
        for g, group in enumerate(optim["param_groups"]):
            members[g].extend(p["names"][i] for i in group["params"]
                              if p["names"][i] in order)
        for i, entry in optim["state"].items():
            if p["names"][i] in order:
                entries[p["names"][i]] = entry
    names: list[str] = []
    groups = []
    for g, group in enumerate(first["optimizer"]["param_groups"]):
        ordered = sorted(members[g], key=order.__getitem__)
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(len(names), len(names) + len(ordered)))})
        names.extend(ordered)
    state = dict(first)
    state["masters"] = {n: masters[n] for n in sorted(masters, key=order.__getitem__)}
    state["optimizer"] = {"state": {i: entries[n] for i, n in enumerate(names) if n in entries},
                          "param_groups": groups}
    state["param_names"] = names
    return state


_STATE_KEYS = {"masters", "optimizer", "step", "mode", "plan", "executor_steps", "shadow",
               "param_names"}
# Optimizers whose state tensors (other than 0-d ones such as Adam's step) have the shape of
# their parameter; others (Adafactor's factored moments) are not shape-checked.
_SHAPED_STATE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                 "RAdam", "RMSprop", "Rprop")


def validate_state(trainer: Any, state: Any, *, strict: bool = True,
                   allow_nonfinite: bool = False) -> None:
    """Check a ``Trainer.state_dict()``-shaped ``state`` against ``trainer`` without changing
    anything: keys, mode, step, every master's name, shape and finiteness, the shadows (async),
    the optimizer state's structure. Raises :class:`CheckpointError` naming the first bad key.
    ``strict=False`` ignores unknown keys and masters; ``allow_nonfinite=True`` accepts inf/NaN."""

    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"state {key}: {why}; nothing was loaded", key)

    if not isinstance(state, Mapping):
        raise CheckpointError(f"a state dict must be a dict, got {type(state).__name__}")
    for key in ("masters", "optimizer", "step", "mode"):
        if key not in state:
            raise bad(repr(key), "missing")
    unknown = sorted(set(state) - _STATE_KEYS)
    if unknown and strict:
        raise bad(repr(unknown[0]), f"unknown key (unknown: {unknown}); pass strict=False to "
                  "ignore unknown keys")
    if state["mode"] != trainer.mode:
        raise bad("'mode'", f"saved in {state['mode']!r} mode, this trainer runs {trainer.mode!r}")
    for key in ("step", "executor_steps"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(repr(key), f"must be a non-negative integer, got {value!r}")

    store = trainer.store
    slots = {s.name: s for s in store.owned_slots}  # sharded: the state was cut to the shard

    def check_tensors(section: str, tensors: Any, required: bool) -> None:
        if not isinstance(tensors, Mapping):
            raise bad(repr(section), f"must be a dict of tensors, got {type(tensors).__name__}")
        missing = [n for n in slots if n not in tensors]
        if missing and required:
            raise bad(f"{section}[{missing[0]!r}]", f"missing ({len(missing)} trainable "
                      f"parameters missing: {missing[:3]}...)")
        for name, value in tensors.items():
            key = f"{section}[{name!r}]"
            if name not in slots:
                if strict:
                    raise bad(key, "not a trainable parameter of this model (pass strict=False "
                              "to ignore unknown parameters)")
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise bad(key, f"must be a floating-point tensor, got {_describe(value)}")
            if tuple(value.shape) != tuple(slots[name].shape):
                raise bad(key, f"shape {tuple(value.shape)} != the parameter's "
                          f"{tuple(slots[name].shape)}")
            if not allow_nonfinite and not bool(torch.isfinite(value).all()):
                raise bad(key, "holds inf or NaN (pass allow_nonfinite=True to load it anyway)")

    check_tensors("masters", state["masters"], required=True)
    if trainer.mode == "async":
        if "shadow" not in state:
            raise bad("'shadow'", "missing (an async checkpoint holds the shadows the next step "
                      "computes with)")
        check_tensors("shadow", state["shadow"], required=True)

    optim = state["optimizer"]
    if not isinstance(optim, Mapping) or "state" not in optim or "param_groups" not in optim:
        raise bad("'optimizer'", "must be an optimizer state_dict (with 'state' and "
                  "'param_groups')")
    mine = trainer.optimizer.param_groups
    groups = optim["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(mine):
        raise bad("optimizer['param_groups']", f"{len(groups)} groups, this optimizer has "
                  f"{len(mine)}")
    params: dict[int, torch.Tensor] = {}
    for g, (theirs, ours) in enumerate(zip(groups, mine)):
        ids = theirs.get("params") if isinstance(theirs, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(ours["params"]):
            raise bad(f"optimizer['param_groups'][{g}]['params']",
                      f"{'not a list' if not isinstance(ids, (list, tuple)) else len(ids)} "
                      f"parameters, this optimizer's group has {len(ours['params'])}")
        for i, p in zip(ids, ours["params"]):
            params[i] = p
    shaped = type(trainer.optimizer).__name__ in _SHAPED_STATE
    entries = optim["state"]
    if not isinstance(entries, Mapping):
        raise bad("optimizer['state']", "must be a dict")
    for index, entry in entries.items():
        key = f"optimizer['state'][{index!r}]"
        if index not in params:
            raise bad(key, f"no parameter {index!r} in the optimizer's groups")
        if not isinstance(entry, Mapping):
            raise bad(key, "must be a dict")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if shaped and value.dim() > 0 and tuple(value.shape) != tuple(params[index].shape):
                raise bad(f"{key}[{name!r}]", f"shape {tuple(value.shape)} != its parameter's "
                          f"{tuple(params[index].shape)}")
            if (not allow_nonfinite and value.is_floating_point()
                    and not bool(torch.isfinite(value).all())):
                raise bad(f"{key}[{name!r}]", "holds inf or NaN (pass allow_nonfinite=True to "
                          "load it anyway)")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__


# ============================================================================================
# 4. CheckpointManager
# ============================================================================================


class CheckpointManager:
    """Checkpoints ``root/step-NNNNNNNN``, keeping the last ``keep_last`` complete ones.

    ``save(compiled, step, extra=None)`` writes the step's folder atomically and only then
    prunes older ones (never the one just written; and temporary folders left by a killed
    write), so a kill at any moment leaves the previous checkpoints readable. ``latest()`` is
    the newest complete one; ``skipped()`` names the step folders passed over as unreadable,
    each with the reason."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidInput(f"keep_last must be a positive integer, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{int(step):08d}"

    def save(self, compiled: Any, step: int, extra: Mapping[str, Any] | None = None, *,
             per_rank: bool = False) -> Path:
        path = compiled.save_checkpoint(self.path_for(step), extra=extra,
                                        **({"per_rank": True} if per_rank else {}))
        dp = getattr(getattr(compiled, "_trainer", compiled), "dp", None)
        if dp is None or dp.rank == 0:  # data parallel: rank 0 alone writes and prunes
            self._prune(Path(path))
        return Path(path)

    def _scan(self) -> tuple[list[Path], list[tuple[Path, str]]]:
        """(complete checkpoints oldest first, [(step folder, why it is unreadable)])."""
        if not self.root.is_dir():
            return [], []
        found, skipped = [], []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match is None or not child.is_dir():
                continue
            try:
                read_manifest(child)
            except CheckpointError as exc:
                skipped.append((child, str(exc)))
                continue
            found.append((int(match.group(1)), child))
        return [p for _, p in sorted(found)], sorted(skipped)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (a readable manifest), oldest first."""
        return self._scan()[0]

    def skipped(self) -> list[tuple[Path, str]]:
        """Step folders that are not complete checkpoints, with the reason (an unreadable or
        truncated manifest, say); :meth:`latest` passes over them."""
        return self._scan()[1]

    def latest(self) -> Path | None:
        done = self.checkpoints()
        return done[-1] if done else None

    def _prune(self, keep: Path) -> None:
        done = [p for p in self.checkpoints() if p != keep]
        for old in done[:max(0, len(done) + 1 - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        mine = f"-{os.getpid()}-"
        for child in self.root.iterdir():
            # Temporary folders of killed writes (this process writes one at a time).
            if child.name.startswith(".step-") and ".tmp-" in child.name and mine not in child.name:
                shutil.rmtree(child, ignore_errors=True)
