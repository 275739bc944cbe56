"""Every pass of a compile leaves a record (name, time, artifact); RPCOMPILE_DEBUG=1 checks each
artifact's invariants and names the pass that broke one."""

from __future__ import annotations

import dataclasses

import pytest

import rpcompile
from rpcompile.ir import Plan, Schedule
from rpcompile.passes.manager import PassInvariantError
from tests.schedules import without_staging
from tests.tiny_models import hf_model, token_batch

PASSES = ["capture", "token-hits", "cost", "partition", "split", "dispatch",
          "upload", "transfers", "grads", "optimizer", "commit", "events", "staging"]


def _compile():
    return rpcompile.compile(hf_model("qwen3", layers=3), gpus=2, microbatches=3,
                             example_inputs=token_batch(6), device="virtual")


def test_every_pass_is_recorded_in_order_with_its_artifact(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "1")
    c = _compile()
    assert [r.name for r in c.history] == PASSES
    by = {r.name: r.artifact for r in c.history}
    # The plan was made on a fork of the capture (Captured.fork): the same nodes, in its own
    # graph, which the token-hits pass gave the count of the tail's token hits.
    assert by["capture"] is c._source and c.capture is not c._source
    assert by["token-hits"] is c.capture
    source = [n.name for n in by["capture"].graph_module.graph.nodes]
    planned = [n.name for n in c.capture.graph_module.graph.nodes]
    assert [n for n in planned if n in set(source)] == source
    assert {n for n in planned if n not in set(source)} == {
        "argmax_default", "eq_tensor", "ne_scalar", "logical_and_default", "sum_default"}
    assert by["cost"] is c.unit_costs
    assert by["partition"] is c.plan and isinstance(c.plan, Plan)
    assert by["split"] is c.stages
    assert isinstance(by["dispatch"], Schedule)
    # The last lowering pass gives the compiled schedule; the staging pass adds its downloads'
    # host slots and the waits that keep a slot's holders apart (rpcompile.passes.staging).
    assert by["staging"] is c.schedule
    assert by["events"] == without_staging(c.schedule)
    assert by["staging"].passes == by["events"].passes
    assert all(r.elapsed_ms >= 0 for r in c.history)
    assert c.history[0].elapsed_ms > 0 and c.history[0].check_ms > 0  # checked under debug


def test_without_debug_the_artifacts_are_not_checked(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    calls = []
    monkeypatch.setattr("rpcompile.compiler.compiled.check_stages", lambda *a: calls.append(a))
    _compile()
    assert calls == []


@pytest.mark.parametrize("broken", ["capture", "split", "partition"])
def test_a_broken_artifact_names_its_pass(monkeypatch, broken):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "1")
    import rpcompile.compiler as compiler

    if broken == "capture":
        real = compiler.entry.capture_graph

        def bad_capture(*a, **k):
            cap = real(*a, **k)
            node = next(n for n in cap.graph_module.graph.nodes if n.op == "call_function")
            del node.meta["rp_unit"]
            return cap

        monkeypatch.setattr(compiler.entry, "capture_graph", bad_capture)
        match = "belongs to no unit"
    elif broken == "split":
        real_split = compiler.compiled.split
        monkeypatch.setattr(compiler.compiled, "split", lambda cap, plan: real_split(cap, plan)[:-1])
        match = "stage programs for"
    else:
        real_partition = compiler.search.partition

        def bad_partition(*a, **k):
            plan = real_partition(*a, **k)
            st = plan.stages[0]
            stages = (dataclasses.replace(st, units=st.units[:-1]), *plan.stages[1:])
            return dataclasses.replace(plan, stages=stages)

        monkeypatch.setattr(compiler.search, "partition", bad_partition)
        match = ""
    with pytest.raises(PassInvariantError, match=f"pass '{broken}'.*{match}"):
        _compile()
