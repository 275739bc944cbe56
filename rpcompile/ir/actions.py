"""The elements of a schedule: the action kinds and their records (ActionKind, KindSpec,
ACTION_SPECS), the streams, the edge kinds, one action (Action), one tensor's dataflow between
stages (Flow) and one dependency between actions (Edge). docs/schedule.md describes every
action kind and edge kind."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rpcompile.errors import InvalidInput, InvalidType

__all__ = [
    "ACTION_KINDS",
    "ACTION_SPECS",
    "BULK_PAYLOADS",
    "COMPUTE_KINDS",
    "EDGE_KINDS",
    "HOST_KINDS",
    "HOST_STREAMS",
    "ORDERED_STREAMS",
    "PAYLOADS",
    "RELEASE_EDGES",
    "STEPS_IN_FLIGHT",
    "STREAMS",
    "TRANSFER_KINDS",
    "Action",
    "ActionKind",
    "Edge",
    "Flow",
    "KindSpec",
    "check_registry",
]


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
    "in_flight",  # step k's commit point -> step k+STEPS_IN_FLIGHT's first actions
    "barrier",  # data parallel: step k's commit point -> step k+1's first actions
    "reuse",  # what frees a staging slot's holder (ACC, every H2D) -> the slot's next D2H
)

# Steps a run keeps uncommitted at once (rpcompile.runtime.executor; data parallel keeps one):
# step k+STEPS_IN_FLIGHT is submitted only once step k has committed. The lowering writes that
# wait into the schedule (edges "in_flight", "barrier"), so the simulator and the memory proof
# order steps as the runtime does.
STEPS_IN_FLIGHT = 2


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
        # Read millions of times per large schedule: plain attributes, not properties.
        # ``stream``: the stream the kind runs on; ``is_compute``: a compute (F, T, B).
        object.__setattr__(self, "stream", _STREAM_OF[self.kind])
        object.__setattr__(self, "is_compute", self.kind in _COMPUTES)

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
    def priority(self) -> str | None:
        """``critical`` for one microbatch's tensor, ``bulk`` for weights and gradients."""
        if self.what is None:
            return None
        return "bulk" if self.what in BULK_PAYLOADS else "critical"

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
