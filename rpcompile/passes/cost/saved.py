"""What autograd saves for backward, per op, and the scratch bytes an op allocates besides
its output (the chunked linear cross-entropy's among them).

Each rule: (node, walk) -> (values saved, scratch bytes saved).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import sympy
import torch
from torch import fx

from rpcompile.passes.cost.flops import _prod
from rpcompile.passes.cost.symbolic import _E, _flat_args, _is_float, _packet

if TYPE_CHECKING:
    from rpcompile.passes.cost.walk import _Walk

__all__ = [
    "linear_ce_scratch_bytes",
]


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


def _save_selected(node, walk):
    """Reductions that pick elements. Along a dimension (``max(x, dim)``, ``sort``, ``topk``:
    a (values, indices) pair) backward scatters the gradient to the picked places, so autograd
    keeps the indices only, never the input: ``x - x.max(-1, keepdim=True).values`` before a
    softmax keeps no copy of the scores. Over the whole tensor (``max(x)``) it keeps the
    input and the result; elementwise (``max(x, y)``) both inputs."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [val[1]], 0
    args = _tensor_args(node)
    return (args if len(args) > 1 else [*args, node]), 0


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
                     "minimum", "prod", "cumprod", "norm"], _save_self),
    **dict.fromkeys(["max", "min", "sort", "topk", "kthvalue", "mode", "median", "nanmedian"],
                    _save_selected),
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
    if node.meta.get("rp_scratch") is not None:  # an opaque block's own working set
        elements, other = node.meta["rp_scratch"]
        return sympy.sympify(elements) * _E + sympy.sympify(other)
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
    live-storage meter of ``tests/passes/test_chunked_loss.py``. Written ``8 - elem`` so the figure
    stays a polynomial in the symbolic element size: exact for 2- and 4-byte floats, the dtypes
    the kernel runs in (over for 1-byte ones). With a trainable weight narrower than fp32 the
    backward also keeps a weight-sized fp32 accumulator (``2 * (4 - elem)`` bytes per weight
    element: 4 in bf16, 0 in fp32, where the accumulator is the returned gradient). A whole
    chunk is charged even when the microbatch has fewer tokens: a polynomial in b and s stays one.
    """
    per_element = 8 - elem
    accumulator = 2 * (4 - elem) * vocab * hidden if weight_grad else 0
    return sympy.Integer(chunk) * vocab * per_element + accumulator
