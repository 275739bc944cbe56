"""The data that flows between rpcompile's passes.

Sections, in reading order:
  1. UnitProfile  - numeric cost of one unit (prefix, one decoder layer, tail) for one microbatch
  2. Stage, Plan  - the RoundPipe partition: forward stages, the fused tail, backward stages
  3. Action, Schedule - (see the second half of this file) the schedule as data

Everything here is a frozen value: passes build new ones instead of editing old ones, and the
string forms are meant to be read by people and parsed back by tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Plan", "Stage", "StageKind", "UnitProfile"]


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
    # Peak working memory of this unit's forward + backward for one microbatch, excluding
    # its weights (activations saved for backward plus the largest transient).
    working_bytes: int = 0

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

    @property
    def name(self) -> str:
        return self.label()

    def label(self, num_forward: int | None = None) -> str:
        """``F1``..``Fp`` for forward stages, ``B1``.. for the tail and backward stages."""
        if self.kind == "forward":
            return f"F{self.index + 1}"
        if num_forward is None:
            raise ValueError("label() of a backward stage needs num_forward")
        return f"B{self.index - num_forward + 1}"


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
    predicted_step_ms: float
    memory_limit_bytes: int
    notes: tuple[str, ...] = field(default=())

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

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.microbatch_size * self.seq_len

    # -- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        n = len(self.units)
        fwd = self.forward_stages
        tails = [s for s in self.stages if s.kind == "tail"]
        if len(tails) != 1:
            raise ValueError(f"a plan needs exactly one tail stage, found {len(tails)}")
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise ValueError(f"stage at position {i} has index {s.index}")
            if not s.units:
                raise ValueError(f"stage {s.label(self.num_forward)} has no units")
            if list(s.units) != list(range(s.units[0], s.units[-1] + 1)):
                raise ValueError(f"stage {s.label(self.num_forward)} units are not contiguous")
        order = [s.kind for s in self.stages]
        p = len(fwd)
        if order[:p] != ["forward"] * p or order[p] != "tail":
            raise ValueError(f"stage kinds out of order: {order}")
        covered = [u for s in fwd for u in s.units]
        t = tails[0].units[0]
        if covered != list(range(t)):
            raise ValueError(f"forward stages cover {covered}, expected units 0..{t - 1}")
        if tails[0].units[-1] != n - 1:
            raise ValueError("the tail must end at the last unit")
        back = [u for s in self.stages[p + 1 :] for u in reversed(s.units)]
        if back != list(range(t - 1, -1, -1)):
            raise ValueError(f"backward stages cover {back}, expected units {t - 1}..0")

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
            rows.append((
                s.label(self.num_forward), s.kind, span, _si(params), f"{s.compute_ms:.2f}",
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
