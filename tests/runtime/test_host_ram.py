"""Host memory planned against the host's RAM (compile() warns, the Trainer refuses), and the
undo journal as an option: its host bytes, its simulated time, and what a failed step means
without it (the trainer stops until a checkpoint is loaded)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import rpcompile
from rpcompile.hardware import get_hardware, host_ram_bytes
from rpcompile.ir import ActionKind
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import (
    HostMemoryError,
    HostMemoryWarning,
    format_bytes,
    host_memory,
)
from rpcompile.runtime.executor import StepFailed
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from tests.option_groups import grouped
from tests.tiny_models import hf_model, token_batch


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


def _compile(**options):
    return rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                             example_inputs=token_batch(4), device="virtual", **grouped(**options))


@pytest.fixture(scope="module")
def compiled():
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)  # a tiny model fits any machine
        return _compile()


def test_compile_warns_when_the_host_bytes_exceed_the_stated_ram(compiled):
    host = compiled.host
    # The figure compile() checks: the plan's static buffers (journal included) and the
    # transfer staging of a simulated run of the schedule it keeps.
    run = simulate(compiled.schedule, compiled.plan, compiled.hardware)
    assert host == host_memory(compiled.plan, "sync", run.peak_host_bytes)
    assert host.journal > 0 and host.transfers > 0
    # The default RAM: a profile without host_ram_gib, so this machine's, probed.
    assert compiled.host_ram == (host_ram_bytes(), "this machine's, probed")

    small = host.total - 1
    with pytest.warns(HostMemoryWarning) as caught:
        stated = _compile(host_ram_bytes=small)
    text = str(caught[0].message)
    assert stated.host_ram == (small, "host_ram_bytes")
    assert f"needs {format_bytes(host.total)} of host memory" in text
    assert f"than the {format_bytes(small)} of RAM (host_ram_bytes)" in text
    assert "LoRA" in text and "undo_journal=False" in text and "more RAM" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        _compile(host_ram_bytes=host.total)  # exactly enough: no warning
    # A profiled machine's own RAM is the default, named as the figure's source.
    profiled = replace(get_hardware("cpu"), host_ram_gib=small / 2**30)
    with pytest.warns(HostMemoryWarning, match=r"\(the cpu profile\).*state it with "
                                               r"host_ram_bytes"):
        on_profile = _compile(hardware=profiled)
    assert on_profile.host_ram[1] == "the cpu profile"


def test_the_trainer_refuses_to_build_a_host_store_beyond_the_stated_ram(compiled,
                                                                          monkeypatch):
    from rpcompile.runtime.memory import HostStore

    built = []
    real = HostStore.build.__func__
    monkeypatch.setattr(HostStore, "build",
                        classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    host = compiled.host
    with pytest.raises(HostMemoryError) as refused:
        Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                        host_ram_bytes=host.total - 1))
    text = str(refused.value)
    assert "refuses to build its host store" in text
    assert f"needs {format_bytes(host.total)}" in text and "(host_ram_bytes)" in text
    assert "LoRA or fewer trainable parameters" in text
    assert f"the undo journal off (undo_journal=False: {format_bytes(host.journal)} less" in text
    assert not built  # refused before anything was allocated
    # The fix it names fits: without the journal the same RAM holds the run.
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                         host_ram_bytes=host.total - host.journal),
                 plan=replace(compiled.options.plan, undo_journal=False)) as trainer:
        assert trainer.host_memory.total == host.total - host.journal
        trainer.step(token_batch(4))
    assert built


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_host_figure_without_the_journal_is_less_by_exactly_the_journal(compiled, mode):
    with_journal = host_memory(compiled.plan, mode)
    without = host_memory(compiled.plan, mode, journal=False)
    assert with_journal.journal > 0 and without.journal == 0
    assert without.total == with_journal.total - with_journal.journal
    assert replace(without, journal=with_journal.journal) == with_journal
    # The simulator's host peak drops the journal too (its static part is the figure's).
    sched = compiled.schedule
    on = simulate(sched, compiled.plan, compiled.hardware).peak_host_bytes
    off = simulate(sched, compiled.plan,
                   compiled.hardware.with_undo_journal(False)).peak_host_bytes
    static = host_memory(compiled.plan, "sync")
    assert on >= static.total and static.total - static.journal <= off < on
    # compile() carries the option to the profile every replay and bound reads, and the
    # Trainer's driver keeps no journal: nothing is saved before an update.
    off_compiled = _compile(undo_journal=False)
    assert off_compiled.hardware.undo_journal is False and compiled.hardware.undo_journal
    assert off_compiled.host.journal == 0
    saved = []
    with Trainer(off_compiled, train=replace(off_compiled.options.train, optimizer=SGD),
                 plan=replace(off_compiled.options.plan, mode=mode)) as trainer:
        assert trainer.driver.rollback is False
        commit = trainer.driver.commit_step

        def watching_commit(skipped=False):
            saved.append(trainer.driver._open.journal)
            return commit(skipped)

        trainer.driver.commit_step = watching_commit
        for seed in range(2):
            trainer.step(token_batch(4, seed=seed))
    assert saved == [None, None]


def test_simulated_opt_without_the_journal_is_shorter_by_its_traffic(compiled):
    from rpcompile.compiler import runtime_schedule
    from rpcompile.planner.bound import (
        _Costs,
        _host_queue,
        _step_paths,
        simulated_lower_bound,
    )
    from rpcompile.sim.engine import JOURNAL_BYTES_PER_PARAM, SIM_COSTS
    from rpcompile.sim.sharding import shadow_journal_bytes

    hw = compiled.hardware
    sched, plan = compiled.schedule, compiled.plan
    host_rate = hw.host_mem_gbps * 1e6  # bytes per ms
    journaled = shadow_journal_bytes(sched, plan)

    def alone_ms(kind, a, on):
        replay = SimpleNamespace(hw=hw.with_undo_journal(on), host_rate=host_rate,
                                 sched=sched, journaled=journaled if on else
                                 dict.fromkeys(journaled, 0))
        work, rate = SIM_COSTS[kind](replay, a)
        return work / rate, work

    opts = [a for a in sched.host if a.kind == "OPT"]
    shadows = [a for a in sched.host if a.kind == "SHADOW"]
    assert opts and shadows
    for a in opts:
        (ms_on, work_on), (ms_off, work_off) = (alone_ms(ActionKind.OPT, a, on)
                                                for on in (True, False))
        params = a.bytes / 4
        assert work_on - work_off == pytest.approx(JOURNAL_BYTES_PER_PARAM * params)
        assert ms_on - ms_off == pytest.approx(JOURNAL_BYTES_PER_PARAM * params / host_rate)
    for a in shadows:
        (_, work_on), (_, work_off) = (alone_ms(ActionKind.SHADOW, a, on) for on in (True, False))
        assert work_on - work_off == pytest.approx(2 * journaled[a])
    # The whole replay: no slower without the journal, and the planner's bound, which no
    # longer charges it either, stays below the replay (sound); its host queue's end falls.
    one = runtime_schedule(plan, PlanOptions(gpus=2, microbatches=2, rounds=1, mode="sync",
                                             schedule_steps=1))
    on_ms = simulate(one, plan, hw).makespan_ms
    off_ms = simulate(one, plan, hw.with_undo_journal(False)).makespan_ms
    assert off_ms <= on_ms
    bound_on = simulated_lower_bound(plan, hw, 1, "sync")
    bound_off = simulated_lower_bound(plan, hw.with_undo_journal(False), 1, "sync")
    assert bound_off <= bound_on and bound_off <= off_ms and bound_on <= on_ms
    _end, home = _step_paths(plan, hw, _Costs(plan, hw, 1))
    assert _host_queue(plan, hw.with_undo_journal(False), 1, home) < \
        _host_queue(plan, hw, 1, home)


class _FailingAdamW(torch.optim.AdamW):
    """AdamW whose ``fail_at``-th group update (counted over the run) raises after updating
    nothing of its own group: the groups before it in the step are already applied."""

    calls = 0
    fail_at: int | None = None

    @torch.no_grad()
    def step(self, closure=None):
        type(self).calls += 1
        if type(self).calls == type(self).fail_at:
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_without_the_journal_a_failed_update_stops_the_trainer(compiled, mode, monkeypatch):
    monkeypatch.setattr(_FailingAdamW, "calls", 0)
    with Trainer(compiled,
                 train=replace(compiled.options.train,
                               optimizer=lambda p: _FailingAdamW(p, lr=1e-2), device="virtual"),
                 plan=replace(compiled.options.plan, mode=mode, undo_journal=False)) as trainer:
        groups = len(trainer.driver.groups)
        assert groups >= 2  # a failure after the first group leaves the update half-applied
        trainer.step(token_batch(4, seed=0))
        trainer.step(token_batch(4, seed=1))
        saved = trainer.state_dict()  # (async: flushed, so the next step applies nothing)
        if mode == "async":
            trainer.step(token_batch(4, seed=2))  # its gradients are the next step's update
        # The next update fails at its second group: its first group is applied.
        monkeypatch.setattr(_FailingAdamW, "fail_at", _FailingAdamW.calls + 2)
        before = trainer.store.master.clone()
        # The executor reports it (StepFailed, or the driver's refusal to discard a step
        # whose groups were updated and cannot be put back); the trainer adds why it stops.
        with pytest.raises(RuntimeError) as failed:
            trainer.step(token_batch(4, seed=3))
        assert "refuses to go on" in "\n".join(getattr(failed.value, "__notes__", []))
        half = trainer.store.master.clone()
        assert not torch.equal(half, before)  # nothing put it back: half-updated
        # The next step is refused, not trained on those weights; so are reads of them.
        for call in (lambda: trainer.step(token_batch(4, seed=3)), trainer.masters,
                     trainer.state_dict, trainer.sync_to_model):
            with pytest.raises(RuntimeError, match=r"undo_journal=False.*Restore the last "
                                                   r"checkpoint \(trainer.load_checkpoint"):
                call()
        assert torch.equal(trainer.store.master, half)
        # Loading the saved state restores the run: it trains again from there.
        monkeypatch.setattr(_FailingAdamW, "fail_at", None)
        trainer.load_state_dict(saved)
        assert trainer.steps_done == saved["step"]
        trainer.step(token_batch(4, seed=2))
        assert trainer.steps_done == saved["step"] + 1


def test_with_the_journal_the_same_failure_is_undone_and_training_goes_on(compiled,
                                                                        monkeypatch):
    # The contrast: the default keeps the journal, so the failed update is put back and the
    # next step trains (what the refusal above guards against without it).
    monkeypatch.setattr(_FailingAdamW, "calls", 0)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: _FailingAdamW(p, lr=1e-2),
                                         device="virtual")) as trainer:
        trainer.step(token_batch(4, seed=0))
        monkeypatch.setattr(_FailingAdamW, "fail_at", _FailingAdamW.calls + 2)
        before = trainer.store.master.clone()
        with pytest.raises(StepFailed, match="was undone"):
            trainer.step(token_batch(4, seed=2))
        assert torch.equal(trainer.store.master, before)
        trainer.step(token_batch(4, seed=2))
        assert trainer.steps_done == 2


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_no_undo_journal_flag(tmp_path, capsys):
    from rpcompile.cli import main

    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "2", "--seq", "128", "--batch",
               "9", "--host-ram", "1", "--no-fit-search", "--no-undo-journal",
               "--out", str(tmp_path)])
    assert rc == 0
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["undo_journal"] is False and summary["host"]["journal"] == 0
    text = capsys.readouterr().out
    warning = next(t for t in text.splitlines() if t.startswith("warning: the plan needs"))
    assert "more than the 1.00 GiB of RAM (--host-ram)" in warning
    assert "LoRA" in warning and "--no-undo-journal" not in warning  # already off


def test_a_profiles_ram_plans_the_server_and_the_trainer_checks_this_machine(monkeypatch):
    # rtx4090x8 is a 512 GB server (an assumption stated in the profile, README): compile()
    # checks a plan for it against that figure, whatever this machine has; the Trainer,
    # which allocates the host store here, checks this machine's RAM.
    import rpcompile.hardware as hardware

    monkeypatch.setattr(hardware, "host_ram_bytes", lambda: 1)  # this machine: 1 byte
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        remote = _compile(hardware="rtx4090x8")
    assert get_hardware("rtx4090x8").host_ram_gib == pytest.approx(512e9 / 2**30, abs=0.01)
    assert remote.host_ram == (int(476.84 * 2**30), "the rtx4090x8 profile")
    with pytest.raises(HostMemoryError, match=r"1 B of RAM \(this machine's, probed\)"):
        Trainer(remote, train=replace(remote.options.train, optimizer=SGD, device="virtual"))


def test_the_pinned_figure_is_what_a_cuda_store_pins(compiled, monkeypatch):
    # On CUDA the host store registers its flat buffers with the driver (shadows, masters,
    # gradients, the pending gradients); HostMemory.pinned counts those and the staging. The
    # registration is faked here (no GPU): every buffer asked for pinned is recorded.
    import rpcompile.runtime.memory.store as memory

    pinned = []

    def fake_flat(numel, dtype, pin):
        flat = torch.empty(numel, dtype=dtype)
        if pin:
            pinned.append(flat.nbytes)
        return flat, "registered" if pin else "no"

    monkeypatch.setattr(memory, "_host_flat", fake_flat)
    store = Trainer._build_store(compiled, pin=True)
    store.add_pending()  # async: the second gradient buffer
    store.add_shadow_pair()  # async: the second copy of the trainable shadow
    host = host_memory(compiled.plan, "async", journal=False)
    assert sum(pinned) == host.pinned - host.transfers == \
        host.shadows + host.masters + host.gradients
    assert host.pinned < host.total  # the optimizer state and the module are not pinned
