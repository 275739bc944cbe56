"""Stages for the weight-bound baseline schedules (GPipe, 1F1B, interleaved, looped BFS).

A baseline binds stage ``s`` to worker ``s % workers`` for the whole run. How layers are dealt
to its stages matters as much as the schedule; :func:`pipeline_stages` uses the rule that
reproduces the RoundPipe paper's simulator figures (arXiv 2604.27085; docs/simulator.md
shows the check): the LM head counts as ``h`` layers, h = its forward + backward time over one
layer's forward + recompute + backward, rounded; the ``layers + h`` slots are split as evenly as
possible over the stages, larger stages last; the last stage's slots are the head's ``h`` plus
the layers left over (the tail alone when its ``h`` slots are more than the last stage's
share). The prefix (embedding) joins the first stage, the tail the last. The "layers" are the
units between the prefix and the tail: a model's attention and MLP blocks
(``PaperModel.units(split_layers=True)``) can be dealt the same way where there are more stages
than layers (benchmarks/paper_bubbles.py's interleaved baselines).
"""

from __future__ import annotations

from collections.abc import Sequence

from rpcompile.errors import InvalidInput
from rpcompile.ir import Stage, UnitProfile

__all__ = ["head_layer_equivalents", "pipeline_stages"]


def head_layer_equivalents(units: Sequence[UnitProfile]) -> int:
    """How many decoder layers the tail (LM head + loss) weighs: its forward + backward time
    over the mean layer's forward + recompute + backward, rounded."""
    layers = units[1:-1]
    if not layers:
        return 0
    layer = sum(2 * u.forward_ms + u.backward_ms for u in layers) / len(layers)
    tail = units[-1].forward_ms + units[-1].backward_ms
    return round(tail / layer) if layer > 0 else 0


def pipeline_stages(units: Sequence[UnitProfile], num_stages: int,
                    head_layers: int | None = None, grad_dtype_bytes: int = 2,
                    weight_dtype_bytes: int = 2) -> tuple[Stage, ...]:
    """``num_stages`` contiguous stages over ``units`` (prefix, layers..., tail) for a baseline.

    ``head_layers`` overrides :func:`head_layer_equivalents`. Byte fields: weights in the
    compute dtype; gradients stay on the GPU in ``grad_dtype_bytes`` (weights bound to a GPU
    never travel); activations are the units' ``output_bytes``. ``compute_ms`` is forward +
    recompute + backward (the simulator splits F and B from the units itself).
    """
    units = tuple(units)
    n_layers = len(units) - 2
    if n_layers < 0:
        raise InvalidInput("pipeline_stages needs at least a prefix and a tail unit")
    if num_stages < 1 or num_stages > max(n_layers, 1):
        raise InvalidInput(f"cannot cut {n_layers} layers into {num_stages} stages; use between "
                         f"1 and {max(n_layers, 1)}, or finer units (a layer's attention and "
                         f"MLP blocks: PaperModel.units(split_layers=True))")
    h = head_layer_equivalents(units) if head_layers is None else head_layers
    h = min(h, n_layers - (num_stages - 1))  # every stage keeps at least one layer
    h = max(h, 0)
    q, rem = divmod(n_layers + h, num_stages)
    counts = [q] * (num_stages - rem) + [q + 1] * rem
    if counts[-1] < h:
        # The head outweighs the last stage's share (many stages, e.g. interleaved chunks
        # over attention/MLP blocks): the tail is the last stage alone and the layers are
        # split as evenly over the others, larger stages last.
        q, rem = divmod(n_layers, num_stages - 1)
        counts = [q] * (num_stages - 1 - rem) + [q + 1] * rem + [h]
    counts[-1] -= h
    bounds, start = [], 1
    for i, c in enumerate(counts):
        first = 0 if i == 0 else start
        last = start + c - 1 if i < num_stages - 1 else len(units) - 1
        bounds.append((first, last))
        start += c
    stages = []
    for i, (a, b) in enumerate(bounds):
        r = tuple(range(a, b + 1))
        params = sum(units[u].params for u in r)
        trainable = sum(units[u].trainable_params for u in r)
        # A parameter a unit borrows from a unit on another stage (a tied LM head reads the
        # embedding) is a copy on this stage's GPU, with its own gradient (Megatron keeps the
        # tied matrix on the first and the last stage), counted once per stage.
        lent = {(o, n, t) for u in r for o, n, t in units[u].borrowed if o not in r}
        params += sum(n for _o, n, _t in lent)
        trainable += sum(n for _o, n, t in lent if t)
        shared = sum(units[u].shared_bytes for u in range(a))  # each travels on (UnitProfile)
        weights = params * weight_dtype_bytes
        grads = trainable * grad_dtype_bytes
        working = sum(units[u].working_bytes for u in r)
        stages.append(Stage(
            index=i, kind="forward", units=r,
            compute_ms=sum(2 * units[u].forward_ms + units[u].backward_ms for u in r),
            weight_bytes=weights, grad_bytes=grads,
            input_bytes=(units[a - 1].output_bytes + shared) if a > 0 else 0,
            output_bytes=units[b].output_bytes, peak_bytes=weights + grads + working,
        ))
    return tuple(stages)
