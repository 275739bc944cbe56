"""The planner's device memory of a gradient job against what one microbatch of it holds.

A full fine-tuning model, so every parameter of a backward or tail job has a gradient: autograd
leaves them all on their leaves until the microbatch's backward ends, in the weights' dtype,
beside the working set. The runtime's buffers (uploaded weights, the fp32 accumulator) are
made before the measured block, as a worker makes them before its computes; what the block
creates is what a compute's working set must cover (``passes.memory.working_bytes``), with
the input gradients the job sends on (the stage's ``output_bytes``, held as its values).
"""

from __future__ import annotations

import torch

import rpcompile
from rpcompile.capture.batch import bind_batch, split_batch
from rpcompile.passes.memory import working_bytes
from rpcompile.runtime.kernels.transfer import accumulate_grads
from rpcompile.runtime.reference import loss_divisor, run_backward_microbatch, stage_arguments
from tests.passes.test_chunked_loss import _PeakBytes
from tests.tiny_models import hf_model, token_batch


def test_a_gradient_jobs_planned_memory_covers_its_measured_peak():
    # Hidden 64, one sequence of 16 tokens: the parameters' gradients outweigh the
    # activations, so a job figure without them falls short of the measured peak. In bf16,
    # as a run computes: the gradients come in the weights' dtype, not in fp32.
    dtype = torch.bfloat16
    model = hf_model("qwen3", layers=4).to(dtype)
    batch = token_batch(1, 16, seed=3)
    compiled = rpcompile.compile(model, gpus=2, microbatches=1, example_inputs=batch,
                                 device="virtual")
    captured = compiled.capture
    params = dict(model.named_parameters())
    mb = split_batch(bind_batch(captured, batch), 1)[0]
    values: dict[str, object] = {}
    value_grads: dict[str, torch.Tensor] = {}
    scale = loss_divisor(captured, 1)
    flat = torch.zeros(2 * sum(p.numel() for p in model.parameters()))
    elem = torch.empty((), dtype=dtype).element_size()

    def accumulate(pairs):  # as a worker adds them: one launch into its fp32 buffer
        accumulate_grads([g.contiguous() for _, g in pairs], flat)

    checked = []
    for prog, stage in zip(compiled.stages, compiled.plan.stages, strict=True):
        assert prog.kind == stage.kind
        if prog.kind == "forward":
            with torch.no_grad():
                outs = prog.graph_module(*stage_arguments(prog, captured, params, mb, values))
            values.update(zip(prog.outputs, outs))
            continue
        with _PeakBytes() as meter:
            run_backward_microbatch(prog, captured, params, mb, values, value_grads, {}, scale,
                                    accumulate=accumulate)
        trainable = sum(params[i.source].numel() for i in prog.inputs
                        if i.kind == "param" and i.requires_grad)
        planned = working_bytes(stage) + stage.output_bytes
        # The gradients in the weights' dtype alone are most of the measured peak.
        assert trainable * elem > 0.5 * meter.peak, (stage.kind, trainable * elem, meter.peak)
        assert meter.peak <= planned, (
            f"{stage.kind} stage {stage.units}: {meter.peak} bytes measured, {planned} planned")
        checked.append(stage.kind)
    assert sorted(checked) == ["backward", "tail"]
