"""The runtime half of each action kind, one method ``_do_<KIND>(run, a)`` each.

**Numerics.** Forward stages run ``graph_module`` under ``no_grad`` like the reference; tail
and backward stages call :func:`rpcompile.runtime.reference.run_backward_microbatch` with the
job's parameter gradients pre-bound to views of one fp32 flat buffer on the worker (zero-filled
when the job starts), so each job's sum is the reference's sum bit for bit. The host adds each
job's buffer into the master gradients (``ACC``) in the schedule's (round, stage) order, which
is the reference's order too. ``ACC``, ``OPT`` and ``SHADOW`` are the optimizer driver's
``accumulate_grad``, ``update`` and ``refresh``; ``CHECK`` is the step's gradient check (its
loss, the non-finite jobs, the decision to skip, unscaling and clipping in place).

**Transfers** are copies made by the action itself on its stream (one per contiguous piece
for UP, one per tensor of a value for H2D/D2H; bulk ones, UP and D2H grad, in the action's
``chunks`` pieces, each completed before the next), in the stream's list order; uploads of
weights and of activations run on different stream threads, so a weight upload never delays
an activation on a virtual worker. This is the only transfer path, and the chunk size is set
once, by the lowering (``rpcompile.passes.lower.DEFAULT_CHUNK_BYTES``).

**Quantized weights** (a QLoRA base) travel packed with the job's UP; its first compute
rebuilds them in the compute dtype with the fused kernel and runs a copy of the stage's graph
that reads them (rpcompile.capture.quantized.without_dequantize); its last compute gives them
back (:class:`JobWeights`).

**Device memory** accounted on each worker: the weight slots (with a quantized stage's packed
bytes, and its rebuilt weights from the job's first compute to its last), the buffers
uploaded with them and each job's fp32 gradient buffer (``Worker.alloc``), plus every
activation or value gradient held between actions, once per storage
(rpcompile.runtime.values.Holds). What a D2H sends home is given back as the compute its
``sent`` or gradient-slot edge names starts (``Schedule.releases``; in the same step or,
steps overlapping, a later one), else once downloaded: what a worker holds follows the
schedule. Transients inside one compute (autograd's saved tensors) are not accounted; they
are freed when the compute returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from rpcompile.capture.quantized import dequantize_sites, without_dequantize
from rpcompile.errors import MissingKey, StateError
from rpcompile.ir import Action
from rpcompile.passes.chunked_loss import TOKEN_HITS
from rpcompile.passes.staging import staging_slot
from rpcompile.runtime import kernels as _kernels
from rpcompile.runtime.actions.copies import _chunked_copy, _same_device
from rpcompile.runtime.actions.grads import _accumulate, clip_grad_norm
from rpcompile.runtime.reference import (
    loss_divisor,
    run_backward_microbatch,
    stage_arguments,
    step_loss,
)
from rpcompile.runtime.step_state import StepState
from rpcompile.runtime.values import HOST_VALUES, Buffers, JobGrads, copy_to, tensors

__all__ = [
    "Actions",
    "JobWeights",
]


@dataclasses.dataclass
class JobWeights:
    """A job's weights on its worker, from its UP to its EVICT: each parameter's view into the
    uploaded buffer (a quantized one: its rebuilt weight, once the job's first compute has
    rebuilt it), the buffers and lifted constants the stage reads (a quantized weight's state:
    views into its uploaded packed record), what is still to rebuild (name, PackedWeight on
    the device, dtype), every allocation EVICT gives back, and the rebuilt weights' buffers,
    given back when the job's last compute ends."""

    views: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor]
    allocated: list[torch.Tensor]
    packed: list[tuple[str, Any, torch.dtype]] = dataclasses.field(default_factory=list)
    rebuilt: list[torch.Tensor] = dataclasses.field(default_factory=list)
    rebuilt_names: list[str] = dataclasses.field(default_factory=list)


class Actions:
    """The action implementations the executor runs (see the module doc). The attributes it
    reads are the executor's (rpcompile.runtime.executor.Executor.__init__)."""

    # -- weights -----------------------------------------------------------------------------
    def _do_UP(self, run: StepState, a: Action) -> None:
        worker = self.workers[a.worker]
        stage = self.store.stages[a.stage]
        prog = self.programs[a.stage]
        name = prog.name
        flat = worker.alloc(shape=(stage.layout.shadow_numel,), dtype=self.store.compute_dtype,
                            tag=f"{name} weights")
        allocated = [flat]
        # One copy per contiguous host piece (one for a stage of contiguous units), cut into
        # the action's chunks by bytes; async, of the shadow copy this step reads. Frozen
        # quantized weights travel packed: the stage's records end to end, their state with
        # their codes (PackedLayout), so the bytes moved are the bytes the plan counts.
        version = run.k % 2 if self.paired else 0
        flat_bytes = flat.view(torch.uint8)
        size = flat.element_size()
        pieces = [(flat_bytes[offset * size:(offset + host.numel()) * size], host.view(torch.uint8))
                  for offset, host in self.store.upload_pieces(a.stage, version)]
        packed = None
        if stage.packed_layout.nbytes:
            packed = worker.alloc(stage.packed_layout.nbytes, tag=f"{name} packed weights")
            allocated.append(packed)
            at = 0
            for host in stage.packed:
                pieces.append((packed[at:at + host.numel()], host))
                at += host.numel()
        _chunked_copy(worker, pieces, a.chunks)
        sites = dequantize_sites(prog.graph_module)
        state = {const for site in sites for _, const in site.state}
        extras = {}
        for key, value in self._extras[a.stage].items():
            if key in state:
                continue  # uploaded in its weight's packed record
            extras[key] = worker.alloc(shape=value.shape, dtype=value.dtype,
                                       tag=f"{name} buffer {key}")
            allocated.append(extras[key])
            worker.copy_(extras[key], value)
        worker.complete_copies()
        job = JobWeights(stage.device_views(flat), extras, allocated)
        if packed is not None:
            weights = stage.packed_views(packed)
            source = {i.name: i.source for i in prog.inputs if i.kind == "param"}
            for site in sites:
                weight = weights[source[site.packed]]
                parts = dict(weight.state)
                extras.update((const, parts[part]) for part, const in site.state)
                job.packed.append((source[site.packed], weight, site.dtype))
        run.weights[(a.worker, a.stage, a.round)] = job

    def _do_EVICT(self, run: StepState, a: Action) -> None:
        worker = self.workers[a.worker]
        job = run.weights.pop((a.worker, a.stage, a.round))
        for t in job.allocated + job.rebuilt:
            worker.free(t)

    # -- activations -------------------------------------------------------------------------
    def _names_for(self, f: Any) -> set[str] | None:
        """The tensor names the consumer of flow ``f`` reads from its value (None: all)."""
        if f.what == "igrad":
            return None
        if self.programs[f.dst_stage].kind == "forward":
            return self.bundles[(f.src_stage, f.value)]
        return set(self.programs[f.dst_stage].value_inputs)

    def _do_H2D(self, run: StepState, a: Action) -> None:
        worker = self.workers[a.worker]
        key = (a.worker, a.stage, a.microbatch, a.round)

        def upload(t: torch.Tensor) -> torch.Tensor:
            dev = torch.empty(t.shape, dtype=t.dtype, device=worker.device)
            worker.copy_(dev, t)
            return dev

        copies: dict[str, Any] = {}
        if a.value in HOST_VALUES:
            # The batch lives on the host: bring in every batch input the consumer reads.
            mb = run.parts[a.round * self.compiled.microbatches + a.microbatch]
            for inp in self.programs[a.stage].inputs:
                if inp.kind == "batch":
                    copies["batch:" + inp.source] = upload(mb[inp.source])
        else:
            hkey = (a.value, a.microbatch, a.round)
            staged = run.host_values[hkey]
            need = self._names_for(self._flow_of[(a.stage, a.value, a.what)])
            prefix = "grad:" if a.what == "igrad" else ""
            for name, value in staged.items():
                if need is None or name in need:
                    copies[prefix + name] = copy_to(value, upload)
        worker.complete_copies()
        if a.value not in HOST_VALUES:
            # Its last reader's copies are done: the staging buffer goes back to the pool.
            with run.lock:
                run.host_readers[hkey] -= 1
                done = run.host_readers[hkey] == 0
                if done:
                    del run.host_values[hkey]
                    buf = run.host_bufs.pop(hkey)
            if done:
                self.staging.give(buf)
        run.flight.holds[a.worker].hold(worker, ("in", run.k, key, a.value), tensors(copies),
                                        f"{self.programs[a.stage].name} input {a.value}")
        with run.lock:
            run.delivered.setdefault(key, {}).update(copies)

    def _do_D2H(self, run: StepState, a: Action) -> None:
        worker = self.workers[a.worker]
        if a.what == "grad":
            job = run.grads.pop((a.worker, a.stage, a.round))
            buf, (host,) = self.staging.carve([job.flat], run.flight.taken,
                                              self._staging_slot(run, a))
            _chunked_copy(worker, [(host, job.flat)], a.chunks)
            flag = worker.host_empty(job.flag.shape, job.flag.dtype)
            worker.copy_(flag, job.flag)
            worker.complete_copies()
            self._give_back(run, a, job.flat)
            with run.lock:
                run.host_grads[(a.stage, a.round)] = host
                run.host_bufs[(a.stage, a.round)] = buf
                run.nonfinite[(a.stage, a.round)] = flag
            return
        key = (a.worker, a.value, a.microbatch, a.round)
        # The value's tensors go home together, into one exact-size staging buffer.
        device = run.device_values[key]
        moved: list[torch.Tensor] = []
        for v in device.values():
            copy_to(v, lambda t: moved.append(t) or t)
        buf, views = self.staging.carve(moved, run.flight.taken, self._staging_slot(run, a))
        slots = iter(views)

        def download(t: torch.Tensor) -> torch.Tensor:
            host = next(slots)
            worker.copy_(host, t)
            return host

        staged = {name: copy_to(v, download) for name, v in device.items()}
        worker.complete_copies()
        hkey = (a.value, a.microbatch, a.round)
        with run.lock:
            run.host_values[hkey] = staged
            run.host_bufs[hkey] = buf
        self._give_back(run, a, key)

    def _staging_slot(self, run: StepState, a: Action) -> int | None:
        """The host staging slot download ``a`` of run step ``run.k`` takes: the slot of the
        same download in the schedule step rpcompile.passes.staging.slot_step names, or its
        cycle phase's (rpcompile.passes.staging.staging_slot; None for a download of no
        bytes, which takes none)."""
        return staging_slot(self.schedule, self._slot_of, a, run.k)

    def _give_back(self, run: StepState, a: Action, what: torch.Tensor | tuple) -> None:
        """After D2H ``a``: give back the device memory it sent home (a gradient buffer, or
        the value ``key`` as one of its readers) now, or, where the schedule names a compute
        for it (``Schedule.releases``, in this step or a later one), as that compute starts
        (:meth:`_take_back`), so that a worker's memory follows the schedule, not the
        download's speed."""
        at = run.plan.releases.get(a)
        if at is not None:
            ahead, compute = at
            if ahead:  # as the schedule step that run step executes holds it
                compute = dataclasses.replace(compute,
                                              step=self.schedule.step_of(run.k + ahead))
            flight = run.flight
            with flight.lock:
                flight.given_back.setdefault((run.k + ahead, compute), []).append((run, what))
        else:
            self._release(run, a.worker, what)

    def _take_back(self, run: StepState, a: Action) -> None:
        """Before compute ``a`` starts: what :meth:`_give_back` held for it (its D2H is done:
        the schedule's edge to ``a`` waited for it), of whichever step sent it home."""
        flight = run.flight
        with flight.lock:
            held = flight.given_back.pop((run.k, a), ())
        for owner, what in held:
            self._release(owner, a.worker, what)

    def _release(self, owner: StepState, worker: int, what: torch.Tensor | tuple) -> None:
        """Give back a gradient buffer, or one reader's hold of step ``owner``'s value."""
        if isinstance(what, tuple):
            self._release_value(owner, what)
        else:
            self.workers[worker].free(what)

    def _release_value(self, run: StepState, key: tuple[int, str, int, int]) -> None:
        with run.lock:
            run.device_readers[key] -= 1
            last = run.device_readers[key] == 0
            if last:
                del run.device_values[key]
        if last:
            run.flight.holds[key[0]].release(("value", run.k, *key))

    # -- compute -----------------------------------------------------------------------------
    def _inputs(self, run: StepState, a: Action) -> tuple[dict[str, Any], dict[str, Any],
                                                     dict[str, Any]]:
        """(forward values, value gradients, batch inputs) of a compute, on its worker."""
        with run.lock:
            delivered = run.delivered.get((a.worker, a.stage, a.microbatch, a.round), {})
        values: dict[str, Any] = {}
        grads: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        for name, v in delivered.items():
            if name.startswith("batch:"):
                batch[name[6:]] = v
            elif name.startswith("grad:"):
                grads[name[5:]] = v
            else:
                values[name] = v
        for f, vkey in run.plan.local_inputs.get(a, ()):
            bundle = run.device_values[vkey]
            need = self._names_for(f)
            into = grads if f.what == "igrad" else values
            into.update(bundle if need is None else {n: v for n, v in bundle.items() if n in need})
        # Every batch input arrives by the schedule's own host upload (roundpipe_flows gives
        # each stage that reads one an ``ids`` or ``labels`` upload): a copy made here would
        # be a transfer the schedule, its timing and its memory proof do not have.
        missing = [i.source for i in self.programs[a.stage].inputs
                   if i.kind == "batch" and i.source not in batch]
        if missing and a.stage in self._host_upload:
            # The upload is in the schedule but has not landed: an ordering edge is missing,
            # as for any other value read before its writer put it there.
            raise MissingKey(f"{a}: batch inputs {missing} read before their host upload landed")
        if missing:
            raise StateError(
                f"{a}: the schedule brings no upload of the batch inputs {missing} that "
                f"{self.programs[a.stage].name} reads; its plan's stages do not say what they "
                "read (Stage.batch_inputs is None: a stage built by hand), so build the plan "
                "with rpcompile.planner.partition.build_plan from the captured units")
        return values, grads, batch

    def _finish_compute(self, run: StepState, a: Action, available: Mapping[str, Any],
                        grads: Mapping[str, Any]) -> None:
        """Keep what this compute sends on on the device, then drop what it read."""
        worker = self.workers[a.worker]
        prog = self.programs[a.stage]
        worker.complete_copies()
        for value in self._produces.get((a.kind, a.stage), ()):
            key = (a.worker, value, a.microbatch, a.round)
            if not run.device_readers.get(key):
                continue
            names = self.bundles[(a.stage, value)]
            if names is None:
                bundle = {n: g for n, g in grads.items() if n not in prog.outputs}
            else:
                bundle = {n: available[n] for n in names}
            run.flight.holds[a.worker].hold(worker, ("value", run.k, *key), tensors(bundle),
                                            f"{prog.name} value {value}")
            with run.lock:
                run.device_values[key] = bundle
        ckey = (a.worker, a.stage, a.microbatch, a.round)
        with run.lock:
            delivered = run.delivered.pop(ckey, {})
        del delivered
        run.flight.holds[a.worker].release_prefix(("in", run.k, ckey))
        for _, vkey in run.plan.local_inputs.get(a, ()):
            self._release_value(run, vkey)

    def _job(self, run: StepState, a: Action) -> tuple[dict[str, torch.Tensor], Buffers]:
        job = run.weights[(a.worker, a.stage, a.round)]
        if job.packed:
            self._dequantize(job, a)
        return job.views, Buffers(job.extras)

    def _dequantize(self, job: JobWeights, a: Action) -> None:
        """The job's first compute rebuilds its stage's packed weights in the dtype its graph
        computes them in, with the fused kernel, into one buffer per dtype that lives until
        the job's last compute ends (:meth:`_drop_rebuilt`): the memory proof holds them in
        each compute's working set (rpcompile.planner.partition), and here they live from
        the job's first compute to its last, never beside another job's."""
        worker = self.workers[a.worker]
        name = self.programs[a.stage].name
        for dtype in dict.fromkeys(d for _, _, d in job.packed):
            weights = [(n, w) for n, w, d in job.packed if d == dtype]
            flat = worker.alloc(shape=(sum(w.numel for _, w in weights),), dtype=dtype,
                                tag=f"{name} dequantized weights")
            job.rebuilt.append(flat)
            at = 0
            for source, weight in weights:
                job.views[source] = _kernels.dequantize_packed(
                    weight, dtype, out=flat[at:at + weight.numel], backend=self.kernels)
                job.rebuilt_names.append(source)
                at += weight.numel
        job.packed.clear()

    def _drop_rebuilt(self, run: StepState, a: Action) -> None:
        """After the job's last compute: give back its rebuilt weights (before its EVICT, so
        that the next job's prefetched upload never shares the worker with them)."""
        if a not in run.plan.job_last:
            return
        job = run.weights[(a.worker, a.stage, a.round)]
        for name in job.rebuilt_names:
            del job.views[name]  # no reference left: the memory is free once given back
        for t in job.rebuilt:
            self.workers[a.worker].free(t)
        job.rebuilt.clear()
        job.rebuilt_names.clear()

    def _graph(self, a: Action) -> fx.GraphModule:
        """The stage's graph for the action's worker device (the captured one when equal),
        reading the job's rebuilt weights where it rebuilds quantized ones
        (rpcompile.capture.quantized.without_dequantize)."""
        prog = self.programs[a.stage]
        device = torch.device(self.workers[a.worker].device)
        key = (a.stage, device)
        with self._graphs_lock:
            if key not in self._graphs:
                same = _same_device(device, self._capture_device)
                self._graphs[key] = without_dequantize(
                    prog.graph_module if same else prog.on_device(device))
            return self._graphs[key]

    def _do_F(self, run: StepState, a: Action) -> None:
        self._take_back(run, a)
        prog = self.programs[a.stage]
        params, extras = self._job(run, a)
        values, _, batch = self._inputs(run, a)
        with torch.no_grad():
            outs = self._graph(a)(*stage_arguments(prog, extras, params, batch, values))
        available = dict(values)
        available.update(zip(prog.outputs, outs))
        self._finish_compute(run, a, available, {})
        self._drop_rebuilt(run, a)

    def _do_T(self, run: StepState, a: Action) -> None:
        self._backward(run, a)

    def _do_B(self, run: StepState, a: Action) -> None:
        self._backward(run, a)

    def _backward(self, run: StepState, a: Action) -> None:
        self._take_back(run, a)
        worker = self.workers[a.worker]
        prog = self.programs[a.stage]
        params, extras = self._job(run, a)
        values, value_grads, batch = self._inputs(run, a)
        job = (a.worker, a.stage, a.round)
        stage = self.store.stages[a.stage]
        if a in run.plan.job_first and stage.layout.grad_numel:
            if job not in run.plan.grad_jobs:
                raise StateError(f"stage {prog.name} has trainable parameters but the "
                                   "schedule never downloads its gradients (no D2H grad)")
            flat = worker.alloc(shape=(stage.layout.grad_numel,), dtype=torch.float32,
                                tag=f"{prog.name} gradients")
            flat.zero_()
            views = stage.grad_views(flat)
            offsets = {n: v.storage_offset() - flat.storage_offset() for n, v in views.items()}
            run.grads[job] = JobGrads(flat, views, offsets,
                                      _kernels.nonfinite_flag(worker.device))
        grads = run.grads.get(job)

        def accumulate(pairs: list[tuple[str, torch.Tensor]]) -> None:
            # The job's fp32 sums live in the flat buffer: the reference's "first microbatch
            # starts from zero, later ones add" is 0 + g, then += g, bit for bit; the kernel
            # adds every parameter of the microbatch in one launch (acc += g.float()).
            stray = sorted(n for n, _ in pairs if grads is None or n not in grads.offsets)
            if stray:
                raise StateError(f"stage {prog.name}: gradients for {stray} have no place in "
                                   "the stage's gradient buffer (parameters the host store "
                                   "holds as frozen?)")
            _accumulate(grads, pairs, self.kernels)

        total = self.compiled.microbatches * self.compiled.rounds
        outputs: dict[str, torch.Tensor] = {}
        loss = run_backward_microbatch(prog, extras, params, batch, values, value_grads,
                                       {}, scale=loss_divisor(self.compiled.capture, total),
                                       accumulate=accumulate,
                                       graph_module=self._graph(a),
                                       loss_scale=self._loss_scale(run), outputs=outputs)
        if loss is not None:
            host = worker.host_empty(loss.shape, loss.dtype)
            worker.copy_(host, loss)
            run.losses[(a.round, a.microbatch)] = host
        hits = outputs.get(TOKEN_HITS)
        if hits is not None:  # brought home with the loss, a scalar
            host = worker.host_empty(hits.shape, hits.dtype)
            worker.copy_(host, hits)
            run.hits[(a.round, a.microbatch)] = host
        self._finish_compute(run, a, values, value_grads)
        self._drop_rebuilt(run, a)

    # -- host --------------------------------------------------------------------------------
    def _do_ACC(self, run: StepState, a: Action) -> None:
        self.driver.accumulate_grad(a.stage, run.host_grads.pop((a.stage, a.round)))
        with run.lock:
            buf = run.host_bufs.pop((a.stage, a.round))
        self.staging.give(buf)  # added into the masters' gradients: free for the next job

    def _do_REDUCE(self, run: StepState, a: Action) -> None:
        # Data parallel: the stage's gradients of the step are home (the edge from its last
        # ACC). Launch the cross-rank reduction of every parameter whose gradient stages are
        # now all home, and wait for it here, on the network lane: what reads the reduced
        # gradients waits for this action (its edge), while the backward jobs go on.
        self.reducer.stage_done(a.stage)
        self.reducer.wait_reductions(run.left())

    def _do_CHECK(self, run: StepState, a: Action) -> None:
        # The step's last ACC ran (host queue order) and, data parallel, every REDUCE
        # (``reduced`` edges): every gradient of the step is home.
        self._check_grads(run)

    def _do_OPT(self, run: StepState, a: Action) -> None:
        # Now, on this thread; undone if the step fails. (Async: the pending gradients of
        # the step before, checked at its end; none in a run's first step.)
        if not run.skipped and not self.driver.update(a.stage):
            run.idle_updates.append(a)

    def _do_SHADOW(self, run: StepState, a: Action) -> None:
        # Async: the copy of the shadow the next step reads (its OPTs applied the step
        # before's checked gradients: a skip of this step does not touch them).
        if self.paired:
            self.driver.refresh(a.stage, (run.k + 1) % 2)
        elif not run.skipped:
            self.driver.refresh(a.stage)

    # -- the gradient check ------------------------------------------------------------------
    def _check_grads(self, run: StepState) -> None:
        """Once per step, when every gradient is home and before any update reads one: find
        the non-finite jobs, the step's loss (data parallel: agreed with the other ranks once
        the gradient all-reduces are done), decide whether the step is skipped, unscale (loss
        scaling) and clip in place, as clip_grad_norm_ after a full backward; then the loss
        scaler learns of the step (its scale is what a later step's backward starts from,
        :meth:`_loss_scale`), undone if the step fails before it commits."""
        if run.checked:
            return
        run.checked = True
        run.bad = tuple(sorted((self.programs[s].name, r)
                               for (s, r), flag in run.nonfinite.items() if int(flag.item())))
        total = self.compiled.microbatches * self.compiled.rounds
        losses = [run.losses[(r, m)] for r in range(self.compiled.rounds)
                  for m in range(self.compiled.microbatches)]
        run.loss = step_loss(losses, loss_divisor(self.compiled.capture, total))
        # An integer sum: exact in any order (every microbatch's count, or none).
        run.correct = sum(int(h) for h in run.hits.values()) \
            if len(run.hits) == len(losses) else None
        run.found = bool(run.bad)
        if self.reducer is not None:
            run.loss, run.found, run.correct = self.reducer.finish(
                run.loss, run.found, run.left(), correct=run.correct)
        run.skipped = run.found and (self.skip_nonfinite or self.loss_scaler is not None)
        if not run.skipped:
            if self.loss_scaler is not None:
                self.loss_scaler.unscale_([self.store.grad], scale=self._loss_scale(run))
            if self.max_grad_norm is not None:
                # Data parallel clips by the norm over every rank's gradients (sharded: each
                # rank holds the reduced gradients of its own shard only).
                clip = clip_grad_norm if self.reducer is None else self.reducer.clip_grad_norm
                run.grad_norm = clip(self.store, self.compiled.model, self.max_grad_norm)
        if self.loss_scaler is not None:
            run.scaler_before = self.loss_scaler.state_dict()
            self.loss_scaler.update(run.found)
            self._scales[run.k] = float(self.loss_scaler.scale)

    def _loss_scale(self, run: StepState) -> float:
        """The scale step ``run.k``'s backward starts from: the loss scaler's after the check
        of step k-1 (sync: every job of step k waits for that step's update, so its check has
        run) or of step k-2 (async: step k starts while step k-1 drains; step k-2's check
        comes before step k-1's updates, which step k's uploads wait for). A step whose
        predecessor ran before the executor's memory of scales (the run's start, a loaded
        state) takes the scaler's scale as it was when the first such step asked."""
        if self.loss_scaler is None:
            return 1.0
        if run.loss_scale is None:
            j = run.k - (2 if self.paired else 1)
            if j in self._scales:
                run.loss_scale = self._scales[j]
            else:
                if self._floor_scale is None:
                    self._floor_scale = float(self.loss_scaler.scale)
                run.loss_scale = self._floor_scale
        return run.loss_scale
