"""Host memory: flat master, shadow and gradient buffers, and the views the runtime needs.

The host keeps, for every parameter, exactly one of each of:

- **master** (fp32, trainable parameters only): what the optimizer updates;
- **shadow** (compute dtype: bf16/fp16, or fp32 when training in fp32; every parameter the
  stages use, trainable or frozen): the copy that gets uploaded;
- **grad** (fp32, trainable only): where gradients from every round and every use sum up;
  with async updates shifted into the next step a second one, **pending**, holds the last
  completed step's gradients until the next step applies them (:meth:`HostStore.add_pending`).

Async runs also keep a second copy of the trainable parameters' shadow
(:meth:`HostStore.add_shadow_pair`): step k uploads copy ``k % 2`` while step k+1, running at
the same time, uploads the other, which step k's SHADOW actions wrote.

Each kind is ONE flat buffer, allocated at its exact size (no rounding), pinned on CUDA by
registering the allocation with the driver (the caching pinned allocator would round each
buffer up to a power of two), unless the run asked for pageable host memory
(``PlanOptions.host_memory="pageable"``, :func:`pin_host_memory`): then the same exact-size
buffers are left pageable, so the host bytes are the same either way. Parameters are laid out in the order they first appear when
walking the stages in order, so a stage made of contiguous units is one contiguous range of the
flat buffers and uploads as ONE copy; a stage whose parameters are not contiguous (a tied weight
owned by an earlier stage, e.g. the LM head tied to the embedding) uploads one copy per
contiguous *segment*. Stages may overlap (RoundPipe's forward and backward stages cover the same
units cut differently): a parameter is stored once whichever stages use it, and the gradients
of all its uses are summed into its one master gradient.

A frozen quantized weight (a QLoRA base, :class:`rpcompile.capture.quantized.PackedWeight`)
has no shadow: the host keeps it **packed**, its codes and quantization state as one record of
a flat byte buffer (pinned or pageable like the others), laid out in stage order too; a job
uploads its stage's packed records (:attr:`StageBuffers.packed`) and the worker rebuilds the
weights in the compute dtype (:meth:`StageBuffers.packed_views`,
:func:`rpcompile.runtime.kernels.dequantize_packed`).

Modules: ``layout`` (where each parameter lives: ParamSlot, Segment, StageLayout,
PackedLayout, StageBuffers, contiguous runs, shard bounds), ``store`` (HostStore: build, shadow
refresh, gradient accumulation, masters for the optimizer), ``report`` (MemoryReport),
``staging`` (HostStaging: the downloads' host buffers, one per staging slot of the
schedule, kept for reuse), ``pinned``
(exact-size, optionally pinned, flat buffers).

**Sharded masters** (data parallel with ``shard_optimizer``, :meth:`HostStore.shard_masters`):
the master buffer then holds only the element range ``[master_start, master_stop)`` of the
master index space (whole parameters, :func:`shard_bounds`); every offset stays the global
one and is translated here. The shadow and gradient buffers stay whole: every stage uploads
its whole shadow, and every job's gradients land in the whole gradient buffer before they are
reduced to their owner.
"""

from rpcompile.runtime.memory.layout import (
    ParamSlot,
    Segment,
    StageBuffers,
    StageLayout,
    shard_bounds,
)
from rpcompile.runtime.memory.pinned import pin_host_memory
from rpcompile.runtime.memory.report import MemoryReport
from rpcompile.runtime.memory.staging import HostStaging
from rpcompile.runtime.memory.store import HostStore

__all__ = [
    "HostStaging",
    "HostStore",
    "MemoryReport",
    "ParamSlot",
    "Segment",
    "StageBuffers",
    "StageLayout",
    "pin_host_memory",
    "shard_bounds",
]
