"""``rpcompile.compile``: run the whole flow and keep every artifact on the result.

capture -> cost -> partition -> split -> dispatch -> lower; every artifact stays on ``Compiled``.
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from rpcompile.capture.batch import largest_microbatch
from rpcompile.capture.core import Captured, is_causal_lm
from rpcompile.capture.core import capture as capture_graph
from rpcompile.capture.tracing import (
    fx_source_mark,
    release_fx_sources,
    release_shape_env_caches,
)
from rpcompile.errors import InvalidInput, InvalidType, RPCompileError, StateError
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, Schedule, UnitProfile
from rpcompile.options import (
    CaptureOptions,
    Options,
    PlanOptions,
    TrainOptions,
    deferred_reasons,
    grad_check_passes,
    update_order,
)
from rpcompile.passes.cost import UnitCost, annotate_costs
from rpcompile.passes.invariants import (
    check_captured,
    check_costs,
    check_plan,
    check_stages,
)
from rpcompile.passes.lower import TIGHTEST_WAITS, runtime_schedule
from rpcompile.passes.manager import PassRecord, run_pass
from rpcompile.passes.memory import (
    HostMemory,
    HostMemoryWarning,
    format_bytes,
    host_memory,
    host_ram_problem,
    worker_peaks,
)
from rpcompile.passes.split import StageProgram, split
from rpcompile.planner.partition import (
    PartitionError,
    StageCosting,
    memory_first_note,
    partition,
    retimed,
    tail_memory_bound,
)
from rpcompile.runtime.reference import reference_step
from rpcompile.runtime.trainer import planned_ranks

__all__ = ["Compiled", "MemoryPlanError", "check_host_memory", "check_memory", "compile",
           "runtime_schedule", "update_order"]


@dataclass
class Compiled:
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
    # ``undo_journal=False``, and the transfer staging of a simulated run of ``schedule``),
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
        trained state carries over to the new plan's trainer. Returns whether a plan was
        made. A larger batch under ``dynamic=False`` is left to the step, which refuses it.
        ``agree`` (what :meth:`step` does): data parallel, the ranks agree on the largest
        shape first, a collective, so that every rank keeps the same plan."""
        from rpcompile.capture.batch import largest_microbatch, normalize_batch

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
        sequences, seq = shape
        parts = self.microbatches * self.rounds
        want = (largest_microbatch(sequences, parts), seq)
        if self.plan is not None:
            have = _shape_of(self)
            if (want[0] <= have[0] and want[1] <= have[1]) or not self.options.plan.dynamic:
                return False
            want = (max(want[0], have[0]), max(want[1], have[1]))
        self._plan_shape(want, why="the first batch" if self.plan is None else
                         f"a batch larger than the plan's {_shape_text(_shape_of(self))}")
        return True

    def _plan_shape(self, shape: tuple[int, int], why: str) -> None:
        """Plan for microbatches of ``shape`` (sequences, tokens), adopt the plan, and move a
        running trainer's state over to a trainer of it."""
        import time

        t0 = time.perf_counter()
        parts = self.microbatches * self.rounds
        # Planned from compile()'s capture, with the running capture's dropout seed (a
        # loaded checkpoint sets it), so the mask stream goes on unchanged under the new plan.
        source = replace(self._source, dropout_seed=self.capture.dropout_seed)
        base = [r for r in self.history if r.name == "capture"][:1]
        new = _plan_captured(self.model, source, base, self.options,
                             (shape[0] * parts, shape[1]))
        state = None
        if self._trainer is not None:
            state = self._trainer.state_dict()
            state.pop("plan", None)  # the new plan's; the state is per parameter
            self._trainer.close()
            self._trainer = None
            _OPEN.pop(id(self), None)
        for name in ("capture", "unit_costs", "profiles", "plan", "stages", "hardware",
                     "history", "schedule", "memory", "host", "host_ram"):
            setattr(self, name, getattr(new, name))
        self.plans_made.append(shape)
        if state is not None:
            self.trainer().load_state_dict(state)
        _notice(self.options.plan, f"rpcompile: planned for microbatches of "
                f"{_shape_text(shape)} ({why}) in {time.perf_counter() - t0:.1f} s; "
                f"predicted step {self.plan.predicted_step_ms:,.1f} ms")

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
        plan yet, the plan is made for the first batch (taken from ``batches`` now); a batch
        larger than the plan's shape later in the stream is refused as ``step`` would refuse
        it under ``dynamic=False``: plan for the largest first (``plan_for``), or ``step``."""
        import itertools

        if self.plan is None and not self._closed:
            it = iter(batches)
            try:
                first = next(it)
            except StopIteration:
                first = None
            if first is not None:
                self.plan_for(first, agree=True)
                batches = itertools.chain([first], it)
        return self.trainer().fit(batches, steps, scheduler=scheduler)

    def _finished_trainer(self) -> Any:
        # After close() the masters and optimizer state are still there to read.
        return self._trainer if self._closed and self._trainer is not None else self.trainer()

    def state_dict(self) -> dict[str, Any]:
        """Masters, optimizer state, step counter and a plan summary."""
        self._need_plan("state_dict()")
        return self._finished_trainer().state_dict()

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True,
                        allow_nonfinite: bool = False) -> None:
        """Restore :meth:`state_dict` (validated first: a bad state changes nothing). Before
        any plan, the plan is made for the shape the state was trained at."""
        self._plan_saved_shape(state.get("plan"))
        self.trainer().load_state_dict(state, strict=strict, allow_nonfinite=allow_nonfinite)

    def _plan_saved_shape(self, summary: dict[str, Any] | None) -> None:
        if self.plan is not None or self._closed:
            return
        if not summary or "microbatch_size" not in summary:
            self._need_plan("loading a state without a plan summary")
        self._plan_shape((int(summary["microbatch_size"]), int(summary["seq_len"])),
                         "the shape the loaded state was trained at")

    def save_checkpoint(self, path: Any, *, extra: dict[str, Any] | None = None,
                        per_rank: bool = False) -> Any:
        """Write masters, optimizer state, step counter, RNG states, loss-scale state, the
        plan's identity and ``extra`` (a JSON-serializable dict) to the folder ``path``
        atomically, in safetensors + a JSON manifest (:mod:`rpcompile.runtime.checkpoint`).
        Returns the folder's path. ``per_rank=True`` (sharded data parallel): one file per
        rank plus a manifest (``Trainer.save_checkpoint``)."""
        self._need_plan("save_checkpoint()")
        return self._finished_trainer().save_checkpoint(path, extra=extra, per_rank=per_rank)

    def load_checkpoint(self, path: Any, *, strict: bool = True,
                        allow_nonfinite: bool = False) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint`, after checking all of it
        (a corrupt, truncated or mismatched one is refused naming the key, changing nothing);
        returns the ``extra`` dict it stored ({} when none). Before any plan, the plan is
        made for the shape the checkpoint was trained at."""
        if self.plan is None and not self._closed:
            from rpcompile.runtime.checkpoint import read_manifest

            manifest = read_manifest(path)
            self._plan_saved_shape(manifest.get("plan"))
        return self.trainer().load_checkpoint(path, strict=strict,
                                              allow_nonfinite=allow_nonfinite)

    def sync_to_model(self) -> None:
        """Write the trained masters back into the original module (then save_pretrained).
        Before any plan nothing was trained: the module holds its own weights already."""
        if self.plan is None:
            return
        self._finished_trainer().sync_to_model()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The host optimizer over the fp32 masters (``trainer().optimizer``). Attach an LR
        scheduler to it as to any optimizer and call ``scheduler.step()`` after each
        :meth:`step`: step ``k``'s update uses the learning rate set when step ``k`` began,
        in both modes (the hyperparameters are read when the step begins)."""
        return self.trainer().optimizer

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

    def save_pretrained(self, directory: str | Any, *, merge: bool = False) -> None:
        """Write the trained weights into ``self.model`` and save it with Hugging Face's
        ``save_pretrained`` (safetensors). A PEFT model saves its adapter folder (loadable with
        ``PeftModel.from_pretrained``); ``merge=True`` saves the base model with the adapters
        merged in instead, from a copy, so this compiled model keeps training. Under
        ``shard_optimizer`` a collective (call it on every rank): the masters are gathered
        from every rank, rank 0 alone writes, and a failure on any rank (its queued updates,
        its copy of the gathered masters into the module, rank 0's write) raises
        ``CheckpointFailed`` on every rank."""
        trainer = self._finished_trainer()
        if trainer.sharded:
            from rpcompile.runtime.distributed import RankFailed

            what = f"writing the model to {directory}"
            # The queued updates first, agreed: a rank whose update fails must not skip the
            # gather the others are in.
            trainer.settle_across_ranks(f"{what} (the queued updates)")
            error = None
            try:
                trainer.sync_to_model()  # the gather (a collective), then this rank's copy
                if trainer.dp.rank == 0:
                    self._write_pretrained(directory, merge)
            except RankFailed:  # the gather failed: announced, out of step
                raise
            except Exception as exc:  # every rank must reach the agreement
                error = exc
            except BaseException as exc:  # announced: the others stop at once
                trainer.dp.interrupted(exc, what)
                raise
            trainer.dp.settle(error, f"{what} (rank 0 writes)")
            return
        self.sync_to_model()
        self._write_pretrained(directory, merge)

    def _write_pretrained(self, directory: Any, merge: bool) -> None:
        import copy

        model = self.model
        if merge:
            if not hasattr(model, "merge_and_unload"):
                raise InvalidInput("merge=True merges LoRA adapters; this model is not a PEFT model")
            model = copy.deepcopy(model).merge_and_unload()
        if not hasattr(model, "save_pretrained"):
            raise InvalidInput(
                f"{type(model).__name__} has no save_pretrained (not a Hugging Face model); "
                "save compiled.model.state_dict() after sync_to_model() instead"
            )
        model.save_pretrained(str(directory))

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


# The everyday options compile() also takes as keywords, by the group that holds each. A
# shortcut's None means "not given" (each of these fields' own default is None or has a
# None-free value), so a shortcut and the same field set in its group are told apart.
SHORTCUTS: dict[str, str] = {
    "gpus": "plan", "microbatches": "plan", "rounds": "plan", "hardware": "plan",
    "mode": "plan", "search_effort": "plan", "optimizer": "train", "device": "train",
    "process_group": "train",
    "max_grad_norm": "train", "loss_fn": "capture",
}
_GROUPS: dict[str, type] = {"capture": CaptureOptions, "plan": PlanOptions,
                            "train": TrainOptions}


def compile(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    capture: CaptureOptions | None = None,
    plan: PlanOptions | None = None,
    train: TrainOptions | None = None,
    gpus: int | None = None,
    microbatches: int | None = None,
    rounds: int | None = None,
    hardware: Hardware | str | None = None,
    mode: str | None = None,
    search_effort: str | None = None,
    optimizer: Callable | None = None,
    device: str | None = None,
    process_group: Any = None,
    max_grad_norm: float | None = None,
    loss_fn: Callable | None = None,
    **elsewhere: Any,
) -> Compiled:
    """Capture ``model``, cost it, cut it into RoundPipe stages and build the stage programs.

    - ``example_inputs``: one global batch; the plan is made now, for its shape. A Hugging
      Face causal LM may omit it: it is planned at the first batch it meets.
    - ``capture``: :class:`~rpcompile.options.CaptureOptions` (how the model becomes a graph).
    - ``plan``: :class:`~rpcompile.options.PlanOptions` (what the plan is made for).
    - ``train``: :class:`~rpcompile.options.TrainOptions` (how the runtime runs it).
    - ``gpus``: workers to plan for (``PlanOptions.gpus``, default 8).
    - ``microbatches``: per round (``PlanOptions.microbatches``, default ``gpus + 1``).
    - ``rounds``: rounds per step, gradient accumulation (``PlanOptions.rounds``).
    - ``hardware``: a profile name or ``Hardware`` (``PlanOptions.hardware``).
    - ``mode``: ``"sync"`` or ``"async"`` (``PlanOptions.mode``).
    - ``search_effort``: ``"normal"``, ``"high"`` or ``"exhaustive"`` (``PlanOptions``).
    - ``optimizer``: ``params -> torch.optim.Optimizer`` (``TrainOptions.optimizer``).
    - ``device``: ``"auto"``, ``"cuda"`` or ``"virtual"`` (``TrainOptions.device``).
    - ``process_group``: a gloo group to train data parallel over (``TrainOptions``).
    - ``max_grad_norm``: clip by the global gradient norm (``TrainOptions.max_grad_norm``).
    - ``loss_fn``: ``loss_fn(outputs, *inputs) -> scalar`` (``CaptureOptions.loss_fn``).

    The keywords after the groups are shortcuts for the most used fields; every other option
    is set in its group. A shortcut and the same field set in its group are refused
    (:class:`~rpcompile.errors.InvalidInput` naming both). The result keeps the groups as
    ``Compiled.options``; docs/compiler.md says how the flow runs and when the plan is made.
    """
    options = _options(capture, plan, train, dict(
        gpus=gpus, microbatches=microbatches, rounds=rounds, hardware=hardware, mode=mode,
        search_effort=search_effort, optimizer=optimizer, device=device,
        process_group=process_group, max_grad_norm=max_grad_norm, loss_fn=loss_fn), elsewhere)
    # The schedule is lowered for the ranks that will run it: a process group's world size.
    options = replace(options, plan=replace(options.plan, ranks=planned_ranks(
        options.plan.ranks, options.train.process_group)))
    co, po = options.capture, options.plan
    if po.hardware is not None:  # a profile given: its refusals come before any capture
        planning_hardware(options)
    history: list[PassRecord] = []
    fx_start = fx_source_mark()  # the generated fx sources from here on are this compile's
    parts = po.microbatches_per_round * po.rounds
    # Without an example batch a causal LM is captured now, with symbolic batch and sequence
    # sizes, from a small synthesized batch (with a padding mask, so padded batches bind),
    # and planned at the first batch it trains on, for that batch's shape.
    lazy = example_inputs is None and co.loss_fn is None and is_causal_lm(model)
    if lazy:
        from rpcompile.capture.core import example_batch_for

        example_inputs = example_batch_for(model, batch=parts, seq=16, mask=True)
    _notice(po, f"rpcompile: capturing {type(model).__name__} as a graph ...")
    captured = run_pass(
        history, "capture",
        lambda: capture_graph(model, example_inputs, loss_fn=co.loss_fn, units=co.units,
                        opaque=co.opaque),
        check_captured,
    )
    _notice(po, f"rpcompile: captured {captured.report.node_count:,} nodes in "
                f"{len(captured.units)} units in {history[-1].elapsed_ms / 1e3:.1f} s")
    dtype = _floating_dtype(model)
    if co.compute_dtype is not None and co.compute_dtype != dtype:
        raise InvalidInput(
            f"compute_dtype={co.compute_dtype} differs from the model's parameters ({dtype}); "
            f"the graph is captured in the model's dtype, so convert the model first "
            f"(model.to({co.compute_dtype})): rpcompile keeps fp32 masters on the host either way"
        )
    if lazy:  # costed and planned at the first batch (Compiled.plan_for), for its shape
        compiled = Compiled(
            model=model, capture=captured, unit_costs=[], profiles=[], plan=None,
            stages=[], hardware=planning_hardware(options), workers=po.gpus,
            microbatches=po.microbatches_per_round, rounds=po.rounds, history=history,
            compute_dtype=dtype, options=options)
    else:
        compiled = _plan_captured(model, captured, history, options,
                                  _batch_shape(captured.example_batch), stacklevel=3)
        compiled.plans_made.append(_shape_of(compiled))
    compiled._source = captured
    compiled._fx_sources = (fx_start, fx_source_mark())
    return compiled


def _options(capture: CaptureOptions | None, plan: PlanOptions | None,
             train: TrainOptions | None, shortcuts: dict[str, Any],
             elsewhere: dict[str, Any]) -> Options:
    """compile()'s :class:`Options`: each group given (``None``: its defaults) with the
    shortcuts given set in it; a shortcut whose field the group sets too is refused."""
    for name in sorted(elsewhere):
        group = next((g for g, cls in _GROUPS.items()
                      if name in {f.name for f in fields(cls)}), None)
        if group is None:
            raise InvalidType(f"compile() got an unknown keyword {name!r}")
        cls = _GROUPS[group]
        raise InvalidType(f"compile() takes {name} in its group: "
                          f"{group}={cls.__name__}({name}=...)")
    groups = {"capture": capture, "plan": plan, "train": train}
    built: dict[str, Any] = {}
    for group, cls in _GROUPS.items():
        given = groups[group]
        if given is not None and not isinstance(given, cls):
            raise InvalidType(f"compile()'s {group} must be an rpcompile.{cls.__name__}, got "
                              f"{type(given).__name__}")
        mine = {k: v for k, v in shortcuts.items() if SHORTCUTS[k] == group and v is not None}
        if given is not None:
            default = cls()
            twice = sorted(k for k in mine if getattr(given, k) != getattr(default, k))
            if twice:
                raise InvalidInput(
                    f"{', '.join(f'{k}={mine[k]!r}' for k in twice)} given both as a keyword "
                    f"and in {group}={cls.__name__}("
                    f"{', '.join(f'{k}={getattr(given, k)!r}' for k in twice)}): pass each "
                    f"option once")
        base = given if given is not None else cls()
        built[group] = replace(base, **mine) if mine else base
    return Options(**built)


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


def _batch_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(sequences, tokens per sequence) of a normalized batch; a batch without ``input_ids``
    (a model with its own ``loss_fn``) has no token axis the plan follows: 1."""
    first = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    return first.shape[0], (first.shape[1] if "input_ids" in batch else 1)


def _shape_text(shape: tuple[int, int]) -> str:
    return f"{shape[0]} x {shape[1]} tokens"


def _data_parallel(process_group: Any) -> bool:
    from rpcompile.runtime.distributed import resolve_group

    return resolve_group(process_group) is not None


def _agreed_shape(shape: tuple[int, int], process_group: Any) -> tuple[int, int]:
    """``shape`` as every data-parallel rank will plan for it: the largest over the ranks in
    each dimension (a collective: every rank calls it at the same step, before the step's
    own collectives; bounded by the process group's timeout, as the step's first all-reduce
    is), so all ranks keep the same plan; ``shape`` itself on one process."""
    from rpcompile.runtime.distributed import resolve_group

    group = resolve_group(process_group)
    if group is None:
        return shape
    import torch.distributed as dist

    both = torch.tensor(shape, dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]), int(both[1])


def _notice(po: PlanOptions, message: str) -> None:
    """One line about what planning did, on standard error, unless progress is off."""
    from rpcompile.progress import notice

    notice(message, po.progress)


def _shape_of(compiled: Compiled) -> tuple[int, int]:
    """The per-microbatch shape a compiled plan was proven for."""
    return compiled.plan.microbatch_size, compiled.plan.seq_len


AUTO_CHUNK_TOKENS = (4096, 1024)  # the chunk sizes "auto" considers besides the whole logits
AUTO_CHUNK_ABOVE_BYTES = 1 << 30
AGAIN = object()  # in _loss_chunks: the chunked variants follow only when they may be needed


def _loss_chunks(captured: Captured, option: int | str | None, parts: int,
                 shape: tuple[int, int]) -> list:
    """The loss-chunk variants to plan, in order of preference: the option itself (checked
    by :class:`CaptureOptions`), or for ``"auto"`` the whole logits, then (when the
    microbatch's fp32 logits exceed 1 GiB or the whole-logits plan does not fit) those of
    :data:`AUTO_CHUNK_TOKENS` shorter than a microbatch."""
    if option is None or captured.loss_reduction != "sum":
        return [None]
    if option == "auto":  # a chunk as long as the microbatch saves nothing
        tokens = _microbatch_tokens(parts, shape)
        return [None, AGAIN, *(c for c in AUTO_CHUNK_TOKENS if c < tokens)]
    return [option]


def _microbatch_tokens(parts: int, shape: tuple[int, int]) -> int:
    sequences, seq = shape
    return largest_microbatch(sequences, parts) * seq


def _large_logits(captured: Captured, parts: int, shape: tuple[int, int]) -> bool:
    from rpcompile.passes.chunked_loss import logits_bytes

    return logits_bytes(captured, _microbatch_tokens(parts, shape)) > AUTO_CHUNK_ABOVE_BYTES


def _fits(compiled: Compiled, capacity_bytes: int | None) -> bool:
    limit = compiled.hardware.usable_memory_bytes
    if capacity_bytes is not None:
        limit = min(limit, int(capacity_bytes))
    return max(p.peak_bytes for p in compiled.memory) <= limit


def _choose_loss_chunk(tried: list, capacity_bytes: int | None,
                       skipped: Sequence[tuple[int, Plan]] = ()) -> Compiled:
    """The planned variant with the shortest predicted step among those whose schedule fits
    (ties: the earlier, so the whole logits before chunks and larger chunks before smaller);
    when none fits, the first planned (compile() then refuses it, naming the worker), else
    the first variant's PartitionError. ``skipped``: smaller chunks not searched, each with
    the plan of the variant whose search it would repeat.

    A variant is split and its runtime schedule lowered and proven only when it may win:
    best first by its searched figure, which finishing can only keep or slow (one gradient
    slot), so the variants never finished could not have won."""
    planned = [(chunk, c) for chunk, c in tried if isinstance(c, _Searched)]
    if not planned:
        raise tried[0][1]

    def figure(c: _Searched) -> float:
        return round((c.compiled.plan if c.compiled is not None else c.plan).predicted_step_ms, 6)

    while True:
        open_ = [(k, c) for k, c in planned
                 if c.compiled is None or _fits(c.compiled, capacity_bytes)]
        if not open_:  # none fits: the first, which compile() refuses naming the worker
            chunk, best = planned[0][0], planned[0][1].finished()
            break
        chunk, lead = min(open_, key=lambda t: figure(t[1]))
        if lead.compiled is not None:
            best = lead.compiled
            break
        lead.finished()
    if len(tried) + len(skipped) > 1:
        def label(k):
            return "whole logits" if k is None else f"{k:,}-token chunks"

        def said(c) -> str:
            if not isinstance(c, _Searched):
                return "no plan fits"
            if c.compiled is None:
                return f"{c.plan.predicted_step_ms:.1f} ms"
            return f"{c.compiled.plan.predicted_step_ms:.1f} ms" + (
                "" if _fits(c.compiled, capacity_bytes) else " (does not fit)")
        considered = ", ".join(f"{label(k)}: {said(c)}" for k, c in tried)
        considered += "".join(
            f", {label(k)}: not searched (only the tail's working set is smaller, and no "
            f"tail memory limited the {plan.predicted_step_ms:.1f} ms plan's search)"
            for k, plan in skipped)
        best.plan = replace(best.plan, notes=(
            *best.plan.notes, f"LM head + loss: {label(chunk)}, the fastest plan that fits "
            f"({considered})"))
    return best


class _Searched:
    """A loss-chunk variant searched (its unit profiles and plan), finished on demand:
    split into stage programs, its runtime schedule lowered and proven (``finished()``)."""

    def __init__(self, profiles: list[UnitProfile], plan: Plan,
                 finish: Callable[[], Compiled]) -> None:
        self.profiles, self.plan, self._finish = profiles, plan, finish
        self.compiled: Compiled | None = None

    def finished(self) -> Compiled:
        if self.compiled is None:
            self.compiled = self._finish()
        return self.compiled


class _SameSearch(Exception):
    """A loss-chunk variant whose search would only repeat ``plan``'s (_plan_and_split)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.plan = plan


def _memory_limited(plan: Plan) -> bool:
    """Whether memory may have limited ``plan`` in a way a smaller tail working set would
    lift: its search says so (:func:`~rpcompile.planner.partition.tail_memory_bound`), or the
    compile moved it to one gradient slot for the runtime's schedule."""
    return tail_memory_bound(plan) or any(n.startswith(_ONE_SLOT_NOTE) for n in plan.notes)


_ONE_SLOT_NOTE = "memory: one gradient slot per worker"


def _only_tail_smaller(profiles: Sequence[UnitProfile], other: Sequence[UnitProfile]) -> bool:
    """Whether ``profiles`` equal ``other`` in everything but the tail's (the last unit's)
    working set, which is no larger: the partitioner's inputs then differ only where memory
    is checked."""
    if len(profiles) != len(other) or tuple(profiles[:-1]) != tuple(other[:-1]):
        return False
    tail, theirs = profiles[-1], other[-1]
    return (tail.working_bytes <= theirs.working_bytes
            and replace(tail, working_bytes=theirs.working_bytes) == theirs)


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
        # into the same history; each lowered schedule is validated always.
        lowered = runtime_schedule(plan, run, trail=trail, validate=True)
        # runtime_peaks(plan, run), from the schedule lowered here rather than again
        return lowered, trail, worker_peaks(lowered, plan, steps=lowered.run_steps)

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


def _head_text(chunk: int | None) -> str:
    return "whole logits" if chunk is None else f"the LM head + loss in {chunk:,}-token chunks"


def _searched_plan(profiles: list[UnitProfile], hw: Hardware, mb_size: int, seq: int,
                   costing: StageCosting, run: PlanOptions, options: Options,
                   head: str = "") -> Plan:
    """The partition search's plan, from the plan cache when it holds this search
    (:mod:`rpcompile.planner.cache`). Data parallel, rank 0 alone searches (or reads the
    cache) and sends the plan to the others, so every rank runs the same plan."""
    from rpcompile.planner.cache import cache_folder, cached_plan, plan_key
    from rpcompile.runtime.distributed import resolve_group

    train = options.train
    checks = grad_check_passes(max_grad_norm=train.max_grad_norm, loss_scale=train.loss_scale)

    def search() -> Plan:
        import time

        _notice(run, f"rpcompile: searching stage cuts of {len(profiles)} units for "
                     f"{run.gpus} workers, microbatches of {mb_size} x {seq} tokens"
                     f"{', ' + head if head else ''} ...")
        t0 = time.perf_counter()
        try:
            plan = partition(profiles, hw, microbatch_size=mb_size, seq_len=seq,
                             costing=costing, options=run, grad_check_passes=checks)
        except PartitionError:
            _notice(run, f"rpcompile: searched in {time.perf_counter() - t0:.1f} s: "
                         f"no plan fits")
            raise
        _notice(run, f"rpcompile: searched in {time.perf_counter() - t0:.1f} s: "
                     f"predicted step {plan.predicted_step_ms:,.1f} ms")
        return plan

    def local() -> Plan:
        key, inputs = plan_key(profiles, hw, mb_size, seq, costing, run, run.capacity_bytes,
                               checks)
        plan, _ = cached_plan(search, key, inputs, profiles, cache_folder(run.plan_cache),
                              partial(_notice, run))
        return plan

    group = resolve_group(train.process_group)
    if group is None:
        return local()
    import torch.distributed as dist

    from rpcompile.planner.cache import plan_from_dict, plan_to_dict

    # Rank 0's search (or its failure, re-raised on every rank) reaches every rank.
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("plan", plan_to_dict(local()))
        except Exception as exc:
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    kind, payload = box[0]
    if kind == "error":
        raise payload
    return plan_from_dict(payload)


def planning_hardware(options: Options) -> Hardware:
    """The one place that decides the profile a compile plans on: the plan option's
    ``hardware`` (else :func:`_default_hardware`) with the plan's workers and link, and as
    this run uses the host: with or without the undo journal's copies, from pinned or
    pageable host memory (``PlanOptions.host_memory``: every transfer of every replay and
    bound of the search is timed at that bandwidth). Raises ``ValueError`` for pageable host
    memory on a profile without pageable figures (:meth:`Hardware.with_host_memory`)."""
    po = options.plan
    hw = get_hardware(po.hardware or _default_hardware()).with_gpus(po.gpus)
    hw = hw.with_undo_journal(po.undo_journal).with_host_memory(po.host_memory)
    if po.link is not None:
        hw = hw.with_link(po.link)
    return hw


class MemoryPlanError(RPCompileError, ValueError):
    """A plan's proven per-worker peak exceeds what a worker has (refused at compile time)."""


def check_memory(compiled: Compiled) -> None:
    """Refuse a plan whose proven peak (``compiled.memory``) exceeds a worker's capacity: the
    virtual workers' ``capacity_bytes``, the hardware profile's usable memory (memory less
    its reserve), and on CUDA each device's free memory now."""
    if not compiled.memory:
        return
    hw = compiled.hardware
    device = compiled.options.train.device
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    limits: list[tuple[int, str]] = [
        (hw.usable_memory_bytes, f"the {hw.name!r} profile's usable memory "
         f"({hw.memory_gib:g} GiB less a {hw.memory_reserve_gib:g} GiB reserve)")]
    capacity = compiled.options.plan.capacity_bytes
    if capacity is not None:
        limits.append((int(capacity), "capacity_bytes"))
    for peak in compiled.memory:
        here = list(limits)
        if cuda and peak.worker < torch.cuda.device_count():
            free, _total = torch.cuda.mem_get_info(peak.worker)
            here.append((free, f"the free memory of cuda:{peak.worker}"))
        limit, source = min(here)
        if peak.peak_bytes > limit:
            names = ", ".join(compiled.plan.stage_name(s) for s in peak.stages)
            raise MemoryPlanError(
                f"the plan does not fit worker {peak.worker}: its schedule needs "
                f"{format_bytes(peak.peak_bytes)} there at {peak.action} ({names}: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in peak.parts.items() if v)
                + f"), over the {format_bytes(limit)} of {source}. To fit: more microbatches "
                "(a smaller microbatch for the same batch), a shorter sequence, finer units "
                "(units=[...] at attention/MLP blocks), LoRA or frozen layers, a plan for "
                "more GPUs, or more capacity")


def check_host_memory(compiled: Compiled, stacklevel: int = 3) -> HostMemory:
    """Set ``compiled.host`` (the host bytes of its runtime schedule, with the transfer
    staging of a simulated run of it) and ``compiled.host_ram`` (``host_ram_bytes``, else
    the profile's ``host_ram_gib``, else this machine's RAM), and warn
    (:class:`~rpcompile.passes.memory.HostMemoryWarning`) when the first exceeds the second:
    a warning, because compile allocates nothing and a plan (``device="virtual"``, a
    profile of another server) may be for elsewhere; the Trainer, which allocates the host
    store, refuses (rpcompile.runtime.trainer)."""
    from rpcompile.hardware import host_ram

    host = _host_figure(compiled)
    ram = host_ram(compiled.options.train.host_ram_bytes, compiled.hardware)
    compiled.host, compiled.host_ram = host, ram
    problem = host_ram_problem(host, *ram)
    if problem is not None:
        warnings.warn(f"rpcompile.compile: {problem}; a Trainer would refuse to build its "
                      f"host store", HostMemoryWarning, stacklevel=stacklevel)
    return host


def _host_figure(compiled: Compiled) -> HostMemory:
    """The host bytes of ``compiled``'s runtime schedule: the static buffers of its plan and
    mode (rpcompile.passes.memory.host_memory; the journal as ``Hardware.undo_journal``
    says) plus the transfer staging of a simulated run of the schedule. Data parallel on a
    profile without an inter-server link cannot be replayed (its REDUCEs have no link to
    be timed on): the static buffers alone then, and ``sharded`` at one rank's share."""
    from rpcompile.sim import simulate

    sched, plan, hw = compiled.schedule, compiled.plan, compiled.hardware
    peak = None
    if sched is not None and (sched.ranks == 1 or hw.link is not None):
        peak = simulate(sched, plan, hw).peak_host_bytes
    host = host_memory(plan, compiled.options.plan.mode, peak, journal=hw.undo_journal,
                       pageable=hw.host_memory == "pageable")
    if sched is not None and sched.sharded:
        host = host.sharded(sched.ranks)
    return host


def unit_profiles(
    captured: Captured, unit_costs: Sequence[UnitCost], b: int, s: int, hardware: Hardware,
    dtype_bytes: int,
) -> list[UnitProfile]:
    """The partitioner's numbers: each unit's costs at ``b`` x ``s`` on ``hardware``, with the
    parameters it borrows from another unit (tied weights)."""
    borrowed = _borrowed_params(captured)
    return [
        replace(u.evaluate(b, s, hardware, dtype_bytes=dtype_bytes), borrowed=borrowed[i])
        for i, u in enumerate(unit_costs)
    ]


def _borrowed_params(captured: Captured) -> list[tuple[tuple[int, int, bool], ...]]:
    """Per unit, the parameters it reads that an earlier unit owns (the cost pass counts a
    parameter once, in the first unit that reads it): (owner, elements, trainable)."""
    out: list[list[tuple[int, int, bool]]] = [[] for _ in captured.units]
    for node in captured.graph_module.graph.find_nodes(op="placeholder"):
        name = captured.params.get(node.name)
        if name is None:
            continue
        readers = sorted({u.meta["rp_unit"] for u in node.users if "rp_unit" in u.meta})
        if len(readers) < 2:
            continue
        p = captured.parameter(name)
        for unit in readers[1:]:
            out[unit].append((readers[0], p.numel(), p.requires_grad))
    return [tuple(b) for b in out]


def _default_hardware() -> Hardware | str:
    """The machine at hand: a probe of its GPU when there is one, else the virtual profile."""
    if torch.cuda.is_available():
        from rpcompile.hardware import probe

        return probe("cuda")
    return "cpu"


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


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
