"""Cost pass: FLOPs and bytes of every node and every unit, symbolic in ``b`` and ``s``.

Sections, in reading order:
  1. Public types: NodeCost, UnitCost (and UnitCost.evaluate -> ir.UnitProfile)
  2. annotate_costs(): one walk over the captured graph
  3. FLOP formulas of the matmul-class ops (what FlopCounterMode counts)
  4. What autograd saves for backward, per op
  5. Helpers: sympy shapes and byte counts, pruning of Max terms
  6. Recompute granularity: a backward stage's working set and time, by stage or by layer

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

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from rpcompile.capture.quantized import DEQUANTIZE_OPS, packed_record_bytes
from rpcompile.capture.types import B, S
from rpcompile.choices import RECOMPUTE_GRANULARITIES, check_choice
from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import UnitProfile

__all__ = [
    "RECOMPUTE",
    "B",
    "NodeCost",
    "S",
    "UnitCost",
    "annotate_costs",
    "recompute_ms",
    "recompute_working_bytes",
]

# Bytes of one element of the graph's floating dtype. Byte expressions are built with it and
# it is substituted at the end, so that evaluate() can rescale fp32 activations to bf16 while
# leaving int64 position ids and bool masks at their size.
_E = sympy.Symbol("_elem", positive=True, integer=True)


# ---------------------------------------------------------------------------------------------
# 1. Public types
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 2. annotate_costs()
# ---------------------------------------------------------------------------------------------


def annotate_costs(captured: Any) -> list[UnitCost]:
    """Write ``node.meta["rp_cost"]`` on every ``call_function`` node; return one UnitCost per unit.

    ``captured`` is a :class:`rpcompile.capture.Captured` (its ``graph_module``, ``units``,
    ``params``, ``buffers``, ``trainable`` and ``subs`` are read). Pure apart from writing
    ``node.meta``; touches no device.
    """
    gm: fx.GraphModule = captured.graph_module
    walk = _Walk(captured)
    walk.run(gm, None, grad_enabled=True)
    walk.boundaries(gm)
    return walk.unit_costs(list(captured.units))


class _UnitAcc:
    """What one unit accumulates during the walk (byte terms are in _E)."""

    def __init__(self) -> None:
        self.fwd: list[sympy.Expr] = []
        self.bwd: list[sympy.Expr] = []
        self.params = {True: [0, 0], False: [0, 0]}  # trainable -> [count, bytes]
        self.packed = [0, 0]  # quantized weights: [dequantized elements, packed bytes]
        self.buffer_bytes = 0
        self.saved: dict[int, sympy.Expr] = {}  # storage key -> bytes
        self.saved_extra: list[sympy.Expr] = []  # scratch autograd keeps (log_softmax of CE, ...)
        self.transient: dict[sympy.Expr, None] = {}  # candidates, insertion-ordered set
        self.output: dict[int, sympy.Expr] = {}  # storage key -> bytes
        self.shared: dict[int, sympy.Expr] = {}
        self.shared_grad: dict[int, sympy.Expr] = {}  # the shared values that carry a gradient
        self.buffers: dict[str, int] = {}  # buffer/constant placeholder -> bytes (every reader)
        self.batch: dict[str, sympy.Expr] = {}  # batch key -> bytes per microbatch


class _Walk:
    def __init__(self, captured: Any) -> None:
        self.subs = {sympy.sympify(k): v for k, v in captured.subs.items()}
        self.params: dict[str, str] = dict(captured.params)
        self.trainable: dict[str, bool] = dict(captured.trainable)
        self.units: list[_UnitAcc] = [_UnitAcc() for _ in captured.units]
        self.num_units = len(captured.units)
        gm = captured.graph_module
        constant_names = set(getattr(captured, "buffers", {})) | set(
            getattr(captured, "constants", {})
        )
        self.weights: dict[str, bool | None] = {}  # placeholder -> trainable (None: buffer)
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name in self.params:
                fqn = self.params[node.name]
                if fqn not in self.trainable:
                    raise InvalidInput(
                        f"captured.trainable has no entry for parameter {fqn!r}; capture must "
                        "record requires_grad for every parameter"
                    )
                self.weights[node.name] = self.trainable[fqn]
            elif node.name in constant_names:
                self.weights[node.name] = None
        self.elem = _graph_element_bytes(gm, self.weights)
        self.batch_keys = dict(zip(getattr(captured, "inputs", ()),
                                   getattr(captured, "input_keys", ())))
        self.weight_storages: set[int] = set()
        self.seen_storages: set[int] = set()
        self.alias: dict[int, int] = {}  # storage of a run-time alias -> storage it aliases
        self.seen_weights: set[str] = set()
        self.rg: dict[fx.Node, Any] = {}  # node -> bool, or list[bool] for multi-output nodes
        self.expr_cache: dict[Any, sympy.Expr] = {}
        self.flop_cache: dict[tuple, tuple[sympy.Expr, sympy.Expr]] = {}
        self.max_cache: dict[tuple, tuple[sympy.Expr, sympy.Expr]] = {}
        self.bytes_cache: dict[tuple, sympy.Expr] = {}
        self.storage_cache: dict[tuple, sympy.Expr] = {}

    # -- the walk ---------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule, operands: Sequence[Any] | None, grad_enabled: bool,
            unit: int | None = None) -> list[bool]:
        """Analyse ``gm``; return requires-grad flags of its outputs.

        ``operands`` is None for the captured graph itself; for the graph inside a higher-order
        op (a no_grad or autocast region) it is the outer values bound to its placeholders, and
        every node inside reports into ``unit``, the unit of the calling node.
        """
        for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
            keys = self.keys(node.meta.get("val"))
            if operands is None:
                self.rg[node] = bool(self.weights.get(node.name, False))
                is_weight = node.name in self.weights
            else:
                outer = operands[i] if i < len(operands) else None
                self.rg[node] = _any_rg(self.rg.get(outer, False))
                is_weight = isinstance(outer, fx.Node) and any(
                    k in self.weight_storages for k in self.keys(outer.meta.get("val"))
                )
            if is_weight:
                self.weight_storages.update(keys)
            self.seen_storages.update(keys)
        outputs: list[bool] = []
        for node in gm.graph.nodes:
            if node.op == "call_function":
                u = unit if unit is not None else node.meta.get("rp_unit")
                if u is None or not 0 <= u < self.num_units:
                    raise InvalidInput(
                        f"node {node.name} ({node.target}) has rp_unit={u!r}; capture must "
                        f"assign every call_function node a unit in 0..{self.num_units - 1}"
                    )
                self._visit(gm, node, u, grad_enabled)
            elif node.op == "get_attr":
                self.rg[node] = False
            elif node.op == "output":
                outputs = [_any_rg(self.rg.get(a, False)) for a in _flat_nodes(node.args[0])]
        return outputs

    def _visit(self, gm: fx.GraphModule, node: fx.Node, u: int, grad_enabled: bool) -> None:
        acc = self.units[u]
        val = node.meta.get("val")
        target = node.target
        arg_nodes = node.all_input_nodes

        if target in DEQUANTIZE_OPS:
            self._visit_dequantize(node, acc, val)
            return

        # Parameters and buffers are charged to the unit that reads them first; every buffer
        # and batch input a unit reads also travels to each stage that holds it.
        for a in arg_nodes:
            if a.op != "placeholder":
                continue
            if a.name in self.batch_keys:
                acc.batch[self.batch_keys[a.name]] = sympy.Mul(
                    *self._shape(a.meta["val"])) * a.meta["val"].element_size()
                continue
            if a.name not in self.weights:
                continue
            nbytes = _concrete_nbytes(a.meta.get("val"), a.name)
            flag = self.weights[a.name]
            if flag is None:
                acc.buffers[a.name] = nbytes
            if a.name in self.seen_weights:
                continue
            self.seen_weights.add(a.name)
            if flag is None:
                acc.buffer_bytes += nbytes
            else:
                acc.params[flag][0] += _concrete_numel(a.meta.get("val"), a.name)
                acc.params[flag][1] += nbytes

        if target is operator.getitem:
            parent, index = node.args
            flags = self.rg.get(parent, False)
            if isinstance(flags, list):
                flags = flags[index] if index < len(flags) else False
            self.rg[node] = bool(flags) and _is_float(val)
            self._record(node, acc, sympy.Integer(0), sympy.Integer(0), val, fresh_ok=False)
            return

        if isinstance(target, torch._ops.HigherOrderOperator):
            self._visit_hop(gm, node, u, grad_enabled)
            return

        out_rg = (
            grad_enabled
            and any(_any_rg(self.rg.get(a, False)) for a in arg_nodes)
            and _any_float(val)
            and _packet(target) not in _NOT_DIFFERENTIABLE
        )
        self.rg[node] = out_rg

        fwd, bwd = self._flops(node, out_rg)
        allocated = self._record(node, acc, fwd, bwd, val, fresh_ok=True)

        if out_rg:
            self._saved(node, acc)
        if allocated is not None:
            cand = allocated + self._input_bytes(node) + _scratch(node, self)
            acc.transient[cand] = None

    def _visit_dequantize(self, node: fx.Node, acc: _UnitAcc, val: Any) -> None:
        """A quantized weight: its packed parameter and state are charged once, as frozen
        parameters of the dequantized size and as packed bytes; the dequantized value is a
        weight (never saved or counted as an activation), with no FLOPs."""
        packed = node.args[0]
        if packed.name not in self.seen_weights:
            inputs = node.all_input_nodes
            self.seen_weights.update(a.name for a in inputs)
            numel = _concrete_numel(val, node.name)
            nbytes = packed_record_bytes(a.meta.get("val") for a in inputs)
            acc.params[False][0] += numel
            acc.params[False][1] += nbytes
            acc.packed[0] += numel
            acc.packed[1] += nbytes
        self.rg[node] = False
        keys = self.keys(val)
        self.weight_storages.update(keys)
        self.seen_storages.update(keys)
        self._record(node, acc, sympy.Integer(0), sympy.Integer(0), val, fresh_ok=False)

    def _visit_hop(self, gm: fx.GraphModule, node: fx.Node, u: int, grad_enabled: bool) -> None:
        """wrap_with_set_grad_enabled / wrap_with_autocast: analyse the wrapped graph in place."""
        args = list(node.args)
        sub_index = next(
            (i for i, a in enumerate(args) if isinstance(a, fx.Node) and a.op == "get_attr"), None
        )
        if sub_index is None:
            raise InvalidInput(
                f"higher-order op {node.target} at {node.name} has no graph argument; the cost "
                "pass only understands wrapped graphs (no_grad / autocast regions)"
            )
        sub = getattr(gm, args[sub_index].target)
        operands = args[sub_index + 1:]
        enabled = grad_enabled
        if "set_grad_enabled" in str(node.target):
            enabled = bool(args[0])
        before = len(self.units[u].fwd), len(self.units[u].bwd)
        flags = self.run(sub, operands, enabled, unit=u)
        self.rg[node] = flags
        self.seen_storages.update(self.keys(node.meta.get("val")))
        acc = self.units[u]
        fwd = sympy.Add(*acc.fwd[before[0]:])
        bwd = sympy.Add(*acc.bwd[before[1]:])
        node.meta["rp_cost"] = NodeCost(
            forward_flops=fwd, backward_flops=bwd,
            output_bytes=self._graph_bytes_of(node.meta.get("val")),
            requires_grad=_any_rg(flags), allocates=False,
        )

    def _record(self, node, acc, fwd, bwd, val, fresh_ok):
        """Write rp_cost; return the bytes of newly allocated storage (None if none)."""
        allocated = None
        if _is_identity_dropout(node):
            source = node.args[0].meta.get("val")
            self.alias[_raw_key(val)] = self.key(source)
        elif fresh_ok:
            keys = self.keys(val)
            fresh = [k for k in keys if k not in self.seen_storages]
            if fresh:
                allocated = self._storage_bytes_of(val, set(fresh))
            self.seen_storages.update(keys)
        acc.fwd.append(fwd)
        acc.bwd.append(bwd)
        node.meta["rp_cost"] = NodeCost(
            forward_flops=fwd,
            backward_flops=bwd,
            output_bytes=self._graph_bytes_of(val),
            requires_grad=_any_rg(self.rg.get(node, False)),
            allocates=allocated is not None,
        )
        return allocated

    def key(self, t: torch.Tensor) -> int:
        """Identity of the storage behind ``t`` (views share it; see ``alias``)."""
        raw = _raw_key(t)
        return self.alias.get(raw, raw)

    def keys(self, val: Any) -> list[int]:
        return [self.key(t) for t in _flat_tensors(val)]

    # -- flops ------------------------------------------------------------------------------
    def _flops(self, node: fx.Node, out_rg: bool) -> tuple[sympy.Expr, sympy.Expr]:
        if node.meta.get("rp_flops") is not None:
            fwd, bwd = node.meta["rp_flops"]
            fwd, bwd = sympy.sympify(fwd), sympy.sympify(bwd)
            return fwd.xreplace(self.subs), (bwd.xreplace(self.subs) if out_rg else sympy.Integer(0))
        packet = _packet(node.target)
        if packet in _OPAQUE_PACKETS:
            raise InvalidInput(
                f"opaque node {node.name} ({node.target}) carries no node.meta['rp_flops']; "
                "capture must set (forward_flops, backward_flops) on every opaque node"
            )
        formula = _FLOPS.get(packet)
        if formula is None:
            return sympy.Integer(0), sympy.Integer(0)
        shapes, flags, consts = [], [], []
        for a in _flat_args(node):
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                shapes.append(self._shape(a.meta["val"]))
                flags.append(out_rg and _any_rg(self.rg.get(a, False)))
            elif isinstance(a, fx.Node):
                v = a.meta.get("val")
                consts.append(self._sym(v) if isinstance(v, torch.SymInt) else None)
            else:
                consts.append(a if isinstance(a, (int, float, bool, str, type(None))) else repr(a))
        out_val = node.meta.get("val")
        out_shape = self._shape(out_val) if isinstance(out_val, torch.Tensor) else None
        key = (packet, tuple(shapes), tuple(flags), tuple(consts), out_shape)
        hit = self.flop_cache.get(key)
        if hit is None:
            fwd, grads = formula(shapes, consts, out_shape, node)
            if formula is _sdpa:  # one fused backward, run when any of q, k, v needs a grad
                bwd = grads[0] if any(flags[:3]) else 0
            else:
                bwd = sum((g for g, f in zip(grads, flags) if f), sympy.Integer(0))
            hit = self.flop_cache[key] = (sympy.sympify(fwd), sympy.sympify(bwd))
        return hit

    # -- bytes ------------------------------------------------------------------------------
    def _sym(self, x: Any) -> Any:
        if isinstance(x, torch.SymInt):
            expr = x.node.expr
            hit = self.expr_cache.get(expr)
            if hit is None:
                hit = self.expr_cache[expr] = sympy.sympify(expr).xreplace(self.subs)
            return hit
        return x

    def _shape(self, t: torch.Tensor) -> tuple:
        return tuple(self._sym(d) for d in t.shape)

    def _elem_bytes(self, t: torch.Tensor) -> sympy.Expr:
        size = t.element_size()
        if (t.dtype.is_floating_point or t.dtype.is_complex) and size == self.elem:
            return _E
        return sympy.Integer(size)

    def _bytes_of(self, val: Any) -> sympy.Expr:
        """Logical bytes of a value (sum over the tensors of a tuple)."""
        total = sympy.Integer(0)
        for t in _flat_tensors(val):
            total += sympy.Mul(*self._shape(t)) * self._elem_bytes(t)
        return total

    def _graph_bytes_of(self, val: Any) -> sympy.Expr:
        """Logical bytes of a value in the graph's dtype (cached: layers repeat shapes)."""
        key = tuple((self._shape(t), t.dtype) for t in _flat_tensors(val))
        hit = self.bytes_cache.get(key)
        if hit is None:
            hit = self.bytes_cache[key] = self._bytes_of(val).xreplace({_E: self.elem})
        return hit

    def _storage_bytes(self, t: torch.Tensor) -> sympy.Expr:
        key = (_raw_key(t), t.dtype)
        hit = self.storage_cache.get(key)
        if hit is None:
            nbytes = sympy.sympify(self._sym(t.untyped_storage().nbytes()))
            hit = self.storage_cache[key] = nbytes / t.element_size() * self._elem_bytes(t)
        return hit

    def _storage_bytes_of(self, val: Any, keys: set[int]) -> sympy.Expr:
        total, done = sympy.Integer(0), set()
        for t in _flat_tensors(val):
            key = self.key(t)
            if key in keys and key not in done:
                done.add(key)
                total += self._storage_bytes(t)
        return total

    def _input_bytes(self, node: fx.Node) -> sympy.Expr:
        total, done = sympy.Integer(0), set()
        for a in node.all_input_nodes:
            for t in _flat_tensors(a.meta.get("val")):
                key = self.key(t)
                if key in done or key in self.weight_storages:
                    continue
                done.add(key)
                total += self._storage_bytes(t)
        return total

    def _saved(self, node: fx.Node, acc: _UnitAcc) -> None:
        rule = _SAVES.get(_packet(node.target), _save_all)
        saved_nodes, extra = rule(node, self)
        for a in saved_nodes:
            for t in _flat_tensors(a.meta.get("val") if isinstance(a, fx.Node) else a):
                key = self.key(t)
                if key in self.weight_storages or key in acc.saved:
                    continue
                acc.saved[key] = self._storage_bytes(t)
        if extra != 0:
            acc.saved_extra.append(extra)

    # -- unit boundaries --------------------------------------------------------------------
    def boundaries(self, gm: fx.GraphModule) -> None:
        """Sort each value read by a later unit into the producer's output or shared bytes
        (and, for a shared value that depends on a trainable parameter, its shared_grad
        bytes: its gradient crosses the same boundaries backward)."""
        graded: set[fx.Node] = set()
        for node in gm.graph.nodes:
            if (self.weights.get(node.name) if node.op == "placeholder"
                    else any(a in graded for a in node.all_input_nodes)):
                graded.add(node)
            if node.op != "call_function":
                continue
            u = node.meta["rp_unit"]
            readers = {
                user.meta.get("rp_unit") for user in node.users
                if user.op == "call_function" and user.meta.get("rp_unit", u) > u
            }
            if not readers:
                continue
            acc = self.units[u]
            buckets = [acc.output] if readers == {u + 1} else [acc.shared]
            if buckets[0] is acc.shared and node in graded:
                buckets.append(acc.shared_grad)
            for t in _flat_tensors(node.meta.get("val")):
                key = self.key(t)
                if key in self.weight_storages:
                    continue
                nbytes = sympy.Mul(*self._shape(t)) * self._elem_bytes(t)
                for bucket in buckets:
                    old = bucket.get(key)
                    bucket[key] = nbytes if old is None else _max_of([old, nbytes])

    # -- per-unit results -------------------------------------------------------------------
    def unit_costs(self, names: list[str]) -> list[UnitCost]:
        out = []
        for i, (name, acc) in enumerate(zip(names, self.units)):
            elem = {_E: sympy.Integer(self.elem)}
            output_b = sympy.expand(sympy.Add(*acc.output.values()))
            shared_b = sympy.expand(sympy.Add(*acc.shared.values()))
            shared_grad_b = sympy.expand(sympy.Add(*acc.shared_grad.values()))
            saved_b = sympy.expand(sympy.Add(*acc.saved.values(), *acc.saved_extra))
            candidates = tuple(acc.transient)
            hit = self.max_cache.get(candidates)
            if hit is None:  # identical layers have identical candidates
                symbolic_max = _max_of(list(candidates))
                hit = self.max_cache[candidates] = (symbolic_max, _subs_in_max(symbolic_max, elem))
            transient_b, transient_graph = hit
            symbolic = (output_b, shared_b, saved_b, transient_b, shared_grad_b)
            out.append(UnitCost(
                index=i,
                name=name,
                forward_flops=sympy.expand(sympy.Add(*acc.fwd)),
                backward_flops=sympy.expand(sympy.Add(*acc.bwd)),
                trainable_params=acc.params[True][0],
                frozen_params=acc.params[False][0],
                trainable_param_bytes=acc.params[True][1],
                frozen_param_bytes=acc.params[False][1],
                buffer_bytes=acc.buffer_bytes,
                output_bytes=output_b.xreplace(elem),
                shared_bytes=shared_b.xreplace(elem),
                shared_grad_bytes=shared_grad_b.xreplace(elem),
                saved_bytes=saved_b.xreplace(elem),
                transient_bytes=transient_graph,
                graph_element_bytes=self.elem,
                symbolic_bytes=symbolic,
                buffers=tuple(acc.buffers.items()),
                batch_inputs=tuple(acc.batch.items()),
                packed_params=acc.packed[0],
                packed_bytes=acc.packed[1],
            ))
        return out


# ---------------------------------------------------------------------------------------------
# 3. FLOP formulas: (arg shapes, non-tensor args, out shape, node) -> (forward, [grad per arg])
# ---------------------------------------------------------------------------------------------
# Each tensor argument gets the FLOPs of its own gradient, charged only when autograd computes
# it (the argument requires grad). The counts mirror FlopCounterMode's formulas for the aten ops
# that the composite ops (linear, matmul, einsum) decompose into at run time.


def _prod(xs) -> sympy.Expr:
    return sympy.Mul(*xs) if xs else sympy.Integer(1)


def _mm_like(shapes, consts, out, node):  # mm(a, b), bmm(a, b)
    a, b = shapes[0], shapes[1]
    f = 2 * _prod(a[:-1]) * a[-1] * b[-1]
    return f, [f, f]


def _addmm_like(shapes, consts, out, node):  # addmm(bias, a, b), baddbmm(bias, a, b)
    a, b = shapes[1], shapes[2]
    f = 2 * _prod(a[:-1]) * a[-1] * b[-1]
    return f, [0, f, f]


def _linear(shapes, consts, out, node):  # linear(x, w, bias?)
    x, w = shapes[0], shapes[1]
    f = 2 * _prod(x[:-1]) * w[0] * (w[1] if len(w) > 1 else 1)
    return f, [f, f, 0]


def _matmul(shapes, consts, out, node):
    a, b = shapes[0], shapes[1]
    k = a[-1]
    m = a[-2] if len(a) >= 2 else 1
    n = b[-1] if len(b) >= 2 else 1
    batch = _prod(out[:-2]) if len(a) >= 2 and len(b) >= 2 else 1
    f = 2 * batch * m * k * n
    return f, [f, f]


def _einsum(shapes, consts, out, node):
    equation = str(consts[0]).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != 2 or "." in equation:
        raise InvalidInput(
            f"cost pass: einsum {equation!r} at {node.name} is not a two-operand einsum without "
            "ellipsis; rewrite it as matmul or add its formula to rpcompile/passes/cost.py"
        )
    sizes: dict[str, Any] = {}
    for term, shape in zip(terms, shapes):
        sizes.update(zip(term, shape))
    if not rhs:  # implicit output: letters that appear once, sorted
        rhs = "".join(sorted(c for c in sizes if lhs.count(c) == 1))
    # Letters summed inside one operand only are reduced before the bmm, so they cost nothing.
    kept = [c for c in sizes if c in rhs or (c in terms[0] and c in terms[1])]
    f = 2 * _prod([sizes[c] for c in kept])
    return f, [f, f]


def _sdpa(shapes, consts, out, node):
    q, k, v = shapes[0], shapes[1], shapes[2]
    bh, sq, d = _prod(q[:-2]), q[-2], q[-1]
    sk, dv = k[-2], v[-1]
    fwd = 2 * bh * sq * sk * d + 2 * bh * sq * sk * dv
    # FlopCounterMode's backward of fused attention: recompute the scores, then the gradients
    # of scores, V, Q and K (one bmm each). Charged once, when any of q, k, v needs a gradient.
    bwd = bh * sq * sk * (6 * d + 4 * dv)
    return fwd, [bwd]


def _conv_count(x, w, out, transposed) -> sympy.Expr:
    spatial = (x if transposed else out)[2:]
    return 2 * x[0] * w[0] * w[1] * _prod(w[2:]) * _prod(spatial)


def _conv(shapes, consts, out, node):
    x, w = shapes[0], shapes[1]
    transposed = _is_transposed_conv(node)
    fwd = _conv_count(x, w, out, transposed)
    grad_x = _conv_count(out, w, x, not transposed)

    def t(shape):
        return (shape[1], shape[0], *shape[2:])

    if transposed:
        grad_w = _conv_count(t(out), t(x), t(w), False)
    else:
        grad_w = _conv_count(t(x), t(out), t(w), False)
    return fwd, [grad_x, grad_w, 0]


def _is_transposed_conv(node: fx.Node) -> bool:
    name = _packet(node.target)
    if name.startswith("conv_transpose"):
        return True
    if name in ("convolution", "_convolution"):
        return bool(node.args[6]) if len(node.args) > 6 else False
    return False


def _linear_ce(shapes, consts, out, node):  # linear_cross_entropy(x [N, h], w [V, h], ...)
    x, w = shapes[0], shapes[1]
    f = 2 * x[0] * x[1] * w[0]
    # Backward recomputes each chunk's logits (one more head matmul), charged to x's gradient.
    return f, [2 * f, f, 0]


def _mv_like(shapes, consts, out, node):  # mv(a, v), dot(a, b)
    a = shapes[0]
    f = 2 * _prod(a)
    return f, [f, f]


_FLOPS: dict[str, Callable] = {
    "mm": _mm_like,
    "bmm": _mm_like,
    "addmm": _addmm_like,
    "baddbmm": _addmm_like,
    "linear": _linear,
    "matmul": _matmul,
    "einsum": _einsum,
    "scaled_dot_product_attention": _sdpa,
    "_scaled_dot_product_flash_attention": _sdpa,
    "_scaled_dot_product_efficient_attention": _sdpa,
    "_scaled_dot_product_cudnn_attention": _sdpa,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "conv_transpose1d": _conv,
    "conv_transpose2d": _conv,
    "conv_transpose3d": _conv,
    "convolution": _conv,
    "_convolution": _conv,
    "mv": _mv_like,
    "dot": _mv_like,
    "linear_cross_entropy": _linear_ce,
}

_OPAQUE_PACKETS = {"opaque"}  # rpcompile::opaque, made by capture

# Ops whose output autograd never tracks, even when an input requires grad.
_NOT_DIFFERENTIABLE = {
    "detach", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "argmax", "argmin", "sym_size",
    "_assert_tensor_metadata", "lift_fresh_copy", "bernoulli",
}


# ---------------------------------------------------------------------------------------------
# 4. What autograd saves for backward: (node, walk) -> (values saved, scratch bytes saved)
# ---------------------------------------------------------------------------------------------
# Only consulted when the node's output requires grad. Values are fx nodes (their storage is
# charged once per unit; parameters are never charged) or scratch bytes autograd keeps that
# the graph does not show as a node (the log_softmax inside cross_entropy, attention's
# logsumexp, a dropout mask). Unknown ops save every input and their output: an over-estimate,
# never an under-estimate.


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in _flat_args(node)
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _save_nothing(node, walk):
    return [], 0


def _save_self(node, walk):
    return _tensor_args(node)[:1], 0


def _save_result(node, walk):
    return [node], 0


def _save_cross(first: int, second: int) -> Callable:
    """Products: each operand is saved iff the other one needs its gradient."""

    def rule(node, walk):
        args = _tensor_args(node)
        if len(args) <= max(first, second):  # a product with a Python scalar saves nothing
            return [], 0
        a, b = args[first], args[second]
        saved = []
        if walk.rg.get(b, False):
            saved.append(a)
        if walk.rg.get(a, False):
            saved.append(b)
        return saved, 0

    return rule


def _save_cross_entropy(node, walk):
    logits, target = node.args[0], node.args[1]
    # log_softmax(logits) and nll_loss's total_weight (a scalar) are kept for backward.
    scratch = walk._bytes_of(logits.meta["val"]) + _E
    return [target], scratch


def _save_sdpa(node, walk):
    q = node.args[0].meta["val"]
    shape = walk._shape(q)
    logsumexp = _prod(shape[:-1]) * 4  # fp32, one per query row
    return [*_tensor_args(node)[:3], node], logsumexp


def _save_linear_ce(node, walk):
    # The input and the targets, and one fp32 log-sum-exp per token (the weight is a parameter).
    x = node.args[0]
    return [x, node.args[2]], 4 * walk._shape(x.meta["val"])[0]


def _save_dropout(node, walk):
    if node.target is torch.ops.rpcompile.dropout.default:
        return [node.args[1]], 0  # the seeds: backward draws the mask again from them
    if _is_identity_dropout(node):
        return [], 0
    return [], _prod(walk._shape(node.meta["val"]))  # bool mask, one byte per element


def _is_identity_dropout(node: fx.Node) -> bool:
    """dropout(x, p=0) and dropout in eval mode return x itself at run time (the fake tensor
    of the graph is a fresh copy, which would count its bytes twice)."""
    if _packet(node.target) != "dropout":
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return p == 0 or not train


def _save_norm(node, walk):
    x = node.args[0].meta["val"]
    rows = _prod(walk._shape(x)[:-1])
    return [node.args[0]], rows * 2 * 4  # input, plus fp32 mean and rstd per row


def _save_indices(node, walk):
    return [a for a in _tensor_args(node) if not _is_float(a.meta["val"])], 0


def _save_div(node, walk):
    args = _tensor_args(node)
    if len(args) < 2:
        return [], 0
    a, b = args[0], args[1]
    return ([a, b] if walk.rg.get(b, False) else [b]), 0


def _save_opaque(node, walk):
    return _tensor_args(node), 0


def _save_all(node, walk):
    return [*_tensor_args(node), node], 0


_SAVES: dict[str, Callable] = {
    **dict.fromkeys([
        "add", "sub", "neg", "view", "reshape", "_unsafe_view", "transpose", "permute", "t",
        "unsqueeze", "squeeze", "expand", "expand_as", "slice", "select", "cat", "stack",
        "split", "split_with_sizes", "chunk", "unbind", "contiguous", "clone", "to",
        "_to_copy", "type_as", "flatten", "unflatten", "mean", "sum", "alias", "pad",
        "constant_pad_nd", "repeat", "narrow", "movedim", "view_as", "squeeze_", "unsqueeze_",
        "diagonal", "as_strided", "roll", "flip", "repeat_interleave", "tril", "triu", "copy",
    ], _save_nothing),
    **dict.fromkeys(["mul", "mm", "bmm", "matmul", "linear", "einsum", "dot", "mv", "outer",
                     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "convolution", "_convolution"], _save_cross(0, 1)),
    **dict.fromkeys(["addmm", "baddbmm"], _save_cross(1, 2)),
    **dict.fromkeys(["pow", "silu", "gelu", "log", "sin", "cos", "abs", "erf", "log1p",
                     "square", "reciprocal_", "clamp", "clamp_min", "clamp_max", "maximum",
                     "minimum", "max", "min", "prod", "cumprod", "norm"], _save_self),
    **dict.fromkeys(["rsqrt", "exp", "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax",
                     "tanh", "sigmoid", "sqrt", "relu", "reciprocal", "expm1"], _save_result),
    **dict.fromkeys(["embedding", "index", "index_select", "gather", "take_along_dim",
                     "where", "masked_fill", "masked_select"], _save_indices),
    **dict.fromkeys(["layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
                     "group_norm", "native_group_norm"], _save_norm),
    "div": _save_div,
    "cross_entropy_loss": _save_cross_entropy,
    "dropout": _save_dropout,
    "linear_cross_entropy": _save_linear_ce,
    "scaled_dot_product_attention": _save_sdpa,
    "opaque": _save_opaque,
}


def _scratch(node: fx.Node, walk: _Walk) -> sympy.Expr:
    """Bytes an op allocates besides its output (counted in its transient footprint)."""
    name = _packet(node.target)
    if name == "cross_entropy_loss":
        return walk._bytes_of(node.args[0].meta["val"])
    if name == "linear_cross_entropy":
        vocab, hidden = walk._shape(node.args[1].meta["val"])
        return linear_ce_scratch_bytes(node.args[4], vocab, hidden, _E,
                                       bool(walk.rg.get(node.args[1], False)))
    return sympy.Integer(0)


def linear_ce_scratch_bytes(chunk, vocab, hidden, elem, weight_grad: bool):
    """Bytes :func:`rpcompile.passes.chunked_loss.linear_cross_entropy` holds besides its inputs,
    saved values and returned gradients, forward or backward (whichever is larger), for a working
    dtype of ``elem`` bytes (an int, or the symbolic element size).

    Per chunk x vocabulary element: ``chunked_loss.chunk_element_bytes`` (4 in fp32, 6 in bf16:
    the fp32 softmax buffer and the working-dtype copy cast to or from it), measured with the
    live-storage meter of ``tests/test_chunked_loss.py``. Written ``8 - elem`` so the figure
    stays a polynomial in the symbolic element size: exact for 2- and 4-byte floats, the dtypes
    the kernel runs in (over for 1-byte ones). With a trainable weight narrower than fp32 the
    backward also keeps a weight-sized fp32 accumulator (``2 * (4 - elem)`` bytes per weight
    element: 4 in bf16, 0 in fp32, where the accumulator is the returned gradient). A whole
    chunk is charged even when the microbatch has fewer tokens: a polynomial in b and s stays one.
    """
    per_element = 8 - elem
    accumulator = 2 * (4 - elem) * vocab * hidden if weight_grad else 0
    return sympy.Integer(chunk) * vocab * per_element + accumulator


# ---------------------------------------------------------------------------------------------
# 5. Helpers
# ---------------------------------------------------------------------------------------------


def _packet(target: Any) -> str:
    """The op's name without namespace and overload: aten.linear.default -> 'linear'."""
    name = getattr(target, "_overloadpacket", None)
    if name is not None:
        return name.__name__
    return getattr(target, "__name__", str(target))


def _flat_args(node: fx.Node) -> list[Any]:
    out: list[Any] = []

    def add(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                add(y)
        else:
            out.append(x)

    add(node.args)
    add(list(node.kwargs.values()))
    return out


def _flat_nodes(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat_nodes(item)]
    return [x]


def _flat_tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _flat_tensors(v)]
    return []


def _any_rg(flag: Any) -> bool:
    """Requires-grad flag of a value; multi-output nodes carry one flag per output."""
    return any(flag) if isinstance(flag, list) else bool(flag)


def _is_float(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def _any_float(val: Any) -> bool:
    return any(_is_float(t) for t in _flat_tensors(val))


def _raw_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _concrete_numel(val: Any, name: str) -> int:
    if not isinstance(val, torch.Tensor):
        raise InvalidInput(f"placeholder {name} has no tensor in node.meta['val']")
    try:
        return math.prod(int(d) for d in val.shape)
    except (TypeError, RuntimeError) as exc:
        raise InvalidInput(f"parameter/buffer {name} has a symbolic shape {tuple(val.shape)}") from exc


def _concrete_nbytes(val: Any, name: str) -> int:
    return _concrete_numel(val, name) * val.element_size()


def _graph_element_bytes(gm: fx.GraphModule, weights: dict[str, bool | None]) -> int:
    """Element size of the graph's floating dtype: that of most parameter elements."""
    by_size: dict[int, int] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.name in weights and _is_float(val):
            size = val.element_size()
            by_size[size] = by_size.get(size, 0) + _concrete_numel(val, node.name)
    if not by_size:
        return 4
    return max(by_size, key=by_size.__getitem__)


def _coefficients(expr: sympy.Expr) -> dict[tuple, sympy.Expr] | None:
    try:
        return sympy.Poly(sympy.expand(expr), B, S, _E).as_dict()
    except sympy.PolynomialError:
        return None


def _dominates(a: dict, b: dict) -> bool:
    """True when a >= b for every b, s, elem >= 1 (a sufficient test, never a wrong True).

    Since every variable is >= 1, a monomial is at least any monomial it divides; so a - b >= 0
    if each negative coefficient of a - b can be paid for by positive coefficients at monomials
    it divides. Paid greedily, highest negative monomials first, from the lowest payers."""
    diff = {m: a.get(m, 0) - b.get(m, 0) for m in set(a) | set(b)}
    credit = {m: c for m, c in diff.items() if c > 0}
    debts = sorted(((m, -c) for m, c in diff.items() if c < 0), key=lambda mc: -sum(mc[0]))
    for mono, debt in debts:
        payers = sorted((m for m in credit if all(x >= y for x, y in zip(m, mono))), key=sum)
        for m in payers:
            pay = min(debt, credit[m])
            credit[m] -= pay
            debt -= pay
            if debt == 0:
                break
        if debt > 0:
            return False
    return True


def _max_of(exprs: list[sympy.Expr]) -> sympy.Expr:
    """Max of byte expressions, dropping terms another term dominates for every size."""
    uniq = list(dict.fromkeys(sympy.expand(e) for e in exprs))
    if not uniq:
        return sympy.Integer(0)
    coeffs = [_coefficients(e) for e in uniq]
    keep = []
    for i, (e, c) in enumerate(zip(uniq, coeffs)):
        if c is None:
            keep.append(e)
            continue
        dominated = any(
            j != i and d is not None and _dominates(d, c) and (d != c or j < i)
            for j, d in enumerate(coeffs)
        )
        if not dominated:
            keep.append(e)
    # The survivors are pairwise incomparable, so Max needs no simplification of its own
    # (evaluating it would search for comparable pairs again, which is slow).
    return keep[0] if len(keep) == 1 else sympy.Max(*keep, evaluate=False)


def _subs_in_max(expr: sympy.Expr, subs: dict) -> sympy.Expr:
    """xreplace of a Max, pruned again by _max_of rather than by sympy's slow evaluation of a
    Max (with the element size fixed, more terms become comparable)."""
    if isinstance(expr, sympy.Max):
        return _max_of([a.xreplace(subs) for a in expr.args])
    return expr.xreplace(subs)


def _to_int(value: sympy.Expr, what: str, unit: str) -> int:
    if not value.is_number:
        raise InvalidInput(
            f"{what} of unit {unit!r} still has free symbols {sorted(map(str, value.free_symbols))} "
            "after substituting b and s; capture's subs must map every shape symbol to B or S"
        )
    return int(sympy.ceiling(value))


# ---------------------------------------------------------------------------------------------
# 6. Recompute granularity
# ---------------------------------------------------------------------------------------------
# A backward stage (not the fused tail) recomputes its forward from its saved input, then runs
# backward. By "stage", one forward with autograd keeps every unit's saved activations until
# the one backward: the working set is the sum of the units'. By "layer", a forward without
# autograd keeps only the values that cross from one unit to a later one (the boundaries);
# then, last unit first, each unit's forward is recomputed with autograd and its backward run:
# the working set is the boundaries, one boundary gradient and the largest unit's own working
# set, at the cost of one more forward of every unit but the last. A one-unit stage gains
# nothing by "layer" and keeps "stage".

RECOMPUTE = RECOMPUTE_GRANULARITIES  # "stage", "layer": the option's choices but "auto"


def recompute_working_bytes(units: Sequence[Any], r: Sequence[int], recompute: str) -> int:
    """One microbatch's working set of a backward stage over units ``r`` (``UnitProfile``s),
    weights, gradient buffer and the stage's own inputs excluded. ``recompute``: the
    stage's resolved granularity, checked by the options' one rule (``rpcompile.choices``):
    this function is public, and a value the partitioner did not resolve ("auto", a typo)
    would otherwise be costed as layer recompute."""
    check_choice("recompute", recompute, RECOMPUTE)
    if recompute == "stage" or len(r) < 2:
        return sum(units[u].working_bytes for u in r)
    inner = r[:-1]  # units whose outputs are boundaries kept for a later unit of the stage
    boundaries = sum(units[u].output_bytes + units[u].shared_bytes for u in inner)
    gradient = max(units[u].output_bytes for u in inner)
    return boundaries + gradient + max(units[u].working_bytes for u in r)


def recompute_ms(units: Sequence[Any], r: Sequence[int], recompute: str) -> float:
    """One microbatch's compute time of a backward stage over units ``r``: recompute plus
    backward, and by "layer" the boundary forward of every unit but the last before it.
    ``recompute`` is checked as in :func:`recompute_working_bytes` (else an unresolved
    "auto" would be timed as stage recompute)."""
    check_choice("recompute", recompute, RECOMPUTE)
    ms = sum(units[u].forward_ms + units[u].backward_ms for u in r)
    if recompute == "layer" and len(r) > 1:
        ms += sum(units[u].forward_ms for u in r[:-1])
    return ms
