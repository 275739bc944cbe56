"""Opaque blocks: mixture-of-experts and data-dependent modules become one ``rpcompile::opaque``
node, run eagerly by a per-thread copy of the module, with its own FLOP rule and its working
set measured on the probes."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils.flop_counter
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rpcompile.capture.dropout import RANDOM_OPS, draws_random
from rpcompile.capture.types import B, CaptureError, RefusedModel, S

# ---------------------------------------------------------------------------------------------
# 4. Opaque blocks
# ---------------------------------------------------------------------------------------------


@dataclass
class _OpaqueEntry:
    module: nn.Module
    forward: Callable
    param_names: list[str]
    out_rules: list[tuple[list[tuple[str, int]], torch.dtype]]
    tuple_out: bool
    flops_per_token: int
    tokens: sympy.Expr  # what flops_per_token is per: B * S (hidden states) or B (rows)
    # The block's own working set as a backward job runs it (_opaque_backward), per token:
    # floating-point elements and other bytes (_working_set, _per_token).
    scratch: tuple[int, int] = (0, 0)
    # Each thread's skeleton clone of ``module`` (see _thread_skeleton).
    local: threading.local = field(default_factory=threading.local, repr=False, compare=False)


# Entries live as long as a Captured holds them (captured.opaque_entries): a failed attempt's
# blocks, and a dropped model's, are released with them.
_OPAQUE: weakref.WeakValueDictionary[str, _OpaqueEntry] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
_SKELETON_LOCK = threading.Lock()  # deepcopy reads the shared module: one clone at a time


def _thread_skeleton(entry: _OpaqueEntry) -> tuple[nn.Module, Callable]:
    """This thread's clone of the opaque module and its forward bound to the clone.

    ``functional_call`` swaps the parameters of the module it is given in place for the
    call, so two threads calling it on the shared module would read each other's weights.
    Each thread gets its own module tree instead: parameters become empty placeholders (no
    weight memory is copied; every call passes its real parameters), buffers stay shared
    (they are only read)."""
    cached = getattr(entry.local, "skeleton", None)
    if cached is not None:
        return cached
    module = entry.module
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b
    with _SKELETON_LOCK:
        clone = copy.deepcopy(module, memo)
    # A forward patched into the instance (the capture-time opaque call) must not follow.
    clone.__dict__.pop("forward", None)
    forward = entry.forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        forward = types.MethodType(forward.__func__, clone)
    else:
        raise CaptureError(
            f"opaque block {type(module).__name__}: its forward is not a method of the module "
            "itself (a wrapper installed by another library?), so it cannot be run on a "
            "per-thread copy; remove the wrapper or leave the block out of opaque="
        )
    entry.local.skeleton = (clone, forward)
    return clone, forward


def _run_opaque(entry: _OpaqueEntry, inputs: list[torch.Tensor], params: list[torch.Tensor]):
    module, forward = _thread_skeleton(entry)
    state = dict(zip(entry.param_names, params))
    with _forward_swapped(module, forward):
        out = torch.func.functional_call(module, state, tuple(inputs))
    return list(out) if entry.tuple_out else [out]


@torch.library.custom_op("rpcompile::opaque", mutates_args=())
def _opaque_op(inputs: list[torch.Tensor], params: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    outs = _run_opaque(_OPAQUE[key], inputs, params)
    seen = {t.data_ptr() for t in (*inputs, *params)}
    return [o.clone() if o.data_ptr() in seen else o for o in outs]


@_opaque_op.register_fake
def _(inputs, params, key):
    entry = _OPAQUE[key]
    x = inputs[0]
    outs = []
    for rule, dtype in entry.out_rules:
        shape = []
        for kind, v in rule:
            if kind == "const":
                shape.append(v)
            elif kind == "in":
                shape.append(x.shape[v])
            else:  # "tokens": product of every input dimension but the last
                shape.append(math.prod(x.shape[:-1]))
        outs.append(x.new_empty(shape, dtype=dtype))
    return outs


def _opaque_setup(ctx, inputs, output):
    ins, params, key = inputs
    ctx.n_in = len(ins)
    ctx.key = key
    ctx.save_for_backward(*ins, *params)


def _opaque_backward(ctx, grads):
    saved = ctx.saved_tensors
    entry = _OPAQUE[ctx.key]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in saved]
    ins, params = leaves[: ctx.n_in], leaves[ctx.n_in :]
    with torch.enable_grad():
        outs = _run_opaque(entry, ins, params)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wrt = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(
        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
    ) if pairs else [None] * len(wrt)
    it = iter(got)
    full = [next(it) if t.requires_grad else None for t in leaves]
    return full[: ctx.n_in], full[ctx.n_in :], None


_opaque_op.register_autograd(_opaque_backward, setup_context=_opaque_setup)


def _default_opaque(model: nn.Module) -> list[str]:
    """Mixture-of-experts blocks: a module with an ``experts`` child and a gate/router."""
    found = []
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if "experts" in kids and ("gate" in kids or "router" in kids):
            if not any(name.startswith(f + ".") for f in found):
                found.append(name)
    return found


@contextlib.contextmanager
def _forward_swapped(module: nn.Module, forward: Callable):
    patched = module.__dict__.get("forward")
    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        if patched is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = patched


@contextlib.contextmanager
def _opaque_patched(model: nn.Module, names: Sequence[str], seen: dict, keep: list):
    """Route each named module's forward through the opaque op while exporting."""
    saved = []
    try:
        for name in names:
            mod = model.get_submodule(name)
            original = mod.forward  # bound method of the class's forward
            entry = _probe_opaque(mod, original, seen.get(name), name)
            key = f"{name}#{next(_KEYS)}"
            _OPAQUE[key] = entry
            keep.append(entry)

            def call(*args, _key=key, _entry=entry, _mod=mod, _name=name, **kwargs):
                if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
                    raise CaptureError(
                        f"opaque module {_name!r} was called with non-tensor or keyword "
                        "arguments; opaque blocks take tensors only"
                    )
                params = [_mod.get_parameter(p) for p in _entry.param_names]
                outs = _opaque_op(list(args), params, _key)
                return tuple(outs) if _entry.tuple_out else outs[0]

            saved.append((mod, mod.__dict__.get("forward")))
            mod.__dict__["forward"] = call
        yield
    finally:
        for mod, prev in reversed(saved):
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.__dict__["forward"] = prev


def _probe_opaque(mod: nn.Module, forward: Callable, seen=None, name: str = "") -> _OpaqueEntry:
    """Learn an opaque block's output shapes and FLOPs by running it on two small inputs.

    Blocks of a causal LM take hidden states [b, s, h]: probed at two (b, s) pairs. Other
    blocks are probed with the input shape seen during capture, at two batch sizes.
    """
    param_names = [n for n, _ in mod.named_parameters()]
    p0 = next(mod.parameters(), None)
    if p0 is None:
        raise CaptureError(f"opaque block {type(mod).__name__} has no parameters")
    device, dtype = p0.device, p0.dtype
    if seen is not None and len(seen[0]) != 3:
        shapes = [(2, *seen[0][1:]), (3, *seen[0][1:])]
        dtype = seen[1]
    else:
        hidden = _input_width(mod)
        shapes = [(2, 3, hidden), (3, 5, hidden)]
    results = []
    flops = []
    for shape in shapes:
        x = torch.randn(shape, dtype=dtype).to(device)
        tokens = math.prod(shape[:-1]) if len(shape) == 3 else shape[0]
        with torch.no_grad(), torch.utils.flop_counter.FlopCounterMode(display=False) as fc, \
                _RandomOpSpy() as spy:
            out = forward(x)
        if spy.seen:
            raise RefusedModel(
                f"opaque block {name or type(mod).__name__} ({type(mod).__name__}) draws random "
                "numbers in training "
                f"({', '.join(sorted(spy.seen))}), which rpcompile cannot replay inside an opaque "
                "block when a backward stage recomputes it, so the gradients would not match "
                "the loss: set its dropout/noise to 0 (e.g. config.router_jitter_noise = 0.0, "
                "a dropout's p = 0.0) or put that block in eval mode"
            )
        flops.append(fc.get_total_flops() / tokens)
        results.append((x.shape, out))
    tuple_out = isinstance(results[0][1], tuple)
    rules = []
    outs0 = results[0][1] if tuple_out else (results[0][1],)
    outs1 = results[1][1] if tuple_out else (results[1][1],)
    for o0, o1 in zip(outs0, outs1):
        rule = []
        for d0, d1 in zip(o0.shape, o1.shape):
            rule.append(_dim_rule(d0, d1, results[0][0], results[1][0]))
        rules.append((rule, o0.dtype))
    # FLOPs per token are read off a real run; FlopCounterMode does not see grouped expert
    # matmuls, so an MoE block is counted from its shapes (router + top-k experts) instead.
    per_token = _moe_flops_per_token(mod)
    if per_token is None:
        per_token = round(max(flops))
    tokens = B * S if len(shapes[0]) == 3 else B
    sizes = [math.prod(shape[:-1]) if len(shape) == 3 else shape[0] for shape in shapes]
    gen = torch.Generator().manual_seed(0)
    peaks = [_working_set(mod, forward, torch.randn(shape, generator=gen).to(device, dtype))
             for shape in shapes]
    return _OpaqueEntry(mod, forward, param_names, rules, tuple_out, per_token, tokens,
                        _per_token(sizes, peaks, dtype))


def _working_set(mod: nn.Module, forward: Callable, x: torch.Tensor) -> tuple[int, int]:
    """(floating-point, other) bytes the block holds at its peak when a backward job runs it:
    its forward again with autograd on, then the gradients of its input and trainable
    parameters (_opaque_backward). Its input, outputs, output gradients and the gradients it
    returns are left out: the cost pass charges those as the node's own values."""
    params = [p for p in mod.parameters() if p.requires_grad]
    x = x.detach().requires_grad_(True)
    with _LiveBytes() as meter, torch.enable_grad():
        out = forward(x)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        seeds = [torch.ones_like(o) for o in outs]
        grads = torch.autograd.grad(outs, [x, *params], seeds, allow_unused=True) \
            if outs else ()
    returned = [*outs, *seeds, *(g for g in grads if g is not None)]
    return meter.peak(returned)


def _per_token(sizes: Sequence[int], peaks: Sequence[tuple[int, int]],
               dtype: torch.dtype) -> tuple[int, int]:
    """(floating-point elements, other bytes) per token: the larger of the probes' ratios,
    rounded up, so the line through zero lies on or above both probes' peaks (a block's
    fixed-size scratch makes the smaller probe's ratio the larger). Floats are counted in
    elements so the figure follows the compute dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    floats = max(-(-f // (t * elem)) for t, (f, _) in zip(sizes, peaks))
    other = max(-(-o // t) for t, (_, o) in zip(sizes, peaks))
    return floats, other


class _LiveBytes(TorchDispatchMode):
    """Records each tensor storage the ops inside it create and when it is freed, so that the
    peak of the live ones can be taken after the run, leaving out storages that turn out to
    be results. Storages are told apart by identity while alive (this works on the meta device
    too) and each allocation gets its own number, since a freed storage's identity is reused."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int, bool]] = []  # (allocation, +/- bytes, floating)
        self.live: dict[int, int] = {}  # id of a live storage -> its allocation
        self.count = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in before or key in self.live:
                continue  # a view or an in-place result: no new memory
            n = self.live[key] = next(self.count)
            nbytes, floating = storage.nbytes(), t.is_floating_point()
            self.events.append((n, nbytes, floating))
            weakref.finalize(storage, self._free, key, n, nbytes, floating)
        return out

    def _free(self, key: int, n: int, nbytes: int, floating: bool) -> None:
        if self.live.get(key) == n:
            del self.live[key]
            self.events.append((n, -nbytes, floating))

    def peak(self, results: Sequence[torch.Tensor]) -> tuple[int, int]:
        """(floating, other) bytes at the largest total of live storages, ``results`` left
        out."""
        leave_out = {self.live.get(id(t.untyped_storage())) for t in results}
        live, best = [0, 0], (0, 0)
        for n, nbytes, floating in self.events:
            if n in leave_out:
                continue
            live[0 if floating else 1] += nbytes
            if sum(live) > sum(best):
                best = (live[0], live[1])
        return best


class _RandomOpSpy(TorchDispatchMode):
    """Records the random ops an opaque block's probe run dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__.rstrip("_")
        if name in RANDOM_OPS and draws_random(name, args, kwargs):
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def _moe_flops_per_token(mod: nn.Module) -> int | None:
    """2 x (router weights + top_k x one expert's weights): the matmul FLOPs one token costs."""
    experts = getattr(mod, "experts", None)
    if experts is None:
        return None
    count = getattr(experts, "num_experts", None)
    top_k = None
    for holder in (mod, getattr(mod, "gate", None), getattr(mod, "router", None), experts):
        for attr in ("top_k", "num_experts_per_tok", "experts_per_token"):
            v = getattr(holder, attr, None) if holder is not None else None
            if isinstance(v, int):
                top_k = top_k or v
    weights3d = [p for p in experts.parameters() if p.dim() == 3]
    if top_k is None or not weights3d:
        return None
    count = count or weights3d[0].shape[0]
    per_expert = sum(p.numel() for p in weights3d) // count
    router = sum(
        p.numel() for name, p in mod.named_parameters()
        if not name.startswith("experts.") and p.dim() == 2
    )
    return 2 * (router + top_k * per_expert)


def _dim_rule(d0: int, d1: int, shape0, shape1) -> tuple[str, int]:
    if d0 == d1:
        return ("const", d0)
    for j, (a, b) in enumerate(zip(shape0, shape1)):
        if (a, b) == (d0, d1):
            return ("in", j)
    if shape0[:-1].numel() == d0 and shape1[:-1].numel() == d1:
        return ("tokens", 0)
    raise CaptureError(f"cannot express an opaque block's output size {d0}/{d1} in its input")


def _input_width(mod: nn.Module) -> int:
    for attr in ("hidden_size", "hidden_dim", "embed_dim"):
        v = getattr(mod, attr, None) or getattr(getattr(mod, "config", None), attr, None)
        if isinstance(v, int):
            return v
    for sub in mod.modules():
        if isinstance(sub, nn.Linear):
            return sub.in_features
        cfg = getattr(sub, "config", None)
        if cfg is not None and isinstance(getattr(cfg, "hidden_size", None), int):
            return cfg.hidden_size
    for p in mod.parameters():
        if p.dim() == 2:
            return p.shape[-1]
    raise CaptureError(f"cannot tell the input width of opaque block {type(mod).__name__}")


def opaque_flops(node: torch.fx.Node) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) FLOPs of an opaque node in B and S.

    Backward recomputes the block's forward and then differentiates it: 1 + 2 forwards.
    """
    key = node.args[2]
    entry = _OPAQUE[key]
    fwd = sympy.Integer(entry.flops_per_token) * entry.tokens
    return fwd, 3 * fwd


def opaque_scratch(node: torch.fx.Node) -> tuple[sympy.Expr, sympy.Expr]:
    """(floating-point elements, other bytes) an opaque node holds inside its block at its
    peak, in B and S: measured at the probe's two sizes (_working_set), taken as proportional
    to the tokens (rows)."""
    entry = _OPAQUE[node.args[2]]
    floats, other = entry.scratch
    return floats * entry.tokens, other * entry.tokens
