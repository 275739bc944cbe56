"""The RoundPipe plan as data: the cost of one unit for one microbatch (UnitProfile) and
the partition of a model's units into forward stages, the fused tail and backward stages (Stage,
Plan), with the memory-bounding waits a plan names and the host staging slots' fit rule.

Sections, in reading order:
  1. UnitProfile  - numeric cost of one unit (prefix, one decoder layer, tail) for one microbatch
  2. Stage, Plan  - the RoundPipe partition: forward stages, the fused tail, backward stages
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rpcompile.errors import InvalidInput

__all__ = [
    "BOUNDED_WAITS",
    "STAGING_FIT",
    "TIGHTEST_WAITS",
    "Plan",
    "Stage",
    "StageKind",
    "UnitProfile",
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

# The host staging slots' rule (rpcompile.passes.staging): in the replay the slots come
# from, a download takes the smallest free slot that holds it, if that slot is at most this
# many times its size (an activation does not tie up a gradient's much larger buffer); else
# a slot of its own.
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
