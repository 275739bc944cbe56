"""One record per action kind: the IR's spec (stream, payloads) plus one implementation in
each interpreter (the runtime executor and the simulator). A kind added to ActionKind without
both halves fails here (and at import, by check_registry)."""

import pytest

from rpcompile.ir import ACTION_SPECS, STREAMS, Action, ActionKind, check_registry
from rpcompile.runtime.executor import RUNTIME_ACTIONS
from rpcompile.sim.engine import SIM_COSTS


@pytest.mark.parametrize("kind", list(ActionKind), ids=str)
def test_every_kind_has_both_halves(kind):
    spec = ACTION_SPECS[kind]
    assert spec.kind is kind and spec.stream in STREAMS
    assert callable(RUNTIME_ACTIONS[kind]), f"{kind} has no runtime implementation"
    assert callable(SIM_COSTS[kind]), f"{kind} has no simulator cost"


def test_tables_hold_nothing_else():
    assert set(ACTION_SPECS) == set(RUNTIME_ACTIONS) == set(SIM_COSTS) == set(ActionKind)


def test_the_timeline_drawing_colours_every_kind():
    # The PNG drawer is a leaf (it imports nothing of rpcompile), so it keeps its own table.
    from rpcompile._draw import _COLORS

    assert set(_COLORS) == {k.value for k in ActionKind}


def test_a_table_missing_a_kind_is_refused():
    partial = {k: None for k in ActionKind if k is not ActionKind.SHADOW}
    with pytest.raises(TypeError, match="SHADOW"):
        check_registry(partial, "an interpreter")
    check_registry({k: None for k in ActionKind}, "an interpreter")


def test_actions_take_stream_and_payload_from_the_spec():
    assert Action(0, ActionKind.UP, 1).stream == "weight_upload"
    assert Action(0, "UP", 1) == Action(0, ActionKind.UP, 1)  # the plain string is kept
    assert type(Action(0, ActionKind.F, 1, 0, 0).kind) is str
    assert Action(None, "OPT", 2).stream == "host"
    with pytest.raises(ValueError, match="carries one of"):
        Action(0, "H2D", 1, 0, 0, what="weights")
    with pytest.raises(ValueError, match="carry no payload"):
        Action(0, "F", 1, 0, 0, what="act")
