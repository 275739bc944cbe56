"""The host staging proof (rpcompile.passes.memory.staging_problem) and the slots it checks
(rpcompile.passes.staging): each download's slot and the reuse edges that keep a slot's
holders apart leave the replay they came from unchanged, make the host figure the slots' sum,
hold across the steps a run repeats, and the proof refuses a schedule missing any one edge."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest

import rpcompile
from rpcompile.ir import Schedule
from rpcompile.passes.memory import staging_problem
from rpcompile.passes.staging import slot_step, staging_slots
from rpcompile.sim import simulate
from rpcompile.sim.engine import replay_timeline
from tests.schedules import without_staging
from tests.tiny_models import hf_model, token_batch


@pytest.fixture(scope="module", params=[(1, 3, "async"), (4, 3, "async"), (3, 3, "sync")],
                ids=lambda p: f"{p[0]}w-{p[1]}mb-{p[2]}")
def compiled(request):
    gpus, microbatches, mode = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rpcompile.compile(hf_model("qwen3", layers=4), gpus=gpus,
                                 microbatches=microbatches, mode=mode,
                                 example_inputs=token_batch(2 * microbatches))


def test_slots_keep_the_replay_and_make_the_host_figure(compiled):
    sched = compiled.schedule
    assert sched.staging_bytes and staging_problem(sched) is None
    bare = without_staging(sched)
    # The waits the slots add were met in the replay they came from: the same timeline.
    assert replay_timeline(bare, compiled.plan, compiled.hardware) == replay_timeline(
        sched, compiled.plan, compiled.hardware)
    assert staging_slots(bare, replay_timeline(bare, compiled.plan, compiled.hardware)) == sched
    run = simulate(sched, compiled.plan, compiled.hardware)
    assert compiled.host.transfers == sum(sched.staging_bytes)
    assert run.peak_host_bytes == simulate(bare, compiled.plan, compiled.hardware).peak_host_bytes
    # Every download fits its slot, and the copies a run repeats share their slot.
    slots = dict(sched.staging)
    for a in (a for lst in sched.actions for a in lst if a.kind == "D2H"):
        k = slot_step(sched, a.step)
        assert a.bytes <= sched.staging_bytes[slots[dataclasses.replace(a, step=k)]]
    assert slot_step(sched, sched.run_steps + 5) == slot_step(
        sched, sched.run_steps + 5 - (sched.run_steps - sched.repeat_from))
    assert Schedule.from_csv(sched.to_csv()) == sched


def _ordered(sched: Schedule, src, dst) -> bool:
    """A path from ``src`` to ``dst`` through the edges and the compute streams' and the host
    queue's list order."""
    succ: dict = {}
    for e in sched.edges:
        succ.setdefault(e.src, []).append(e.dst)
    for lst in [[a for a in lst if a.stream == "compute"] for lst in sched.actions] + [
            list(sched.host)]:
        for x, y in itertools.pairwise(lst):
            succ.setdefault(x, []).append(y)
    seen, todo = {src}, [src]
    while todo:
        for n in succ.get(todo.pop(), ()):
            if n == dst:
                return True
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


def test_the_proof_refuses_any_missing_reuse_edge(compiled):
    sched = compiled.schedule
    bare = without_staging(sched)
    reuse = [e for e in sched.edges if e.kind == "reuse"]
    refused = 0
    for cut in reuse:
        problem = staging_problem(sched.replace(edges=tuple(e for e in sched.edges if e != cut)))
        # Accepted only where the schedule orders the two holders without any reuse edge.
        assert problem is not None or _ordered(bare, cut.src, cut.dst), cut
        refused += problem is not None
    assert refused >= 0.9 * len(reuse) > 0
    assert "no host staging slots" in staging_problem(bare)


def test_the_proof_refuses_a_download_larger_than_its_slot(compiled):
    sched = compiled.schedule
    small = tuple(n - 1 if i == 0 else n for i, n in enumerate(sched.staging_bytes))
    assert "does not fit its staging slot 0" in staging_problem(sched.replace(
        staging_bytes=small))
