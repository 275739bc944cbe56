"""load(): read and verify the manifest and the tensor files, rebuild the state, validate all
of it, then apply it.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.runtime.checkpoint.format import (
    FORMAT,
    MANIFEST,
    TENSORS,
    VERSION,
    CheckpointError,
    CheckpointFailed,
    _decode,
)
from rpcompile.runtime.checkpoint.merge import merge_shards

if TYPE_CHECKING:
    from rpcompile.runtime.memory import HostStore
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "Prepared",
    "apply",
    "load",
    "prepare",
    "read_manifest",
    "shards_to_read",
]


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


def _check_listed_masters(manifest: Mapping[str, Any], store: HostStore, *, strict: bool) -> None:
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


def _rebuild_shards(folder: Path, manifest: Mapping[str, Any], store: HostStore,
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


def prepare(trainer: Trainer, path: str | os.PathLike, *, strict: bool = True,
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


def apply(trainer: Trainer, prepared: Prepared) -> dict[str, Any]:
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


def load(trainer: Trainer, path: str | os.PathLike, *, strict: bool = True,
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
