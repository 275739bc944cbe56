"""``rpcompile.compile``: run the whole flow and keep every artifact on the result.

capture -> cost -> partition -> split -> dispatch -> lower; every artifact stays on ``Compiled``.
The options compile() takes: the three groups, and the shortcuts it also takes as keywords."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from torch import nn

from rpcompile.capture.core import capture as capture_graph
from rpcompile.capture.core import is_causal_lm
from rpcompile.capture.tracing import (
    fx_source_mark,
)
from rpcompile.compiler.compiled import Compiled, _plan_captured
from rpcompile.compiler.profiles import _floating_dtype
from rpcompile.compiler.search import planning_hardware
from rpcompile.compiler.shapes import _batch_shape, _notice, _shape_of
from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.hardware import Hardware
from rpcompile.options import (
    CaptureOptions,
    Options,
    PlanOptions,
    TrainOptions,
)
from rpcompile.passes.invariants import (
    check_captured,
)
from rpcompile.passes.manager import PassRecord, run_pass
from rpcompile.runtime.trainer import planned_ranks

__all__ = [
    "SHORTCUTS",
    "compile",
]


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
