"""Fused kernels on the weight and gradient transfer path, in Triton with a torch reference.

Every job uploads its stage's weights as one flat low-precision buffer and sends its gradients
home from one flat fp32 accumulator. These kernels do the per-stage work in one launch each
instead of one copy and one cast per parameter tensor:

  cast_pack            fp32 tensors -> one flat bf16/fp16/fp32 buffer (round to nearest even)
  cast_flat            the reverse cast of a flat fp32 accumulator, for a low-precision download
  accumulate_grads     bf16/fp16/fp32 gradient tensors added into the flat fp32 accumulator,
                       with an optional fused inf/NaN check that sets a flag on the device
  dequantize_4bit      a packed NF4/FP4 weight (absmax plain or double-quantized) -> the
                       compute dtype, bit-identical to bitsandbytes' dequantize_4bit
  dequantize_int8      an int8 weight and its row absmax -> the compute dtype, as bitsandbytes'
                       int8 training matmul dequantizes it
  dequantize_packed    either of the two for a captured PackedWeight

Each takes ``backend``: ``"torch"`` (the reference, plain torch ops), ``"triton"`` (the Triton
kernel: compiled on CUDA tensors, run by Triton's interpreter on CPU tensors) or ``"auto"``
(Triton on CUDA, torch elsewhere). :func:`host_backend` is the rule for the host's own calls
(the shadow refresh on CPU tensors): the interpreter runs there only beside virtual workers.
Both backends are bit-exact with torch for every finite and infinite value; a NaN stays a NaN,
but its bits may differ (torch itself does not fix them: its vectorised CPU cast to bf16
writes 0xFFFF for every NaN, its scalar cast 0x7FC0).

Modules: ``transfer`` (cast_pack, cast_flat, accumulate_grads: validation, backends, the
torch reference), ``tables`` (block tables: how many tensors become one launch), ``programs``
(the Triton kernels, wrapped lazily so importing this package imports no triton),
``dequantize`` (packed weights; their torch reference is rpcompile.capture.quantized's).

See docs/kernels.md for the design, the bf16 rounding trick and the interpreter notes.
"""

from rpcompile.runtime.kernels.dequantize import (
    dequantize_4bit,
    dequantize_int8,
    dequantize_packed,
)
from rpcompile.runtime.kernels.transfer import (
    BACKENDS,
    accumulate_grads,
    cast_flat,
    cast_pack,
    host_backend,
    nonfinite_flag,
    packed_offsets,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "accumulate_grads",
    "cast_flat",
    "cast_pack",
    "dequantize_4bit",
    "dequantize_int8",
    "dequantize_packed",
    "host_backend",
    "nonfinite_flag",
    "packed_offsets",
    "resolve_backend",
]
