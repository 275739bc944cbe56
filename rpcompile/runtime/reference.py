"""Reference executor: runs a plan's stage programs on one device, one after another.

It is the semantic definition of a RoundPipe step: for each round, every forward stage over
all microbatches, then the fused tail (forward, loss, backward), then every backward stage
(recompute, backward). Gradients are accumulated exactly as the runtime does: per job (stage x
round) into a zeroed fp32 accumulator, microbatch by microbatch, then added into the host's
gradient once per job. The runtime's results are compared with this bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from rpcompile.capture.batch import split_batch
from rpcompile.capture.types import Captured
from rpcompile.passes.split import StageProgram, unit_segments

__all__ = [
    "forward_loss",
    "loss_divisor",
    "reference_step",
    "split_batch",
    "stage_arguments",
    "step_loss",
]


def stage_arguments(
    program: StageProgram,
    captured: Captured,
    params: Mapping[str, torch.Tensor],
    microbatch: Mapping[str, torch.Tensor],
    values: Mapping[str, object],
) -> list:
    """The positional arguments of ``program.graph_module`` for one microbatch."""
    args = []
    for inp in program.inputs:
        if inp.kind == "param":
            args.append(params[inp.source])
        elif inp.kind in ("buffer", "constant"):
            args.append(captured.value_of(inp.name))
        elif inp.kind == "batch":
            args.append(microbatch[inp.source])
        else:
            args.append(values[inp.name])
    return args


def reference_step(
    programs: Sequence[StageProgram],
    captured: Captured,
    params: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    microbatches: int,
    rounds: int = 1,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step's loss and fp32 gradient per parameter.

    ``params`` maps parameter names to tensors (not modified); ``batch`` is bound to the
    graph's inputs (:func:`rpcompile.capture.batch.bind_batch`). A causal LM's microbatch losses are
    already divided by the step's labelled tokens (``loss_reduction == "sum"``): they are
    summed, and so are their gradients. A ``loss_fn`` model's losses are means: each is divided
    by ``microbatches * rounds`` before backward, and the step's loss is their mean.
    ``device``: run there (params, batch, buffers copied over, each stage's graph retargeted
    with :meth:`StageProgram.on_device`), as a worker on that device would; the gradients stay
    on it, the loss is reduced on the host (:func:`step_loss`), as the runtime reduces it.
    """
    graphs = {p.index: p.graph_module for p in programs}
    if device is not None:
        device = torch.device(device)
        graphs = {p.index: p.on_device(device) for p in programs}
        captured = _Moved(captured, device)  # type: ignore[assignment]
        params = {n: t.to(device) for n, t in params.items()}
        batch = {k: v.to(device) for k, v in batch.items()}
    total = microbatches * rounds
    scale = loss_divisor(captured, total)
    parts = split_batch(batch, total)
    grads: dict[str, torch.Tensor] = {}
    losses = []
    forward = [p for p in programs if p.kind == "forward"]
    backward = [p for p in programs if p.kind != "forward"]  # tail first, then B2..
    for r in range(rounds):
        mbs = parts[r * microbatches : (r + 1) * microbatches]
        values: list[dict[str, object]] = [{} for _ in mbs]
        value_grads: list[dict[str, torch.Tensor]] = [{} for _ in mbs]
        for prog in forward:
            for m, mb in enumerate(mbs):
                with torch.no_grad():
                    outs = graphs[prog.index](
                        *stage_arguments(prog, captured, params, mb, values[m]))
                values[m].update(zip(prog.outputs, outs))
        for prog in backward:
            job: dict[str, torch.Tensor] = {}
            for m, mb in enumerate(mbs):
                loss = run_backward_microbatch(
                    prog, captured, params, mb, values[m], value_grads[m], job, scale=scale,
                    graph_module=graphs[prog.index],
                )
                if loss is not None:
                    losses.append(loss)
            for name, g in job.items():
                if name in grads:
                    grads[name] += g
                else:
                    grads[name] = g.clone()
    return step_loss(losses, scale), grads


def step_loss(losses: Sequence[torch.Tensor], divisor: int) -> torch.Tensor:
    """The step's loss from its microbatch losses, given in (round, microbatch) order: brought
    to the host, summed there, divided by ``divisor`` (:func:`loss_divisor`).

    The one reduction of the runtime, the reference and :func:`forward_loss`. A sum on a GPU
    may add in another order than the CPU does, so reducing where the losses happen to be would
    let two runs of the same losses differ in the last bit.
    """
    return torch.stack([loss.detach().cpu() for loss in losses]).sum() / divisor


def loss_divisor(captured: Captured, microbatches: int) -> int:
    """What each microbatch's loss is divided by before its backward: 1 when the losses
    already sum to the step's loss (a causal LM's token mean), else the microbatch count."""
    return 1 if captured.loss_reduction == "sum" else microbatches


def forward_loss(
    programs: Sequence[StageProgram],
    captured: Captured,
    stage_params: Callable[[StageProgram], Mapping[str, torch.Tensor]],
    batch: Mapping[str, torch.Tensor],
    parts: int,
    device: torch.device,
) -> torch.Tensor:
    """The loss of ``batch`` by the forward stages and the tail's forward, forward only (no
    gradients, dropout off), on ``device``: one stage at a time, each with only its own
    weights there (``stage_params(program)``, moved over and freed after it), like a worker's
    job; values between stages stay on ``device``. Returns the loss on the host."""
    from rpcompile.capture.dropout import dropout_disabled

    device = torch.device(device)
    moved = _Moved(captured, device)
    mbs = [{k: v.to(device) for k, v in mb.items()} for mb in split_batch(batch, parts)]
    values: list[dict[str, object]] = [{} for _ in mbs]
    losses = []
    order = [p for p in programs if p.kind == "forward"] + [
        p for p in programs if p.kind == "tail"]
    with torch.no_grad(), dropout_disabled():
        for prog in order:
            graph = prog.on_device(device) if device.type != "cpu" else prog.graph_module
            params = {n: t.to(device) for n, t in stage_params(prog).items()}
            for m, mb in enumerate(mbs):
                outs = graph(*stage_arguments(prog, moved, params, mb, values[m]))
                if prog.kind == "tail":
                    losses.append(outs[0].float())
                else:
                    values[m].update(zip(prog.outputs, outs))
            del params
    return step_loss(losses, loss_divisor(captured, parts))


class _Moved:
    """The captured model's buffers and constants, read through ``value_of`` as copies on
    ``device`` (made once each)."""

    def __init__(self, captured: Captured, device: torch.device) -> None:
        self.captured = captured
        self.device = device
        self.loss_reduction = captured.loss_reduction
        self.copies: dict[str, object] = {}

    def value_of(self, name: str) -> object:
        if name not in self.copies:
            value = self.captured.value_of(name)
            self.copies[name] = value.to(self.device) if isinstance(value, torch.Tensor) else value
        return self.copies[name]


def run_backward_microbatch(
    prog: StageProgram,
    captured: Captured,
    params: Mapping[str, torch.Tensor],
    microbatch: Mapping[str, torch.Tensor],
    values: Mapping[str, object],
    value_grads: dict[str, torch.Tensor],
    job_grads: dict[str, torch.Tensor],
    scale: int,
    *,
    accumulate: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    graph_module: torch.fx.GraphModule | None = None,
    loss_scale: float = 1.0,
    outputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Recompute (or, for the tail, compute) one microbatch's forward, then its backward.

    Parameter gradients are added into ``job_grads`` (fp32), gradients of value inputs into
    ``value_grads``; returns the unscaled loss for the tail, else None.

    ``accumulate``: instead of adding into ``job_grads``, hand this microbatch's parameter
    gradients, as ``(name, grad)`` pairs in the order above, to the caller (the runtime adds
    them into its flat fp32 buffer in one kernel launch: ``acc += grad.float()``, the same
    sum). ``graph_module``: the stage's graph to run instead of ``prog.graph_module`` (its
    copy for another device, :meth:`StageProgram.on_device`). ``loss_scale``: the tail's
    backward starts from ``loss / scale * loss_scale`` (fp16 loss scaling; the gradients are
    then scaled by it and the caller divides it out). ``outputs``: the tail's outputs after
    the loss (its token hits, ``prog.outputs``) are put there by name, detached.

    A backward stage with ``recompute="layer"`` runs unit by unit (:func:`_layer_by_layer`):
    the same gradients, summed in another order, with one unit's activations held at a time.
    """
    gm = prog.graph_module if graph_module is None else graph_module
    leaves: dict[str, torch.Tensor] = {}
    local_params = {}
    for inp in prog.inputs:
        if inp.kind == "param":
            p = params[inp.source]
            leaf = p.detach().requires_grad_(inp.requires_grad)
            local_params[inp.source] = leaf
            if inp.requires_grad:
                leaves["param:" + inp.source] = leaf
    local_values = dict(values)
    for name in prog.grad_inputs:
        leaf = values[name].detach().requires_grad_(True)
        local_values[name] = leaf
        leaves["value:" + name] = leaf
    args = stage_arguments(prog, captured, local_params, microbatch, local_values)
    loss = None
    if prog.kind == "backward" and prog.recompute == "layer":
        _layer_by_layer(prog, gm, args, value_grads, list(leaves.values()))
    else:
        with torch.enable_grad():
            outs = gm(*args)
        if prog.kind == "tail":
            loss = outs[0]
            if outputs is not None:
                outputs.update((n, o.detach()) for n, o in zip(prog.outputs[1:], outs[1:]))
            root = loss / scale
            roots, seeds = [root if loss_scale == 1.0 else root * loss_scale], [None]
        else:
            pairs = [
                (o, value_grads[n]) for n, o in zip(prog.outputs, outs)
                if n in value_grads and isinstance(o, torch.Tensor) and o.requires_grad
            ]
            roots, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        if roots and leaves:
            torch.autograd.backward(roots, seeds, inputs=list(leaves.values()))
    handed: list[tuple[str, torch.Tensor]] = []
    for key, leaf in leaves.items():
        kind, name = key.split(":", 1)
        if leaf.grad is None:
            continue
        if kind == "param" and accumulate is not None:
            handed.append((name, leaf.grad))
            continue
        target = job_grads if kind == "param" else value_grads
        if name in target:
            target[name] += leaf.grad.float() if kind == "param" else leaf.grad
        else:
            target[name] = (
                torch.zeros_like(leaf.grad, dtype=torch.float32) + leaf.grad.float()
                if kind == "param" else leaf.grad
            )
    if handed:
        accumulate(handed)
    return None if loss is None else loss.detach()


def _layer_by_layer(prog: StageProgram, gm: torch.fx.GraphModule, args: Sequence,
                    value_grads: Mapping[str, torch.Tensor], leaves: list[torch.Tensor]) -> None:
    """Layer-by-layer recompute and backward of one microbatch of backward stage ``prog``
    (``gm``: its graph as it runs, ``args``: its arguments, the parameter and value-input
    leaves among them). First a forward without autograd through every unit but the last keeps
    the boundary values; then, last unit first, each unit's forward runs again with autograd
    from its boundaries (fresh leaves), and its backward from the gradients of its outputs: the
    stage's ``value_grads`` for the stage's outputs, what later units sent back for the others.
    The gradients of the leaves accumulate in their ``.grad`` across units. Dropout draws the
    same masks in both forwards (rpcompile.capture.dropout: seeded by microbatch and node)."""
    cut = unit_segments(prog, gm)
    env: dict[str, object] = dict(zip(cut.placeholders, args))
    segments = cut.segments
    with torch.no_grad():
        for seg in segments[:-1]:
            outs = seg.graph_module(*(env[n] for n in seg.inputs))
            env.update(zip(seg.outputs, outs))
            for n in seg.outputs:  # only what a later unit reads is kept
                if n not in cut.last_use:
                    del env[n]
    seeds: dict[str, torch.Tensor] = {}
    for name, node in zip(prog.outputs, cut.stage_outputs):
        if name in value_grads:
            seeds[node] = value_grads[name]
    wanted = {id(t) for t in leaves}
    for k in range(len(segments) - 1, -1, -1):
        seg = segments[k]
        fresh: dict[str, torch.Tensor] = {}
        inputs = []
        for n in seg.inputs:
            value = env[n]
            if n in seg.grad_inputs:
                value = fresh[n] = value.detach().requires_grad_(True)
            inputs.append(value)
        with torch.enable_grad():
            outs = seg.graph_module(*inputs)
        roots, grads = [], []
        for n, o in zip(seg.outputs, outs):
            g = seeds.pop(n, None)
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                roots.append(o)
                grads.append(g)
        targets = [*fresh.values(), *(v for v in inputs
                                      if isinstance(v, torch.Tensor) and id(v) in wanted)]
        if roots and targets:
            torch.autograd.backward(roots, grads, inputs=targets)
        del outs, roots, grads
        for n, leaf in fresh.items():
            if leaf.grad is not None:
                seeds[n] = seeds[n] + leaf.grad if n in seeds else leaf.grad
        for n in seg.inputs:  # a boundary's earliest reader is done: it is not needed again
            if cut.last_use.get(n) == k:
                del env[n]
