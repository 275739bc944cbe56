"""Split pass: one GraphModule per stage of a Plan, with explicit inputs and outputs.

Sections, in reading order:
  1. Boundary marker ops (`rpcompile::prefetch`, `offload`, `record`, `wait`)
  2. StageProgram: a stage's graph plus the names of what flows in and out
  3. split(): decide which values cross which boundary, then build each stage's graph
  4. unit_segments(): a backward stage's graph cut per unit, for layer-by-layer recompute

Every value that crosses a stage boundary is named by the captured graph's node name. A
forward stage outputs each value that a later forward stage or the tail reads, and each value
that a backward stage needs to recompute its forward ("recompute inputs"). Values used by many
stages (rotary tables, masks, position ids) are therefore ordinary stage inputs. Parameters are
inputs too: a parameter used by two stages (tied embeddings) is one master whose gradient is
the sum of both stages' contributions.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from rpcompile.capture.quantized import DEQUANTIZE_OPS
from rpcompile.capture.types import Captured
from rpcompile.errors import InvalidInput
from rpcompile.ir import Plan
from rpcompile.passes.chunked_loss import TOKEN_HITS
from rpcompile.passes.manager import PassInvariantError

__all__ = ["LayerRecompute", "StageInput", "StageProgram", "UnitSegment", "retarget", "split",
           "unit_segments"]

# ---------------------------------------------------------------------------------------------
# 1. Boundary marker ops
# ---------------------------------------------------------------------------------------------
# Markers document, inside the stage's own code, what the runtime moves around the stage: the
# stage's weights arriving, values leaving for the host, events recorded and waited on. They
# do nothing when the graph runs; the lowered Schedule carries the real transfers and events.


@torch.library.custom_op("rpcompile::prefetch", mutates_args=())
def prefetch(stage: str, weights: list[torch.Tensor]) -> None:
    """Marks where a stage's weights (one flat upload) must be resident."""


@torch.library.custom_op("rpcompile::offload", mutates_args=())
def offload(value: str, tensor: torch.Tensor) -> None:
    """Marks a value that leaves the stage for pinned host memory."""


@torch.library.custom_op("rpcompile::record", mutates_args=())
def record(event: str) -> None:
    """Marks an event the stage records when its outputs are ready."""


@torch.library.custom_op("rpcompile::wait", mutates_args=())
def wait(event: str) -> None:
    """Marks an event the stage waits for before it reads its inputs."""


for _op in (prefetch, offload, record, wait):
    _op.register_fake(lambda *args, **kwargs: None)

MARKERS = (
    torch.ops.rpcompile.prefetch.default,
    torch.ops.rpcompile.offload.default,
    torch.ops.rpcompile.record.default,
    torch.ops.rpcompile.wait.default,
)

# ---------------------------------------------------------------------------------------------
# 2. StageProgram
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageInput:
    name: str  # value name (captured node name) or placeholder name
    kind: str  # "param" | "buffer" | "constant" | "batch" | "value"
    source: str  # parameter/buffer name for params and buffers, batch key for batch inputs
    requires_grad: bool  # a gradient flows back through it (trainable param or activation)


# The tail's outputs, in the captured graph's output order: the microbatch loss, then the
# count of its labelled tokens predicted right when the graph counts them.
TAIL_OUTPUTS = ("loss", TOKEN_HITS)


@dataclass(frozen=True)
class StageProgram:
    """One stage's program: ``graph_module(*inputs) -> outputs`` (forward values or the loss).

    Forward stages run without autograd. The tail runs its forward with autograd, then
    backward from the loss. A backward stage recomputes its forward from saved inputs, then
    runs backward from the gradients of its outputs (``grad_outputs``). ``recompute`` (the
    plan's ``Stage.recompute``): a backward stage recomputes its whole forward with autograd
    (``"stage"``) or unit by unit (``"layer"``; :func:`unit_segments`).
    """

    index: int
    name: str  # F1.., B1 (tail), B2..
    kind: str  # "forward" | "tail" | "backward"
    units: tuple[int, ...]
    unit_names: tuple[str, ...]
    graph_module: fx.GraphModule = field(repr=False, compare=False)
    inputs: tuple[StageInput, ...]
    outputs: tuple[str, ...]  # value names; the tail's: "loss" (then "correct_tokens")
    grad_outputs: tuple[str, ...] = ()  # outputs whose gradients this stage receives
    grad_inputs: tuple[str, ...] = ()  # value inputs whose gradients this stage sends on
    recompute: str = "stage"

    @property
    def code(self) -> str:
        return self.graph_module.code

    def on_device(self, device: torch.device | str) -> fx.GraphModule:
        """This stage's graph with the capture device's constants (``device=`` of factory
        ops, ``.to(device)``, metadata checks) replaced by ``device``: a stateless worker runs
        a stage on whatever device it is, while export recorded the device it traced on."""
        return retarget(self.graph_module, torch.device(device))

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(i.source for i in self.inputs if i.kind == "param")

    @property
    def value_inputs(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.kind == "value")

    def __str__(self) -> str:
        units = ", ".join(self.unit_names)
        return (
            f"{self.name} ({self.kind}): units [{units}]; {len(self.params)} params, "
            f"{len(self.value_inputs)} value inputs, {len(self.outputs)} outputs"
        )


def retarget(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of ``gm`` whose ``torch.device`` constants all name ``device``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def swap(value):
        return device if isinstance(value, torch.device) else value

    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda a: env[a])
        new.args = fx.node.map_aggregate(new.args, swap)
        new.kwargs = fx.node.map_aggregate(new.kwargs, swap)
        env[node] = new
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


# ---------------------------------------------------------------------------------------------
# 3. split()
# ---------------------------------------------------------------------------------------------


def split(captured: Captured, plan: Plan) -> list[StageProgram]:
    """Build every stage's program from the captured graph and the plan's unit ranges."""
    gm = captured.graph_module
    nodes = list(gm.graph.nodes)
    unit_count = len(captured.units)
    if len(plan.units) != unit_count:
        raise InvalidInput(
            f"plan has {len(plan.units)} units but the captured graph has {unit_count}"
        )
    fwd_of = [-1] * unit_count  # forward-side stage of each unit (the tail counts as one)
    bwd_of = [-1] * unit_count  # backward-side stage of each unit
    for st in plan.stages:
        for u in st.units:
            if st.kind in ("forward", "tail"):
                fwd_of[u] = st.index
            if st.kind in ("backward", "tail"):
                bwd_of[u] = st.index

    requires_grad = _requires_grad(captured, nodes)
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    consumers: dict[fx.Node, set[int]] = {}
    for n in nodes:
        if n.op in ("call_function", "output"):
            for a in n.all_input_nodes:
                consumers.setdefault(a, set()).add(n.meta["rp_unit"])

    # A computed value crosses a boundary when a consumer sits in another forward-side
    # stage (activation) or in another backward stage (recompute input).
    crossing: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function":
            continue
        u = n.meta["rp_unit"]
        for c in consumers.get(n, ()):
            if fwd_of[c] != fwd_of[u] or bwd_of[c] != bwd_of[u]:
                crossing.add(n)
                break

    programs = []
    for st in plan.stages:
        units = set(st.units)
        members = [n for n in nodes if n.op == "call_function" and n.meta["rp_unit"] in units]
        if st.kind == "forward":
            outs = [n for n in members if n in crossing]
        elif st.kind == "tail":
            outs = _graph_outputs(gm)
        else:
            # Outputs of a recomputed forward whose gradients come from earlier backward jobs.
            outs = [
                n for n in members
                if n in crossing and requires_grad.get(n, False)
                and any(c > max(units) for c in consumers.get(n, ()))
            ]
        program = _build(captured, plan, st, members, outs, placeholders, requires_grad)
        _check_reads(placeholders, st, program)
        if program.recompute == "layer":
            unit_segments(program)  # checked (and cached) now: a bad cut fails at compile time
        programs.append(program)
    return programs


def _graph_outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The captured graph's outputs, the tail's: the loss, then (a causal LM) its token hits
    (rpcompile.passes.chunked_loss.count_token_hits)."""
    outs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if not 1 <= len(outs) <= len(TAIL_OUTPUTS):
        raise InvalidInput(f"the captured graph has {len(outs)} outputs; the tail returns "
                         f"{' and '.join(TAIL_OUTPUTS)}")
    return outs


def _check_reads(placeholders: dict[str, fx.Node], st, program: StageProgram) -> None:
    """The plan's memory proof and transfer times count what each stage uploads besides its
    parameters (Stage.buffer_bytes, Stage.batch_inputs, from the cost walk); the program the
    runtime runs must read exactly that, or the proof would not bound the run. (A stage
    built by hand, ``batch_inputs`` None, does not say.)"""
    if st.batch_inputs is None:
        return
    # A quantized weight's state travels with its packed codes (UnitProfile.packed_bytes).
    state = {a.name for n in program.graph_module.graph.nodes if n.target in DEQUANTIZE_OPS
             for a in n.all_input_nodes[1:]}
    extras = [i for i in program.inputs if i.kind in ("buffer", "constant")
              and i.name not in state]
    nbytes = sum(placeholders[i.name].meta["val"].nbytes for i in extras)
    keys = sorted({i.source for i in program.inputs if i.kind == "batch"})
    planned = sorted(k for k, _ in st.batch_inputs)
    if nbytes != st.buffer_bytes or keys != planned:
        raise PassInvariantError(
            f"stage {program.name}: its program reads buffers of {nbytes} bytes and the batch "
            f"inputs {keys}, but the plan counts {st.buffer_bytes} bytes and {planned}: the "
            "cost walk (rpcompile.passes.cost) and the split disagree on what the stage reads")


def _requires_grad(captured: Captured, nodes: Sequence[fx.Node]) -> dict[fx.Node, bool]:
    """Which values carry a gradient: those computed (in floating point) from a trainable
    parameter. Fake tensors of a lifted graph do not record requires_grad, so it is derived."""
    rg: dict[fx.Node, bool] = {}
    for n in nodes:
        if n.op == "placeholder":
            fqn = captured.params.get(n.name)
            rg[n] = fqn is not None and captured.trainable.get(fqn, False)
        elif n.op == "call_function":
            val = n.meta.get("val")
            floating = _is_float(val)
            rg[n] = floating and any(rg.get(a, False) for a in n.all_input_nodes)
    return rg


def _is_float(val) -> bool:
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    if isinstance(val, (tuple, list)):
        return any(_is_float(v) for v in val)
    return False


def _build(captured, plan, st, members, outs, placeholders, requires_grad) -> StageProgram:
    name = plan.stage_name(st.index)
    member_set = set(members)
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in members:
        for a in n.all_input_nodes:
            if a not in member_set and a not in seen:
                seen.add(a)
                needed.append(a)

    # Inputs in a fixed order: parameters, buffers, constants, batch inputs, then values.
    def kind_of(n: fx.Node) -> tuple[str, str]:
        if n.op == "placeholder":
            if n.name in captured.params:
                return "param", captured.params[n.name]
            if n.name in captured.buffers:
                return "buffer", captured.buffers[n.name]
            if n.name in captured.constants:
                return "constant", n.name
            key = captured.input_keys[captured.inputs.index(n.name)]
            return "batch", key
        return "value", n.name

    order = {"param": 0, "buffer": 1, "constant": 2, "batch": 3, "value": 4}
    needed.sort(key=lambda n: order[kind_of(n)[0]])
    inputs = []
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in needed:
        kind, source = kind_of(n)
        ph = graph.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph
        inputs.append(StageInput(n.name, kind, source, bool(requires_grad.get(n, False))))

    # Markers first: what must arrive before the stage can run.
    value_inputs = [env[n] for n in needed if kind_of(n)[0] == "value"]
    if value_inputs:
        graph.call_function(MARKERS[3], (f"{name}: inputs ready",))
    weights = [env[n] for n in needed if kind_of(n)[0] in ("param", "buffer", "constant")]
    if weights:
        graph.call_function(MARKERS[0], (name, weights))
    for n in members:
        env[n] = graph.node_copy(n, lambda a: env[a])

    result = [env[n] for n in outs]
    if st.kind == "forward":
        for n in outs:
            if isinstance(n.meta.get("val"), torch.Tensor):
                graph.call_function(MARKERS[1], (n.name, env[n]))
    graph.call_function(MARKERS[2], (f"{name}: done",))
    graph.output(tuple(result))
    module = fx.GraphModule(captured.graph_module, graph, class_name=f"Stage_{name}")
    grad_inputs = tuple(
        i.name for i in inputs if i.kind == "value" and i.requires_grad
    ) if st.kind != "forward" else ()
    grad_outputs = tuple(n.name for n in outs) if st.kind == "backward" else ()
    out_names = TAIL_OUTPUTS[:len(outs)] if st.kind == "tail" else tuple(n.name for n in outs)
    return StageProgram(
        index=st.index,
        name=name,
        kind=st.kind,
        units=st.units,
        unit_names=tuple(captured.units[u] for u in st.units),
        graph_module=module,
        inputs=tuple(inputs),
        outputs=out_names,
        grad_outputs=grad_outputs,
        grad_inputs=grad_inputs,
        recompute=st.recompute,
    )


# ---------------------------------------------------------------------------------------------
# 4. unit_segments()
# ---------------------------------------------------------------------------------------------
# Layer-by-layer recompute runs a backward stage's graph one unit at a time: a forward without
# autograd through every unit but the last keeps only what crosses from a unit to a later one
# (the boundaries); then, last unit first, each unit's forward is recomputed with autograd from
# its boundaries and its backward run (rpcompile.runtime.reference.run_backward_microbatch).
# The cut is of the graph that runs (a worker's retargeted copy included), so it is made from
# that graph and cached with it.


@dataclass(frozen=True)
class UnitSegment:
    """One unit of a stage's graph: ``graph_module(*inputs) -> outputs``. Names are node
    names of the stage's graph: its placeholders or nodes of earlier segments (``inputs``);
    this segment's nodes read by a later segment or by the stage's output (``outputs``).
    ``grad_inputs``: the inputs produced by earlier segments that a gradient flows back to."""

    unit: int
    graph_module: fx.GraphModule = field(repr=False, compare=False)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    grad_inputs: tuple[str, ...]


@dataclass(frozen=True)
class LayerRecompute:
    """A stage's graph as unit segments in model order. ``placeholders``: the stage graph's
    placeholder names, in the order of its arguments; ``stage_outputs``: the node name of each
    of the stage's outputs, in order; ``last_use``: per boundary value, the index of the
    earliest segment that reads it (after that segment's backward it is no longer needed)."""

    placeholders: tuple[str, ...]
    segments: tuple[UnitSegment, ...]
    stage_outputs: tuple[str, ...]
    last_use: dict[str, int] = field(compare=False)


_SEGMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEGMENTS_LOCK = threading.Lock()


def unit_segments(program: StageProgram, graph_module: fx.GraphModule | None = None,
                  ) -> LayerRecompute:
    """``graph_module`` (default: the program's own graph; or its copy for another device)
    cut into one segment per unit. Raises ``ValueError`` when a node reads a later unit's
    value (the units are not in model order there, so no unit-by-unit order exists)."""
    gm = program.graph_module if graph_module is None else graph_module
    with _SEGMENTS_LOCK:
        cached = _SEGMENTS.get(gm)
    if cached is not None:
        return cached
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(program.inputs):
        raise InvalidInput(f"stage {program.name}: its graph has {len(placeholders)} placeholders "
                         f"for {len(program.inputs)} inputs")
    rg: dict[fx.Node, bool] = {
        ph: inp.requires_grad and inp.kind in ("param", "value")
        for ph, inp in zip(placeholders, program.inputs)}
    unit_of: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op != "call_function" or n.target in MARKERS:
            continue
        if "rp_unit" not in n.meta:
            raise InvalidInput(f"stage {program.name}: node {n.name} has no unit")
        unit_of[n] = n.meta["rp_unit"]
        rg[n] = _is_float(n.meta.get("val")) and any(rg.get(a, False) for a in n.all_input_nodes)
    units = sorted(set(unit_of.values()))
    output = next(n for n in nodes if n.op == "output")
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    stage_outputs = tuple(o.name for o in outs)
    segments, last_use = [], {}
    for k, u in enumerate(units):
        members = [n for n in nodes if unit_of.get(n) == u]
        member_set = set(members)
        inputs: list[fx.Node] = []
        for n in members:
            for a in n.all_input_nodes:
                if a in member_set or a in inputs:
                    continue
                if unit_of.get(a, -1) > u:
                    raise InvalidInput(
                        f"stage {program.name}: node {n.name} of unit {u} reads {a.name} of "
                        f"the later unit {unit_of[a]}; recompute this stage by stage")
                inputs.append(a)
                if a in unit_of:
                    last_use.setdefault(a.name, k)
                    last_use[a.name] = min(last_use[a.name], k)
        exported = [n for n in members
                    if any(user not in member_set and (user is output or user in unit_of)
                           for user in n.users)]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            ph = graph.placeholder(a.name)
            ph.meta = dict(a.meta)
            env[a] = ph
        for n in members:
            env[n] = graph.node_copy(n, lambda a, env=env: env[a])
        graph.output(tuple(env[n] for n in exported))
        for n in exported:
            if rg[n] and not isinstance(n.meta.get("val"), torch.Tensor):
                raise InvalidInput(
                    f"stage {program.name}: unit {u} passes {n.name}, which carries a gradient "
                    "but is not one tensor, to a later unit; recompute this stage by stage")
        segments.append(UnitSegment(
            unit=u,
            graph_module=fx.GraphModule(gm, graph, class_name=f"Segment_{program.name}_u{u}"),
            inputs=tuple(a.name for a in inputs),
            outputs=tuple(n.name for n in exported),
            grad_inputs=tuple(a.name for a in inputs if a in unit_of and rg[a]),
        ))
    result = LayerRecompute(tuple(p.name for p in placeholders), tuple(segments),
                            stage_outputs, last_use)
    with _SEGMENTS_LOCK:
        _SEGMENTS[gm] = result
    return result
