"""The compiled model (:class:`Compiled`) and the planning it runs again for a new batch shape:
each loss-chunk variant costed, partitioned, split and lowered (``_plan_captured``,
``_plan_and_split``, ``_finish``); the models with a running trainer, closed at exit."""

from __future__ import annotations

import atexit
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from rpcompile.capture.batch import largest_microbatch
from rpcompile.capture.core import Captured
from rpcompile.capture.tracing import (
    release_fx_sources,
    release_shape_env_caches,
)
from rpcompile.compiler.checks import check_host_memory, check_memory
from rpcompile.compiler.chunks import (
    _ONE_SLOT_NOTE,
    AGAIN,
    _choose_loss_chunk,
    _fits,
    _large_logits,
    _loss_chunks,
    _memory_limited,
    _only_tail_smaller,
    _SameSearch,
    _Searched,
)
from rpcompile.compiler.profiles import _floating_dtype, unit_profiles
from rpcompile.compiler.search import _head_text, _searched_plan, planning_hardware
from rpcompile.compiler.shapes import (
    _agreed_shape,
    _batch_shape,
    _data_parallel,
    _notice,
    _shape_of,
    _shape_text,
)
from rpcompile.compiler.state import CompiledState
from rpcompile.errors import InvalidInput, StateError
from rpcompile.hardware import Hardware
from rpcompile.ir import Plan, Schedule, UnitProfile
from rpcompile.options import (
    Options,
    PlanOptions,
    deferred_reasons,
    update_order,
)
from rpcompile.passes.cost import UnitCost, annotate_costs
from rpcompile.passes.invariants import (
    check_captured,
    check_costs,
    check_plan,
    check_stages,
)
from rpcompile.passes.lower import (
    TIGHTEST_WAITS,
    keep_runtime_schedules,
    runtime_peaks,
    runtime_schedule,
)
from rpcompile.passes.manager import PassRecord, run_pass
from rpcompile.passes.memory import HostMemory, check_staging
from rpcompile.passes.split import StageProgram, split
from rpcompile.planner.partition import (
    PartitionError,
    StageCosting,
    memory_first_note,
    retimed,
    tail_memory_bound,
)
from rpcompile.runtime.reference import reference_step
from rpcompile.sim.engine import paused_gc, with_staging

__all__ = [
    "Compiled",
]


class _FitPlanner:
    """A :meth:`Compiled.fit` stream's planner (``rpcompile.runtime.stream.Planner``): a batch
    outgrows the plan when :meth:`Compiled.plan_for` would plan for it."""

    def __init__(self, compiled: Compiled) -> None:
        self._compiled = compiled

    def outgrows(self, bound: dict[str, Any]) -> bool:
        return self._compiled._shape_wanted(_batch_shape(bound)) is not None

    def replan(self, batch: Any) -> None:
        self._compiled.plan_for(batch)

    def trainer(self) -> Any:
        return self._compiled.trainer()


@dataclass
class Compiled(CompiledState):
    """A compiled model: every artifact of the flow, open for inspection."""

    model: nn.Module
    capture: Captured
    unit_costs: list[UnitCost]
    profiles: list[UnitProfile]
    plan: Plan
    stages: list[StageProgram]
    hardware: Hardware
    workers: int
    microbatches: int
    rounds: int
    history: list[PassRecord]
    compute_dtype: torch.dtype
    # The lowered Schedule (ir.Schedule) the runtime runs: one dealing period of steps (step k
    # of a run is schedule step k mod steps), its update order set by the training options
    # (update_order); the Trainer, the CLI and the benchmarks read this one.
    schedule: Any = None
    # Per worker, the proven device-memory peak of the schedule the runtime runs (every step
    # of one dealing period, each from empty workers): rpcompile.passes.memory.WorkerPeak.
    memory: tuple[Any, ...] = ()
    options: Options = field(default_factory=Options)  # the compile's option groups
    # The host bytes the run keeps (rpcompile.passes.memory.HostMemory: masters, optimizer
    # state, gradients, shadows, the module's own copy, the undo journal unless
    # ``undo_journal=False``, and the transfer staging: ``schedule``'s staging slots),
    # and the RAM compile() checked it against with where that figure came from.
    host: HostMemory | None = None
    host_ram: tuple[int, str] = (0, "")
    # The per-microbatch shapes (sequences, tokens) this object was planned for, in order:
    # one entry per plan made (at compile time with example_inputs, else at the first batch,
    # then once per larger batch; PlanOptions.dynamic).
    plans_made: list[tuple[int, int]] = field(default_factory=list)
    _trainer: Any = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)
    # The capture as compile() made it, before any planning pass rewrote a copy of it: every
    # plan (each loss-chunk variant, each shape) plans a fork of it.
    _source: Any = field(default=None, repr=False)
    # Ids of the generated fx sources this compile made (released at close()).
    _fx_sources: tuple[int, int] | None = field(default=None, repr=False)

    # -- planning at the data's shape -----------------------------------------------------
    @property
    def planned(self) -> bool:
        """Whether a plan exists: at compile time with ``example_inputs``, else from the first
        batch (``step``, ``evaluate``, ``plan_for``) or a loaded checkpoint on."""
        return self.plan is not None

    def plan_for(self, batch: Any, *, agree: bool = False) -> bool:
        """Make sure the plan holds ``batch``: plan for its shape when there is no plan yet,
        or (``PlanOptions.dynamic``) plan anew when it is larger than the proven shape, for
        the larger of the two in each dimension, so every batch that fitted still fits. The
        trained state carries over to the new plan's trainer, and its optimizer object with
        it. Returns whether a plan was made. A larger batch under ``dynamic=False`` is left
        to the step, which refuses it. ``agree`` (what :meth:`step` does): data parallel,
        the ranks agree on the largest shape first, a collective, so that every rank keeps
        the same plan."""
        from rpcompile.capture.batch import normalize_batch

        normal = normalize_batch(self.model, batch, self.capture.loss_fn,
                                 causal=self.capture.loss_reduction == "sum")
        shape = _batch_shape(normal)
        group = self.options.train.process_group
        if agree:
            shape = _agreed_shape(shape, group)
        elif self.plan is None and _data_parallel(group):
            raise StateError(
                "data parallel: the ranks agree on the plan's shape at a step (a collective), "
                "and this model has no plan yet: train a step first, or compile with "
                "example_inputs")
        want = self._shape_wanted(shape)
        if want is None:
            return False
        self._plan_shape(want, why="the first batch" if self.plan is None else
                         f"a batch larger than the plan's {_shape_text(_shape_of(self))}")
        return True

    def _shape_wanted(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The per-microbatch shape (sequences, tokens) to plan for so that the plan holds a
        batch of ``shape`` (sequences, tokens per sequence); None when the plan holds it
        already, or is fixed (``dynamic=False``)."""
        sequences, seq = shape
        parts = self.microbatches * self.rounds
        want = (largest_microbatch(sequences, parts), seq)
        if self.plan is not None:
            have = _shape_of(self)
            if (want[0] <= have[0] and want[1] <= have[1]) or not self.options.plan.dynamic:
                return None
            want = (max(want[0], have[0]), max(want[1], have[1]))
        return want

    def _plan_shape(self, shape: tuple[int, int], why: str) -> None:
        """Plan for microbatches of ``shape`` (sequences, tokens), adopt the plan, and move a
        running trainer's state over to a trainer of it: masters, optimizer state, step
        counters (``state_dict``), and the optimizer object itself
        (``Trainer.adopt_optimizer``), so an lr scheduler bound to it drives the new plan's
        updates. A failure after the running trainer stopped puts the previous plan back,
        with a trainer holding that state, and raises."""
        import time

        if self._trainer is not None and self._trainer.sharded:
            raise StateError(
                f"this batch needs a plan for microbatches of {_shape_text(shape)} ({why}), "
                "and shard_optimizer=True keeps each rank's masters and optimizer state as a "
                "shard of the running plan's layout, which a new plan does not move: plan for "
                "the largest batch before the first step (example_inputs, or "
                "plan_for(batch, agree=True) on every rank), or pad batches up to the plan's "
                "shape")
        t0 = time.perf_counter()
        parts = self.microbatches * self.rounds
        # Planned from compile()'s capture, with the running capture's dropout seed (a
        # loaded checkpoint sets it), so the mask stream goes on unchanged under the new plan.
        source = replace(self._source, dropout_seed=self.capture.dropout_seed)
        base = [r for r in self.history if r.name == "capture"][:1]
        new = _plan_captured(self.model, source, base, self.options,
                             (shape[0] * parts, shape[1]))
        state = optimizer = None
        if self._trainer is not None:
            state = self._trainer.state_dict()  # async: the pending gradients applied first
            optimizer, retired = self._trainer.optimizer, self._trainer
            if retired.loss_scaler is not None:  # the scale moves on with the run too
                state = dict(state, loss_scale=retired.loss_scaler.state_dict())
            self._trainer = None
            _OPEN.pop(id(self), None)
            # A caller still holding it would read, or save, a state the run has left.
            retired.retire(
                f"this trainer was retired when the compiled model planned for microbatches "
                f"of {_shape_text(shape)} ({why}); its state moved to compiled.trainer(): "
                "train, read and save through the compiled model (compiled.trainer(), "
                "compiled.save_checkpoint(), compiled.state_dict())")
        planned = ("capture", "unit_costs", "profiles", "plan", "stages", "hardware",
                   "history", "schedule", "memory", "host", "host_ram")
        before = {name: getattr(self, name) for name in planned}
        for name in planned:
            setattr(self, name, getattr(new, name))
        try:
            if state is not None:
                self._resume(state, optimizer)
        except BaseException:
            self._drop_trainer()
            for name, value in before.items():
                setattr(self, name, value)
            if state is not None:
                self._resume(state, optimizer)
            raise
        self.plans_made.append(shape)
        _notice(self.options.plan, f"rpcompile: planned for microbatches of "
                f"{_shape_text(shape)} ({why}) in {time.perf_counter() - t0:.1f} s; "
                f"predicted step {self.plan.predicted_step_ms:,.1f} ms")

    def _resume(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """A trainer of the current plan, driving ``optimizer``, with ``state`` (and the loss
        scaler's state, ``loss_scale``, when the run scales its loss) loaded."""
        trainer = self.trainer()
        trainer.adopt_optimizer(optimizer, state["param_names"])
        state = dict(state)
        state.pop("plan", None)  # the state is per parameter; the new plan is this one
        scale = state.pop("loss_scale", None)
        if scale is not None:  # first: loading the state restarts the steps' scales from it
            trainer.loss_scaler.load_state_dict(scale)
        trainer.load_state_dict(state)

    def _drop_trainer(self) -> None:
        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None
            _OPEN.pop(id(self), None)

    def _need_plan(self, what: str) -> None:
        if self.plan is None:
            raise StateError(
                f"{what} needs a plan, and this model has none yet: compile() without "
                "example_inputs plans at the first batch it trains on; call step(batch) or "
                "plan_for(batch) first, or compile with example_inputs")

    # -- training (the runtime starts on the first step) ----------------------------------
    def trainer(self) -> Any:
        """The :class:`rpcompile.runtime.trainer.Trainer` that runs this plan (created on first use
        with the options given to :func:`compile`)."""
        self._need_plan("the trainer")
        if self._closed:
            raise StateError(
                "this compiled model was closed: its workers are stopped. Its trained weights "
                "are still available (sync_to_model(), state_dict()); to train on, compile "
                "again and load_state_dict() the saved state"
            )
        if self._trainer is None:
            from rpcompile.runtime.trainer import Trainer

            self._trainer = Trainer(self, train=self.options.train)
            # Stop the worker threads before the interpreter tears down (a thread still
            # blocked at exit aborts the process); one exit handler for all (not one each).
            _OPEN[id(self)] = self
        return self._trainer

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step over ``batch`` on the workers; returns the mean loss. The first
        batch makes the plan when compile() had no ``example_inputs``; a larger one makes a
        new plan (:meth:`plan_for`)."""
        if not self._closed:
            self.plan_for(batch, agree=True)
        return self.trainer().step(batch)

    def fit(self, batches: Iterable[Any], steps: int | None = None, *,
            scheduler: Any = None) -> Iterator[Any]:
        """Train on ``batches`` as a stream of steps, step k+1 running while step k drains:
        an iterator of each committed step's ``StepResult`` (see ``Trainer.fit``). Without a
        plan yet, the plan is made for the first batch (taken from ``batches`` now).

        A batch larger than the plan's shape later in the stream (``dynamic=True``, the
        default) gets a new plan, as in :meth:`step`: the steps in flight drain and commit,
        the plan is made (one line says so), and the stream goes on under it with the same
        masters, optimizer (the same object, so ``scheduler`` keeps driving its learning
        rate), step counter, position in ``batches`` and dropout masks. A failed re-plan
        raises from ``next()`` and changes nothing: the previous plan stays, with the last
        committed state, and the next ``next()`` tries the batch again. ``dynamic=False``
        refuses the batch, naming both shapes. Data parallel: the stream keeps its plan and
        refuses a larger batch (the ranks agree on a shape only at a ``step``): plan for the
        largest batch first (``plan_for(batch, agree=True)`` on every rank)."""
        import itertools

        from rpcompile.runtime.stream import StepStream

        if self.plan is None and not self._closed:
            it = iter(batches)
            try:
                first = next(it)
            except StopIteration:
                first = None
            if first is not None:
                self.plan_for(first, agree=True)
                batches = itertools.chain([first], it)
        follow = (self.options.plan.dynamic and not self._closed
                  and not _data_parallel(self.options.train.process_group))
        return StepStream(self.trainer(), batches, steps, scheduler,
                          planner=_FitPlanner(self) if follow else None)


    def evaluate(self, batch: Any, *, masters: dict[str, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """The loss of ``batch`` under the current trained weights, forward only: no gradients,
        dropout off, the optimizer, its state and the masters untouched. ``masters``: the fp32
        masters to evaluate, by name (``None``: the trainer's); under ``shard_optimizer`` a
        rank holds only its shard, so pass ``trainer().gather_masters()`` (a collective).

        It runs the stage programs on the first worker's device (a GPU for CUDA workers), one
        stage at a time with that stage's weights uploaded for it (the low-precision copy the
        workers train with, from the masters once queued updates have run), then the tail's
        forward; values between stages stay on that device. It is sequential, not the
        pipelined schedule. For a causal LM the loss is Hugging Face's token mean over the
        whole batch (labels other than -100); the batch may not exceed the plan's shape."""
        from rpcompile.capture.batch import bind_batch
        from rpcompile.runtime.reference import forward_loss
        from rpcompile.runtime.trainer import check_plan_shape

        if self.plan is None:
            self.plan_for(batch)
        trainer = self.trainer()
        bound = bind_batch(self.capture, batch, step=trainer.steps_done)
        check_plan_shape(self, bound)
        if masters is None:
            masters = trainer.masters()  # waits for queued updates
        else:
            missing = [s.name for s in trainer.store.trainable_slots if s.name not in masters]
            if missing:
                raise InvalidInput(f"evaluate(masters=...) lacks {len(missing)} trainable "
                                 f"parameters ({missing[:3]}): pass them all "
                                 "(trainer().gather_masters())")
        dtype = self.compute_dtype

        def stage_params(prog):
            out = {}
            for name in prog.params:
                if name in masters:
                    out[name] = masters[name].to(dtype)
                else:  # frozen: the model's own tensor
                    out[name] = self.model.get_parameter(name).detach()
            return out

        sequences = next(iter(bound.values())).shape[0]
        parts = min(self.microbatches * self.rounds, sequences)  # a short last eval batch
        return forward_loss(self.stages, self.capture, stage_params, bound, parts,
                            trainer.workers[0].device)

    def memory_report(self) -> Any:
        """Host bytes per trainable parameter: masters, shadow, gradients, optimizer state."""
        self._need_plan("memory_report()")
        return self._finished_trainer().memory_report()

    def close(self) -> None:
        """Stop the workers and release what the capture left in torch's process-global
        caches (the fake-tensor dispatch cache of its ShapeEnv, the generated fx sources kept
        for tracebacks). The trained state stays readable (sync_to_model, state_dict); further
        steps raise."""
        if self._closed:
            return
        if self._trainer is not None:
            self._trainer.close()
        self._closed = True
        _OPEN.pop(id(self), None)
        graphs = [self.capture.graph_module] + [p.graph_module for p in self.stages]
        release_shape_env_caches(graphs)
        if self._fx_sources is not None:
            release_fx_sources(*self._fx_sources)
            self._fx_sources = None

    # -- inspection ----------------------------------------------------------------------
    def explain(self) -> str:
        """Per stage: units, parameters, FLOPs at the planned size, predicted ms, memory;
        above them which host memory (pinned or pageable) the transfers are timed for, and
        the host bytes (``Compiled.host``)."""
        if self.plan is None:
            return (f"{type(self.model).__name__}: captured ({len(self.capture.units)} units), "
                    f"not planned yet: the plan is made for the first batch it trains on")
        b, s = self.plan.microbatch_size, self.plan.seq_len
        rows = [("stage", "kind", "units", "params", "fwd GFLOP", "bwd GFLOP", "ms/mb",
                 "peak mem")]
        for prog, st in zip(self.stages, self.plan.stages):
            fwd = bwd = 0
            for u in st.units:
                f, g = self.unit_costs[u].flops_at(b, s)
                fwd += f
                if st.kind != "forward":
                    bwd += g
            params = sum(self.plan.units[u].params for u in st.units)
            units = prog.unit_names[0] if len(prog.unit_names) == 1 else (
                f"{prog.unit_names[0]}..{prog.unit_names[-1]}")
            rows.append((prog.name, st.kind, units, f"{params:,}", f"{fwd / 1e9:.3f}",
                         f"{bwd / 1e9:.3f}", f"{st.compute_ms:.3f}",
                         f"{st.peak_bytes / 2**20:.1f} MiB"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = (
            f"{type(self.model).__name__}: {len(self.plan.units)} units, "
            f"{self.plan.num_forward} forward + {len(self.plan.stages) - self.plan.num_forward} "
            f"backward stages on {self.workers} workers ({self.hardware.name}), "
            f"{self.microbatches} microbatches of {b}x{s}, "
            f"predicted step {self.plan.predicted_step_ms:.2f} ms"
        )
        # Which host memory the plan assumes (PlanOptions.host_memory), and its host bytes.
        head += f"\ntransfers: {self.hardware.describe_host_memory()}"
        if self.host is not None:
            head += f"\nhost memory: {self.host.describe()}"
        return head + "\n" + "\n".join(lines)

    def _front_history(self) -> list[PassRecord]:
        """The records of the passes a replan keeps: those up to and including ``cost``
        (capture, chunk-loss when it ran, token-hits for a causal LM, cost)."""
        names = [r.name for r in self.history]
        return list(self.history[:names.index("cost") + 1])

    def timings(self) -> str:
        return "\n".join(f"{r.name:<10} {r.elapsed_ms:9.1f} ms" for r in self.history)

    def replan(
        self, gpus: int, microbatches: int | None = None, hardware: Hardware | str | None = None,
        rounds: int | None = None,
    ) -> Compiled:
        """The same captured model planned for another worker count or machine, without
        capturing or costing it again, for the same global batch shape."""
        self._need_plan("replan()")
        plan = replace(self.options.plan, gpus=gpus, microbatches=microbatches,
                       hardware=hardware or self.hardware,
                       rounds=self.rounds if rounds is None else rounds)
        compiled = _plan_and_split(
            self.model, self.capture, self.unit_costs, self.compute_dtype,
            self._front_history(), replace(self.options, plan=plan),
            (self.plan.microbatch_size * self.microbatches * self.rounds, self.plan.seq_len),
        ).finished()
        check_memory(compiled)
        check_host_memory(compiled)
        compiled._source = self._source
        compiled.plans_made.append(_shape_of(compiled))
        return compiled

    # -- reference semantics -----------------------------------------------------------
    def reference_step(
        self, batch: Any, params: dict[str, torch.Tensor] | None = None,
        device: torch.device | str | None = None, step: int = 0,
    ):
        """Loss and gradients of one step run stage by stage on one device (no update);
        ``device`` runs the stage programs retargeted to another device; ``step`` is the
        optimizer step whose dropout masks to draw (the runtime's step ``k`` draws step ``k``'s)."""
        from rpcompile.capture.batch import bind_batch

        if self.plan is None:
            self.plan_for(batch)
        batch = bind_batch(self.capture, batch, step=step)
        params = params if params is not None else dict(self.model.named_parameters())
        return reference_step(
            self.stages, self.capture, params, batch, self.microbatches, self.rounds,
            device=device,
        )


def _plan_captured(model: nn.Module, source: Captured, history: list[PassRecord],
                   options: Options, shape: tuple[int, int], *,
                   stacklevel: int = 2) -> Compiled:
    """Plan ``source`` for global batches of ``shape`` (sequences, tokens per sequence):
    each loss-chunk variant (:func:`_loss_chunks`) costed, partitioned, split and lowered on
    its own fork of ``source`` (which stays as captured), the fastest that fits kept, its
    memory checked. ``history`` holds the records up to capture."""
    co = options.capture
    parts = options.plan.microbatches_per_round * options.plan.rounds
    dtype = _floating_dtype(model)
    capacity = options.plan.capacity_bytes
    base = list(history)
    tried: list[tuple[int | None, Any]] = []  # (loss chunk, Compiled or PartitionError)
    skipped: list[tuple[int, Plan]] = []  # (loss chunk, the variant's plan it would repeat)
    # The search proves its candidates over the runtime's schedule; the variant finished
    # keeps the schedule and proof of its plan from there (keep_runtime_schedules). The
    # collector waits meanwhile (paused_gc): planning allocates millions of small objects and
    # makes next to no cyclic garbage, and each collection would walk the whole captured
    # graph (a tenth of a large model's planning time).
    with keep_runtime_schedules(), paused_gc():
        for chunk in _loss_chunks(source, co.loss_chunk_tokens, parts, shape):
            if chunk is AGAIN:  # "auto": the whole-logits plan is refused or the logits are large
                if all(isinstance(c, _Searched) and _fits(c.finished(), capacity)
                       for _, c in tried) and not _large_logits(source, parts, shape):
                    break
                continue
            run = list(base)
            captured = source.fork()  # each variant rewrites its own copy of the graph
            if chunk is not None:
                from rpcompile.passes.chunked_loss import chunk_lm_loss

                def chunk_loss(captured: Captured = captured, chunk: int = chunk) -> Captured:
                    if chunk_lm_loss(captured.graph_module, chunk):
                        captured.loss_chunk_tokens = chunk
                    return captured

                run_pass(run, "chunk-loss", chunk_loss, check_captured)
                if captured.loss_chunk_tokens != chunk:
                    continue  # no head + loss the rewrite matches: the captured form only
            if captured.loss_reduction == "sum":  # a causal LM: its step counts its token hits
                from rpcompile.passes.chunked_loss import count_token_hits

                def token_hits(captured: Captured = captured) -> Captured:
                    count_token_hits(captured.graph_module)
                    return captured

                run_pass(run, "token-hits", token_hits, check_captured)
            unit_costs = run_pass(run, "cost", partial(annotate_costs, captured),
                                  partial(check_costs, captured=captured))
            # A smaller chunk only shrinks the tail's working set: after a variant whose search
            # no tail memory limited, it can only find the same plan, so it is not searched.
            unlimited = [c.finished() for _, c in tried if isinstance(c, _Searched)
                         and not tail_memory_bound(c.plan) and _fits(c.finished(), capacity)
                         and not _memory_limited(c.finished().plan)]
            try:
                tried.append((chunk, _plan_and_split(model, captured, unit_costs, dtype, run,
                                                     options, shape, same_unless=unlimited)))
            except PartitionError as exc:
                tried.append((chunk, exc))
            except _SameSearch as same:
                skipped.append((chunk, same.plan))
        compiled = _choose_loss_chunk(tried, capacity, skipped)
    check_memory(compiled)
    check_host_memory(compiled, stacklevel=stacklevel + 1)
    fallback = memory_first_note(compiled.plan)
    if fallback is not None:  # fits, but slow: say so where a script would not look
        warnings.warn(f"rpcompile.compile: the plan is the {fallback}; it fits, one unit per "
                      f"stage, but runs slower than a searched plan would: a shorter sequence, "
                      f"a smaller microbatch or more workers give the search room",
                      RuntimeWarning, stacklevel=stacklevel)
    return compiled


def _plan_and_split(model, captured, unit_costs, dtype, history, options: Options,
                    shape: tuple[int, int] | None = None, *,
                    same_unless: Sequence[Compiled] = ()) -> _Searched:
    """Partition ``captured`` for global batches of ``shape``; split and lower it when the
    result's ``finished()`` is asked for.
    ``same_unless``: planned variants that no memory limited; when this one's unit profiles
    differ from one's only by a smaller tail working set, its search would find that one's
    plan: :class:`_SameSearch` is raised instead."""
    po = options.plan
    microbatches, rounds, mode = po.microbatches_per_round, po.rounds, po.mode
    hw = planning_hardware(options)
    ranks = po.ranks or 1
    train = options.train
    order = update_order(mode, po.updates, deferred_reasons(
        max_grad_norm=train.max_grad_norm, loss_scale=train.loss_scale,
        skip_nonfinite=train.skip_nonfinite,
        data_parallel=ranks > 1 or _data_parallel(train.process_group)))
    sequences, seq = shape or _batch_shape(captured.example_batch)
    if sequences < microbatches * rounds:
        raise InvalidInput(
            f"the example batch has {sequences} sequences, too few to fill "
            f"{microbatches} microbatches x {rounds} rounds; pass at least "
            f"{microbatches * rounds} sequences or lower microbatches/rounds"
        )
    # An uneven split (torch.tensor_split) gives some microbatches one sequence more: the plan
    # and its memory figures are made for the largest.
    mb_size = largest_microbatch(sequences, microbatches * rounds)
    dtype_bytes = dtype.itemsize
    profiles = unit_profiles(captured, unit_costs, mb_size, seq, hw, dtype_bytes)
    for other in same_unless:
        if _only_tail_smaller(profiles, other.profiles):
            raise _SameSearch(other.plan)
    costing = StageCosting(weight_dtype_bytes=dtype_bytes, act_dtype_bytes=dtype_bytes)
    # The plan options of the run (the update order its training options need): the
    # partitioner lowers, replays and proves each candidate as the run will be.
    run = replace(po, updates=order)
    plan = run_pass(
        history, "partition",
        lambda: _searched_plan(profiles, hw, mb_size, seq, costing, run, options,
                               _head_text(captured.loss_chunk_tokens)),
        lambda p: check_plan(p, len(captured.units)),
    )

    return _Searched(profiles, plan, partial(
        _finish, model, captured, unit_costs, dtype, history, options, hw, run, profiles, plan))


def _finish(model, captured, unit_costs, dtype, history, options: Options, hw: Hardware,
            run: PlanOptions, profiles: list[UnitProfile], plan: Plan) -> Compiled:
    """Lower and prove the runtime schedule of ``plan`` (moving it to one gradient slot when
    the schedule needs it), and split ``captured`` into its stage programs."""
    gpus, microbatches, rounds, mode = (run.gpus, run.microbatches_per_round, run.rounds,
                                        run.mode)

    def schedule_of(plan: Plan) -> tuple[Schedule, list, tuple]:
        """The schedule the runtime runs for ``plan`` (its cycle of steps, the run's update
        order), its pass records, and its proven peaks."""
        trail: list = []
        # The one builder of the runtime's schedule (the Trainer's too); the dispatch's and
        # the lowering's passes go through the same run_pass (a PassManager), their records
        # into the same history; each lowered schedule is validated always. The search
        # proved its plan over this same schedule (keep_runtime_schedules, _plan_captured):
        # both are then taken from its proof, not made again.
        lowered = runtime_schedule(plan, run, trail=trail, validate=True)
        # Each download's host staging slot, lent as a replay lends it, and the waits that
        # keep a slot's holders apart, so the host figure holds for any timing; the proof
        # (passes.memory.staging_problem) checks it under RPCOMPILE_DEBUG=1.
        lowered = run_pass(trail, "staging", lambda: with_staging(lowered, plan, hw),
                           check_staging)
        return lowered, trail, runtime_peaks(plan, run)

    lowered, trail, memory = schedule_of(plan)
    fit = hw.usable_memory_bytes
    if options.plan.capacity_bytes is not None:
        fit = min(fit, int(options.plan.capacity_bytes))
    if plan.memory_waits != TIGHTEST_WAITS and max(p.peak_bytes for p in memory) > fit:
        # The partitioner's simulated run fits with two gradient slots per worker; the
        # runtime's own schedule, or capacity_bytes, needs one, which costs time: the plan's
        # peaks and its predicted step are those of the schedule that runs.
        plan = replace(plan, memory_waits=TIGHTEST_WAITS)
        lowered, trail, memory = schedule_of(plan)
        plan = replace(retimed(plan, hw, rounds, mode),
                       worker_peak_bytes=tuple(p.peak_bytes for p in memory),
                       notes=(*plan.notes, f"{_ONE_SLOT_NOTE} (the runtime's schedule "
                              "does not fit with two); predicted step replayed with it"))
    stages = run_pass(history, "split", lambda: split(captured, plan),
                      lambda progs: check_stages(progs, plan))
    # The schedule lowered and proven above is the one kept: compile lowers it once (twice
    # when the waits must be added), and the proof is of what runs.
    history.extend(trail)
    return Compiled(
        model=model, capture=captured, unit_costs=unit_costs, profiles=profiles, plan=plan,
        stages=stages, hardware=hw, workers=gpus, microbatches=microbatches, rounds=rounds,
        history=history, compute_dtype=dtype, schedule=lowered, memory=memory,
        options=options,
    )


# Compiled models with a running trainer, by id (a dataclass is not hashable).
_OPEN: weakref.WeakValueDictionary[int, Compiled] = weakref.WeakValueDictionary()


@atexit.register
def _close_open() -> None:
    for compiled in list(_OPEN.values()):
        try:
            compiled.close()
        except BaseException as exc:  # exit must not raise because a run failed
            import warnings

            warnings.warn(f"rpcompile: closing at exit: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=1)
