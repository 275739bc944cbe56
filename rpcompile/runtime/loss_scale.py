"""Dynamic loss scaling for fp16 training, driven by the kernels' fused non-finite flag.

fp16 gradients underflow unless the loss is multiplied by a large scale before backward. The
scale is then divided out on the host before the optimizer step. Each step, the gradient
accumulation kernel (:func:`rpcompile.runtime.kernels.accumulate_grads`) raises a
found-non-finite flag on the device if any accumulated gradient is inf or NaN; the scaler reads
those flags once per step and

  - skips the step and multiplies the scale by ``backoff_factor`` when a flag is up;
  - otherwise lets the step run, and after ``growth_interval`` clean steps in a row multiplies
    the scale by ``growth_factor``.

The rule is torch.amp.GradScaler's, plus a clamp to ``[min_scale, max_scale]``. With
``dynamic=False`` the scale stays fixed and the scaler only refuses non-finite steps, which is
what a bf16 run wants. The scaler's whole state is one frozen :class:`LossScaleState`; the
update rule is the pure function :func:`next_loss_scale_state`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

import torch

from rpcompile.errors import InvalidInput
from rpcompile.options import LossScaleConfig  # the option value; defined with the options

__all__ = [
    "DynamicLossScaler",
    "LossScaleConfig",
    "LossScaleState",
    "any_nonfinite",
    "next_loss_scale_state",
]


@dataclass(frozen=True)
class LossScaleState:
    """Where the scaler stands after ``steps`` calls of ``update``."""

    scale: float
    clean_steps: int = 0  # finite steps in a row since the scale last changed or backed off
    steps: int = 0  # update calls so far
    skipped_steps: int = 0  # of those, steps refused for a non-finite gradient


def next_loss_scale_state(
    state: LossScaleState, config: LossScaleConfig, found_nonfinite: bool
) -> LossScaleState:
    """The state after one step whose gradients were (``found_nonfinite``) or were not finite."""
    if found_nonfinite:
        scale = state.scale
        if config.dynamic:
            scale = max(config.min_scale, scale * config.backoff_factor)
        return replace(
            state,
            scale=scale,
            clean_steps=0,
            steps=state.steps + 1,
            skipped_steps=state.skipped_steps + 1,
        )
    clean_steps = state.clean_steps + 1
    scale = state.scale
    if config.dynamic and clean_steps == config.growth_interval:
        scale, clean_steps = min(config.max_scale, scale * config.growth_factor), 0
    return replace(state, scale=scale, clean_steps=clean_steps, steps=state.steps + 1)


def any_nonfinite(found: bool | torch.Tensor | Iterable[torch.Tensor]) -> bool:
    """Combine found-non-finite flags (a bool, one flag tensor, or flags from several devices).

    This is where the host waits for the devices: once per flag tensor, once per step.
    """
    if isinstance(found, bool):
        return found
    flags = [found] if isinstance(found, torch.Tensor) else list(found)
    return any(bool(flag.any()) for flag in flags)


class DynamicLossScaler:
    """Scales the loss, unscales gradients and decides whether each step may run.

    Typical use, once per optimizer step::

        loss = scaler.scale_loss(loss)          # before backward, on every microbatch
        ...                                     # accumulate_grads(..., found_nonfinite=flag)
        if scaler.update(flag):                 # one host sync; also moves the scale
            scaler.unscale_(master_grads)
            optimizer.step()
        # else: the step is skipped; zero the gradients and go on

    ``update`` may change ``scale`` for the next step; the gradients of the step just recorded
    still carry ``last_step_scale``, which is what ``unscale_`` divides by unless told otherwise.
    """

    def __init__(self, config: LossScaleConfig | None = None, **overrides: float | int | bool):
        if config is None:
            config = LossScaleConfig(**overrides)  # type: ignore[arg-type]
        elif overrides:
            config = replace(config, **overrides)
        self.config = config
        self.state = LossScaleState(scale=config.init_scale)
        self._last_step_scale = config.init_scale

    @property
    def scale(self) -> float:
        """The scale to multiply the next step's loss by."""
        return self.state.scale

    @property
    def last_step_scale(self) -> float:
        """The scale the most recent step ran with (what its gradients are multiplied by)."""
        return self._last_step_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.state.scale

    def update(self, found_nonfinite: bool | torch.Tensor | Iterable[torch.Tensor]) -> bool:
        """Record one step; return True when it may run (its gradients were all finite)."""
        found = any_nonfinite(found_nonfinite)
        self._last_step_scale = self.state.scale
        self.state = next_loss_scale_state(self.state, self.config, found)
        return not found

    @torch.no_grad()
    def unscale_(self, grads: Iterable[torch.Tensor], scale: float | None = None) -> None:
        """Divide gradients in place by ``scale`` (default: the last step's scale)."""
        inverse = 1.0 / (self._last_step_scale if scale is None else scale)
        for grad in grads:
            grad.mul_(inverse)

    def state_dict(self) -> dict[str, float | int | bool]:
        return {
            **asdict(self.config),
            **asdict(self.state),
            "last_step_scale": self._last_step_scale,
        }

    def load_state_dict(self, state_dict: dict[str, float | int | bool]) -> None:
        fields = dict(state_dict)
        last = float(fields.pop("last_step_scale"))
        state_names = LossScaleState.__dataclass_fields__
        state = {k: fields.pop(k) for k in list(fields) if k in state_names}
        unknown = set(fields) - set(LossScaleConfig.__dataclass_fields__)
        if unknown:
            raise InvalidInput(f"unknown loss scaler state_dict keys: {sorted(unknown)}")
        self.config = LossScaleConfig(**fields)  # type: ignore[arg-type]
        self.state = LossScaleState(**state)  # type: ignore[arg-type]
        self._last_step_scale = last
