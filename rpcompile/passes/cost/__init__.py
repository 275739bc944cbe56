"""Cost pass: FLOPs and bytes of every node and every unit, symbolic in ``b`` and ``s``.

Modules, in reading order:
  types      - the public types: NodeCost, UnitCost (and UnitCost.evaluate -> ir.UnitProfile)
  walk       - annotate_costs(): one walk over the captured graph
  flops      - FLOP formulas of the matmul-class ops (what FlopCounterMode counts)
  saved      - what autograd saves for backward, per op
  symbolic   - helpers: sympy shapes and byte counts, pruning of Max terms
  recompute  - recompute granularity: a backward stage's working set and time, by stage or by
               layer, and a gradient job's peak over its backward's progress

Conventions (docs/cost.md explains them with examples):
  * FLOPs follow ``torch.utils.flop_counter.FlopCounterMode``: 2 per multiply-add, counted only
    for matmul-class work (linear, matmul, mm, bmm, addmm, baddbmm, einsum, attention,
    convolution), which is what runs at tensor-core speed. Elementwise ops, norms, softmax and
    reductions count 0. Backward FLOPs are those of the gradients autograd really computes: a
    matmul's input gradient only when that input requires grad, its weight gradient only when
    the weight is trainable.
  * Bytes are in the graph's dtype (the dtype the model was captured in). ``evaluate`` rescales
    the floating-point part to the compute dtype; integer and bool tensors keep their size.
  * A frozen quantized weight (a ``rpcompile::dequantize_*`` node over a packed parameter and
    its quantization state) counts as frozen parameters of its dequantized size and as
    ``packed_bytes``, the packed codes plus the state: what the host holds and a job uploads.
    The dequantized weight is a weight on the device, not an activation: the stage figures
    add it to a job's working set (rpcompile.planner.partition).
"""

from rpcompile.capture.types import B, S
from rpcompile.passes.cost.recompute import (
    RECOMPUTE,
    gradient_job_bytes,
    recompute_ms,
    recompute_working_bytes,
)
from rpcompile.passes.cost.saved import linear_ce_scratch_bytes
from rpcompile.passes.cost.types import NodeCost, UnitCost
from rpcompile.passes.cost.walk import annotate_costs

__all__ = [
    "RECOMPUTE",
    "B",
    "NodeCost",
    "S",
    "UnitCost",
    "annotate_costs",
    "gradient_job_bytes",
    "linear_ce_scratch_bytes",
    "recompute_ms",
    "recompute_working_bytes",
]
