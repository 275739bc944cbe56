"""The planner's device memory of a gradient job against what one microbatch of it holds.

A full fine-tuning model, so every parameter of a backward or tail job has a gradient: autograd
leaves them on their leaves, in the weights' dtype, until the microbatch's backward ends, while
the activations of the units the backward has passed are freed. The planned figure is the peak
over that progress, unit by unit in the order the backward runs
(``passes.cost.gradient_job_bytes``). The runtime's buffers (uploaded weights, the fp32
accumulator) are made before the measured block, as a worker makes them before its computes;
what the block creates is what a compute's working set must cover
(``passes.memory.working_bytes``), with the input gradients the job sends on (the stage's
``output_bytes``, held as its values).
"""

from __future__ import annotations

from dataclasses import replace

import torch

import rpcompile
from rpcompile.capture.batch import bind_batch, split_batch
from rpcompile.passes.memory import working_bytes
from rpcompile.passes.split import split
from rpcompile.planner.partition import StageCosting, build_plan
from rpcompile.runtime.kernels.transfer import accumulate_grads
from rpcompile.runtime.reference import loss_divisor, run_backward_microbatch, stage_arguments
from tests.passes.test_chunked_loss import _PeakBytes
from tests.tiny_models import hf_model, token_batch

DTYPE = torch.bfloat16  # as a run computes: the gradients come in the weights' dtype


def _jobs(compiled, model, batch):
    """Per stage of ``compiled``: (stage, measured peak bytes of one microbatch's compute,
    planned bytes, its gradients' bytes in the weights' dtype). A forward compute's figure is
    its working set, its outputs included; a gradient job's adds the input gradients it
    sends on."""
    captured = compiled.capture
    params = dict(model.named_parameters())
    mb = split_batch(bind_batch(captured, batch), 1)[0]
    values: dict[str, object] = {}
    value_grads: dict[str, torch.Tensor] = {}
    scale = loss_divisor(captured, 1)
    flat = torch.zeros(2 * sum(p.numel() for p in model.parameters()))
    elem = torch.empty((), dtype=DTYPE).element_size()

    def accumulate(pairs):  # as a worker adds them: one launch into its fp32 buffer
        accumulate_grads([g.contiguous() for _, g in pairs], flat)

    jobs = []
    for prog, stage in zip(compiled.stages, compiled.plan.stages, strict=True):
        assert prog.kind == stage.kind and prog.recompute == stage.recompute
        if prog.kind == "forward":
            with torch.no_grad(), _PeakBytes() as meter:
                outs = prog.graph_module(*stage_arguments(prog, captured, params, mb, values))
            values.update(zip(prog.outputs, outs))
            # Its outputs are made inside the compute and held until it ends.
            jobs.append((stage, meter.peak, working_bytes(stage), 0))
            continue
        with _PeakBytes() as meter:
            run_backward_microbatch(prog, captured, params, mb, values, value_grads, {}, scale,
                                    accumulate=accumulate)
        trainable = sum(params[i.source].numel() for i in prog.inputs
                        if i.kind == "param" and i.requires_grad)
        planned = working_bytes(stage) + stage.output_bytes
        jobs.append((stage, meter.peak, planned, trainable * elem))
    return jobs


def _jobs_of_cuts(tokens, gpus, forward_bounds, backward_bounds, costing):
    """(compiled, :func:`_jobs`) of a 4-layer Qwen3 in bf16 on one ``tokens``-long sequence,
    planned for ``gpus`` workers and then cut by hand at ``forward_bounds`` and
    ``backward_bounds`` (each stage's start unit), the tail starting at the last unit."""
    model = hf_model("qwen3", layers=4).to(DTYPE)
    batch = token_batch(1, tokens, seed=3)
    compiled = rpcompile.compile(model, gpus=gpus, microbatches=1, example_inputs=batch,
                                 device="virtual")
    n = len(compiled.profiles)
    plan = build_plan(compiled.profiles, forward_bounds, backward_bounds, n - 1,
                      compiled.hardware, gpus, 1, compiled.plan.microbatch_size,
                      compiled.plan.seq_len, 1, costing)
    compiled.plan = replace(plan, memory_waits=compiled.plan.memory_waits)
    compiled.stages = split(compiled.capture, compiled.plan)
    return compiled, _jobs(compiled, model, batch)


def _check(jobs, kinds):
    jobs = [j for j in jobs if j[0].kind in kinds]
    assert sorted(stage.kind for stage, *_ in jobs) == kinds
    for stage, measured, planned, _ in jobs:
        what = f"{stage.kind} stage {stage.units} by {stage.recompute}"
        # Never below: the proof's peaks rest on it.
        assert measured <= planned, f"{what}: {measured} bytes measured, {planned} planned"
        # Not far above either: the plan would give away memory it could use.
        assert measured >= 0.75 * planned, f"{what}: {measured} measured, {planned} planned"


def test_a_gradient_jobs_planned_memory_covers_its_measured_peak_and_is_close_to_it():
    # Hidden 64, one sequence of 16 tokens: the parameters' gradients outweigh the
    # activations, so a job figure without them falls short of the measured peak.
    model = hf_model("qwen3", layers=4).to(DTYPE)
    batch = token_batch(1, 16, seed=3)
    compiled = rpcompile.compile(model, gpus=2, microbatches=1, example_inputs=batch,
                                 device="virtual")
    jobs = _jobs(compiled, model, batch)
    assert [s.units for s, *_ in jobs if s.kind == "backward"] == [(0, 1, 2, 3)]
    # The gradients alone are most of each peak: a figure without them falls short, one
    # that adds them all to the whole working set (they grow as the activations are freed)
    # lies far above.
    assert all(grads > 0.5 * measured for s, measured, _, grads in jobs if s.kind != "forward")
    _check(jobs, ["backward", "tail"])


def test_a_layer_by_layer_backward_jobs_planned_memory_covers_its_measured_peak():
    # 128 tokens: each layer's activations outweigh its gradients, so the plan's one
    # backward stage (the prefix and every layer) recomputes by layer; its gradients still
    # grow while it runs, beside one layer's activations and the boundaries.
    compiled, jobs = _jobs_of_cuts(128, 1, (0,), (0,), StageCosting(recompute="layer"))
    n = len(compiled.profiles)
    assert [(s.units, s.recompute) for s, *_ in jobs if s.kind == "backward"] == [
        (tuple(range(n - 1)), "layer")]
    _check(jobs, ["backward", "tail"])


def test_a_forward_jobs_planned_memory_covers_the_values_it_saves_for_recompute():
    # One forward stage over every unit, backward stages of one or two layers: the forward
    # saves the recompute input of each backward stage inside it, and holds them (and the
    # rotary tables it makes) until it ends, beside the unit running.
    compiled, jobs = _jobs_of_cuts(16, 2, (0,), (0, 2, 3, 4), StageCosting())
    n = len(compiled.profiles)
    (forward,) = [s for s, *_ in jobs if s.kind == "forward"]
    assert forward.output_bytes > 3 * compiled.profiles[n - 2].output_bytes  # three saved
    _check(jobs, ["forward"])
