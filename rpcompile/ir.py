"""The data that flows between rpcompile's passes.

Sections, in reading order:
  1. UnitProfile  - numeric cost of one unit (prefix, one decoder layer, tail) for one microbatch
  2. Stage, Plan  - the RoundPipe partition: forward stages, the fused tail, backward stages
  3. Action, Flow, Edge, Schedule - the schedule as data (docs/schedule.md)

Everything here is a frozen value: passes build new ones instead of editing old ones, and the
string forms are meant to be read by people and parsed back by tests.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import io
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rpcompile.errors import InvalidInput, InvalidType, RPCompileError

__all__ = [
    "ACTION_KINDS",
    "ACTION_SPECS",
    "BOUNDED_WAITS",
    "BULK_PAYLOADS",
    "COMPUTE_KINDS",
    "EDGE_KINDS",
    "HOST_KINDS",
    "HOST_STREAMS",
    "ORDERED_STREAMS",
    "PAYLOADS",
    "RELEASE_EDGES",
    "STREAMS",
    "TIGHTEST_WAITS",
    "TRANSFER_KINDS",
    "Action",
    "ActionKind",
    "DryRun",
    "Edge",
    "Flow",
    "KindSpec",
    "Plan",
    "Schedule",
    "ScheduleError",
    "Stage",
    "StageKind",
    "UnitProfile",
    "check_registry",
]


# --------------------------------------------------------------------------------------------
# 1. UnitProfile
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitProfile:
    """The cost of one unit for one microbatch, evaluated at a size on a hardware profile.

    A *unit* is the smallest piece the partitioner moves: the prefix (embeddings, rotary tables,
    masks), one decoder layer, or the tail (final norm, LM head, loss). ``forward_ms`` and
    ``backward_ms`` are compute times on one GPU; ``backward_ms`` is the backward pass alone,
    without the recompute of the forward (the partitioner adds that for non-tail stages).
    """

    name: str
    forward_ms: float
    backward_ms: float
    trainable_params: int
    frozen_params: int = 0
    # Bytes of the activation leaving this unit for the next one, per microbatch, in the
    # compute dtype (this is what crosses a stage boundary cut right after this unit).
    output_bytes: int = 0
    # Bytes of values computed once and used by many later units (rotary cos/sin, masks,
    # position ids). They travel with every boundary that lies after the unit producing them.
    shared_bytes: int = 0
    # Of those, the bytes of values whose gradient travels back the same way (they depend on
    # a trainable parameter: a long skip connection; not rotary tables or masks).
    shared_grad_bytes: int = 0
    # Peak working memory of this unit's forward + backward for one microbatch, excluding
    # its weights (activations saved for backward plus the largest transient).
    working_bytes: int = 0
    # Parameters this unit reads that an earlier unit owns (a tied LM head reads the
    # embedding): (owner unit index, elements, trainable). A stage that holds this unit but
    # not the owner uploads them too, and (when trainable) sends back a gradient for them.
    borrowed: tuple[tuple[int, int, bool], ...] = ()
    # The layer this unit is a block of, when layers are cut into blocks (attention, MLP):
    # consecutive units with the same non-empty group form one layer. The partitioner also
    # tries cuts at layer boundaries only ("" = the unit is a group of its own).
    group: str = ""
    # Non-parameter inputs the unit's nodes read, each with its bytes: ``buffers``, the
    # buffers and lifted constants (rotary inv_freq, ...), uploaded with a stage's weights in
    # their own dtype; ``batch_inputs``, the batch keys (input_ids, attention_mask, labels,
    # num_items_in_batch, dropout seeds) per microbatch, uploaded from the host. A stage reads
    # the union over its units (rpcompile.passes.cost). Empty for a profile built by hand
    # (rpcompile.workloads.paper), which then stands for ids and labels alone.
    buffers: tuple[tuple[str, int], ...] = ()
    batch_inputs: tuple[tuple[str, int], ...] = ()
    # Frozen quantized weights (a QLoRA base, rpcompile.capture.quantized): their elements,
    # counted in frozen_params too, and the bytes they are kept and uploaded as (packed codes
    # plus quantization state). On the device each is dequantized to the compute dtype.
    packed_params: int = 0
    packed_bytes: int = 0

    @property
    def params(self) -> int:
        return self.trainable_params + self.frozen_params


# --------------------------------------------------------------------------------------------
# 2. Stage, Plan
# --------------------------------------------------------------------------------------------

StageKind = str  # "forward" | "tail" | "backward"


@dataclass(frozen=True)
class Stage:
    """One stage of a RoundPipe plan.

    ``index`` is the stage's position in a round's job order: forward stages F1..Fp are
    0..p-1, the fused tail B1 is p, the other backward stages B2..Bq are p+1..p+q-1.
    ``units`` are contiguous unit indices in model order (a backward stage runs them in reverse).
    All byte and time figures are per job (weights, gradients) or per microbatch (compute,
    activations), as named.
    """

    index: int
    kind: StageKind
    units: tuple[int, ...]
    compute_ms: float  # per microbatch: forward | forward+loss+backward | recompute+backward
    weight_bytes: int  # low-precision weights uploaded once per job
    grad_bytes: int  # fp32 gradients downloaded once per job (0 for forward stages)
    input_bytes: int  # per microbatch, arriving (activation or output gradient, + shared values)
    output_bytes: int  # per microbatch, leaving (activation + saved recompute inputs, or input grad)
    peak_bytes: int  # predicted device memory peak of one job of this stage
    # How a backward stage recomputes its forward (rpcompile.passes.cost.RECOMPUTE): "stage"
    # keeps every unit's activations for one backward; "layer" keeps only the unit
    # boundaries, then recomputes and backpropagates one unit at a time (one more forward).
    recompute: str = "stage"
    # Low-precision bytes of the stage's trainable parameters (borrowed ones included): what
    # its SHADOW rewrites from the masters, since frozen parameters have no masters (a LoRA
    # base). The partitioner always sets it; None, for a stage built by hand without its
    # units' counts, stands for every weight (weight_bytes).
    shadow_bytes: int | None = None
    # Bytes of the buffers and lifted constants the stage's program reads (the union over its
    # units' UnitProfile.buffers): uploaded with its weights and evicted with them.
    buffer_bytes: int = 0
    # The batch inputs the stage's program reads, (key, bytes per microbatch), the union over
    # its units' UnitProfile.batch_inputs: what its host uploads carry
    # (rpcompile.passes.schedule.roundpipe_flows). None for a stage built without captured
    # units (the paper workloads' profiles): ids and labels, 8 bytes a token each.
    batch_inputs: tuple[tuple[str, int], ...] | None = None

    @property
    def upload_bytes(self) -> int:
        """What the stage's UP moves and its worker holds until EVICT: the low-precision
        weights and the buffers."""
        return self.weight_bytes + self.buffer_bytes

    @property
    def trainable_weight_bytes(self) -> int:
        """What the stage's SHADOW rewrites: ``shadow_bytes``, or every weight when unset."""
        return self.weight_bytes if self.shadow_bytes is None else self.shadow_bytes

    def label(self, num_forward: int | None = None) -> str:
        """``F1``..``Fp`` for forward stages, ``B1`` for the tail, ``B2``.. for the backward
        stages. A stage does not know how many forward stages its plan has, so a backward
        stage's label needs ``num_forward`` (``Plan.stage_name(i)`` passes it)."""
        if self.kind == "forward":
            return f"F{self.index + 1}"
        if self.kind == "tail":
            return "B1"
        if num_forward is None:
            raise InvalidInput(f"the label of backward stage {self.index} needs num_forward "
                             "(use plan.stage_name(index))")
        return f"B{self.index - num_forward + 1}"


# Every plan's memory-bounding waits by default (rpcompile.passes.lower: the activation waits
# and two gradient slots per worker), and the tightest set (one slot), for a plan that fits
# only so.
BOUNDED_WAITS = ("window", "sent", "grad_pair")
TIGHTEST_WAITS = ("window", "sent", "grad_slot")

# The transfer staging's rule (rpcompile.runtime.memory.HostStaging, replayed by the
# simulator): a download takes the smallest free host buffer that holds it, if that buffer
# is at most this many times its size (a shorter batch fits the buffers of a longer one; an
# activation does not tie up a gradient's much larger buffer); else a buffer of its own.
STAGING_FIT = 2


@dataclass(frozen=True)
class Plan:
    """A RoundPipe partition of a model's units into forward stages, the tail and backward stages.

    Invariants (checked by :meth:`validate`):
      * forward stages cover units ``0 .. t-1`` contiguously in order;
      * the tail (B1) covers units ``t .. n-1`` and is the only ``tail`` stage;
      * backward stages B2..Bq cover units ``t-1 .. 0`` contiguously in reverse order.
    """

    units: tuple[UnitProfile, ...]
    stages: tuple[Stage, ...]
    workers: int
    microbatches: int
    microbatch_size: int
    seq_len: int
    hardware: str
    # Milliseconds per optimizer step, in one timing model, the simulator's: a plan from
    # rpcompile.planner.partition.partition (and so Compiled.plan) carries the simulated figure
    # of its replayed lowered schedule (sync: one step's makespan; async: the steady-state time
    # per step); a plan from build_plan (a candidate not replayed yet, or a hand cut) carries
    # the simulator's proven lower bound on that figure
    # (rpcompile.planner.bound.simulated_lower_bound), which the partitioner's local search
    # scores and its replays are ordered by.
    predicted_step_ms: float
    memory_limit_bytes: int
    notes: tuple[str, ...] = field(default=())
    # Per worker, the device memory proven over the simulated lowered schedule
    # (rpcompile.passes.memory.worker_peaks); empty when the plan was built by hand.
    worker_peak_bytes: tuple[int, ...] = field(default=())
    # The memory-bounding waits its lowering adds (rpcompile.passes.lower): BOUNDED_WAITS
    # by default (two gradient slots per worker); the partitioner takes TIGHTEST_WAITS (one
    # slot) for a plan that fits only with them.
    memory_waits: tuple[str, ...] = field(default=BOUNDED_WAITS)
    # How the run closes and applies each step, which its lowering follows (and so every
    # replay the partitioner ranks it by; rpcompile.compile sets both from the training
    # options): ``updates``, the sync update order of rpcompile.passes.lower.add_optimizer
    # ("overlap", or "deferred" when clipping, loss scaling or skipping non-finite steps must
    # see the whole step's gradients first; async plans keep "overlap"), and
    # ``grad_check_passes``, the passes over the fp32 gradients of the step's CHECK action
    # (rpcompile.passes.lower.grad_check_passes: clipping reads them for the norm and
    # rewrites them, 3; unscaling rewrites them, 2; 0 when the check only gathers the loss).
    updates: str = "overlap"
    grad_check_passes: int = 0

    # -- views ---------------------------------------------------------------------------
    @property
    def num_forward(self) -> int:
        return sum(1 for s in self.stages if s.kind == "forward")

    @property
    def forward_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.kind == "forward")

    @property
    def tail(self) -> Stage:
        return next(s for s in self.stages if s.kind == "tail")

    @property
    def backward_stages(self) -> tuple[Stage, ...]:
        """B1 (the tail) first, then B2..Bq."""
        return tuple(s for s in self.stages if s.kind != "forward")

    def stage_name(self, stage_index: int) -> str:
        return self.stages[stage_index].label(self.num_forward)

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        n = len(self.units)
        fwd = self.forward_stages
        tails = [s for s in self.stages if s.kind == "tail"]
        if len(tails) != 1:
            raise InvalidInput(f"a plan needs exactly one tail stage, found {len(tails)}")
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise InvalidInput(f"stage at position {i} has index {s.index}")
            if not s.units:
                raise InvalidInput(f"stage {s.label(self.num_forward)} has no units")
            if list(s.units) != list(range(s.units[0], s.units[-1] + 1)):
                raise InvalidInput(f"stage {s.label(self.num_forward)} units are not contiguous")
            if s.recompute not in ("stage", "layer") or (
                    s.recompute == "layer" and s.kind != "backward"):
                raise InvalidInput(f"stage {s.label(self.num_forward)} ({s.kind}) cannot "
                                 f"recompute by {s.recompute!r}: only a backward stage "
                                 "recomputes, by 'stage' or 'layer'")
        order = [s.kind for s in self.stages]
        p = len(fwd)
        if order[:p] != ["forward"] * p or order[p] != "tail":
            raise InvalidInput(f"stage kinds out of order: {order}")
        covered = [u for s in fwd for u in s.units]
        t = tails[0].units[0]
        if covered != list(range(t)):
            raise InvalidInput(f"forward stages cover {covered}, expected units 0..{t - 1}")
        if tails[0].units[-1] != n - 1:
            raise InvalidInput("the tail must end at the last unit")
        back = [u for s in self.stages[p + 1 :] for u in reversed(s.units)]
        if back != list(range(t - 1, -1, -1)):
            raise InvalidInput(f"backward stages cover {back}, expected units {t - 1}..0")

    # -- printing ------------------------------------------------------------------------
    def table(self) -> str:
        """A per-stage table: name, units, parameters, compute, transfer sizes, memory."""
        rows = [
            ("stage", "kind", "units", "params", "ms/mb", "weights", "grads", "in/mb",
             "out/mb", "peak mem")
        ]
        for s in self.stages:
            first, last = self.units[s.units[0]].name, self.units[s.units[-1]].name
            span = first if first == last else f"{first}..{last}"
            params = sum(self.units[u].params for u in s.units)
            kind = s.kind if s.recompute == "stage" else f"{s.kind} ({s.recompute})"
            rows.append((
                s.label(self.num_forward), kind, span, _si(params), f"{s.compute_ms:.2f}",
                _bytes(s.weight_bytes), _bytes(s.grad_bytes), _bytes(s.input_bytes),
                _bytes(s.output_bytes), _bytes(s.peak_bytes),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"Plan: {len(self.units)} units -> {self.num_forward} forward + "
            f"{len(self.stages) - self.num_forward} backward stages; {self.workers} workers, "
            f"{self.microbatches} microbatches of {self.microbatch_size}x{self.seq_len} on "
            f"{self.hardware}; predicted step {self.predicted_step_ms:.1f} ms"
        )
        return head + "\n" + self.table()


def _si(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


# --------------------------------------------------------------------------------------------
# 3. Action, Flow, Edge, Schedule
# --------------------------------------------------------------------------------------------
#
# A Schedule is a list of Actions per worker (plus one host list), the dataflow between stages
# (Flows) and the dependency edges (events) between actions. Each action runs on one *stream* of
# its worker. The compute stream and the host queue run their actions in list order, one at a
# time; the three transfer streams are lanes: no pass relies on their list order, so every
# dependency of a transfer is an edge. The runtime's stream threads and the simulator run
# each lane in list order, one transfer at a time (the strictest reading, which the dry run
# proves free of deadlock); an interpreter free to start any ready transfer could only be
# faster. docs/schedule.md describes every action kind and edge kind.

class ActionKind(str, enum.Enum):
    """Every kind of action a schedule may hold. Each has one :class:`KindSpec` in
    :data:`ACTION_SPECS` (stream, payload); the runtime (``rpcompile.runtime.executor``) and the
    simulator (``rpcompile.sim.engine``) each register one implementation per kind, checked
    complete by :func:`check_registry` when they are imported. ``Action.kind`` holds the plain
    string value (``"F"``), which compares and hashes equal to the member."""

    F = "F"  # forward of one microbatch
    T = "T"  # fused tail: forward + loss + backward of one microbatch
    B = "B"  # backward stage: recompute + backward of one microbatch
    EVICT = "EVICT"  # free a job's weights
    UP = "UP"  # upload a stage's weights (a job's)
    H2D = "H2D"  # one microbatch's tensor into a worker
    D2H = "D2H"  # a tensor out of a worker (a microbatch's, or a job's gradients)
    ACC = "ACC"  # add a job's downloaded gradients into the host's fp32 accumulator
    OPT = "OPT"  # run the optimizer over a stage's masters
    SHADOW = "SHADOW"  # rewrite a stage's low-precision flat buffer (what UP reads)
    REDUCE = "REDUCE"  # sum a stage's host gradients across data-parallel ranks (network)
    CHECK = "CHECK"  # close a step's gradients: loss, non-finite jobs, unscale, clip

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class KindSpec:
    """The interpreter-independent half of an action kind's record: the stream it runs on,
    the payloads (``Action.what``) it may carry (empty: none), whether it is a compute of a
    microbatch, and what ``Action.bytes`` counts. The other half (runtime implementation,
    simulator cost) is registered by each interpreter against the same :class:`ActionKind`."""

    kind: ActionKind
    stream: str
    payloads: tuple[str, ...] = ()
    computes: bool = False
    bytes: str = ""


# What a transfer carries. weights and grad are bulk (large, chunked); the others are one
# microbatch's tensor and are latency-critical.
PAYLOADS = ("weights", "act", "save", "igrad", "grad")
BULK_PAYLOADS = ("weights", "grad")

ACTION_SPECS: Mapping[ActionKind, KindSpec] = {
    s.kind: s for s in (
        KindSpec(ActionKind.F, "compute", computes=True),
        KindSpec(ActionKind.T, "compute", computes=True),
        KindSpec(ActionKind.B, "compute", computes=True),
        KindSpec(ActionKind.EVICT, "compute"),
        KindSpec(ActionKind.UP, "weight_upload", ("weights",), bytes="the stage's weights"),
        KindSpec(ActionKind.H2D, "activation_upload", ("act", "save", "igrad", "grad"),
                 bytes="the microbatch's tensor"),
        KindSpec(ActionKind.D2H, "download", ("act", "save", "igrad", "grad"),
                 bytes="the tensor (grad: the job's fp32 gradients)"),
        KindSpec(ActionKind.ACC, "host", bytes="the job's fp32 gradients"),
        KindSpec(ActionKind.OPT, "host", bytes="the stage's fp32 gradients"),
        KindSpec(ActionKind.SHADOW, "host", bytes="the stage's low-precision weights"),
        KindSpec(ActionKind.CHECK, "host",
                 bytes="the fp32 gradient traffic of the step's check (Plan.grad_check_passes "
                       "passes over every trainable parameter's gradient)"),
        KindSpec(ActionKind.REDUCE, "network",
                 bytes="the fp32 gradients it reduces (each parameter once, at its last "
                       "gradient stage)"),
    )
}


def check_registry(table: Mapping[Any, Any], interpreter: str) -> None:
    """Raise unless ``table`` has exactly one entry per :class:`ActionKind`: an interpreter
    that lacks a kind (or knows one the IR does not) would run a different protocol."""
    keys = {ActionKind(k) for k in table}
    missing = [k.value for k in ActionKind if k not in keys]
    if missing or len(keys) != len(table):
        raise InvalidType(f"{interpreter} has no implementation of action kinds {missing}: every "
                        "ActionKind needs one in each interpreter (runtime and simulator)")


COMPUTE_KINDS = tuple(k.value for k, s in ACTION_SPECS.items() if s.stream == "compute")
TRANSFER_KINDS = tuple(k.value for k, s in ACTION_SPECS.items() if s.payloads)
# The host's two ordered lanes: the host queue (gradients, optimizer, shadows) and the network
# lane (cross-rank reductions, data parallel only), each one list of the schedule.
HOST_STREAMS = ("host", "network")
HOST_KINDS = tuple(k.value for k, s in ACTION_SPECS.items() if s.stream in HOST_STREAMS)
ACTION_KINDS = tuple(k.value for k in ActionKind)
_STREAM_OF = {k.value: s.stream for k, s in ACTION_SPECS.items()}
_COMPUTES = frozenset(k.value for k, s in ACTION_SPECS.items() if s.computes)

# Stream names match rpcompile.runtime.workers.STREAMS (plus the host's two lanes).
STREAMS = ("compute", "weight_upload", "activation_upload", "download", "host", "network")
# The streams whose list order the passes rely on (the transfer lanes also run in list order
# at run time and in the simulator, but every dependency there is an explicit edge).
ORDERED_STREAMS = ("compute", "host", "network")

EDGE_KINDS = (
    "data",  # compute -> compute, same microbatch (the value stays on the device if same worker)
    "weights",  # UP -> first compute of its job
    "landed",  # UP of job n+1 -> EVICT of job n, same worker and step (the sets overlap)
    "buffer",  # EVICT of job n-2 -> UP of job n on the same worker (two weight slots)
    "produced",  # compute -> D2H of the value it produced
    "on_host",  # D2H -> H2D of the same value on the consumer's worker
    "arrived",  # H2D -> the compute that reads it
    "window",  # compute two places before a reader -> the H2D it reads (bounded early upload)
    "sent",  # D2H of a value -> the compute two places after its producer (freed before it)
    "grad_ready",  # last compute of a job -> D2H grad of the job
    "grad_home",  # D2H grad -> host ACC
    "grad_slot",  # D2H grad of a worker's gradient job -> its next one's first compute (1 slot)
    "grad_pair",  # D2H grad of a worker's gradient job -> its next but one's first (2 slots)
    "accumulated",  # ACC -> OPT
    "reduce_ready",  # ACC of a stage's last round -> its REDUCE (data parallel)
    "reduced",  # REDUCE -> the step's first OPT (sync; the gradient check reads every gradient)
    "updated",  # OPT -> SHADOW of every stage sharing its parameters
    "pending",  # async OPT(s, k) -> the first ACC of s in step k (update k-1 reads first)
    "shadow",  # SHADOW -> UP that reads that shadow version
    "shadow_read",  # UP -> SHADOW that overwrites the buffer the UP read (write after read)
    "commit",  # step k's last action of each ordered queue -> its last host action (commit)
    "barrier",  # data parallel: step k's commit point -> step k+1's first actions
)


# The edges from a D2H to the compute before which what it sent home is given back on the
# device (Schedule.releases).
RELEASE_EDGES = ("sent", "grad_slot", "grad_pair")


@dataclass(frozen=True)
class Action:
    """One unit of work on one stream of one worker (or on the host).

    String form (parses back with :meth:`parse`), tokens in this order, optional ones omitted::

        w3 F s5 m2 r0                  forward of stage 5, microbatch 2, round 0 (step 0)
        w3 UP s5 r0 1073741824B x16    upload stage 5's weights, 1 GiB in 16 chunks
        w0 D2H act s1 m2 r0 @x8        download value x8 (activation after unit 8) of stage 1
        w1 D2H grad s7 r0 k1           download the job's gradients, step 1
        host OPT s7                    optimizer update of stage 7's parameters (step 0)

    ``worker`` is None for host actions. ``step`` (``k``) is the optimizer step, printed when
    not 0. ``value`` names the tensor an activation transfer carries (see :class:`Flow`).
    ``bytes`` is the whole transfer; ``chunks`` how many pieces a bulk transfer is cut into.
    """

    worker: int | None
    kind: str
    stage: int
    microbatch: int | None = None
    round: int | None = None
    step: int = 0
    what: str | None = None
    value: str | None = None
    bytes: int = 0
    chunks: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.kind, ActionKind):  # kept as the plain string: cheap to hash
            object.__setattr__(self, "kind", self.kind.value)
        if self.kind not in ACTION_KINDS:
            raise InvalidInput(f"unknown action kind {self.kind!r}; expected one of {ACTION_KINDS}")
        if (self.worker is None) != (self.kind in HOST_KINDS):
            raise InvalidInput(f"{self.kind} actions run on {'the host' if self.kind in HOST_KINDS else 'a worker'}")
        if self.kind == "UP" and self.what is None:
            object.__setattr__(self, "what", "weights")
        allowed = ACTION_SPECS[self.kind].payloads  # type: ignore[index]
        if allowed:
            if self.what not in allowed:
                raise InvalidInput(f"{self.kind} carries one of {allowed}, not {self.what!r}")
        elif self.what is not None:
            raise InvalidInput(f"{self.kind} actions carry no payload (what={self.what!r})")
        if self.value is not None and not _VALUE_RE.fullmatch(self.value):
            raise InvalidInput(f"value name {self.value!r} must match {_VALUE_RE.pattern}")
        if self.chunks < 1 or self.bytes < 0:
            raise InvalidInput("chunks must be >= 1 and bytes >= 0")
        # Lowering, memory proofs and the replay key dicts by Action: the hash is computed once,
        # the same value dataclass's own __hash__ gives (so set and dict orders are unchanged).
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _fields(self) -> tuple:
        return (self.worker, self.kind, self.stage, self.microbatch, self.round, self.step,
                self.what, self.value, self.bytes, self.chunks)

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:  # a string's hash differs between processes
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash(self._fields()))

    @property
    def stream(self) -> str:
        return _STREAM_OF[self.kind]

    @property
    def priority(self) -> str | None:
        """``critical`` for one microbatch's tensor, ``bulk`` for weights and gradients."""
        if self.what is None:
            return None
        return "bulk" if self.what in BULK_PAYLOADS else "critical"

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTES

    def short(self) -> str:
        """The string form without the worker, for grid cells."""
        return str(self).split(" ", 1)[1]

    def __str__(self) -> str:
        parts = ["host" if self.worker is None else f"w{self.worker}", self.kind]
        if self.kind in ("H2D", "D2H"):
            parts.append(str(self.what))
        parts.append(f"s{self.stage}")
        if self.microbatch is not None:
            parts.append(f"m{self.microbatch}")
        if self.round is not None:
            parts.append(f"r{self.round}")
        if self.step:
            parts.append(f"k{self.step}")
        if self.value is not None:
            parts.append(f"@{self.value}")
        if self.bytes:
            parts.append(f"{self.bytes}B")
        if self.chunks != 1:
            parts.append(f"x{self.chunks}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Action:
        tokens = text.split()
        if len(tokens) < 3:
            raise InvalidInput(f"cannot parse action {text!r}: expected '<worker> <KIND> ... s<stage>'")
        head, kind, rest = tokens[0], tokens[1], tokens[2:]
        if head == "host":
            worker = None
        elif head.startswith("w") and head[1:].isdigit():
            worker = int(head[1:])
        else:
            raise InvalidInput(f"cannot parse action {text!r}: worker must be 'w<N>' or 'host'")
        fields: dict = {"what": None}
        if kind in ("H2D", "D2H") and rest:
            fields["what"], rest = rest[0], rest[1:]
        for tok in rest:
            m = _TOKEN_RE.fullmatch(tok)
            if m is None:
                raise InvalidInput(f"cannot parse action {text!r}: bad token {tok!r}")
            key = m.lastgroup
            fields[key] = tok[1:] if key == "value" else int(m.group(key))
        if "stage" not in fields:
            raise InvalidInput(f"cannot parse action {text!r}: missing s<stage>")
        return cls(worker=worker, kind=kind, **fields)


_VALUE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_TOKEN_RE = re.compile(
    r"s(?P<stage>\d+)|m(?P<microbatch>\d+)|r(?P<round>\d+)|k(?P<step>\d+)"
    r"|(?P<value>@[A-Za-z_][A-Za-z0-9_.]*)|(?P<bytes>\d+)B|x(?P<chunks>\d+)"
)


# Action's cached hash must cover exactly its fields, in order, as dataclass's would.
if tuple(f.name for f in dataclasses.fields(Action)) != ("worker", "kind", "stage", "microbatch",
                                                        "round", "step", "what", "value",
                                                        "bytes", "chunks"):
    raise InvalidType("Action._fields must list Action's fields in order (its cached hash)")


@dataclass(frozen=True)
class Flow:
    """One tensor that a compute kind of one stage needs, per microbatch, and where it comes from.

    ``value`` names the tensor (``x8``: activation after unit 8, ``g8``: gradient with respect to
    it, ``ids``/``labels``: the batch, which lives on the host). Several flows may share a value
    (an activation that is both the next forward stage's input and a backward stage's saved
    recompute input); it then leaves its producer once. ``src_kind``/``src_stage`` are None for
    host-resident values. ``what`` is the payload the consumer's H2D carries.
    """

    value: str
    what: str
    src_kind: str | None
    src_stage: int | None
    dst_kind: str
    dst_stage: int
    bytes: int

    @property
    def from_host(self) -> bool:
        return self.src_kind is None


@dataclass(frozen=True)
class Edge:
    """``dst`` waits until ``src`` has finished (an event recorded after src, waited before dst)."""

    src: Action
    dst: Action
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in EDGE_KINDS:
            raise InvalidInput(f"unknown edge kind {self.kind!r}; expected one of {EDGE_KINDS}")


@dataclass(frozen=True)
class DryRun:
    """Unit-time replay: every ready queue head runs in one step. ``blocked`` lists the heads
    left waiting when no queue can move (a deadlock); empty when everything ran."""

    steps: dict[Action, int]
    blocked: tuple[Action, ...]

    @property
    def ok(self) -> bool:
        return not self.blocked


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists, a host action list, the dataflow and the edges between actions.

    ``actions[w]`` is worker ``w``'s list; the actions of one stream run in this order. ``host``
    is the host queue. ``passes`` names the lowering passes applied so far (empty: compute only).
    ``stage_units`` is (first unit, last unit) per stage; ``stage_workers`` is the worker a stage
    is bound to (baselines) or None (RoundPipe: any worker). ``ranks`` is how many processes
    train data parallel, each running this schedule on its share of the batch; with more than
    one, ``network`` is the host's network lane (REDUCE actions, in order). ``sharded``: the
    ranks shard the masters and optimizer state (``shard_optimizer``): each REDUCE reduces its
    gradients to their owners, and each SHADOW also brings the other ranks' updated shadows.
    ``repeat_from``, ``repeat_until``: how a run cycles through the schedule (:meth:`step_of`;
    the runtime's schedule, rpcompile.passes.schedule.runtime_cycle): steps ``repeat_from ..
    repeat_until-1`` over and over; the steps after ``repeat_until`` (0: none) are never run
    as such, they give the last repeated step the waits into the step after it that a long
    run has.
    """

    kind: str
    workers: int
    microbatches: int
    rounds: int
    steps: int
    optimizer: str
    stage_names: tuple[str, ...]
    stage_units: tuple[tuple[int, int], ...]
    flows: tuple[Flow, ...]
    actions: tuple[tuple[Action, ...], ...]
    host: tuple[Action, ...] = ()
    edges: tuple[Edge, ...] = ()
    stage_workers: tuple[int, ...] | None = None
    passes: tuple[str, ...] = ()
    network: tuple[Action, ...] = ()
    ranks: int = 1
    sharded: bool = False
    repeat_from: int = 0
    repeat_until: int = 0

    def __post_init__(self) -> None:
        if self.sharded and self.ranks < 2:
            raise InvalidInput("a sharded schedule is data parallel: it needs ranks > 1")
        if not 0 <= self.repeat_from < self.run_steps <= self.steps:
            raise InvalidInput(f"the schedule's repeated steps {self.repeat_from}.."
                             f"{self.run_steps - 1} must lie within its {self.steps} steps")
        # Edges are kept in one canonical order (by the waiting action's place in the lists,
        # then as given) so that equal schedules compare equal after a CSV or JSON round trip.
        if self.edges:
            place = {a: i for i, a in enumerate(self.all_actions())}
            end = len(place)
            edges = sorted(self.edges, key=lambda e: place.get(e.dst, end))
            object.__setattr__(self, "edges", tuple(edges))

    # -- views ---------------------------------------------------------------------------
    @property
    def run_steps(self) -> int:
        """The steps a run executes (:meth:`step_of`): ``repeat_until``, else ``steps``."""
        return self.repeat_until or self.steps

    def step_of(self, run_step: int) -> int:
        """The schedule step that step ``run_step`` of a run executes: itself while it is
        below :attr:`run_steps`, then ``repeat_from .. run_steps-1`` over and over. An edge
        from step ``j - d`` into step ``j`` means the action of the run's step
        ``run_step - d``, as the step that run step executes holds it."""
        end = self.run_steps
        if run_step < end:
            return run_step
        return self.repeat_from + (run_step - self.repeat_from) % (end - self.repeat_from)

    def all_actions(self) -> Iterator[Action]:
        for lst in self.actions:
            yield from lst
        yield from self.host
        yield from self.network

    def queues(self) -> dict[tuple[int | None, str], tuple[Action, ...]]:
        """(worker, stream) -> that stream's actions in order; the host queue is (None, 'host'),
        the network lane (None, 'network')."""
        out: dict[tuple[int | None, str], list[Action]] = {}
        for w, lst in enumerate(self.actions):
            for a in lst:
                out.setdefault((w, a.stream), []).append(a)
        if self.host:
            out[(None, "host")] = list(self.host)
        if self.network:
            out[(None, "network")] = list(self.network)
        return {k: tuple(v) for k, v in out.items()}

    def waits(self) -> dict[Action, list[Edge]]:
        """dst action -> the edges it waits on."""
        out: dict[Action, list[Edge]] = {}
        for e in self.edges:
            out.setdefault(e.dst, []).append(e)
        return out

    def releases(self) -> dict[Action, Action]:
        """D2H -> the compute before whose start the device memory it sent home is given back:
        for a job's gradients, the target of its ``grad_slot`` / ``grad_pair`` edge (the
        worker's gradient slots); for a value, the target of its ``sent`` edge (rpcompile
        .passes.lower), in its step or a later one (steps overlap). Memory whose D2H has
        none (a run's last jobs, a plan without the waits) is given back when the download
        (and every local reader) is done. The proof, the simulator and the runtime all read
        this one map, so what a worker holds is a property of the schedule, not of how fast
        its downloads run."""
        return {e.src: e.dst for e in self.edges if e.kind in RELEASE_EDGES}

    def replace(self, **changes: object) -> Schedule:
        return dataclasses.replace(self, **changes)

    # -- dry run -------------------------------------------------------------------------
    def dry_run(self) -> DryRun:
        """Replay with unit durations: at each step every queue whose head has all its waits
        finished (in earlier steps) runs that head. Every stream is taken as in order here, the
        strictest reading: if this finishes, so does any runtime that also lets a transfer lane
        pick any ready transfer (it has fewer constraints). Gives each action the step index
        :meth:`grid` shows."""
        queues = list(self.queues().values())
        preds: dict[Action, list[Action]] = {}
        for e in self.edges:
            preds.setdefault(e.dst, []).append(e.src)
        done: dict[Action, int] = {}
        heads = [0] * len(queues)
        remaining = sum(len(q) for q in queues)
        step = 0
        while remaining:
            ran = []
            for i, q in enumerate(queues):
                if heads[i] < len(q):
                    a = q[heads[i]]
                    if all(done.get(p, step) < step for p in preds.get(a, ())):
                        ran.append(i)
            if not ran:
                blocked = tuple(q[heads[i]] for i, q in enumerate(queues) if heads[i] < len(q))
                return DryRun(done, blocked)
            for i in ran:
                done[queues[i][heads[i]]] = step
                heads[i] += 1
            remaining -= len(ran)
            step += 1
        return DryRun(done, ())

    # -- text grid -----------------------------------------------------------------------
    def grid(self, mark: Action | None = None, streams: Sequence[str] | None = None,
             window: int | None = None, dry: DryRun | None = None) -> str:
        """Step x worker grid: row t holds what each worker (and the host) runs at dry-run step
        t. ``mark`` is shown as ``!!<action>!!`` with ``<-- here`` after its row; ``window``
        keeps that many rows either side of the mark; ``streams`` filters what is shown."""
        dry = dry or self.dry_run()
        cols = [f"w{w}" for w in range(self.workers)] + (["host"] if self.host else []) + (
            ["network"] if self.network else [])
        rows: dict[int, dict[str, list[str]]] = {}
        blocked_row = max(dry.steps.values(), default=-1) + 1
        for a in self.all_actions():
            if streams is not None and a.stream not in streams and a != mark:
                continue
            t = dry.steps.get(a)
            if t is None:
                if a not in dry.blocked and a != mark:
                    continue
                t = blocked_row
            text = f"!!{a.short()}!!" if a == mark else a.short()
            col = (a.stream if a.worker is None else f"w{a.worker}")
            rows.setdefault(t, {}).setdefault(col, []).append(text)
        steps = sorted(rows)
        mark_step = next((t for t in steps if any("!!" in c for v in rows[t].values() for c in v)), None)
        if window is not None and mark_step is not None:
            steps = [t for t in steps if abs(t - mark_step) <= window]
        cells = [["step", *cols]]
        for t in steps:
            label = "blocked" if t == blocked_row and dry.blocked else str(t)
            cells.append([label, *(" | ".join(rows[t].get(c, [])) for c in cols)])
        widths = [max(len(r[i]) for r in cells) for i in range(len(cols) + 1)]
        lines = []
        for r, t in zip(cells, [None, *steps]):
            line = "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            lines.append(line + ("   <-- here" if t is not None and t == mark_step else ""))
        return "\n".join(lines)

    # -- CSV -----------------------------------------------------------------------------
    def to_csv(self) -> str:
        """Header lines ``# key: json`` with the metadata, then one row per action:
        ``worker,index,stream,action,waits`` where waits is ``kind=<action>`` joined by ``;``."""
        buf = io.StringIO()
        for key, val in self._meta().items():
            buf.write(f"# {key}: {json.dumps(val)}\n")
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["worker", "index", "stream", "action", "waits"])
        waits = self.waits()
        lists = [*((lst, str(w)) for w, lst in enumerate(self.actions)), (self.host, "host"),
                 (self.network, "host")]
        for lst, who in lists:
            for i, a in enumerate(lst):
                w = ";".join(f"{e.kind}={e.src}" for e in waits.get(a, ()))
                writer.writerow([who, i, a.stream, str(a), w])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        meta: dict = {}
        body = []
        for line in text.splitlines():
            if line.startswith("# "):
                key, _, val = line[2:].partition(": ")
                meta[key] = json.loads(val)
            elif line.strip():
                body.append(line)
        rows = list(csv.DictReader(body))
        per_worker: list[list[Action]] = [[] for _ in range(meta["workers"])]
        host: list[Action] = []
        network: list[Action] = []
        edges: list[Edge] = []
        for row in rows:
            a = Action.parse(row["action"])
            if row["worker"] != "host":
                per_worker[int(row["worker"])].append(a)
            else:
                (network if a.stream == "network" else host).append(a)
            for item in filter(None, row["waits"].split(";")):
                kind, _, src = item.partition("=")
                edges.append(Edge(Action.parse(src), a, kind))
        return cls._from_meta(meta, per_worker, host, edges, network)

    # -- JSON (Chrome trace) -------------------------------------------------------------
    def to_json(self, timeline: Mapping[Action, tuple[float, float]] | None = None) -> dict:
        """A Chrome trace (``traceEvents``; open in Perfetto or chrome://tracing): one process
        per worker (and the host), one thread per stream, one ``X`` event per action, one flow
        arrow per edge. Times come
        from ``timeline`` (action -> (start_ms, end_ms), e.g. from the simulator) or else from
        the dry run (1 step = 1 ms). The whole schedule rides along under ``rpcompile`` so the
        file loads back with :meth:`from_json`."""
        if timeline is None:
            dry = self.dry_run()
            timeline = {a: (float(t), float(t) + 1.0) for a, t in dry.steps.items()}
        events: list[dict] = []
        host_pid = self.workers
        for pid in range(self.workers + 1):
            name = "host" if pid == host_pid else f"worker {pid}"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            for tid, stream in enumerate(STREAMS):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": stream}})
        waits = self.waits()

        def lane(a: Action) -> dict:
            return {"pid": host_pid if a.worker is None else a.worker,
                    "tid": STREAMS.index(a.stream)}

        for a in self.all_actions():
            if a not in timeline:
                continue
            start, end = timeline[a]
            events.append({
                "ph": "X", "name": a.short(), "cat": a.kind, **lane(a),
                "ts": start * 1000.0, "dur": max(end - start, 0.0) * 1000.0,
                "args": {"action": str(a), "waits": [f"{e.kind}={e.src}" for e in waits.get(a, ())]},
            })
        # Edges as flow arrows (Perfetto draws them from the waited-on slice to the waiter).
        for n, e in enumerate(self.edges):
            if e.src in timeline and e.dst in timeline:
                events.append({"ph": "s", "id": n, "name": e.kind, "cat": "edge", **lane(e.src),
                               "ts": timeline[e.src][0] * 1000.0})
                events.append({"ph": "f", "bp": "e", "id": n, "name": e.kind, "cat": "edge",
                               **lane(e.dst), "ts": timeline[e.dst][0] * 1000.0})
        doc = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "rpcompile": {
                **self._meta(),
                "actions": [[str(a) for a in lst] for lst in self.actions],
                "host": [str(a) for a in self.host],
                **({"network": [str(a) for a in self.network]} if self.network else {}),
                "edges": [[str(e.src), str(e.dst), e.kind] for e in self.edges],
            },
        }
        return doc

    @classmethod
    def from_json(cls, doc: dict | str) -> Schedule:
        if isinstance(doc, str):
            doc = json.loads(doc)
        if "rpcompile" not in doc:
            raise InvalidInput("this JSON trace holds no schedule (no 'rpcompile' key); only "
                             "traces written by Schedule.dump / to_json load back")
        body = doc["rpcompile"]
        per_worker = [[Action.parse(s) for s in lst] for lst in body["actions"]]
        host = [Action.parse(s) for s in body["host"]]
        edges = [Edge(Action.parse(s), Action.parse(d), k) for s, d, k in body["edges"]]
        network = [Action.parse(s) for s in body.get("network", ())]
        return cls._from_meta(body, per_worker, host, edges, network)

    # -- files ---------------------------------------------------------------------------
    def dump(self, path: str | os.PathLike,
             timeline: Mapping[Action, tuple[float, float]] | None = None) -> None:
        """Write by extension: ``.csv``, ``.json`` (Chrome trace), ``.txt`` (grid), ``.png``."""
        p = os.fspath(path)
        ext = os.path.splitext(p)[1].lower()
        if ext == ".csv":
            text = self.to_csv()
        elif ext == ".json":
            text = json.dumps(self.to_json(timeline))
        elif ext == ".txt":
            text = self.grid() + "\n"
        elif ext == ".png":
            from rpcompile._draw import draw_timeline

            draw_timeline(self, p, timeline, STREAMS)
            return
        else:
            raise InvalidInput(f"cannot dump a schedule to {p!r}: use .csv, .json, .txt or .png")
        with open(p, "w") as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Schedule:
        p = os.fspath(path)
        with open(p) as f:
            text = f.read()
        if p.lower().endswith(".csv"):
            return cls.from_csv(text)
        if p.lower().endswith(".json"):
            return cls.from_json(text)
        raise InvalidInput(f"cannot load a schedule from {p!r}: use .csv or .json")

    # -- helpers -------------------------------------------------------------------------
    def _meta(self) -> dict:
        return {
            "kind": self.kind, "workers": self.workers, "microbatches": self.microbatches,
            "rounds": self.rounds, "steps": self.steps, "optimizer": self.optimizer,
            "stage_names": list(self.stage_names),
            "stage_units": [list(u) for u in self.stage_units],
            "stage_workers": None if self.stage_workers is None else list(self.stage_workers),
            "passes": list(self.passes),
            "flows": [dataclasses.asdict(f) for f in self.flows],
            # Written only for data parallel, so one-process schedules read as before.
            **({"ranks": self.ranks} if self.ranks != 1 else {}),
            **({"sharded": True} if self.sharded else {}),
            **({"repeat_from": self.repeat_from} if self.repeat_from else {}),
            **({"repeat_until": self.repeat_until} if self.repeat_until else {}),
        }

    @classmethod
    def _from_meta(cls, meta: dict, per_worker: list[list[Action]], host: list[Action],
                   edges: list[Edge], network: list[Action] = ()) -> Schedule:
        sw = meta.get("stage_workers")
        return cls(
            kind=meta["kind"], workers=meta["workers"], microbatches=meta["microbatches"],
            rounds=meta["rounds"], steps=meta["steps"], optimizer=meta["optimizer"],
            stage_names=tuple(meta["stage_names"]),
            stage_units=tuple(tuple(u) for u in meta["stage_units"]),
            flows=tuple(Flow(**f) for f in meta["flows"]),
            actions=tuple(tuple(lst) for lst in per_worker), host=tuple(host),
            edges=tuple(edges), stage_workers=None if sw is None else tuple(sw),
            passes=tuple(meta["passes"]), network=tuple(network),
            ranks=int(meta.get("ranks", 1)), sharded=bool(meta.get("sharded", False)),
            repeat_from=int(meta.get("repeat_from", 0)),
            repeat_until=int(meta.get("repeat_until", 0)),
        )

    def __str__(self) -> str:
        n = sum(len(lst) for lst in self.actions) + len(self.host) + len(self.network)
        lowered = ", ".join(self.passes) or "compute only"
        return (f"Schedule({self.kind}, {self.workers} workers, {self.microbatches} microbatches"
                f" x {self.rounds} rounds x {self.steps} steps, {n} actions, {len(self.edges)}"
                f" edges; {lowered})")


class ScheduleError(RPCompileError, ValueError):
    """A schedule broke an invariant; the message names the pass and shows the marked grid."""
