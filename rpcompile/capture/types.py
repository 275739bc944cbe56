"""The capture's public types: the size symbols B and S, the report, the captured graph and
the errors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import sympy
import torch
import torch.utils.flop_counter
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from rpcompile.errors import RPCompileError

# ---------------------------------------------------------------------------------------------
# 1. Public types
# ---------------------------------------------------------------------------------------------

B = sympy.Symbol("b", positive=True, integer=True)  # sequences per microbatch
S = sympy.Symbol("s", positive=True, integer=True)  # sequence length

_WRAPPED = "inner"  # attribute under which the wrapper holds the user's model


class CaptureError(RPCompileError, RuntimeError):
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
    # Frozen quantized weights by parameter name (rpcompile.capture.quantized.PackedWeight):
    # each is read through one dequantize node of the graph.
    quantized: dict = field(default_factory=dict)

    def parameter(self, name: str) -> torch.Tensor:
        return self.model.get_parameter(name)

    def fork(self) -> Captured:
        """A copy whose graph the planning passes may rewrite (the loss-chunk rewrite, the
        cost annotations) without touching this one: a copy of every node, with a copy of its
        ``meta`` dict whose values (the fake tensors above all) are shared, since no pass
        changes a value in place. Planning one capture for several loss-chunk variants and
        shapes this way costs milliseconds, where capturing again costs seconds."""
        graph = copy.deepcopy(self.graph_module.graph)  # fx copies nodes, meta dicts shallowly
        # A lazy graph module writes its Python code when it is first run or read, not at
        # each rewrite: planning rewrites a fork's graph (chunk-loss, token-hits) and only
        # reads it, and the stage programs split from it have their own code.
        return replace(
            self, graph_module=_LazyGraphModule(self.graph_module, graph),
            units=list(self.units), params=dict(self.params), buffers=dict(self.buffers),
            constants=dict(self.constants), inputs=list(self.inputs),
            input_keys=list(self.input_keys), subs=dict(self.subs),
            opaque_entries=list(self.opaque_entries), quantized=dict(self.quantized))

    def value_of(self, placeholder: str) -> torch.Tensor:
        """The tensor the user's model holds for a parameter/buffer/constant placeholder."""
        if placeholder in self.params:
            return self.model.get_parameter(self.params[placeholder])
        if placeholder in self.buffers:
            return self.model.get_buffer(self.buffers[placeholder])
        return self.constants[placeholder]


class RefusedModel(RPCompileError, ValueError):
    """A model rpcompile cannot train exactly: raised through every capture strategy (no
    other strategy would change the answer)."""


class NoLossError(RefusedModel):
    """The model returned no loss for a batch with labels."""
