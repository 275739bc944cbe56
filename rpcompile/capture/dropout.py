"""Dropout that a recompute replays: masks drawn from seeds carried with the batch.

Sections, in reading order:
  1. Seeds: one base seed per compile, one seed per sequence per optimizer step
  2. ``rpcompile::dropout``: the seeded dropout op (forward and backward draw the same mask)
  3. replay_random_ops(): the capture pass that rewrites every dropout of the graph to it

Why: a backward stage recomputes its forward from a saved input. An ordinary dropout would draw
a fresh mask there, and the gradients would belong to another forward than the one that gave the
loss. Here every dropout node of the captured graph draws its mask from a generator seeded by
(the microbatch's first sequence seed, the node's index in the graph): the forward stage, the
recompute of any backward stage and the op's own backward all draw the same mask, whatever the
stage boundaries are, on whichever worker. No RNG state is saved or moved between workers.

The seeds are a batch input (``rp_rng``, one int64 per sequence) so they travel with each
microbatch like the token ids. Masks come from ``torch.rand`` on the worker's device: they are
the same on every run of a step on the same kind of device, not the same numbers as eager
PyTorch's dropout (no system can promise that), and differ between CPU and CUDA workers.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch
import torch.fx as fx

__all__ = [
    "RANDOM_OPS",
    "draws_random",
    "dropout_disabled",
    "dropout_seed",
    "emit_like",
    "record_masks",
    "replay_random_ops",
    "seeded_dropout",
    "step_seeds",
]

_MASK = (1 << 62) - 1

# ---------------------------------------------------------------------------------------------
# 1. Seeds
# ---------------------------------------------------------------------------------------------


def dropout_seed() -> int:
    """The base seed of a compile: torch's initial seed, so ``torch.manual_seed`` before
    ``compile`` makes every later step's masks repeatable (the default generator is not
    consumed)."""
    return int(torch.initial_seed()) & _MASK


def _mix(*values: int) -> int:
    """splitmix64 of the values, folded one after another into 62 bits."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


def step_seeds(base: int, step: int, sequences: int) -> torch.Tensor:
    """One seed per sequence of optimizer step ``step`` (int64, shape ``[sequences]``)."""
    start = _mix(base, step)
    return (torch.arange(sequences, dtype=torch.int64) + start) & _MASK


# ---------------------------------------------------------------------------------------------
# 2. The seeded dropout op
# ---------------------------------------------------------------------------------------------

_recording: list[list] = []
_disabled = contextvars.ContextVar("rpcompile_dropout_disabled", default=False)


@contextlib.contextmanager
def dropout_disabled() -> Iterator[None]:
    """Inside the block (this thread), ``rpcompile::dropout`` is the identity: the graph's
    forward in eval mode (``Compiled.evaluate``)."""
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)
_recording_lock = threading.Lock()


@contextlib.contextmanager
def record_masks() -> Iterator[list[tuple[int, int, torch.Tensor]]]:
    """Collect ``(salt, seed, keep)`` for every mask a forward draws inside the block (from any
    thread: virtual workers included); ``keep`` is the boolean mask. For tests and debugging."""
    out: list[tuple[int, int, torch.Tensor]] = []
    with _recording_lock:
        _recording.append(out)
    try:
        yield out
    finally:
        with _recording_lock:
            _recording.remove(out)


def _keep(rng: torch.Tensor, salt: int, p: float, like: torch.Tensor) -> tuple[int, torch.Tensor]:
    seed = _mix(int(rng.reshape(-1)[0]), salt)
    gen = torch.Generator(device=like.device)
    gen.manual_seed(seed)
    return seed, torch.rand(like.shape, generator=gen, device=like.device) >= p


def _scaled(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    if p >= 1.0:
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device)  # as F.dropout(p=1)
    return keep.to(dtype) * (1.0 / (1.0 - p))


@torch.library.custom_op("rpcompile::dropout", mutates_args=())
def seeded_dropout(x: torch.Tensor, rng: torch.Tensor, p: float, salt: int) -> torch.Tensor:
    """``x * keep / (1 - p)`` with ``keep`` drawn from (``rng[0]``, ``salt``): the same mask in
    every forward, recompute and backward of one microbatch."""
    if _disabled.get():
        return x.clone()
    seed, keep = _keep(rng, salt, p, x)
    if _recording:
        with _recording_lock:
            for out in _recording:
                out.append((salt, seed, keep.clone()))
    return x * _scaled(keep, p, x.dtype)


@seeded_dropout.register_fake
def _(x: torch.Tensor, rng: torch.Tensor, p: float, salt: int) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    _x, rng, p, salt = inputs
    ctx.save_for_backward(rng)
    ctx.p, ctx.salt = p, salt


def _backward(ctx, grad: torch.Tensor):
    (rng,) = ctx.saved_tensors
    _seed, keep = _keep(rng, ctx.salt, ctx.p, grad)  # the forward's mask, drawn again
    return grad * _scaled(keep, ctx.p, grad.dtype), None, None, None


seeded_dropout.register_autograd(_backward, setup_context=_setup_context)

# ---------------------------------------------------------------------------------------------
# 3. The capture pass
# ---------------------------------------------------------------------------------------------

# The ops that draw random numbers (by overload packet name, trailing "_" removed).
RANDOM_OPS = frozenset({
    "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
    "randperm", "normal", "multinomial", "native_dropout", "dropout", "feature_dropout",
    "alpha_dropout", "feature_alpha_dropout", "scaled_dot_product_attention",
    "rrelu_with_noise", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random"})
_DROPOUT_FAMILY = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                   "native_dropout")


def draws_random(name: str, args: tuple, kwargs: dict | None) -> bool:
    """Whether a call of the random op ``name`` (one of :data:`RANDOM_OPS`) with these
    arguments draws: a dropout only with ``p > 0`` in training, SDPA only with
    ``dropout_p > 0``; every other random op always. The one reader of these arguments for the
    capture's refusal, the opaque probe's spy and the replay pass."""
    kwargs = kwargs or {}

    def arg(index: int, key: str, default):
        return args[index] if len(args) > index else kwargs.get(key, default)

    if name == "scaled_dot_product_attention":
        return bool(arg(4, "dropout_p", 0.0))
    if name in _DROPOUT_FAMILY:
        return bool(arg(1, "p", 0.5)) and arg(2, "train", True) is not False
    return name in RANDOM_OPS


_DROPOUT = (torch.ops.aten.dropout.default,)
_SDPA = (torch.ops.aten.scaled_dot_product_attention.default,)
_KEEP_META = ("nn_module_stack", "rp_unit", "stack_trace", "source_fn_stack", "from_node")


def replay_random_ops(gm: fx.GraphModule, first_input: str, wrapped: str) -> fx.Node | None:
    """Rewrite every training-mode ``aten.dropout`` and every ``scaled_dot_product_attention``
    with ``dropout_p > 0`` of ``gm`` to draw from seeds; return the new ``rp_rng`` batch
    placeholder (``meta["rp_random_ops"]``: the modules rewritten), or None if there were none.

    SDPA with dropout becomes its math form (scores, softmax, seeded dropout, values), since the
    fused kernels draw their own mask. Other random ops are left for the capture to refuse."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and _replayable(n)]
    if not nodes:
        return None
    first = next(n for n in gm.graph.find_nodes(op="placeholder") if n.name == first_input)
    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    with gm.graph.inserting_after(last):
        rng = gm.graph.placeholder("rp_rng")
    val = first.meta["val"]
    with val.fake_mode:
        rng.meta["val"] = torch.empty((val.shape[0],), dtype=torch.int64)
    rng.meta["rp_unit"] = 0
    modules = []
    for salt, node in enumerate(nodes):
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        modules.append(stack[-1][0].removeprefix(wrapped + ".") if stack else "the model")
        with gm.graph.inserting_before(node):
            if node.target in _DROPOUT:
                p = float(_arg(node, 1, "p", 0.5))
                new = emit_like(gm, node, torch.ops.rpcompile.dropout.default,
                            (node.args[0], rng, p, salt))
            else:
                new = _sdpa_math(gm, node, rng, salt)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    rng.meta["rp_random_ops"] = modules
    gm.graph.lint()
    gm.recompile()
    return rng


def _replayable(node: fx.Node) -> bool:
    if node.target in _DROPOUT:
        return draws_random("dropout", node.args, node.kwargs)
    if node.target in _SDPA:
        return draws_random("scaled_dot_product_attention", node.args, node.kwargs)
    return False


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def emit_like(gm: fx.GraphModule, like: fx.Node, target, args: tuple, kwargs: dict | None = None):
    """A new node computing ``target(*args)``, with the fake value and provenance of ``like``'s
    place in the graph."""
    kwargs = kwargs or {}
    node = gm.graph.call_function(target, args, kwargs)
    node.meta.update({k: like.meta[k] for k in _KEEP_META if k in like.meta})
    fake_args = fx.map_arg(args, lambda a: a.meta["val"])
    fake_kwargs = fx.map_arg(kwargs, lambda a: a.meta["val"])
    with like.meta["val"].fake_mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def _sdpa_math(gm: fx.GraphModule, node: fx.Node, rng: fx.Node, salt: int) -> fx.Node:
    aten = torch.ops.aten
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask", None)
    p = float(_arg(node, 4, "dropout_p", 0.0))
    causal = bool(_arg(node, 5, "is_causal", False))
    scale = _arg(node, 6, "scale", None)
    gqa = bool(_arg(node, 7, "enable_gqa", False))
    qv, kv = q.meta["val"], k.meta["val"]
    if scale is None:
        scale = 1.0 / float(qv.shape[-1]) ** 0.5
    if gqa and kv.shape[-3] != qv.shape[-3]:
        reps = int(qv.shape[-3]) // int(kv.shape[-3])
        k = emit_like(gm, node, aten.repeat_interleave.self_int, (k, reps, -3))
        v = emit_like(gm, node, aten.repeat_interleave.self_int, (v, reps, -3))
    kt = emit_like(gm, node, aten.transpose.int, (k, -2, -1))
    scores = emit_like(gm, node, aten.matmul.default, (q, kt))
    scores = emit_like(gm, node, aten.mul.Tensor, (scores, float(scale)))
    if causal:
        ones = emit_like(gm, node, aten.ones_like.default, (scores,), {"dtype": torch.bool})
        lower = emit_like(gm, node, aten.tril.default, (ones,))
        upper = emit_like(gm, node, aten.logical_not.default, (lower,))
        scores = emit_like(gm, node, aten.masked_fill.Scalar, (scores, upper, float("-inf")))
    if mask is not None:
        if mask.meta["val"].dtype == torch.bool:
            hidden = emit_like(gm, node, aten.logical_not.default, (mask,))
            scores = emit_like(gm, node, aten.masked_fill.Scalar, (scores, hidden, float("-inf")))
        else:
            scores = emit_like(gm, node, aten.add.Tensor, (scores, mask))
    # Torch's SDPA gives 0, not NaN, for a query that sees no key (left padding): same here.
    probs = emit_like(gm, node, aten._safe_softmax.default, (scores, -1))
    probs = emit_like(gm, node, torch.ops.rpcompile.dropout.default, (probs, rng, p, salt))
    return emit_like(gm, node, aten.matmul.default, (probs, v))
