"""Checkpoint files: a trainer's whole state in safetensors plus a small JSON manifest, written
atomically; a manager that keeps the last K.

    compiled.save_checkpoint("runs/ckpt", extra={"loader": {"epoch": 1, "index": 40}})
    extra = compiled.load_checkpoint("runs/ckpt")          # in a new process, after compile()

    manager = CheckpointManager("runs/ckpts", keep_last=3)
    manager.save(compiled, step=compiled.trainer().steps_done, extra={...})
    latest = manager.latest()                               # Path | None

Modules, in reading order:
  format       - what a checkpoint folder holds, how state maps to tensors and JSON; the errors
  writing      - save(): write aside, fsync files and folder, rename into place; per-rank shards
  reading      - load(): verify the files, rebuild the state, validate all of it, then apply
  optim_state  - optimizer state matched by parameter name
  merge        - one state from every rank's shard
  validate     - a state checked against a trainer before anything changes
  manager      - CheckpointManager: one folder per step, the last K kept

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
"""

from rpcompile.runtime.checkpoint.format import (
    FORMAT,
    MANIFEST,
    TENSORS,
    VERSION,
    CheckpointError,
    CheckpointFailed,
    plan_identity,
)
from rpcompile.runtime.checkpoint.manager import CheckpointManager
from rpcompile.runtime.checkpoint.merge import merge_shards
from rpcompile.runtime.checkpoint.optim_state import match_optimizer_state, optimizer_param_names
from rpcompile.runtime.checkpoint.reading import (
    Prepared,
    apply,
    load,
    prepare,
    read_manifest,
    shards_to_read,
)
from rpcompile.runtime.checkpoint.validate import validate_state
from rpcompile.runtime.checkpoint.writing import (
    begin_folder,
    finish_shards,
    replace_folder,
    save,
    shard_file,
    write_shard,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TENSORS",
    "VERSION",
    "CheckpointError",
    "CheckpointFailed",
    "CheckpointManager",
    "Prepared",
    "apply",
    "begin_folder",
    "finish_shards",
    "load",
    "match_optimizer_state",
    "merge_shards",
    "optimizer_param_names",
    "plan_identity",
    "prepare",
    "read_manifest",
    "replace_folder",
    "save",
    "shard_file",
    "shards_to_read",
    "validate_state",
    "write_shard",
]
