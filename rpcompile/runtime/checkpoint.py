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
parameter name (:mod:`rpcompile.runtime.distributed`).

**Atomicity.** ``save`` writes both files into a hidden temporary folder beside the target,
fsyncs them and the folder, renames the folder to the target name and fsyncs the parent; the
manifest, which ``load`` reads first, is written last. A process killed at any moment leaves
either no folder of the target name (only a ``.<name>.tmp-*`` one, which the manager sweeps)
or a complete checkpoint. Overwriting an existing folder moves it aside first (two renames);
:class:`CheckpointManager` never overwrites: each step gets its own folder.

**Loading** verifies the manifest, the tensor file's size and checksum, rebuilds the state
and hands it to ``Trainer.load_state_dict``, which validates everything (names, shapes,
finiteness, optimizer structure, mode) before it changes anything; only then are the RNG
states, the loss scale and the dropout seed restored. Every refusal is a
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
from pathlib import Path
from typing import Any

import torch

from rpcompile.runtime.errors import RuntimeFault

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "CheckpointManager",
    "load",
    "read_manifest",
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


def _split_state(trainer: Any, extra: Mapping[str, Any] | None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, manifest) of the trainer's current state."""
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


def save(trainer: Any, path: str | os.PathLike, *, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``trainer``'s state to the folder ``path`` atomically (see the module doc)."""
    from safetensors.torch import save_file

    final = Path(path)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tensors, manifest = _split_state(trainer, extra)
    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / TENSORS))
        size, digest = _fsync_and_hash(tmp / TENSORS)
        manifest["files"] = {TENSORS: {"bytes": size, "sha256": digest}}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def _read_tensors(folder: Path, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    expected = manifest["files"].get(TENSORS, {})
    file = folder / TENSORS
    if not file.is_file():
        raise CheckpointError(f"{folder}: {TENSORS} is missing", TENSORS)
    size, digest = file.stat().st_size, None
    if size != expected.get("bytes"):
        raise CheckpointError(f"{folder}: {TENSORS} has {size} bytes, the manifest says "
                              f"{expected.get('bytes')} (truncated or replaced)", TENSORS)
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected.get("sha256"):
        raise CheckpointError(f"{folder}: {TENSORS} does not match the manifest's sha256 "
                              "(corrupt)", TENSORS)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {TENSORS} cannot be read: {exc}", TENSORS) from None


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


def load(trainer: Any, path: str | os.PathLike, *, strict: bool = True,
         allow_nonfinite: bool = False) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save` into ``trainer``; returns its ``extra``
    dict ({} when none was stored). Nothing changes unless every check passes."""
    folder = Path(path)
    manifest = read_manifest(folder)
    tensors = _read_tensors(folder, manifest)
    state, rng = _rebuild_state(manifest, tensors)
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
    # Validates everything (raising CheckpointError-compatible ValueErrors naming the key)
    # before it changes anything; what follows cannot fail.
    trainer.load_state_dict(state, strict=strict, allow_nonfinite=allow_nonfinite)
    torch.set_rng_state(torch_rng)
    cuda = [rng[k] for k in sorted((k for k in rng if k.startswith("cuda/")),
                                   key=lambda k: int(k.split("/")[1]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if scaler_state is not None:
        trainer.loss_scaler.load_state_dict(_decode(scaler_state))
    capture = trainer.compiled.capture
    if hasattr(capture, "dropout_seed"):
        capture.dropout_seed = int(manifest.get("dropout_seed", capture.dropout_seed))
    return dict(extra or {})


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
    prunes older ones (and temporary folders left by a killed write), so a kill at any moment
    leaves the previous checkpoints readable. ``latest()`` is the newest complete one."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive integer, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{int(step):08d}"

    def save(self, compiled: Any, step: int, extra: Mapping[str, Any] | None = None) -> Path:
        path = compiled.save_checkpoint(self.path_for(step), extra=extra)
        dp = getattr(getattr(compiled, "_trainer", compiled), "dp", None)
        if dp is None or dp.rank == 0:  # data parallel: rank 0 alone writes and prunes
            self._prune()
        return Path(path)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (a readable manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match is None or not child.is_dir():
                continue
            try:
                read_manifest(child)
            except CheckpointError:
                continue
            found.append((int(match.group(1)), child))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.checkpoints()
        return done[-1] if done else None

    def _prune(self) -> None:
        done = self.checkpoints()
        for old in done[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        mine = f"-{os.getpid()}-"
        for child in self.root.iterdir():
            # Temporary folders of killed writes (this process writes one at a time).
            if child.name.startswith(".step-") and ".tmp-" in child.name and mine not in child.name:
                shutil.rmtree(child, ignore_errors=True)
