"""The helpers the cost modules share: an fx node's op name, flattened arguments and tensors,
concrete sizes, and the sympy side (the element-size symbol, polynomial coefficients, pruning of
Max terms, integer figures)."""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch import fx

from rpcompile.capture.types import B, S
from rpcompile.errors import InvalidInput

# Bytes of one element of the graph's floating dtype. Byte expressions are built with it and
# it is substituted at the end, so that evaluate() can rescale fp32 activations to bf16 while
# leaving int64 position ids and bool masks at their size.
_E = sympy.Symbol("_elem", positive=True, integer=True)


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
