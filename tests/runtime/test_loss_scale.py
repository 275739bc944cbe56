"""Dynamic loss scaling: hand-computed sequences, torch's own update rule, and the kernel flag."""

from __future__ import annotations

import math

import pytest
import torch

from rpcompile.runtime import kernels
from rpcompile.runtime.loss_scale import (
    DynamicLossScaler,
    LossScaleConfig,
    LossScaleState,
    any_nonfinite,
    next_loss_scale_state,
)


def _run(scaler: DynamicLossScaler, overflows: str) -> list[tuple[bool, float, int]]:
    """Feed a step pattern ('x' = overflow, '.' = clean); record (step ok, scale, clean run)."""
    trace = []
    for mark in overflows:
        ok = scaler.update(mark == "x")
        trace.append((ok, scaler.scale, scaler.state.clean_steps))
    return trace


def test_hand_computed_sequence():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    assert _run(scaler, "..x...x.....") == [
        (True, 8.0, 1),
        (True, 8.0, 2),
        (False, 4.0, 0),  # overflow: skip, back off, restart the clean run
        (True, 4.0, 1),
        (True, 4.0, 2),
        (True, 8.0, 0),  # third clean step in a row: grow
        (False, 4.0, 0),
        (True, 4.0, 1),
        (True, 4.0, 2),
        (True, 8.0, 0),
        (True, 8.0, 1),
        (True, 8.0, 2),
    ]
    assert scaler.state == LossScaleState(scale=8.0, clean_steps=2, steps=12, skipped_steps=2)


def test_scale_is_clamped_to_its_bounds():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_scale=8.0, growth_interval=1)
    assert [s for _, s, _ in _run(scaler, "xxxx")] == [2.0, 1.0, 1.0, 1.0]
    assert [s for _, s, _ in _run(scaler, "......")] == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert scaler.state.skipped_steps == 4


def test_static_scale_only_refuses_bad_steps():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, dynamic=False, growth_interval=1)
    assert _run(scaler, ".x..") == [(True, 1.0, 1), (False, 1.0, 0), (True, 1.0, 1), (True, 1.0, 2)]


def test_matches_torch_amp_update_rule_inside_the_bounds():
    # torch's GradScaler kernel is the independent reference for the unclamped rule.
    pattern = "".join("x" if (i * 7919) % 11 == 0 else "." for i in range(200))
    scaler = DynamicLossScaler(
        init_scale=2.0**10, growth_interval=4, min_scale=1.0, max_scale=2.0**40
    )
    scale = torch.tensor([2.0**10])
    tracker = torch.tensor([0], dtype=torch.int32)
    for mark in pattern:
        scaler.update(mark == "x")
        found = torch.tensor([1.0 if mark == "x" else 0.0])
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 4)
        assert scaler.scale == scale.item() and scaler.state.clean_steps == tracker.item()
    assert scaler.scale != 2.0**10  # the pattern did move the scale


def test_pure_update_returns_new_state():
    config = LossScaleConfig(init_scale=2.0, growth_interval=2)
    state = LossScaleState(scale=2.0)
    after = next_loss_scale_state(state, config, found_nonfinite=False)
    assert state == LossScaleState(scale=2.0)  # unchanged: frozen values, new object
    assert after == LossScaleState(scale=2.0, clean_steps=1, steps=1)
    with pytest.raises(AttributeError):
        after.scale = 3.0  # type: ignore[misc]


def test_state_dict_round_trip_continues_identically():
    a = DynamicLossScaler(init_scale=64.0, growth_interval=2)
    _run(a, "x..x.")
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.config == a.config and b.state == a.state and b.last_step_scale == a.last_step_scale
    assert _run(a, "..x...") == _run(b, "..x...")
    with pytest.raises(ValueError, match="unknown loss scaler state_dict keys"):
        b.load_state_dict({**a.state_dict(), "hysteresis": 2})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "min_scale <= init_scale"),
    ],
)
def test_invalid_config_says_what_is_wrong(overrides, message):
    with pytest.raises(ValueError, match=message):
        LossScaleConfig(**overrides)


def test_flags_from_tensors_and_several_devices():
    assert not any_nonfinite(kernels.nonfinite_flag())
    assert any_nonfinite([kernels.nonfinite_flag(), torch.ones(1, dtype=torch.int32)])
    assert not any_nonfinite([])
    assert any_nonfinite(True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp16_overflow_is_skipped_then_recovers(backend):
    # A loss scale too large for fp16 makes the scaled gradient inf; the fused check in the
    # accumulation raises the flag, the step is skipped and the next step at half the scale
    # goes through with the exact unscaled gradient.
    # 2**-26 is below fp16's smallest subnormal: only the scale keeps it from flushing to 0.
    true_grad = torch.tensor([0.75, -0.25, 1e-3, 2.0**-26])
    scaler = DynamicLossScaler(init_scale=2.0**17, growth_interval=100)
    results = []
    for _ in range(3):
        accumulator = torch.zeros(4)
        flag = kernels.nonfinite_flag()
        scaled = (true_grad * scaler.scale).to(torch.float16)  # what backward would produce
        kernels.accumulate_grads([scaled], accumulator, found_nonfinite=flag, backend=backend)
        ok = scaler.update(flag)
        if ok:
            scaler.unscale_([accumulator])
        results.append((ok, scaler.last_step_scale, accumulator))
    assert [(ok, s) for ok, s, _ in results] == [(False, 2.0**17), (True, 2.0**16), (True, 2.0**16)]
    expected = (true_grad * 2.0**16).to(torch.float16).float() / 2.0**16
    assert torch.equal(results[1][2], expected)
    assert results[1][2][3].item() == 2.0**-26 and true_grad.half()[3].item() == 0.0
    assert scaler.state.skipped_steps == 1


def test_scale_loss_multiplies():
    scaler = DynamicLossScaler(init_scale=1024.0)
    assert scaler.scale_loss(torch.tensor(0.5)).item() == 512.0
