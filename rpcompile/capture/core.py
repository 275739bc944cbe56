"""Capture: any model -> one torch.fx graph of its training loss, grouped into units.

``capture()`` wraps the model so that it returns its loss, then tries strategies in order.
The rest of the package, by concept:
  types      B, S, CaptureReport, Captured and the errors
  units      find the layer list, assign every node to prefix / a layer / tail
  replicate  export a few identical layers, copy their graph for the rest
  opaque     MoE and data-dependent modules become one `rpcompile::opaque` node
  quantized  bitsandbytes 4-bit / 8-bit linears: packed weight + state + a dequantize node
  batch      binding, splitting and checking batches; dropout: seeded replay of random ops

Why torch.export(strict=False): torch.fx.symbolic_trace fails on transformers 5 models, while
non-strict export captures them with symbolic batch and sequence sizes, keeps each node's
``nn_module_stack`` (which is how nodes are grouped into units), and its training-IR graph runs
bit-identically to the eager model in fp32.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.utils.flop_counter
from torch import nn

from rpcompile.capture.batch import NUM_ITEMS, RNG, is_causal_lm, normalize_batch
from rpcompile.capture.dropout import RANDOM_OPS, draws_random, replay_random_ops
from rpcompile.capture.dropout import dropout_seed as _dropout_seed
from rpcompile.capture.opaque import (
    _default_opaque,
    _opaque_patched,
    _OpaqueEntry,
    opaque_flops,
    opaque_scratch,
)
from rpcompile.capture.quantized import check_quantized, packed_weights, quantized_patched
from rpcompile.capture.replicate import _NotRepeatable, _repeat_plan, _replicate, _truncated
from rpcompile.capture.tracing import tracing
from rpcompile.capture.types import (
    _WRAPPED,
    B,
    Captured,
    CaptureError,
    CaptureReport,
    NoLossError,
    RefusedModel,
    S,
)
from rpcompile.capture.units import (
    _assign_units,
    _check_module,
    _find_layers,
    _has_module,
    loss_node,
)
from rpcompile.errors import InvalidInput

__all__ = [
    "B",
    "CaptureError",
    "CaptureReport",
    "Captured",
    "S",
    "capture",
    "is_causal_lm",
]

# ---------------------------------------------------------------------------------------------
# 2. capture()
# ---------------------------------------------------------------------------------------------


class _CausalLMLoss(nn.Module):
    """Calls the model with the batch's named inputs (bound by name, in ``keys`` order) and
    returns Hugging Face's loss: with ``num_items_in_batch`` given, the sum of the microbatch's
    token losses over the labelled tokens of the whole step."""

    def __init__(self, model: nn.Module, keys: Sequence[str]) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.keys = tuple(keys)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = getattr(self, _WRAPPED)(**dict(zip(self.keys, args)), use_cache=False)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise NoLossError(
                f"{type(getattr(self, _WRAPPED)).__name__} returned no loss for a batch with "
                "labels; give compile() a loss_fn(outputs, target) and pass (inputs..., target)"
            )
        return loss


class _LossOf(nn.Module):
    """Generic models: the last batch item is the target when ``loss_fn`` is given."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        model = getattr(self, _WRAPPED)
        if self.loss_fn is None:
            return model(*args)
        return self.loss_fn(model(*args[:-1]), args[-1])


def example_batch_for(model: nn.Module, batch: int = 2, seq: int = 16,
                      mask: bool = False) -> dict[str, torch.Tensor]:
    """A batch synthesized from a causal LM's config (random token ids, labels = ids; with
    ``mask``, an all-ones ``attention_mask`` too, so the graph takes padded batches)."""
    device = _model_device(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device="cpu").to(device)
    out = {"input_ids": ids, "labels": ids.clone()}
    if mask:
        out["attention_mask"] = torch.ones_like(ids)
    return out


def capture(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    loss_fn: Callable | None = None,
    units: Sequence[str] | None = None,
    opaque: Sequence[str] | None = None,
    replicate: bool = True,
) -> Captured:
    """Capture ``model``'s training loss as a torch.fx graph grouped into units.

    ``example_inputs``: for a causal LM, token ids or a dict with ``input_ids``/``labels``
    (synthesized from the config when omitted); for any other model, a tuple of tensors, the
    last being the target when ``loss_fn`` is given (otherwise the model must return a scalar
    loss). ``units``: names of the modules that are the model's repeated layers (default: the
    largest ``nn.ModuleList``/``nn.Sequential``). ``opaque``: extra module names to keep as
    one node (MoE blocks are opaque by default). ``replicate``: when the layers are
    structurally identical, export only the first few and copy their graph for the others
    (a 94-layer model captures in the time of a 4-layer one); the copy is checked node by node
    and capture falls back to a full export when layers differ.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise InvalidInput(
            f"{type(model).__name__} has no parameters: there is nothing to train; pass the "
            "model whose weights you want to fine-tune"
        )
    causal = loss_fn is None and is_causal_lm(model)
    if example_inputs is None:
        if not causal:
            raise InvalidInput(
                f"{type(model).__name__} is not a Hugging Face causal LM, so rpcompile cannot "
                "synthesize its inputs: pass example_inputs=(inputs..., target)"
            )
        example_inputs = example_batch_for(model)
    batch = normalize_batch(model, example_inputs, loss_fn, causal=causal)
    if causal and getattr(model.config, "output_router_logits", False):
        raise InvalidInput(
            f"{type(model).__name__} adds a router auxiliary loss (config.output_router_logits"
            "=True), a per-batch statistic that does not split into microbatches, so the step "
            "could not equal eager training on the whole batch: set "
            "model.config.output_router_logits = False"
        )
    wrapper = _CausalLMLoss(model, list(batch)) if causal else _LossOf(model, loss_fn)

    layer_names = _find_layers(model, units)
    opaque_names = list(opaque or ()) + [
        n for n in _default_opaque(model) if n not in (opaque or ())
    ]
    for name in opaque_names:
        _check_module(model, name, "opaque")
    quantized = check_quantized(model)
    inside = [q for q in quantized for o in opaque_names if q.startswith(o + ".")]
    if inside:
        raise RefusedModel(
            f"quantized linear {inside[0]} lies inside the opaque block "
            f"{next(o for o in opaque_names if inside[0].startswith(o + '.'))}, where its "
            "packed weight would be hidden from the cost model; keep that block unquantized "
            "(BitsAndBytesConfig(llm_int8_skip_modules=[...]))"
        )

    t0 = time.perf_counter()
    attempts: list[tuple[str, str]] = []
    ladder = [("export", True), ("export-static", False)]
    # Each layer's quantization state is its own lifted constants, which a copied layer graph
    # would share with its template: a quantized model is exported whole.
    repeat = _repeat_plan(model, layer_names) if replicate and not quantized else None
    if repeat is not None:
        ladder.insert(0, ("export+replicate", True))
    seen: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # module input shapes traced
    for strategy, dynamic in ladder:
        extra: list[str] = []
        while True:
            keep: list[_OpaqueEntry] = []  # the opaque blocks of this attempt's graph
            try:
                if strategy == "export+replicate":
                    with _truncated(model, repeat):
                        present = [n for n in opaque_names + extra if _has_module(model, n)]
                        ep = _export(model, wrapper, batch, causal, present, dynamic, seen, keep,
                                     quantized)
                else:
                    ep = _export(
                        model, wrapper, batch, causal, opaque_names + extra, dynamic, seen, keep,
                        quantized,
                    )
            except _NotRepeatable as exc:
                attempts.append((strategy, str(exc)))
                break
            except RefusedModel:
                raise
            except Exception as exc:  # capture errors come in many types; each is recorded
                culprit = _culprit_of(exc)
                if culprit is not None and _is_data_dependent(exc) and culprit not in extra:
                    attempts.append((strategy, f"data-dependent code in {culprit!r}; made opaque"))
                    extra.append(culprit)
                    continue
                attempts.append((strategy, _one_line(exc)))
                break
            try:
                captured = _finish(
                    model, ep, layer_names, batch, causal, strategy, dynamic,
                    tuple(opaque_names + extra), attempts, t0, loss_fn,
                    repeat if strategy == "export+replicate" else None,
                )
            except _NotRepeatable as exc:
                attempts.append((strategy, str(exc)))
                break
            captured.opaque_entries = keep
            return captured
    failed = "; ".join(f"{s}: {why}" for s, why in attempts)
    advice = ("name the repeated layers with units=[...] and the modules that cannot be "
              "traced with opaque=[...] (module names as in model.named_modules())")
    if not causal and loss_fn is None:
        raise CaptureError(
            f"could not capture {type(model).__name__}: "
            f"{_NO_LOSS_FN.format(type(model).__name__)}. Strategies tried -> {failed}. If the "
            f"model does return its loss from forward(*batch), {advice}."
        )
    raise CaptureError(
        f"could not capture {type(model).__name__}. Strategies tried -> {failed}. To proceed, "
        f"{advice}."
    )


_NO_LOSS_FN = (
    "{} is not a Hugging Face causal LM and no loss_fn was given, so rpcompile called it with "
    "the whole batch and expected a scalar loss back; pass loss_fn=lambda outputs, target: ... "
    "and example_inputs=(inputs..., target)"
)


def _export(model, wrapper, batch, causal, opaque_names, dynamic, seen, keep, quantized):
    args = tuple(batch.values())
    shapes = None
    if dynamic:
        bdim = torch.export.Dim("b", min=1, max=1 << 16)
        if causal:
            max_pos = getattr(model.config, "max_position_embeddings", None) or 1 << 17
            sdim = torch.export.Dim("s", min=2, max=max(int(max_pos), args[0].shape[1]))
            shapes = (tuple({0: bdim, 1: sdim} if t.dim() else None for t in args),)
        else:
            # _LossOf.forward takes *args: export sees them as one tuple argument.
            shapes = (tuple({0: bdim} if t.dim() else None for t in args),)
    with _opaque_patched(model, opaque_names, seen, keep), quantized_patched(quantized), \
            _module_tracker(model) as tracker:
        try:
            with tracing():  # no optimizer update runs meanwhile (rpcompile.capture.tracing)
                return torch.export.export(wrapper, args, dynamic_shapes=shapes, strict=False)
        except Exception as exc:
            exc.rp_module = tracker.innermost()  # type: ignore[attr-defined]
            seen.update(tracker.first_inputs)
            raise


def _finish(model, ep, layer_names, batch, causal, strategy, dynamic, opaque, attempts, t0,
            loss_fn, repeat=None):
    gm = ep.graph_module
    sig = ep.graph_signature
    prefix = _WRAPPED + "."
    # A parameter shared by identity (tied embeddings) has several names; every placeholder
    # maps to the name named_parameters() reports first, so there is one master per tensor.
    canonical = {id(p): name for name, p in model.named_parameters()}
    params = {
        k: canonical[id(model.get_parameter(v.removeprefix(prefix)))]
        for k, v in sig.inputs_to_parameters.items()
    }
    buffers = {k: v.removeprefix(prefix) for k, v in sig.inputs_to_buffers.items()}
    const_names = dict(sig.inputs_to_lifted_tensor_constants)
    constants = {k: ep.constants[v] for k, v in const_names.items()}
    inputs = list(sig.user_inputs)
    trainable = {
        name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)
    }

    _refuse_buffer_updates(gm, buffers, model)
    if repeat is not None:
        _assign_units(gm, layer_names[: repeat.exported])
        gm = _replicate(gm, params, model, repeat)
    out_val = loss_node(gm).meta.get("val")
    if isinstance(out_val, torch.Tensor) and out_val.dim() != 0:
        what = _NO_LOSS_FN.format(type(model).__name__) if loss_fn is None and not causal else (
            "loss_fn must return a scalar (reduce over the microbatch)")
        raise InvalidInput(f"the captured loss has shape {tuple(out_val.shape)}, not a scalar: "
                         f"{what}")
    if causal:
        counted = next(n for n in gm.graph.find_nodes(op="placeholder")
                       if n.name == inputs[list(batch).index(NUM_ITEMS)])
        if not counted.users:
            raise InvalidInput(
                f"{type(model).__name__}'s loss ignores num_items_in_batch, so rpcompile cannot "
                "make the microbatch losses add up to the token mean of the whole batch: give "
                "compile() a loss_fn(outputs, target) and pass (inputs..., target) (each "
                "microbatch's loss is then a mean, the step's the mean of those)"
            )
    unit_names = _assign_units(gm, layer_names, params)
    seeded = replay_random_ops(gm, inputs[0], _WRAPPED)
    if seeded:
        inputs.append(seeded.name)
    _refuse_random_ops(gm)
    if not layer_names:
        warnings.warn(
            f"{type(model).__name__} has no nn.ModuleList/nn.Sequential of layers, so it is one "
            "unit and cannot be pipelined; pass units=[...] with the names of its layers",
            RuntimeWarning, stacklevel=3,
        )
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.rpcompile.opaque.default):
        node.meta["rp_flops"] = opaque_flops(node)
        node.meta["rp_scratch"] = opaque_scratch(node)
    subs = _symbol_map(gm, inputs, causal)
    dyn = tuple(str(v) for v in (B, S) if v in subs.values())
    report = CaptureReport(
        strategy=strategy,
        node_count=len(gm.graph.nodes),
        units=tuple(unit_names),
        seconds=time.perf_counter() - t0,
        opaque=opaque,
        attempts=tuple(attempts),
        dynamic=dyn if dynamic else (),
    )
    captured = Captured(
        graph_module=gm, units=unit_names, params=params, buffers=buffers, constants=constants,
        inputs=inputs, input_keys=list(batch) + ([RNG] if seeded else []), trainable=trainable,
        subs=subs, report=report, example_batch=batch, model=model, loss_fn=loss_fn,
        loss_reduction="sum" if causal else "mean", dropout_seed=_dropout_seed() if seeded else 0,
        random_ops=tuple(seeded.meta["rp_random_ops"]) if seeded else (),
    )
    captured.quantized = packed_weights(gm, params, captured.value_of)
    return captured


def _refuse_random_ops(gm: torch.fx.GraphModule) -> None:
    """Backward stages recompute their forward: a random op that is not replayed from seeds
    (:func:`rpcompile.capture.dropout.replay_random_ops` rewrites dropout and SDPA dropout) would draw
    new numbers there, and the gradients would belong to another forward than the loss.
    Refuse, naming the module and the fix that applies to it."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is torch.ops.rpcompile.dropout.default:
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0].rstrip("_")
        if name not in RANDOM_OPS or not draws_random(name, node.args, node.kwargs):
            continue
        where = list((node.meta.get("nn_module_stack") or {}).values())
        module = where[-1][0].removeprefix(_WRAPPED + ".") if where else "the model"
        if str(node.target).split(".")[-2].endswith("_") and "dropout" in name:
            fix = "construct that dropout with inplace=False (in-place dropout is not replayed)"
        elif "lora_" in module:
            fix = "build the adapter with LoraConfig(lora_dropout=0.0)"
        elif where:
            fix = (f"set that module's probability to 0 (model.get_submodule({module!r})), or "
                   "its config's dropout fields (e.g. attention_dropout = 0.0)")
        else:
            fix = "remove the random call from the model's forward"
        raise InvalidInput(
            f"{module} draws random numbers in training ({node.target}), which rpcompile cannot "
            "replay when a backward stage recomputes that forward (it replays nn.Dropout, "
            "F.dropout and scaled_dot_product_attention(dropout_p=...) only), so the gradients "
            f"would not match the loss: {fix}"
        )


# Composite ops whose schema marks no write but which update running statistics in place:
# op -> (index of the "use batch statistics" flag, indexes of the statistics).
_STATS_OPS = {
    torch.ops.aten.batch_norm.default: (5, (3, 4)),
    torch.ops.aten.native_batch_norm.default: (5, (3, 4)),
    torch.ops.aten.instance_norm.default: (5, (3, 4)),
}


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` writes in place: the arguments its schema marks as written, and a
    normalization's running statistics when it uses batch statistics."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    if target in _STATS_OPS:
        flag, stats = _STATS_OPS[target]
        if len(node.args) > flag and node.args[flag] is True:
            out += [node.args[i] for i in stats if isinstance(node.args[i], torch.fx.Node)]
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def _base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``node`` is a view of (through view ops), or ``node`` itself."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        if not returns or returns[0].alias_info is None or not node.args \
                or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def _refuse_buffer_updates(gm: torch.fx.GraphModule, buffers: dict[str, str],
                           model: nn.Module) -> None:
    """Refuse a forward that updates buffers (BatchNorm's running statistics and counter in
    training mode, any in-place write to a buffer): each microbatch's forward would update
    them in turn where eager training updates them once from the whole batch, recompute
    would update them again, and a batch-statistics normalization sees a microbatch's
    statistics, not the batch's, so the step could not equal eager training (and the
    workers' copies of the buffers would be thrown away). Name them and the fix."""
    names = sorted({buffers[b.name] for n in gm.graph.nodes for b in map(_base_of, _written(n))
                    if b.op == "placeholder" and b.name in buffers})
    if not names:
        return
    prefix = _WRAPPED + "."
    owners = {n.removeprefix(prefix).rpartition(".")[0] for n in names}
    kinds = {type(model.get_submodule(o)) for o in owners if o}
    # Replicated layers were exported once: name every module of those kinds in training.
    modules = sorted({o for o in owners if o} | {
        name for name, m in model.named_modules() if type(m) in kinds and m.training})
    shown = [n.removeprefix(prefix) for n in names]
    listed = ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
    kind = ", ".join(sorted(k.__name__ for k in kinds)) or "the model"
    where = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    raise RefusedModel(
        f"{type(model).__name__}'s forward updates buffers in place ({listed}; {kind} "
        f"modules: {where or 'the model itself'}). rpcompile runs each step as microbatches "
        "and recomputes forwards, so a batch-statistics layer would see a microbatch's "
        "statistics instead of the batch's, the buffers would be updated once per microbatch "
        "and again in recompute, and the step could not equal eager training: put those "
        "modules in eval mode before compile (e.g. "
        f"model.get_submodule({(modules or [''])[0]!r}).eval(), which normalizes with the "
        "running statistics and leaves them unchanged), or replace a layer that must "
        "train with batch statistics (by LayerNorm or GroupNorm, which keep none)"
    )


def _symbol_map(gm: torch.fx.GraphModule, inputs: list[str], causal: bool) -> dict:
    """Map the export's shape symbols (s0, s1, ...) to B and S via the first batch input."""
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    first = nodes[inputs[0]].meta.get("val")
    if first is None:
        return subs
    for dim, sym in ((0, B), (1, S)) if causal else ((0, B),):
        if dim < first.dim():
            expr = first.shape[dim]
            if isinstance(expr, torch.SymInt):
                subs[sympy.sympify(expr.node.expr)] = sym
    return subs


class _Tracker:
    def __init__(self) -> None:
        self.stack: list[str] = []
        # module name -> (shape, dtype) of its first tensor argument, from the trace's hints
        self.first_inputs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def innermost(self) -> str | None:
        return self.stack[-1] if self.stack else None


@contextlib.contextmanager
def _module_tracker(model: nn.Module):
    """Keep the stack of modules being run, so a capture failure can name its module."""
    tracker = _Tracker()

    def pre(name):
        def hook(_mod, args):
            tracker.stack.append(name)
            if name not in tracker.first_inputs and args and isinstance(args[0], torch.Tensor):
                shape = tuple(_hint(d) for d in args[0].shape)
                tracker.first_inputs[name] = (shape, args[0].dtype)
        return hook

    def post(name):
        def hook(_mod, _args, _out):
            if tracker.stack and tracker.stack[-1] == name:
                tracker.stack.pop()
        return hook

    handles = []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post(name)))
    try:
        yield tracker
    finally:
        for h in handles:
            h.remove()


def _hint(d) -> int:
    return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)


def _culprit_of(exc: BaseException) -> str | None:
    return getattr(exc, "rp_module", None)


def _is_data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(
        k in text
        for k in ("GuardOnDataDependentSymNode", "data-dependent", "DataDependentOutputException",
                  "data dependent")
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    where = getattr(exc, "rp_module", None)
    head = f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
    return head + (f" (in module {where!r})" if where else "")


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
