"""The cross-rank gradient reduction is part of the schedule: REDUCE actions on the host's
network lane, lowered only for data parallel over more than one rank, run by the executor
exactly where the schedule puts them, and timed by the simulator on the inter-server link.

The lowering is checked against the model's own parameters (each reduced once, a tied one
after its last gradient stage); the run against a log of every action taken with this test's
own clock (two processes, gloo, virtual workers); the simulator against the ring all-reduce
formula, on a profile whose host memory is far faster than its link (a reduction that
overlaps a host memory pass shares the bus, by a bounded share)."""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.ir import ORDERED_STREAMS, ActionKind
from rpcompile.options import PlanOptions, TrainOptions
from rpcompile.passes.lower import DATA_PARALLEL_PASSES, LOWERING_PASSES
from tests.option_groups import grouped
from tests.runtime.test_distributed import _batches, _sgd, _share, _spawn
from tests.tiny_models import hf_model


def _tied(ranks=None, **options):
    batch = _share(_batches()[0], 0, ranks or 1)
    return rpcompile.compile(hf_model("qwen3_tied"), gpus=2, microbatches=2,
                             example_inputs=batch, optimizer=_sgd, device="virtual",
                             **grouped(ranks=ranks, **options))


def _first_opts(sched):
    first = {}
    for a in sched.host:
        if a.kind == "OPT":
            first.setdefault(a.step, a)
    return first


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_ranks_lower_one_reduce_per_gradient_stage_and_the_check_waits(mode):
    two, one = _tied(2, mode=mode), _tied(1, mode=mode)
    try:
        sched, single = two.schedule, one.schedule
        assert single.ranks == 1 and not single.network and single.passes == LOWERING_PASSES
        assert not any(a.kind == "REDUCE" for a in single.all_actions())
        assert sched.ranks == 2 and sched.passes == DATA_PARALLEL_PASSES
        last = sched.rounds - 1
        model = two.model
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for k in range(sched.steps):
            accs = [a for a in sched.host if a.kind == "ACC" and a.step == k and a.round == last]
            reds = [a for a in sched.network if a.step == k]
            # One REDUCE per gradient stage, in the order their gradients come home.
            assert [r.stage for r in reds] == [a.stage for a in accs]
            assert all(r.stream == "network" and r.worker is None for r in reds)
            for acc, red in zip(accs, reds):
                assert any(e.src == acc and e.dst == red and e.kind == "reduce_ready"
                           for e in sched.edges)
            first = _first_opts(sched)[k]
            host = list(sched.host)
            check = next(a for a in host if a.kind == "CHECK" and a.step == k)
            # The step's gradient check (its CHECK, after its last ACC) waits for the last
            # REDUCE, and the network lane is ordered, so for every one of them.
            assert any(e.src == reds[-1] and e.dst == check and e.kind == "reduced"
                       for e in sched.edges)
            assert host.index(check) > max(host.index(a) for a in accs)
            if mode == "sync":
                # Every OPT of the step is after the check (host queue order).
                assert all(host.index(o) > host.index(check) for o in host
                           if o.kind == "OPT" and o.step == k)
                assert host.index(first) > max(host.index(a) for a in accs)
            else:
                # Step k's OPTs apply step k-1's reduced gradients (checked at its end): they
                # lead the step's host queue; step k+1 starts after the step's CHECK, which
                # follows the last REDUCE.
                assert host.index(first) < min(host.index(a) for a in accs)
            # Every parameter reduced once: the bytes add up to the model's fp32 gradients,
            # and the tied embedding waits for the last of its two stages.
            assert sum(r.bytes for r in reds) == 4 * sum(p.numel() for p in trainable.values())
            tail = next(r for r in reds if two.stages[r.stage].kind == "tail")
            tail_acc = next(a for a in accs if a.stage == tail.stage)
            assert tail.bytes < tail_acc.bytes  # the borrowed embedding is reduced later
            assert tail_acc.bytes - tail.bytes == 4 * model.get_input_embeddings().weight.numel()
        assert sched.dry_run().ok
        # The network lane and the ranks survive a CSV and a JSON round trip.
        from rpcompile.ir import Schedule

        assert Schedule.from_csv(sched.to_csv()) == sched
        assert Schedule.from_json(sched.to_json()) == sched
        assert "# ranks" not in single.to_csv()  # one-process schedules read as before
    finally:
        two.close()
        one.close()


def test_a_plan_for_other_ranks_than_the_run_has_is_refused():
    compiled = _tied(2)
    try:
        with pytest.raises(ValueError, match=r"lowered for 2 data-parallel ranks.*ranks=1"):
            compiled.trainer()
    finally:
        compiled.close()
    with pytest.raises(ValueError, match=r"data parallel .*updates='deferred'"):
        _tied(2, updates="overlap")


# -- at run time: two processes --------------------------------------------------------------


def _protocol_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = {shard: _protocol_case(rank, world, shard) for shard in (False, True)}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _protocol_case(rank: int, world: int, shard: bool) -> dict:
    """One run's step 1 with every action logged, and the bytes each REDUCE and SHADOW made
    gloo move (counted at torch.distributed's reduce / all_reduce / broadcast calls)."""
    import torch.distributed as dist

    from rpcompile.runtime.executor import Executor
    from rpcompile.sim.sharding import shadow_gather_bytes

    batches = [_share(b, rank, world) for b in _batches()]
    compiled = rpcompile.compile(hf_model("qwen3_tied", seed=rank), gpus=2, microbatches=2,
                                 example_inputs=batches[0], optimizer=_sgd, device="virtual",
                                 plan=PlanOptions(shard_optimizer=shard),
                                 train=TrainOptions(chaos=rank + 1))
    trainer = compiled.trainer()
    sched = trainer.schedule
    compiled.step(batches[0])  # step 0: its own schedule step, not logged
    log: list[tuple[object, float, float]] = []
    lock = threading.Lock()
    launched: dict[object, int] = {}
    moved: dict[object, dict[str, int]] = {}
    sent = {"reduce": 0, "all_reduce": 0, "broadcast": 0}  # bytes, by collective
    collectives = {name: getattr(dist, name) for name in sent}
    for name, original in collectives.items():
        def counting(tensor, *args, name=name, original=original, **kwargs):
            sent[name] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        setattr(dist, name, counting)
    originals = {k: getattr(Executor, f"_do_{k.value}") for k in ActionKind}
    for kind, original in originals.items():
        def wrapped(self, run, a, original=original):
            begin = time.perf_counter()
            before, counts = self.reducer.reductions, dict(sent)
            original(self, run, a)
            end = time.perf_counter()
            with lock:
                log.append((a, begin, end))
                if a.kind in ("REDUCE", "SHADOW"):
                    # One network thread and one host queue: no other REDUCE or SHADOW ran
                    # in between, and a REDUCE never broadcasts, a SHADOW never reduces.
                    moved[a] = {k: sent[k] - counts[k] for k in sent}
                if a.kind == "REDUCE":
                    launched[a] = self.reducer.reductions - before
        setattr(Executor, f"_do_{kind.value}", wrapped)
    step = trainer.executor.steps_run % sched.steps
    compiled.step(batches[1])
    for kind, original in originals.items():
        setattr(Executor, f"_do_{kind.value}", original)
    for name, original in collectives.items():
        setattr(dist, name, original)
    ran = [a for a, _, _ in log]
    expected = [a for a in sched.all_actions() if a.step == step]
    measured = {a: (b, e) for a, b, e in log}
    # What each REDUCE reduced, from the host store's own record of which gradient stages
    # every parameter has (not from the plan the lowering read).
    store = trainer.store
    done: set[int] = set()
    pending = list(store.trainable_slots)
    reduced = {}
    for a in sched.network:
        if a.step != step:
            continue
        done.add(a.stage)
        ready = [s for s in pending if set(s.grad_stages) <= done]
        pending = [s for s in pending if s not in ready]
        reduced[str(a)] = (a.bytes, 4 * sum(s.numel for s in ready))
    # What the replay of a sharded schedule times: each REDUCE's bytes reduced to their
    # owners, and at each SHADOW the shadows it gathers (rpcompile.sim.sharding).
    gathers = shadow_gather_bytes(sched, compiled.plan) if sched.sharded else {}
    result = {
        "sharded": sched.sharded,
        "twice": len(ran) - len(set(ran)),
        "missing": [str(a) for a in set(expected) - set(ran)],
        "extra": [str(a) for a in set(ran) - set(expected)],
        "reduces": sum(1 for a in ran if a.kind == "REDUCE"),
        "grad_stages": sum(1 for p in compiled.stages if p.kind != "forward"),
        "launched": {str(a): n for a, n in launched.items()},
        "reduced": reduced,
        "moved": {str(a): (a.kind, a.bytes, gathers.get(a), m) for a, m in moved.items()
                  if a.step == step},
        "shadow_bytes": sum(s.numel for s in store.trainable_slots)
        * store.shadow.element_size(),
        "broken": [f"{e.kind}: {e.src} -> {e.dst}" for e in sched.edges
                   if e.src in measured and e.dst in measured
                   and measured[e.src][1] > measured[e.dst][0]],
        "unordered": [stream for (_, stream), queue in sched.queues().items()
                      if stream in ORDERED_STREAMS and
                      [measured[a][0] for a in queue if a.step == step] !=
                      sorted(measured[a][0] for a in queue if a.step == step)],
        "masters": trainer.gather_masters(),
    }
    compiled.close()
    return result


def test_at_run_time_every_reduce_runs_once_where_the_schedule_puts_it(tmp_path):
    """Replicated and sharded: every action once, every edge held, and what each REDUCE and
    SHADOW made gloo move is what the schedule (and, sharded, the replay) says it moves."""
    ranks = _spawn(_protocol_rank, 2, tmp_path)
    assert all(r is not None for r in ranks), "a rank failed (see its output)"
    for shard in (False, True):
        for r in (rank[shard] for rank in ranks):
            assert r["sharded"] == shard
            assert r["twice"] == 0 and not r["missing"] and not r["extra"], r
            assert r["reduces"] == r["grad_stages"] >= 2  # one per gradient stage
            assert not r["broken"], r["broken"]
            assert not r["unordered"], r["unordered"]
            # Each REDUCE's bytes are what it reduced: the lowering (from the plan's units)
            # and the runtime (from the host store's slots) agree, the tied embedding included.
            for bytes_, expected in r["reduced"].values():
                assert bytes_ == expected
            assert sum(r["launched"].values()) >= 2  # each REDUCE launched its own collectives
            assert all(n >= 1 for n in r["launched"].values())
            collective = "reduce" if shard else "all_reduce"
            gathered = 0
            for kind, bytes_, gather, m in r["moved"].values():
                if kind == "REDUCE":  # its gradients, once, by the collective of its mode
                    assert m == {"reduce": 0, "all_reduce": 0, "broadcast": 0,
                                 collective: bytes_}, (kind, bytes_, m)
                elif shard:  # SHADOW: the replay's gathered bytes are what it broadcast
                    assert m["broadcast"] == gather and not m["reduce"], (bytes_, gather, m)
                    gathered += gather
                else:
                    assert not any(m.values()), m
            if shard:  # every trainable parameter's shadow gathered once in the step
                assert gathered == r["shadow_bytes"] > 0
        first, second = (rank[shard] for rank in ranks)
        for name, value in first["masters"].items():
            assert torch.equal(value, second["masters"][name]), name


# -- in the simulator --------------------------------------------------------------------------


@functools.cache
def _sim_plan():
    from rpcompile.hardware import get_hardware
    from rpcompile.planner.partition import partition
    from rpcompile.workloads.paper import MODELS

    # Host memory far faster than any link: with a link without latency a REDUCE then takes
    # exactly its ring time, 2 (N-1)/N x bytes / bandwidth, unless a host memory pass shares
    # the bus with it (_check_reduction_times bounds that share). One sync step of 27 layers
    # of Qwen3-1.7B on 4 workers (the search's plan; the test reads its gradient stage count
    # from the plan).
    hw = replace(get_hardware("rtx4090x8").with_gpus(4), host_mem_gbps=1e6)
    units = MODELS["qwen3-1.7b"].units(2, 1024)
    units = units[:29] + units[-1:]
    return partition(units, hw, PlanOptions(gpus=4, microbatches=5, rounds=1, mode="async"),
                     microbatch_size=2, seq_len=1024), hw


@functools.cache
def _sim_case(gbit: float, sharded: bool = False):
    from rpcompile.hardware import Link
    from rpcompile.passes.lower import lower
    from rpcompile.passes.schedule import build_schedule
    from rpcompile.sim import simulate, simulate_roundpipe

    plan, hw = _sim_plan()
    link = Link("test", "test link", gbit_per_s=gbit, efficiency=1.0, latency_us=0.0)
    two = simulate_roundpipe(plan, hw.with_link(link), optimizer="sync", ranks=2,
                             sharded=sharded)
    # One server with the same update order (data parallel defers sync updates).
    sched = build_schedule(plan, 4, 5, kind="roundpipe", optimizer="sync")
    one = simulate(lower(sched, plan, updates="deferred")[0], plan, hw)
    return one, two


def _ring_ms(a, gbit: float) -> float:
    return a.bytes * 8 / (gbit * 1e9) * 1e3  # 2 (N-1)/N = 1 for two ranks


def _check_reduction_times(run, gbit: float, hw) -> None:
    """Each REDUCE of ``run`` takes its ring time (a ring all-reduce and, on two ranks, gloo's
    reduce to the owners alike: 2 (N-1)/N x bytes / bandwidth) when no host memory pass
    overlaps it. A memory pass (ACC, SHADOW) asks for the bus's full rate however fast the bus
    is, and the replay shares the bus in proportion to demand: a REDUCE beside one is slower,
    at most by the share of the bus that it and every worker's two links (all that can run
    beside the pass) ask for."""
    from rpcompile.sim.engine import GLOO_HOST_BYTES_PER_BYTE

    bus = hw.host_mem_gbps * 1e6  # bytes per ms
    others = GLOO_HOST_BYTES_PER_BYTE / 2 * gbit * 1e9 / 8 * 1e-3  # a REDUCE's own demand
    others += run.schedule.workers * (hw.h2d_gbps + hw.d2h_gbps) * 1e6
    tl = run.timeline
    passes = [tl[x] for x in run.schedule.host if x.kind in ("ACC", "SHADOW")]
    reds = run.schedule.network
    alone = 0
    for a in reds:
        start, end = tl[a]
        ring = _ring_ms(a, gbit)
        if not any(s < end and e > start for s, e in passes):
            assert end - start == pytest.approx(ring, rel=1e-6), a
            alone += 1
        else:
            assert ring * (1 - 1e-9) <= end - start <= ring * (1 + others / bus) * (1 + 1e-9), a
    assert alone >= len(reds) // 2  # most run alone: the equality is what is tested


def test_the_reduction_time_follows_the_link_bandwidth():
    one, fast = _sim_case(800.0)
    _, slow = _sim_case(400.0)
    plan, hw = _sim_plan()
    gradient_stages = sum(1 for st in plan.stages if st.kind != "forward")
    assert gradient_stages >= 4
    for run, gbit in ((fast, 800.0), (slow, 400.0)):
        reds = run.schedule.network
        assert len(reds) == gradient_stages  # one REDUCE per gradient stage and step
        _check_reduction_times(run, gbit, hw)
        # The last reduction has nothing left to hide behind: the time data parallel adds
        # to the step is its ring time, exposed.
        assert run.makespan_ms - one.makespan_ms == pytest.approx(_ring_ms(reds[-1], gbit),
                                                                  rel=1e-6)
    exposed, exposed_slow = fast.makespan_ms - one.makespan_ms, slow.makespan_ms - one.makespan_ms
    assert exposed > 1.0
    assert exposed_slow == pytest.approx(2 * exposed, rel=1e-6)


def test_a_fast_link_hides_the_reductions_behind_backward_jobs():
    _, run = _sim_case(400.0)
    tl = run.timeline
    last_backward = max(tl[a][1] for lst in run.schedule.actions for a in lst if a.is_compute)
    reds = run.schedule.network
    hidden = [a for a in reds if tl[a][1] <= last_backward]
    # Most stages' reductions end while later backward jobs still compute, each starting as
    # soon as its stage's gradients are home and the reduction before it is done.
    assert len(hidden) >= len(reds) // 2
    previous_end = 0.0
    for a in reds:
        acc = next(x for x in run.schedule.host if x.kind == "ACC" and x.stage == a.stage)
        assert tl[a][0] == pytest.approx(max(tl[acc][1], previous_end))
        previous_end = tl[a][1]


def test_a_sharded_run_is_timed_as_reduces_to_owners_and_shadow_broadcasts():
    """Sharded (``Schedule.sharded``): each REDUCE is gloo's reduce to the owners (on two
    ranks as long as the ring all-reduce: 2 (N-1)/N x bytes), and each SHADOW adds the
    broadcast of the shadows it gathers, one binomial-tree round on two ranks; every
    trainable parameter's shadow is gathered once per step. All of that traffic is exposed
    after the step's last backward, so halving the bandwidth doubles the exposed time."""
    from rpcompile.sim.sharding import shadow_gather_bytes

    plan, hw = _sim_plan()
    one, fast = _sim_case(800.0, True)
    _, slow = _sim_case(400.0, True)
    _, replicated = _sim_case(800.0)
    assert fast.schedule.sharded and not replicated.schedule.sharded
    for run, gbit in ((fast, 800.0), (slow, 400.0)):
        gathers = shadow_gather_bytes(run.schedule, plan)
        # The shadows of every trainable parameter once (the tail borrows the tied embedding
        # from the prefix, which owns it: counted once, as the plan does).
        trainable = sum(u.trainable_params for u in plan.units)
        assert sum(gathers.values()) == 2 * trainable  # bf16 shadows
        _check_reduction_times(run, gbit, hw)
        for a in run.schedule.host:
            if a.kind == "SHADOW":
                start, end = run.timeline[a]
                alone = one.timeline[a]  # the same action in one server's schedule
                assert (end - start) - (alone[1] - alone[0]) == pytest.approx(
                    gathers[a] * 8 / (gbit * 1e9) * 1e3, rel=1e-6, abs=1e-9)
        reds = run.schedule.network
        exposed = run.makespan_ms - one.makespan_ms
        broadcast_ms = sum(gathers.values()) * 8 / (gbit * 1e9) * 1e3
        assert exposed == pytest.approx(_ring_ms(reds[-1], gbit) + broadcast_ms, rel=1e-6)
    exposed_fast = fast.makespan_ms - one.makespan_ms
    assert exposed_fast > replicated.makespan_ms - one.makespan_ms > 1.0
    assert slow.makespan_ms - one.makespan_ms == pytest.approx(2 * exposed_fast, rel=1e-6)


def test_a_sharded_schedule_says_so_and_survives_a_round_trip():
    from rpcompile.ir import Schedule

    _, run = _sim_case(800.0, True)
    sched = run.schedule
    assert sched.sharded and "# sharded: true" in sched.to_csv()
    assert Schedule.from_csv(sched.to_csv()) == sched
    assert Schedule.from_json(sched.to_json()) == sched
    assert "# sharded" not in _sim_case(800.0)[1].schedule.to_csv()
    with pytest.raises(ValueError, match="needs ranks > 1"):
        sched.replace(ranks=1)
