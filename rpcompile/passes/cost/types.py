"""The cost pass's results: the cost of one node (NodeCost) and of one unit (UnitCost),
symbolic in ``b`` and ``s``; UnitCost.evaluate turns a unit's into an ir.UnitProfile at a size,
on a hardware profile."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from rpcompile.capture.types import B, S
from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import UnitProfile
from rpcompile.passes.cost.symbolic import _E, _to_int

__all__ = [
    "NodeCost",
    "UnitCost",
]


@dataclass(frozen=True)
class NodeCost:
    """Cost of one graph node for one microbatch (``node.meta["rp_cost"]``), in ``b`` and ``s``.

    ``output_bytes`` is the size of the node's value(s) in the graph's dtype, views included
    (a view's bytes are what a transfer of that value would move); ``allocates`` tells whether
    the node creates new storage (False for views, aliases and in-place ops).
    """

    forward_flops: sympy.Expr
    backward_flops: sympy.Expr
    output_bytes: sympy.Expr
    requires_grad: bool
    allocates: bool


@dataclass(frozen=True)
class UnitCost:
    """Cost of one unit (prefix, one layer, tail) for one microbatch, symbolic in ``b``, ``s``.

    Parameters are counted once, in the unit that uses them first (a tied embedding belongs to
    the prefix). Byte figures are in the graph's dtype:

    * ``output_bytes``: values produced here and read only by the next unit (the hidden state);
    * ``shared_bytes``: values produced here and read by any other later unit, or by several
      (rotary cos/sin, attention masks, long skip connections);
    * ``shared_grad_bytes``: those of them that carry a gradient back (they depend on a
      trainable parameter: a long skip connection, not a rotary table or a mask);
    * ``saved_bytes``: activations autograd keeps from this unit's forward until its backward
      (parameters excluded; values saved by this unit but produced earlier are included);
    * ``transient_bytes``: the largest single op's footprint beyond what is saved: its output,
      its activation inputs and any scratch it keeps (the same bound covers its backward, which
      holds the output gradient and the input gradients);
    * ``working_bytes`` = saved + transient: the unit's forward+backward peak without weights.
    """

    index: int
    name: str
    forward_flops: sympy.Expr
    backward_flops: sympy.Expr
    trainable_params: int
    frozen_params: int
    trainable_param_bytes: int
    frozen_param_bytes: int
    buffer_bytes: int  # buffers and lifted constants first used here (rotary inv_freq, ...)
    output_bytes: sympy.Expr
    shared_bytes: sympy.Expr
    shared_grad_bytes: sympy.Expr
    saved_bytes: sympy.Expr
    transient_bytes: sympy.Expr
    graph_element_bytes: int  # element size of the graph's floating dtype (4 for fp32)
    # Every buffer/constant the unit reads, with its bytes, and every batch input, with its
    # bytes per microbatch (symbolic in b, s): UnitProfile.buffers / batch_inputs.
    buffers: tuple[tuple[str, int], ...] = ()
    batch_inputs: tuple[tuple[str, sympy.Expr], ...] = ()
    # Frozen quantized weights first read here: their dequantized elements (also counted in
    # frozen_params) and their packed bytes with the quantization state (frozen_param_bytes
    # holds these bytes for them, not the dequantized ones).
    packed_params: int = 0
    packed_bytes: int = 0
    # output, shared, saved, transient, shared_grad with the floating element size left
    # symbolic (_E).
    symbolic_bytes: tuple[sympy.Expr, ...] = field(repr=False, compare=False, default=())

    @property
    def working_bytes(self) -> sympy.Expr:
        return self.saved_bytes + self.transient_bytes

    @property
    def params(self) -> int:
        return self.trainable_params + self.frozen_params

    def bytes_at(self, b: int, s: int, dtype_bytes: int | None = None) -> dict[str, int]:
        """output/shared/saved/transient/shared_grad/working bytes at a size, floats as
        ``dtype_bytes``."""
        elem = self.graph_element_bytes if dtype_bytes is None else dtype_bytes
        at = {B: sympy.Integer(b), S: sympy.Integer(s), _E: sympy.Integer(elem)}
        keys = ("output", "shared", "saved", "transient", "shared_grad")
        out = {k: _to_int(e.xreplace(at), k, self.name) for k, e in zip(keys, self.symbolic_bytes)}
        out["working"] = out["saved"] + out["transient"]
        return out

    def flops_at(self, b: int, s: int) -> tuple[int, int]:
        """(forward, backward) FLOPs at a size."""
        at = {B: sympy.Integer(b), S: sympy.Integer(s)}
        return (
            _to_int(self.forward_flops.xreplace(at), "forward_flops", self.name),
            _to_int(self.backward_flops.xreplace(at), "backward_flops", self.name),
        )

    def evaluate(self, b: int, s: int, hardware: Hardware, dtype_bytes: int = 2) -> UnitProfile:
        """Numbers for one microbatch of ``b`` sequences of ``s`` tokens on ``hardware``."""
        if b < 1 or s < 1:
            raise InvalidInput(f"evaluate() needs b >= 1 and s >= 1, got b={b}, s={s}")
        fwd, bwd = self.flops_at(b, s)
        sizes = self.bytes_at(b, s, dtype_bytes)
        return UnitProfile(
            name=self.name,
            forward_ms=hardware.compute_ms(fwd),
            backward_ms=hardware.compute_ms(bwd),
            trainable_params=self.trainable_params,
            frozen_params=self.frozen_params,
            output_bytes=sizes["output"],
            shared_bytes=sizes["shared"],
            shared_grad_bytes=sizes["shared_grad"],
            working_bytes=sizes["working"],
            buffers=self.buffers,
            batch_inputs=tuple((key, _to_int(e.xreplace({B: sympy.Integer(b), S: sympy.Integer(s)}),
                                             key, self.name))
                               for key, e in self.batch_inputs),
            packed_params=self.packed_params,
            packed_bytes=self.packed_bytes,
        )
