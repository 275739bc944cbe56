"""FLOP formulas of the matmul-class ops (what FlopCounterMode counts), per op: the forward
and each argument's own gradient, and the ops autograd never differentiates.

Each formula: (arg shapes, non-tensor args, out shape, node) -> (forward, [grad per arg]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
from torch import fx

from rpcompile.errors import InvalidInput
from rpcompile.passes.cost.symbolic import _packet

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
            "ellipsis; rewrite it as matmul or add its formula to rpcompile/passes/cost/flops.py"
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
