"""annotate_costs(): one walk over the captured graph that writes ``node.meta["rp_cost"]``
on every ``call_function`` node and sums each unit's FLOPs, parameters, saved activations,
transient peak, boundary outputs, shared values, buffers and batch inputs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx

from rpcompile.capture.quantized import DEQUANTIZE_OPS, packed_record_bytes
from rpcompile.errors import InvalidInput
from rpcompile.passes.cost.flops import _FLOPS, _NOT_DIFFERENTIABLE, _OPAQUE_PACKETS, _sdpa
from rpcompile.passes.cost.saved import _SAVES, _is_identity_dropout, _save_all, _scratch
from rpcompile.passes.cost.symbolic import (
    _E,
    _any_float,
    _any_rg,
    _concrete_nbytes,
    _concrete_numel,
    _flat_args,
    _flat_nodes,
    _flat_tensors,
    _graph_element_bytes,
    _is_float,
    _max_of,
    _packet,
    _raw_key,
    _subs_in_max,
)
from rpcompile.passes.cost.types import NodeCost, UnitCost

__all__ = [
    "annotate_costs",
]


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
