"""Schedule IR (Action, Schedule) and dispatch (RoundPipe round-robin, baselines)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpcompile.ir import (
    ACTION_KINDS,
    HOST_KINDS,
    Action,
    Edge,
    Plan,
    Schedule,
    Stage,
    UnitProfile,
)
from rpcompile.passes.lower import lower
from rpcompile.passes.schedule import build_schedule, roundpipe_jobs
from rpcompile.passes.validate import validate

MiB = 2**20


def make_plan(workers: int = 4, microbatches: int = 5) -> Plan:
    """8 units (prefix u0, layers u1..u6, tail u7); F1 0-2, F2 3-4, F3 5-6, B1 = tail 7,
    B2 3-6 (saved input x2, made by F1), B3 0-2 (saved input: the ids).

    Activation after unit u: (u + 1) MiB, plus 1 MiB of shared values (made by the prefix);
    its gradient: (u + 1) MiB. Stage byte fields follow the contract: a forward stage's input
    is the activation it reads, a backward stage's input is its saved input plus the output
    gradient, and a backward stage or the tail sends on the gradient of its input.
    """
    units = tuple(UnitProfile(f"u{i}", 1.0, 2.0, 1000, output_bytes=(i + 1) * MiB,
                              shared_bytes=MiB if i == 0 else 0) for i in range(8))

    def act(u: int) -> int:  # activation after unit u, with the shared values
        return (u + 2) * MiB

    def grad(u: int) -> int:
        return (u + 1) * MiB

    def stage(i: int, kind: str, lo: int, hi: int, inp: int, out: int) -> Stage:
        return Stage(i, kind, tuple(range(lo, hi + 1)), 1.0, (10 + i) * MiB,
                     0 if kind == "forward" else (100 + i) * MiB, inp, out, 0)

    stages = (stage(0, "forward", 0, 2, 0, act(2)),
              stage(1, "forward", 3, 4, act(2), act(4)),
              stage(2, "forward", 5, 6, act(4), act(6)),
              stage(3, "tail", 7, 7, act(6), grad(6)),
              stage(4, "backward", 3, 6, act(2) + grad(6), grad(2)),
              stage(5, "backward", 0, 2, grad(2), 0))
    plan = Plan(units, stages, workers, microbatches, 2, 16, "test", 0.0, 0)
    plan.validate()
    return plan


def pipeline_stages(n: int) -> list[Stage]:
    return [Stage(i, "forward", (i,), 1.0, MiB, MiB, MiB, MiB, 0) for i in range(n)]


# --------------------------------------------------------------------------------------------
# Action
# --------------------------------------------------------------------------------------------

_small = st.integers(min_value=0, max_value=40)


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(ACTION_KINDS))
    worker = None if kind in HOST_KINDS else draw(_small)
    what = None
    if kind in ("H2D", "D2H"):
        what = draw(st.sampled_from(("act", "save", "igrad", "grad")))
    elif kind == "UP":
        what = "weights"
    return Action(
        worker=worker, kind=kind, stage=draw(_small),
        microbatch=draw(st.none() | _small), round=draw(st.none() | _small), step=draw(_small),
        what=what, value=draw(st.none() | st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,6}",
                                                       fullmatch=True)),
        bytes=draw(st.integers(0, 2**40)), chunks=draw(st.integers(1, 1000)),
    )


@given(actions())
def test_action_string_parses_back(a: Action) -> None:
    assert Action.parse(str(a)) == a


def test_action_string_examples() -> None:
    assert str(Action(3, "F", 5, 2, 0)) == "w3 F s5 m2 r0"
    assert str(Action(3, "UP", 5, None, 0)) == "w3 UP s5 r0"
    assert str(Action(1, "D2H", 7, None, 0, what="grad")) == "w1 D2H grad s7 r0"
    assert str(Action(None, "OPT", 7)) == "host OPT s7"
    up = Action.parse("w3 UP s5 r0 k2 1073741824B x16")
    assert (up.step, up.bytes, up.chunks, up.what) == (2, 2**30, 16, "weights")
    assert (up.stream, up.priority) == ("weight_upload", "bulk")
    act = Action.parse("w0 D2H act s1 m2 r0 @x8 4096B")
    assert (act.stream, act.priority, act.value) == ("download", "critical", "x8")
    assert Action.parse("w0 D2H grad s1 r0").stream == "download"
    assert Action.parse("w0 H2D igrad s1 m0").stream == "activation_upload"


@pytest.mark.parametrize("text", ["w3 F m2", "x3 F s1", "w3 ZAP s1", "w3 F s1 q9",
                                  "host F s1", "w1 OPT s1", "w1 H2D weights s1",
                                  "w1 F s1 m0 @1bad"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


# --------------------------------------------------------------------------------------------
# RoundPipe dispatch
# --------------------------------------------------------------------------------------------


def test_roundpipe_jobs_round_robin_carries_over_rounds_and_steps() -> None:
    jobs = roundpipe_jobs(num_stages=6, workers=4, rounds=2, steps=2)
    # The counter never restarts: job n of the whole run goes to worker n % 4, so round 1 of
    # step 0 starts on worker 6 % 4 = 2, and step 1 on worker 12 % 4 = 0.
    assert [w for w, *_ in jobs] == [n % 4 for n in range(24)]
    assert jobs[6] == (2, 0, 1, 0)
    assert jobs[12] == (0, 0, 0, 1)
    assert [s for _, s, _, _ in jobs] == list(range(6)) * 4


@pytest.mark.parametrize(("workers", "microbatches", "rounds", "steps"),
                         [(4, 5, 1, 1), (4, 5, 2, 2), (3, 2, 3, 1), (1, 4, 1, 2), (8, 9, 1, 1)])
def test_roundpipe_dispatch_properties(workers, microbatches, rounds, steps) -> None:
    plan = make_plan()
    sched = build_schedule(plan, workers, microbatches, rounds, steps)
    validate(sched, "dispatch")
    computes = [a for lst in sched.actions for a in lst]
    keys = Counter((a.stage, a.microbatch, a.round, a.step) for a in computes)
    # every (stage, microbatch, round, step) exactly once
    assert set(keys.values()) == {1}
    assert len(keys) == len(plan.stages) * microbatches * rounds * steps
    # kind follows the stage: forward F, the fused tail T, other backward stages B
    expected_kind = {"forward": "F", "tail": "T", "backward": "B"}
    assert all(a.kind == expected_kind[plan.stages[a.stage].kind] for a in computes)
    # a job is all microbatches of one stage, in order, on the worker the counter names
    n_stages = len(plan.stages)
    for a in computes:
        n = (a.step * rounds + a.round) * n_stages + a.stage
        assert a.worker == n % workers
    for lst in sched.actions:
        jobs = [(a.step, a.round, a.stage) for a in lst]
        assert jobs == sorted(jobs)  # jobs in dispatch order
        for i in range(0, len(lst), microbatches):
            assert [a.microbatch for a in lst[i:i + microbatches]] == list(range(microbatches))


def test_roundpipe_wavefront() -> None:
    """Stage k+1 starts one microbatch after stage k: with unit times, F2 m0 runs at step 1."""
    sched = build_schedule(make_plan(), 4, 5)
    dry = sched.dry_run()
    assert dry.ok
    assert dry.steps[Action(0, "F", 0, 0, 0)] == 0
    assert dry.steps[Action(1, "F", 1, 0, 0)] == 1
    assert dry.steps[Action(2, "F", 2, 0, 0)] == 2
    assert dry.steps[Action(3, "T", 3, 0, 0)] == 3
    # B2 (stage 4) is on worker 0 after F1's five microbatches, and needs T of microbatch 0
    assert dry.steps[Action(0, "B", 4, 0, 0)] == 5


def test_roundpipe_flows() -> None:
    plan = make_plan()
    flows = {(f.dst_stage, f.value): f for f in build_schedule(plan, 4, 5).flows}
    tokens = 2 * 16 * 8  # microbatch of 2 x 16 int64 ids
    # (consumer, value): (what, producer kind, producer stage, bytes), by hand from make_plan
    assert {k: (f.what, f.src_kind, f.src_stage, f.bytes) for k, f in flows.items()} == {
        (0, "ids"): ("act", None, None, tokens),
        (1, "x2"): ("act", "F", 0, 4 * MiB),
        (2, "x4"): ("act", "F", 1, 6 * MiB),
        (3, "x6"): ("act", "F", 2, 8 * MiB),
        (3, "labels"): ("act", None, None, tokens),
        (4, "g6"): ("igrad", "T", 3, 7 * MiB),
        # B2 covers units 3..6: it recomputes from x2 (made by F1), the same tensor F2 reads
        (4, "x2"): ("save", "F", 0, 4 * MiB),
        (5, "g2"): ("igrad", "B", 4, 3 * MiB),
        (5, "ids"): ("save", None, None, tokens),
    }


def test_dispatch_rejects_bad_arguments() -> None:
    plan = make_plan()
    with pytest.raises(ValueError, match="unknown schedule kind"):
        build_schedule(plan, 4, 5, kind="zigzag")
    with pytest.raises(ValueError, match="optimizer"):
        build_schedule(plan, 4, 5, optimizer="lazy")
    with pytest.raises(ValueError, match="microbatches"):
        build_schedule(plan, 4, 0)
    with pytest.raises(TypeError):
        build_schedule(pipeline_stages(4), 4, 5)
    with pytest.raises(ValueError, match="one stage per worker"):
        build_schedule(pipeline_stages(8), 4, 5, kind="1f1b")
    with pytest.raises(ValueError, match="divisible"):
        build_schedule(pipeline_stages(8), 4, 5, kind="interleaved")


# --------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------


def _order(sched: Schedule, w: int) -> list[str]:
    return [f"{a.kind}{a.stage}.{a.microbatch}" for a in sched.actions[w]]


def test_gpipe_order() -> None:
    sched = build_schedule(pipeline_stages(4), 4, 3, kind="gpipe")
    assert _order(sched, 2) == ["F2.0", "F2.1", "F2.2", "B2.0", "B2.1", "B2.2"]
    validate(sched, "dispatch")


def test_1f1b_order() -> None:
    """PipeDream-flush: worker w warms up with 4-w-1 forwards, then alternates F and B."""
    sched = build_schedule(pipeline_stages(4), 4, 5, kind="1f1b")
    assert _order(sched, 0) == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F0.4", "B0.1", "B0.2",
                                "B0.3", "B0.4"]
    assert _order(sched, 3) == ["F3.0", "B3.0", "F3.1", "B3.1", "F3.2", "B3.2", "F3.3", "B3.3",
                                "F3.4", "B3.4"]
    validate(sched, "dispatch")
    # in-flight forwards on worker 0 never exceed 4 (the memory point of 1F1B)
    inflight = peak = 0
    for a in sched.actions[0]:
        inflight += 1 if a.kind == "F" else -1
        peak = max(peak, inflight)
    assert peak == 4


def test_interleaved_order() -> None:
    """Megatron interleaving, 2 workers, 2 chunks (stages w and w+2), 4 microbatches: worker 0
    warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards: chunk 0 on m0,m1 then chunk 1 on m0,m1."""
    sched = build_schedule(pipeline_stages(4), 2, 4, kind="interleaved")
    assert _order(sched, 0)[:6] == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "B2.0"]
    assert Counter(a.stage for a in sched.actions[1]) == {1: 8, 3: 8}
    validate(sched, "dispatch")


def test_looped_bfs_order() -> None:
    sched = build_schedule(pipeline_stages(6), 3, 2, kind="looped-bfs")
    assert _order(sched, 1) == ["F1.0", "F1.1", "F4.0", "F4.1", "B4.0", "B4.1", "B1.0", "B1.1"]
    assert sched.stage_workers == (0, 1, 2, 0, 1, 2)
    validate(sched, "dispatch")


@pytest.mark.parametrize(("kind", "stages", "workers", "microbatches"),
                         [("gpipe", 4, 4, 6), ("1f1b", 4, 4, 2), ("1f1b", 8, 8, 16),
                          ("interleaved", 8, 4, 8), ("looped-bfs", 12, 4, 5)])
def test_baselines_cover_and_progress(kind, stages, workers, microbatches) -> None:
    sched = build_schedule(pipeline_stages(stages), workers, microbatches, rounds=2, kind=kind)
    validate(sched, "dispatch")  # coverage, bound workers, data order, no deadlock
    low, history = lower(sched, pipeline_stages(stages))
    assert [h.name for h in history] == ["transfers", "events"]
    # B reads its own F's stash on the same worker: never transferred
    assert not any(a.value and a.value.startswith("stash") for a in low.all_actions())


# --------------------------------------------------------------------------------------------
# Schedule: round trips, dumps, grid, dry run
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_csv_and_json_round_trip(optimizer: str) -> None:
    plan = make_plan()
    compute = build_schedule(plan, 4, 3, rounds=2, steps=2, optimizer=optimizer)
    lowered, _ = lower(compute, plan)
    for sched in (compute, lowered, build_schedule(pipeline_stages(4), 4, 3, kind="1f1b")):
        assert Schedule.from_csv(sched.to_csv()) == sched
        assert Schedule.from_json(json.dumps(sched.to_json())) == sched


def test_edges_are_kept_by_the_waiting_actions_place_then_as_given() -> None:
    # The canonical order equal schedules share: an edge into an earlier action of the
    # lists first, edges into one action (or into none the lists hold) in the order given.
    plan = make_plan()
    lowered, _ = lower(build_schedule(plan, 4, 3, rounds=1, steps=2), plan)
    place = {a: i for i, a in enumerate(lowered.all_actions())}
    end = len(place)
    expected = sorted(lowered.edges, key=lambda e: place.get(e.dst, end))
    assert list(lowered.edges) == expected
    stray = Action(3, "F", 0, 99, 0, 0)  # no list holds it: after every other edge
    shuffled = [Edge(a, stray, "data") for a in lowered.actions[0][:2]]
    shuffled += list(reversed(lowered.edges))
    again = lowered.replace(edges=shuffled)
    rest = sorted(reversed(lowered.edges), key=lambda e: place[e.dst])
    assert again.edges == (*rest, *shuffled[:2])
    assert lowered.replace(edges=list(lowered.edges)).edges == lowered.edges
    # Edges holding equal copies of the listed actions (as a file read back holds) are
    # placed by equality, in the same order.
    copies = [Edge(Action.parse(str(e.src)), Action.parse(str(e.dst)), e.kind)
              for e in reversed(lowered.edges)]
    assert lowered.replace(edges=copies).edges == tuple(rest)


def test_dump_by_extension(tmp_path) -> None:
    plan = make_plan()
    sched, _ = lower(build_schedule(plan, 4, 2, steps=2), plan)
    for ext in ("csv", "json", "txt", "png"):
        sched.dump(tmp_path / f"s.{ext}")
    assert Schedule.load(tmp_path / "s.csv") == sched
    assert Schedule.load(tmp_path / "s.json") == sched
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "s.txt").read_text().startswith("step")
    trace = json.loads((tmp_path / "s.json").read_text())["traceEvents"]
    xs = [e for e in trace if e["ph"] == "X"]
    assert len(xs) == sum(1 for _ in sched.all_actions())
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert all(names[(e["pid"], e["tid"])] == Action.parse(e["args"]["action"]).stream
               for e in xs)
    assert sum(1 for e in trace if e["ph"] == "s") == len(sched.edges)
    assert sum(1 for e in trace if e["ph"] == "f") == len(sched.edges)
    with pytest.raises(ValueError, match=r"\.csv"):
        sched.dump(tmp_path / "s.xlsx")
    with pytest.raises(ValueError, match="no schedule"):
        Schedule.from_json({"traceEvents": []})


def test_json_uses_given_timeline() -> None:
    sched = build_schedule(make_plan(), 4, 2)
    a = sched.actions[0][0]
    doc = sched.to_json(timeline={a: (2.5, 4.0)})
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 1 and xs[0]["ts"] == 2500.0 and xs[0]["dur"] == 1500.0


def test_dry_run_finds_deadlock_and_grid_marks_it() -> None:
    # two workers, each waiting for the other's second action before its first
    a0, a1 = Action(0, "F", 0, 0, 0), Action(0, "F", 0, 1, 0)
    b0, b1 = Action(1, "F", 1, 0, 0), Action(1, "F", 1, 1, 0)
    sched = Schedule("roundpipe", 2, 2, 1, 1, "sync", ("F1", "F2"), ((0, 0), (1, 1)), (),
                     ((a0, a1), (b0, b1)), edges=(Edge(b1, a0, "data"), Edge(a1, b0, "data")))
    dry = sched.dry_run()
    assert not dry.ok and set(dry.blocked) == {a0, b0}
    grid = sched.grid(mark=a0, dry=dry)
    assert "!!F s0 m0 r0!!" in grid and "blocked" in grid and "<-- here" in grid
