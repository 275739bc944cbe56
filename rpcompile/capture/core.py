"""Capture: any model -> one torch.fx graph of its training loss, grouped into units.

Sections, in reading order:
  1. Public types: B, S, CaptureReport, Captured, CaptureError
  2. capture(): wrap the model so that it returns its loss, then try strategies in order
  3. Units: find the layer list, assign every node to prefix / a layer / tail
  4. Opaque blocks: MoE and data-dependent modules become one `rpcompile::opaque` node

Why torch.export(strict=False): torch.fx.symbolic_trace fails on transformers 5 models, while
non-strict export captures them with symbolic batch and sequence sizes, keeps each node's
``nn_module_stack`` (which is how nodes are grouped into units), and its training-IR graph runs
bit-identically to the eager model in fp32.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils.flop_counter
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rpcompile.capture.batch import NUM_ITEMS, RNG, is_causal_lm, normalize_batch
from rpcompile.capture.dropout import RANDOM_OPS, draws_random, replay_random_ops
from rpcompile.capture.dropout import dropout_seed as _dropout_seed

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
# 1. Public types
# ---------------------------------------------------------------------------------------------

B = sympy.Symbol("b", positive=True, integer=True)  # sequences per microbatch
S = sympy.Symbol("s", positive=True, integer=True)  # sequence length

_WRAPPED = "inner"  # attribute under which the wrapper holds the user's model


class CaptureError(RuntimeError):
    """Every capture strategy failed; the message names the module, the strategies and a fix."""


@dataclass(frozen=True)
class CaptureReport:
    strategy: str  # the strategy that succeeded
    node_count: int
    units: tuple[str, ...]
    seconds: float
    opaque: tuple[str, ...] = ()  # module names captured as one opaque node
    attempts: tuple[tuple[str, str], ...] = ()  # (strategy, why it failed) before success
    dynamic: tuple[str, ...] = ()  # which sizes stayed symbolic ("b", "s")

    def __str__(self) -> str:
        lines = [
            f"captured with {self.strategy!r} in {self.seconds:.2f}s: {self.node_count} nodes, "
            f"{len(self.units)} units ({self.units[0]}, ..., {self.units[-1]})",
            f"  symbolic sizes: {', '.join(self.dynamic) or 'none'}",
        ]
        if self.opaque:
            lines.append(f"  opaque blocks: {', '.join(self.opaque)}")
        for strategy, why in self.attempts:
            lines.append(f"  tried {strategy!r} first: {why}")
        return "\n".join(lines)


@dataclass
class Captured:
    """The captured loss graph and what the later passes need to know about it.

    ``graph_module`` is the lifted graph: placeholders are parameters, then buffers, then the
    batch inputs; it returns the scalar loss of one microbatch.
    """

    graph_module: torch.fx.GraphModule
    units: list[str]
    params: dict[str, str]  # placeholder name -> parameter name in the user's model
    buffers: dict[str, str]  # placeholder name -> buffer name in the user's model
    constants: dict[str, torch.Tensor]  # placeholder name -> lifted tensor constant
    inputs: list[str]  # placeholder names of the batch inputs, in call order
    input_keys: list[str]  # the batch key each input comes from (e.g. "input_ids")
    trainable: dict[str, bool]  # parameter name -> requires_grad
    subs: dict[sympy.Symbol, sympy.Expr]  # graph shape symbols -> B / S
    report: CaptureReport
    example_batch: dict[str, torch.Tensor]
    model: nn.Module = field(repr=False)
    loss_fn: Callable | None = None
    opaque_entries: list = field(default_factory=list, repr=False)  # keeps opaque ops alive
    # "sum": microbatch losses add up to the step's loss (a causal LM's loss divides by the
    # step's labelled tokens, ``num_items_in_batch``); "mean": each microbatch's loss is a mean
    # (``loss_fn`` models), the step's loss is their mean.
    loss_reduction: str = "mean"
    dropout_seed: int = 0  # base of the step's dropout seeds (rpcompile.capture.dropout.step_seeds)
    random_ops: tuple[str, ...] = ()  # modules whose dropout is replayed from seeds
    loss_chunk_tokens: int | None = None  # set when the LM head + loss run chunked

    def parameter(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def value_of(self, placeholder: str) -> torch.Tensor:
        """The tensor the user's model holds for a parameter/buffer/constant placeholder."""
        if placeholder in self.params:
            return self.model.get_parameter(self.params[placeholder])
        if placeholder in self.buffers:
            return self.model.get_buffer(self.buffers[placeholder])
        return self.constants[placeholder]


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


class RefusedModel(ValueError):
    """A model rpcompile cannot train exactly: raised through every capture strategy (no
    other strategy would change the answer)."""


class NoLossError(RefusedModel):
    """The model returned no loss for a batch with labels."""


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


def example_batch_for(model: nn.Module, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """A batch synthesized from a causal LM's config (random token ids, labels = ids)."""
    device = _model_device(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device="cpu").to(device)
    return {"input_ids": ids, "labels": ids.clone()}


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
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no parameters: there is nothing to train; pass the "
            "model whose weights you want to fine-tune"
        )
    causal = loss_fn is None and is_causal_lm(model)
    if example_inputs is None:
        if not causal:
            raise ValueError(
                f"{type(model).__name__} is not a Hugging Face causal LM, so rpcompile cannot "
                "synthesize its inputs: pass example_inputs=(inputs..., target)"
            )
        example_inputs = example_batch_for(model)
    batch = normalize_batch(model, example_inputs, loss_fn, causal=causal)
    if causal and getattr(model.config, "output_router_logits", False):
        raise ValueError(
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

    t0 = time.perf_counter()
    attempts: list[tuple[str, str]] = []
    ladder = [("export", True), ("export-static", False)]
    repeat = _repeat_plan(model, layer_names) if replicate else None
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
                        ep = _export(model, wrapper, batch, causal, present, dynamic, seen, keep)
                else:
                    ep = _export(
                        model, wrapper, batch, causal, opaque_names + extra, dynamic, seen, keep
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


def _export(model, wrapper, batch, causal, opaque_names, dynamic, seen, keep):
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
    with _opaque_patched(model, opaque_names, seen, keep), _module_tracker(model) as tracker:
        try:
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

    if repeat is not None:
        _assign_units(gm, layer_names[: repeat.exported])
        gm = _replicate(gm, params, model, repeat)
    out_val = loss_node(gm).meta.get("val")
    if isinstance(out_val, torch.Tensor) and out_val.dim() != 0:
        what = _NO_LOSS_FN.format(type(model).__name__) if loss_fn is None and not causal else (
            "loss_fn must return a scalar (reduce over the microbatch)")
        raise ValueError(f"the captured loss has shape {tuple(out_val.shape)}, not a scalar: "
                         f"{what}")
    if causal:
        counted = next(n for n in gm.graph.find_nodes(op="placeholder")
                       if n.name == inputs[list(batch).index(NUM_ITEMS)])
        if not counted.users:
            raise ValueError(
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
    return Captured(
        graph_module=gm, units=unit_names, params=params, buffers=buffers, constants=constants,
        inputs=inputs, input_keys=list(batch) + ([RNG] if seeded else []), trainable=trainable,
        subs=subs, report=report, example_batch=batch, model=model, loss_fn=loss_fn,
        loss_reduction="sum" if causal else "mean", dropout_seed=_dropout_seed() if seeded else 0,
        random_ops=tuple(seeded.meta["rp_random_ops"]) if seeded else (),
    )


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
        raise ValueError(
            f"{module} draws random numbers in training ({node.target}), which rpcompile cannot "
            "replay when a backward stage recomputes that forward (it replays nn.Dropout, "
            "F.dropout and scaled_dot_product_attention(dropout_p=...) only), so the gradients "
            f"would not match the loss: {fix}"
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


# ---------------------------------------------------------------------------------------------
# 3. Units
# ---------------------------------------------------------------------------------------------


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_module(model: nn.Module, name: str, what: str) -> None:
    try:
        model.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"{what}=[...] names {name!r}, which is not a submodule of {type(model).__name__}; "
            "use names from model.named_modules()"
        ) from None


def _find_layers(model: nn.Module, units: Sequence[str] | None) -> list[str]:
    """The module names that are one unit each: given, or the children of the largest list."""
    if units is not None:
        for name in units:
            _check_module(model, name, "units")
        return list(units)
    best, best_params = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n > best_params:
            best, best_params = name, n
    if best is None:
        return []
    container = model.get_submodule(best)
    return [f"{best}.{i}" if best else str(i) for i in range(len(container))]


def _assign_units(
    gm: torch.fx.GraphModule, layer_names: list[str], params: Container[str] | None = None
) -> list[str]:
    """Write ``node.meta['rp_unit']``; return the unit names (prefix, layers..., tail).

    A node inside layer i belongs to unit i+1. A node outside every layer belongs to the
    latest unit among its inputs (it is computed as soon as its inputs exist), except that
    once it depends on the last layer it belongs to the tail. Placeholders belong to the
    prefix; they are re-assigned per use by the split pass.
    """
    prefix_len = len(_WRAPPED) + 1
    owner = {name: i + 1 for i, name in enumerate(layer_names)}
    tail = len(layer_names) + 1
    unit_names = ["prefix", *layer_names, "tail"]

    def layer_of(node: torch.fx.Node) -> int | None:
        for path, _cls in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
            path = path[prefix_len:] if path.startswith(_WRAPPED + ".") else path
            while path:
                if path in owner:
                    return owner[path]
                path = path.rpartition(".")[0]
        return None

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["rp_unit"] = 0
            continue
        if node.op == "output":
            node.meta["rp_unit"] = tail
            continue
        from_inputs = max((a.meta["rp_unit"] for a in node.all_input_nodes), default=0)
        layer = layer_of(node)
        if layer is not None and layer >= from_inputs:
            unit = layer
        elif from_inputs >= tail - 1 and tail > 1 and from_inputs > 0:
            unit = tail
        else:
            unit = from_inputs
        node.meta["rp_unit"] = unit
    loss = loss_node(gm)
    if loss.meta["rp_unit"] != tail:
        loss.meta["rp_unit"] = tail
    if params is not None:
        _sink_input_only_nodes(gm, params)
    return unit_names


def loss_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The node of the captured graph's output: the microbatch loss."""
    loss = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    return loss[0] if isinstance(loss, (tuple, list)) else loss


def _sink_input_only_nodes(gm: torch.fx.GraphModule, params: Container[str]) -> None:
    """Move prefix nodes that read no parameter and serve one later unit only (the shifted
    labels, read by the loss) into that unit, so they do not ride through every stage boundary.
    Values read by many units (rotary tables, masks) stay in the prefix as shared values."""
    reads_param: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name in params:
                reads_param.add(n)
        elif any(a in reads_param for a in n.all_input_nodes):
            reads_param.add(n)
    for n in reversed(list(gm.graph.nodes)):
        if n.op != "call_function" or n.meta["rp_unit"] != 0 or n in reads_param:
            continue
        # Checks with no users (_assert_tensor_metadata) follow their input afterwards.
        users = {u.meta["rp_unit"] for u in n.users if u.op != "output" and u.users}
        if len(users) == 1 and min(users) > 0:  # values read by many units stay shared
            n.meta["rp_unit"] = users.pop()
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.users and n.all_input_nodes:
            n.meta["rp_unit"] = max(a.meta["rp_unit"] for a in n.all_input_nodes)


# ---------------------------------------------------------------------------------------------
# 3b. Replicated layers: export the first few identical layers, copy their graph for the rest
# ---------------------------------------------------------------------------------------------


class _NotRepeatable(Exception):
    """The exported layers are not copies of each other; capture exports every layer."""


@dataclass(frozen=True)
class _Repeat:
    container: str  # module name of the layer list ("" for a root nn.Sequential)
    count: int  # layers in the model
    period: int  # layer kinds repeat with this period (GPT-OSS alternates: 2)
    exported: int  # layers actually exported (two periods)


def _layer_signature(model: nn.Module, layer: nn.Module, i: int) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple(n for n, _ in layer.named_buffers())
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    kind = kinds[i] if isinstance(kinds, (list, tuple)) and i < len(kinds) else None
    return (type(layer).__name__, params, buffers, kind, getattr(layer, "attention_type", None))


def _repeat_plan(model: nn.Module, layer_names: list[str]) -> _Repeat | None:
    """How to capture by replication, or None when layers are too few or not periodic."""
    if len(layer_names) < 8:
        return None
    container, _, first = layer_names[0].rpartition(".")
    if not container:
        return None  # a root nn.Sequential: no parent to swap a shorter layer list into
    if first != "0" or layer_names != [f"{container}.{i}" if container else str(i)
                                       for i in range(len(layer_names))]:
        return None
    layers = list(model.get_submodule(container)) if container else list(model)
    if any(_layer_signature(model, lay, 0)[2] for lay in layers):
        return None  # per-layer buffers would need copying too; export them all instead
    sigs = [_layer_signature(model, lay, i) for i, lay in enumerate(layers)]
    for period in (1, 2, 3, 4):
        if len(sigs) % period == 0 and all(sigs[i] == sigs[i % period] for i in range(len(sigs))):
            exported = 2 * period
            if len(sigs) >= exported + 4:
                return _Repeat(container, len(sigs), period, exported)
            return None
    return None


@contextlib.contextmanager
def _truncated(model: nn.Module, repeat: _Repeat):
    parent_name, _, attr = repeat.container.rpartition(".")
    parent = model.get_submodule(parent_name) if repeat.container else None
    if parent is None:
        raise _NotRepeatable("a root nn.Sequential is exported whole")
    full = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(full)[: repeat.exported]))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def _replicate(gm: torch.fx.GraphModule, params: dict[str, str], model: nn.Module,
               repeat: _Repeat) -> torch.fx.GraphModule:
    """A graph of ``repeat.count`` layers from the export of the first ``repeat.exported``.

    Layer i (i >= exported) is a copy of template layer ``period + i % period``: its parameters
    become new placeholders, inputs from the template's previous layer come from layer i-1
    (matched by position, the layers being structurally equal), inputs from the prefix stay.
    ``params`` gains the new placeholders. Raises _NotRepeatable if layers differ.
    """
    P, K, L = repeat.period, repeat.exported, repeat.count
    nodes = list(gm.graph.nodes)
    by_unit: dict[int, list[torch.fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function":
            by_unit.setdefault(n.meta["rp_unit"], []).append(n)
    layer_nodes = [by_unit.get(i + 1, []) for i in range(K)]
    for i in range(P, K):
        a, b = layer_nodes[i - P], layer_nodes[i]
        if [n.target for n in a] != [n.target for n in b]:
            raise _NotRepeatable(f"layers {i - P} and {i} traced to different graphs")
    prefix_fqn = (repeat.container + "." if repeat.container else "")
    param_of = {n: params[n.name] for n in nodes if n.op == "placeholder" and n.name in params}

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    last_param = max((i for i, n in enumerate(placeholders) if n in param_of), default=-1)
    new_params: dict[int, dict[torch.fx.Node, torch.fx.Node]] = {}
    canonical = {id(p): name for name, p in model.named_parameters()}

    def add_layer_params(i: int, template: int) -> None:
        mapping = {}
        t_prefix = f"{prefix_fqn}{template}."
        for ph, fqn in param_of.items():
            if fqn.startswith(t_prefix):
                name = f"{prefix_fqn}{i}." + fqn[len(t_prefix):]
                new = graph.placeholder(f"p_rp_{name.replace('.', '_')}")
                new.meta = dict(ph.meta)
                new.meta["val"] = _fresh_like(ph.meta["val"], {})
                params[new.name] = canonical[id(model.get_parameter(name))]
                mapping[ph] = new
        new_params[i] = mapping

    for idx, n in enumerate(placeholders):
        env[n] = graph.node_copy(n)
        if idx == last_param:
            for i in range(K, L):
                add_layer_params(i, P + i % P)
    tail = [n for n in nodes if n.op == "call_function" and n.meta["rp_unit"] > K]
    for n in nodes:
        if n.op == "call_function" and n.meta["rp_unit"] <= K:
            env[n] = graph.node_copy(n, lambda a: env[a])
    new_layers = [[env[n] for n in lay] for lay in layer_nodes]
    position = {n: (i, k) for i, lay in enumerate(layer_nodes) for k, n in enumerate(lay)}

    for i in range(K, L):
        template = P + i % P
        t_nodes = layer_nodes[template]
        storages: dict[int, torch.Tensor] = {}
        local: dict[torch.fx.Node, torch.fx.Node] = {}

        def remap(a: torch.fx.Node, i=i, template=template, local=local) -> torch.fx.Node:
            if a in local:
                return local[a]
            if a in new_params[i]:
                return new_params[i][a]
            if a in position:
                src, k = position[a]
                if src != template - 1:
                    raise _NotRepeatable(
                        f"layer {template} reads layer {src}, not only the layer before it"
                    )
                return new_layers[i - 1][k]
            if a.op == "placeholder" and a in param_of and param_of[a].startswith(prefix_fqn):
                raise _NotRepeatable(f"layer {template} reads another layer's parameter")
            return env[a]

        copies = []
        for n in t_nodes:
            new = graph.node_copy(n, remap)
            new.meta = _renamed_meta(n.meta, f"{prefix_fqn}{template}", f"{prefix_fqn}{i}")
            if "val" in n.meta:
                new.meta["val"] = _fresh_like(n.meta["val"], storages)
            new.meta["rp_unit"] = i + 1
            local[n] = new
            copies.append(new)
        new_layers.append(copies)

    last = layer_nodes[K - 1]
    last_index = {n: k for k, n in enumerate(last)}

    def remap_tail(a: torch.fx.Node) -> torch.fx.Node:
        if a in last_index:
            return new_layers[L - 1][last_index[a]]
        if a in position:
            raise _NotRepeatable("the tail reads a layer other than the last")
        return env[a]

    for n in tail:
        env[n] = graph.node_copy(n, remap_tail)
    out = next(iter(gm.graph.find_nodes(op="output")))
    graph.output(torch.fx.map_arg(out.args[0], remap_tail))
    for n in graph.nodes:
        n.meta.pop("rp_unit", None)
    return torch.fx.GraphModule(gm, graph)


def _renamed_meta(meta: dict, old: str, new: str) -> dict:
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        wrapped_old, wrapped_new = f"{_WRAPPED}.{old}", f"{_WRAPPED}.{new}"
        renamed = {}
        for key, (path, cls) in stack.items():
            if path == wrapped_old or path.startswith(wrapped_old + "."):
                path = wrapped_new + path[len(wrapped_old):]
            renamed[key] = (path, cls)
        meta["nn_module_stack"] = renamed
    return meta


def _fresh_like(val, storages: dict[int, torch.Tensor]):
    """A new fake value like ``val`` on new storage; views of one storage stay views of one."""
    if isinstance(val, (tuple, list)):
        return type(val)(_fresh_like(v, storages) for v in val)
    if not isinstance(val, torch.Tensor):
        return val
    mode = getattr(val, "fake_mode", None)
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx:
        key = val.untyped_storage()._cdata
        base = storages.get(key)
        if base is None or base.dtype != val.dtype:
            nbytes = val.untyped_storage().nbytes()
            base = torch.empty(nbytes // val.element_size(), dtype=val.dtype, device=val.device)
            storages[key] = base
        return base.as_strided(val.shape, val.stride(), val.storage_offset())


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
    return _OpaqueEntry(mod, forward, param_names, rules, tuple_out, per_token, tokens)


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
