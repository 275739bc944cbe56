"""What each artifact of the compile must satisfy; checked after its pass under RPCOMPILE_DEBUG=1.

Each check raises ``AssertionError`` with what is wrong; :func:`rpcompile.passes.manager.run_pass`
turns it into a ``PassInvariantError`` naming the pass. The checks read the artifacts only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["check_captured", "check_costs", "check_dispatch", "check_plan", "check_stages"]


def check_captured(captured: Any) -> None:
    """One well-formed graph; every computing node in a unit, units in graph order; the
    placeholders the capture names exist; the output is the scalar loss."""
    gm = captured.graph_module
    gm.graph.lint()
    names = {n.name for n in gm.graph.nodes}
    for table in (captured.params, captured.buffers, captured.constants):
        missing = sorted(set(table) - names)
        assert not missing, f"placeholders named by the capture are not in the graph: {missing}"
    missing = [i for i in captured.inputs if i not in names]
    assert not missing, f"batch inputs not in the graph: {missing}"
    assert len(captured.inputs) == len(captured.input_keys), "inputs and input keys differ"
    n_units = len(captured.units)
    assert n_units >= 1, "no units"
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        unit = node.meta.get("rp_unit")
        assert unit is not None, f"node {node.name} belongs to no unit"
        assert 0 <= unit < n_units, f"node {node.name} is in unit {unit} of {n_units}"
        for arg in node.all_input_nodes:
            u = arg.meta.get("rp_unit")
            assert u is None or u <= unit, (
                f"node {node.name} (unit {unit}) reads {arg.name} of a later unit {u}")
    out = gm.graph.find_nodes(op="output")
    assert len(out) == 1, "the graph must have one output"


def check_costs(unit_costs: Sequence[Any], captured: Any) -> None:
    """One cost per unit, and no negative cost at the example batch's size."""
    assert len(unit_costs) == len(captured.units), (
        f"{len(unit_costs)} unit costs for {len(captured.units)} units")
    ids = next(iter(captured.example_batch.values()))
    b, s = ids.shape[0], ids.shape[1] if ids.dim() > 1 else 1
    for i, cost in enumerate(unit_costs):
        fwd, bwd = cost.flops_at(b, s)
        assert fwd >= 0 and bwd >= 0, f"unit {i} has negative FLOPs ({fwd}, {bwd})"


def check_plan(plan: Any, units: int) -> None:
    """The partition's own rules (``Plan.validate``) over all the units."""
    plan.validate()
    assert len(plan.units) == units, f"the plan covers {len(plan.units)} of {units} units"


def check_stages(stages: Sequence[Any], plan: Any) -> None:
    """One program per stage of the plan, its units the stage's, each graph well formed, every
    value a stage reads made by an earlier stage (or a batch input / parameter)."""
    assert len(stages) == len(plan.stages), (
        f"{len(stages)} stage programs for {len(plan.stages)} stages")
    made: set[str] = set()
    everything = {o for prog in stages for o in prog.outputs}
    for prog, st in zip(stages, plan.stages):
        assert tuple(prog.units) == tuple(st.units), (
            f"stage {prog.name} runs units {prog.units}, the plan says {st.units}")
        prog.graph_module.graph.lint()
        for i in prog.inputs:
            if i.kind != "value":
                continue
            assert i.name in everything, f"stage {prog.name} reads {i.name}, which no stage makes"
            if prog.kind == "forward":
                assert i.name in made, (
                    f"forward stage {prog.name} reads {i.name} before any stage makes it")
        made.update(prog.outputs)


def check_dispatch(schedule: Any) -> None:
    """The dispatched compute schedule passes the schedule validator."""
    from rpcompile.passes.validate import validate

    validate(schedule, "dispatch")
