"""Recompute granularity: layer-by-layer recompute gives stage recompute's and eager Hugging
Face's loss and gradients, holds less while a backward job runs (measured in bytes), and the
planner chooses it only where the stage-recompute plan does not fit.

The equality tests run a hand-cut plan (rpcompile.planner.partition.build_plan) whose backward
stages hold several layers, since the partitioner cuts tiny models' backward stages to one
layer; the runtime (virtual workers) then runs the layer-by-layer stage programs."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.capture.batch import bind_batch, split_batch
from rpcompile.capture.dropout import record_masks
from rpcompile.compiler import runtime_schedule
from rpcompile.ir import UnitProfile
from rpcompile.options import PlanOptions, TrainOptions
from rpcompile.passes.cost import recompute_ms, recompute_working_bytes
from rpcompile.passes.memory import worker_peaks
from rpcompile.passes.split import split, unit_segments
from rpcompile.planner.partition import StageCosting, build_plan, partition
from rpcompile.runtime.reference import (
    loss_divisor,
    run_backward_microbatch,
    stage_arguments,
)
from tests.capture.test_dropout import _eager_dropout_uses, _full_masks, _tiny
from tests.passes.test_chunked_loss import _PeakBytes
from tests.tiny_models import eager_batch_grads, hf_model, sft_batch, token_batch


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def _cut(compiled, recompute: str, forward=(0, 3), backward=(0, 3)):
    """``compiled`` re-planned by hand: forward stages starting at ``forward``, the tail the
    last unit alone, backward stages starting at ``backward`` (several layers each), every
    backward stage recomputing by ``recompute``; its stage programs, schedule and proof."""
    c = compiled
    n = len(c.profiles)
    costing = StageCosting(weight_dtype_bytes=4, act_dtype_bytes=4, recompute=recompute)
    plan = build_plan(c.profiles, forward, backward, n - 1, c.hardware, c.workers,
                      c.microbatches, c.plan.microbatch_size, c.plan.seq_len, c.rounds, costing)
    c.plan = replace(plan, memory_waits=c.plan.memory_waits)
    c.stages = split(c.capture, c.plan)
    c.schedule = runtime_schedule(c.plan, PlanOptions(gpus=c.workers, microbatches=c.microbatches,
                                                      rounds=c.rounds, mode="sync"))
    c.memory = worker_peaks(c.schedule, c.plan)
    return c


def _step(model, batch, recompute: str, dropout: bool = False):
    """(loss, gradient per parameter read from an SGD(lr=1) step, recorded masks or None) of
    one step on 2 virtual workers."""
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=batch,
                                 optimizer=_sgd, device="virtual", train=TrainOptions(chaos=1))
    _cut(compiled, recompute)
    backward = [s for s in compiled.stages if s.kind == "backward"]
    # B2: two layers, B3: the prefix and two layers (values shared by every layer cross
    # from the prefix's segment to each layer's).
    assert [s.units for s in backward] == [(3, 4), (0, 1, 2)]
    assert [s.recompute for s in backward] == [recompute] * 2
    try:
        before = {n: t.clone() for n, t in compiled.trainer().masters().items()}
        with record_masks() as records:
            loss = compiled.step(batch)
        after = compiled.trainer().masters()
        grads = {n: before[n] - after[n] for n in before}
        masks = _full_masks(compiled, batch, records)[0] if dropout else None
    finally:
        compiled.close()
    return loss, grads, masks


def _close(got, want, what):
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize("case", ["qwen3-padded", "llama-tokens", "gpt2-dropout"])
def test_layer_recompute_equals_stage_recompute_and_eager(case):
    if case == "gpt2-dropout":  # nn.Dropout on embeddings, residuals and attention weights
        model = _tiny("gpt2")
        model.train()
        ids = token_batch(6, 12, seed=5)
        batch = {"input_ids": ids, "labels": ids.clone()}
    elif case == "qwen3-padded":  # left padding, -100 prompt labels
        model = hf_model("qwen3", layers=4)
        batch = sft_batch(6, 12, left=True, seed=4)
    else:
        model = hf_model("llama", layers=4)
        ids = token_batch(6, 16, seed=2)  # long enough that layer recompute holds less
        batch = {"input_ids": ids, "labels": ids.clone()}
    eager = copy.deepcopy(model)
    dropout = case == "gpt2-dropout"
    stage_loss, stage_grads, stage_masks = _step(copy.deepcopy(model), batch, "stage", dropout)
    layer_loss, layer_grads, layer_masks = _step(copy.deepcopy(model), batch, "layer", dropout)
    torch.testing.assert_close(layer_loss, stage_loss, rtol=1e-6, atol=1e-6)
    _close(layer_grads, stage_grads, "layer vs stage recompute")
    if dropout:  # the same masks, every draw of one (node, microbatch) identical
        assert all(torch.equal(a, b) for a, b in zip(layer_masks, stage_masks))
        with _eager_dropout_uses(layer_masks):
            eager_loss, eager_grads = eager_batch_grads(eager, batch)
    else:
        eager_loss, eager_grads = eager_batch_grads(eager, batch)
    torch.testing.assert_close(layer_loss, eager_loss, rtol=1e-6, atol=1e-6)
    _close(layer_grads, eager_grads, "layer recompute vs eager")


def _backward_job_peak(recompute: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Measured peak bytes of live tensors while the backward stage of a one-worker plan (all
    four layers and the prefix in one backward stage) runs one microbatch, and its gradients."""
    model = hf_model("qwen3", layers=4)
    batch = token_batch(2, 256, seed=3)
    compiled = rpcompile.compile(model, gpus=1, microbatches=1, example_inputs=batch)
    _cut(compiled, recompute, forward=(0,), backward=(0,))
    captured = compiled.capture
    params = dict(model.named_parameters())
    mb = split_batch(bind_batch(captured, batch), 1)[0]
    values: dict[str, object] = {}
    value_grads: dict[str, torch.Tensor] = {}
    scale = loss_divisor(captured, 1)
    for prog in compiled.stages:
        if prog.kind == "forward":
            with torch.no_grad():
                outs = prog.graph_module(*stage_arguments(prog, captured, params, mb, values))
            values.update(zip(prog.outputs, outs))
        elif prog.kind == "tail":
            run_backward_microbatch(prog, captured, params, mb, values, value_grads, {}, scale)
    (stage,) = [p for p in compiled.stages if p.kind == "backward"]
    assert stage.recompute == recompute and len(stage.units) == 5
    job: dict[str, torch.Tensor] = {}
    with _PeakBytes() as meter:
        run_backward_microbatch(stage, captured, params, mb, values, value_grads, job, scale)
    return meter.peak, job


def test_layer_recompute_lowers_the_measured_peak_of_a_backward_job():
    stage_peak, stage_job = _backward_job_peak("stage")
    layer_peak, layer_job = _backward_job_peak("layer")
    _close(layer_job, stage_job, "the backward job's gradients")
    # Four layers' activations at once against one layer's and the boundaries: well below.
    assert layer_peak < 0.6 * stage_peak, (layer_peak, stage_peak)


def test_unit_segments_cover_the_stage_once_in_model_order():
    model = hf_model("qwen3", layers=4)
    compiled = rpcompile.compile(model, gpus=1, microbatches=1, example_inputs=token_batch(2))
    _cut(compiled, "layer", forward=(0,), backward=(0,))
    (stage,) = [p for p in compiled.stages if p.kind == "backward"]
    cut = unit_segments(stage)
    assert [s.unit for s in cut.segments] == list(stage.units)
    members = [n.name for s in cut.segments for n in s.graph_module.graph.nodes
               if n.op == "call_function"]
    stage_nodes = [n.name for n in stage.graph_module.graph.nodes
                   if n.op == "call_function" and "rp_unit" in n.meta]
    # Every node once (graph order interleaves units where a node reads only earlier units).
    assert sorted(members) == sorted(stage_nodes) and len(set(members)) == len(members)
    assert unit_segments(stage) is cut  # cut once per graph
    # A worker runs a retargeted copy of the stage's graph: it is cut again, same result.
    batch = token_batch(2)
    here, there = compiled.reference_step(batch), compiled.reference_step(batch, device="cpu")
    assert torch.equal(here[0], there[0])
    assert all(torch.equal(here[1][n], there[1][n]) for n in here[1])


def _units(out=512 << 20, work=4 << 30, params=50_000_000):
    units = [UnitProfile("prefix", 0.5, 0.5, 1_000_000, output_bytes=out, working_bytes=out)]
    units += [UnitProfile(f"layer{i}", 5.0, 10.0, params, output_bytes=out, working_bytes=work)
              for i in range(8)]
    return [*units, UnitProfile("tail", 2.0, 4.0, 1_000_000, output_bytes=out,
                                working_bytes=2 * out)]


def test_the_cost_model_by_layer_holds_one_layer_and_adds_a_forward():
    units = _units()
    r = (1, 2, 3)
    assert recompute_working_bytes(units, r, "stage") == 3 * (4 << 30)
    # Two boundaries kept, one boundary gradient, one layer's working set.
    assert recompute_working_bytes(units, r, "layer") == 3 * (512 << 20) + (4 << 30)
    assert recompute_ms(units, r, "layer") == recompute_ms(units, r, "stage") + 2 * 5.0
    assert recompute_working_bytes(units, (4,), "layer") == recompute_working_bytes(
        units, (4,), "stage")


@pytest.mark.parametrize("capacity_gib,expect", [(None, "stage"), (12, "layer")])
def test_the_planner_recomputes_by_layer_only_where_stage_recompute_does_not_fit(
        capacity_gib, expect):
    # Large activations per layer and costly hops between stages: at 12 GiB the stage plan
    # (two backward stages of three layers) does not fit; cut again by stage it needs a stage
    # per layer (a hop each), by layer it keeps three-layer stages and is faster.
    cap = None if capacity_gib is None else capacity_gib << 30
    plan = partition(_units(), "rtx4090x8", PlanOptions(gpus=2, microbatches=3, mode="sync",
                                                        capacity_bytes=cap), search=200, refine=0)
    backward = [s for s in plan.stages if s.kind == "backward"]
    if expect == "stage":
        assert all(s.recompute == "stage" for s in backward)
        assert not any(n.startswith("recompute:") for n in plan.notes)
        forced = partition(_units(), "rtx4090x8", PlanOptions(gpus=2, microbatches=3, mode="sync",
                                                              recompute="layer"), search=200,
                           refine=0)
        assert any(s.recompute == "layer" for s in forced.stages)
        assert forced.predicted_step_ms > plan.predicted_step_ms  # one more forward
    else:
        assert any(s.recompute == "layer" for s in backward)
        assert max(plan.worker_peak_bytes) <= cap
        (note,) = [n for n in plan.notes if n.startswith("recompute:")]
        assert "layer by layer" in note and "12.00 GiB" in note and "stage " in note


def test_the_option_reaches_the_plan_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="recompute must be one of"):
        rpcompile.PlanOptions(recompute="layers")
    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 plan=PlanOptions(recompute="stage"))
    assert compiled.options.plan.recompute == "stage"
    assert all(s.recompute == "stage" for s in compiled.stages)
