"""save(): a trainer's state written aside, its files and folder fsynced, then renamed into
place; the per-rank shard files of a sharded save.

**Atomicity.** ``save`` writes both files into a hidden temporary folder beside the target,
fsyncs them and the folder, renames the folder to the target name and fsyncs the parent; the
manifest, which ``load`` reads first, is written last. A process killed at any moment leaves
either no folder of the target name (only a ``.<name>.tmp-*`` one, which the manager sweeps)
or a complete checkpoint. Overwriting an existing folder moves it aside first (two renames);
:class:`CheckpointManager` never overwrites: each step gets its own folder. A write the file
system refuses (read-only, full, over quota) removes its temporary folder and raises a
:class:`CheckpointError` that names the folder, the bytes it needs and those free: the target
folder and every other checkpoint are as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpcompile.runtime.checkpoint.format import MANIFEST, TENSORS, CheckpointError, _split_state

if TYPE_CHECKING:
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "begin_folder",
    "finish_shards",
    "replace_folder",
    "save",
    "shard_file",
    "write_shard",
]


def save(trainer: Trainer, path: str | os.PathLike, *, extra: Mapping[str, Any] | None = None,
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


def write_shard(trainer: Trainer, tmp: Path, state: Mapping[str, Any],
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
