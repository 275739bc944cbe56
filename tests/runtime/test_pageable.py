"""Pinned or pageable host memory (PlanOptions.host_memory): one bandwidth
for the simulator and the partitioner's bounds, a clear refusal where the profile has no
pageable figures, the plan saying which it assumes, and the runtime's pin decision."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import host_memory
from rpcompile.planner.bound import simulated_lower_bound
from rpcompile.planner.partition import build_plan, partition
from rpcompile.runtime.memory import pin_host_memory
from rpcompile.runtime.trainer import Trainer
from rpcompile.runtime.trainer import core as trainer_core
from rpcompile.runtime.workers import devices as workers_module
from rpcompile.sim import simulate_roundpipe
from rpcompile.workloads.paper import get_model
from tests.tiny_models import hf_model, token_batch

# Links that are the only limit on a transfer's time: no DMA latency, host memory never a
# limit (1e6 GB/s: within 1e-6 of none); pageable links a quarter of the pinned ones.
LINKS = dict(transfer_latency_us=0.0, host_mem_gbps=1e6, h2d_gbps=24.0, d2h_gbps=20.0,
             pageable_h2d_gbps=6.0, pageable_d2h_gbps=5.0)


def _profile() -> Hardware:
    return replace(get_hardware("rtx4090x8"), **LINKS)


def _hand_plan(hw: Hardware):
    """A plan cut by hand (not the search's pick): ten units of Qwen3-1.7B at 4 x 2048."""
    units = get_model("qwen3-1.7b").units(4, 2048)[:10]
    return build_plan(units, (0, 3, 6), (0, 2, 4, 6, 8), 9, hw, 4, 6, 4, 2048,
                      optimizer="sync")


@pytest.mark.parametrize("kind", ["pinned", "pageable"])
def test_simulated_transfers_take_their_bytes_over_the_chosen_bandwidth(kind):
    hw = _profile().with_host_memory(kind)
    h2d, d2h = (24.0, 20.0) if kind == "pinned" else (6.0, 5.0)
    assert (hw.link_h2d_gbps, hw.link_d2h_gbps) == (h2d, d2h)
    run = simulate_roundpipe(_hand_plan(hw), hw, steps=1, optimizer="sync")
    transfers = [(a, s, e) for a, (s, e) in run.timeline.items()
                 if a.kind in ("UP", "H2D", "D2H") and a.bytes]
    assert transfers
    # A transfer alone on its link (its worker's H2D or D2H direction) moves at that link's
    # rate from start to end; one sharing its link with another is slowed by it.
    alone = 0
    for a, s, e in transfers:
        down = a.kind == "D2H"
        if any(b is not a and b.worker == a.worker and (b.kind == "D2H") == down
               and bs < e and s < be for b, bs, be in transfers):
            continue
        alone += 1
        assert e - s == pytest.approx(a.bytes / ((d2h if down else h2d) * 1e6), rel=1e-6), a
    assert alone >= len(transfers) // 2
    assert {a.kind for a, _s, _e in transfers} == {"UP", "H2D", "D2H"}


def test_the_partitioners_bound_and_ranking_time_transfers_like_the_simulator():
    pinned, pageable = _profile(), _profile().with_host_memory("pageable")
    plan = _hand_plan(pinned)
    slow, fast = (simulated_lower_bound(plan, hw, optimizer="sync") for hw in (pageable, pinned))
    assert slow > fast  # the bound reads the chosen bandwidth
    for hw, bound in ((pinned, fast), (pageable, slow)):
        replay = simulate_roundpipe(plan, hw, steps=1, optimizer="sync").makespan_ms
        assert bound <= replay
    # The search ranks by replays on the profile it is given: its pick's predicted step is
    # that plan's replay from pageable memory, not from pinned.
    units = get_model("qwen3-1.7b").units(4, 2048)[:10]
    picked = partition(units, pageable, PlanOptions(gpus=4, microbatches=6, mode="sync",
                                                    max_simulations=4), microbatch_size=4,
                       seq_len=2048)
    on = {hw.host_memory: simulate_roundpipe(picked, hw, steps=1, optimizer="sync").makespan_ms
          for hw in (pinned, pageable)}
    assert picked.predicted_step_ms == pytest.approx(on["pageable"], rel=1e-9)
    assert on["pageable"] > on["pinned"]


def test_pageable_on_a_profile_without_its_figures_is_refused_before_capture(monkeypatch):
    def no_capture(*a, **k):
        raise AssertionError("captured before the profile was checked")

    monkeypatch.setattr("rpcompile.compiler.entry.capture_graph", no_capture)
    with pytest.raises(ValueError, match=r"'a800x8' profile.*pageable_h2d_gbps.*probe\(\)"):
        rpcompile.compile(hf_model("qwen3", layers=1), hardware="a800x8", device="virtual",
                          plan=PlanOptions(host_memory="pageable"))
    with pytest.raises(ValueError, match="host_memory must be one of 'pinned', 'pageable'"):
        rpcompile.compile(hf_model("qwen3", layers=1), plan=PlanOptions(host_memory="locked"))


def test_the_cli_refuses_pageable_on_a_profile_without_its_figures(capsys):
    assert main(["plan", "--model", "qwen3-tiny", "--hardware", "a800x8",
                 "--host-memory", "pageable"]) == 2
    err = capsys.readouterr().err
    assert "'a800x8' profile" in err and "pageable_d2h_gbps" in err


def test_the_pin_decision():
    assert pin_host_memory("pinned", "cuda") is True
    assert pin_host_memory("pageable", "cuda") is False
    assert pin_host_memory("pinned", "virtual") is False  # CPU copies either way
    assert pin_host_memory("pageable", "virtual") is False
    with pytest.raises(ValueError, match="host_memory must be one of"):
        pin_host_memory("locked", "cuda")


def test_cuda_workers_are_made_with_the_runs_host_memory(monkeypatch):
    # No GPU here: stand in for the CudaWorker class and check what make_workers gives it,
    # and what a CudaWorker's staging allocates from pageable memory.
    host_empty = workers_module.CudaWorker.host_empty
    made = []
    monkeypatch.setattr(workers_module, "CudaWorker",
                        lambda i, **kw: made.append(kw.get("host_memory")) or SimpleNamespace())
    workers_module.make_workers(2, "cuda", host_memory="pageable")
    workers_module.make_workers(1, "cuda")
    assert made == ["pageable", "pageable", "pinned"]
    with pytest.raises(ValueError, match="host_memory must be one of"):
        workers_module.make_workers(1, "virtual", host_memory="locked")
    buf = host_empty(SimpleNamespace(pinned=False), (3, 2), torch.float32)
    assert buf.shape == (3, 2) and not buf.is_pinned() and buf.device.type == "cpu"


def _spy(monkeypatch) -> list:
    seen = []
    real = trainer_core.pin_host_memory

    def spy(host_memory, kind):
        seen.append((host_memory, kind))
        return real(host_memory, kind)

    monkeypatch.setattr(trainer_core, "pin_host_memory", spy)
    return seen


def test_the_option_reaches_the_pin_decision_from_compile_and_the_trainer(monkeypatch):
    seen = _spy(monkeypatch)
    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual", plan=PlanOptions(host_memory="pageable"))
    try:
        assert compiled.options.plan.host_memory == "pageable"
        assert compiled.hardware.host_memory == "pageable"
        trainer = compiled.trainer()
        assert seen == [("pageable", "virtual")]
        assert trainer.pin_host is False and trainer.store.pin == "no"
        assert trainer.host_memory.pageable and trainer.host_memory.pinned == 0
        loss = compiled.step(token_batch(4))  # virtual workers compute the same either way
        assert torch.isfinite(loss)
    finally:
        compiled.close()
    seen.clear()
    default = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                device="virtual")
    # A plan group given to the Trainer is what it runs with, not the compile's.
    other = Trainer(default, plan=replace(default.options.plan, host_memory="pageable"))
    try:
        assert seen == [("pageable", "virtual")]
        assert other.plan_options.host_memory == "pageable" and other.host_memory.pinned == 0
    finally:
        for w in other.workers:
            w.shutdown()
        default.close()


def test_the_option_reaches_the_pin_decision_from_the_train_cli(monkeypatch, tmp_path, capsys):
    seen = _spy(monkeypatch)
    assert main(["train", "--steps", "1", "--workers", "2", "--seq", "32", "--batch", "6",
                 "--eval-every", "0", "--save-every", "0", "--report-to", "none",
                 "--host-memory", "pageable", "--out", str(tmp_path)]) == 0
    assert seen and all(h == "pageable" for h, _kind in seen)
    assert "transfers: pageable host memory" in capsys.readouterr().err


@pytest.mark.usefixtures("no_timeline_png")
def test_the_plan_summary_and_explain_name_the_assumption(tmp_path, capsys):
    common = ["plan", "--model", "qwen3-tiny", "--seq", "128", "--gpus", "2", "--batch", "3",
              "--max-simulations", "2", "--no-fit-search"]
    assert main([*common, "--host-memory", "pageable", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    line = next(t for t in text.splitlines() if t.startswith("transfers: "))
    assert line.startswith("transfers: pageable host memory (--host-memory pageable")
    assert "H2D 12.5 GB/s, D2H 12.5 GB/s per GPU; pinned would be 25/25 GB/s" in line
    assert "pageable, nothing pinned" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["host_memory"] == "pageable" and summary["host_pinned_gib"] == 0
    assert summary["link_gbps"] == {"h2d": 12.5, "d2h": 12.5}

    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual",
                                 hardware="rtx4090x8", plan=PlanOptions(host_memory="pageable"))
    head = compiled.explain().splitlines()[1:3]
    assert head[0].startswith("transfers: pageable host memory")
    assert head[1].startswith("host memory: ") and "nothing pinned" in head[1]
    pinned = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                               example_inputs=token_batch(4), device="virtual",
                               hardware="rtx4090x8")
    assert pinned.explain().splitlines()[1].startswith(
        "transfers: pinned host memory (the runtime pins its host store and staging buffers), "
        "H2D 25 GB/s, D2H 25 GB/s per GPU; pageable would be 12.5/12.5 GB/s")


def test_pageable_pins_nothing_and_needs_the_same_host_bytes():
    plan = _hand_plan(_profile())
    pinned = host_memory(plan, "sync", 10 << 30)
    pageable = host_memory(plan, "sync", 10 << 30, pageable=True)
    assert pinned.pinned == (pinned.shadows + pinned.masters + pinned.gradients
                             + pinned.transfers) > 0
    assert pageable.pinned == 0 and pageable.total == pinned.total
    assert replace(pageable, pageable=False) == pinned
    assert pageable.sharded(2).pinned == 0
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual",
                                 hardware="rtx4090x8", plan=PlanOptions(host_memory="pageable"))
    assert compiled.host.pageable and compiled.host.pinned == 0
    assert compiled.host.total > 0


def test_the_hardware_listing_shows_the_pageable_figures(capsys):
    assert main(["hardware"]) == 0
    lines = {t.split()[0]: t for t in capsys.readouterr().out.splitlines()}
    assert "25/25 GB/s pinned, 12.5/12.5 GB/s pageable" in lines["rtx4090x8"]
    assert "pageable unknown" in lines["a800x8"]


# -- the CUDA tier (skipped without a GPU) ---------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_a_cuda_worker_stages_in_pageable_memory_and_copies_right():
    worker = workers_module.CudaWorker(0, host_memory="pageable")
    try:
        host = torch.randn(1 << 18)
        dev = worker.alloc(shape=host.shape, dtype=host.dtype, tag="w")
        down = worker.host_empty(host.shape, host.dtype)
        worker.submit("weight_upload", lambda: (worker.copy_(dev, host),
                                                worker.complete_copies()), label="UP")
        up = worker.record("weight_upload", "UP done")
        worker.wait("download", up)
        worker.submit("download", lambda: (worker.copy_(down, dev), worker.complete_copies()),
                      label="D2H")
        worker.synchronize(timeout=30)
        assert not down.is_pinned() and torch.equal(down, host)
        again = worker.respawn()  # a replacement keeps the run's choice
        try:
            assert again.pinned is False and again.host_memory == "pageable"
        finally:
            again.shutdown()
    finally:
        worker.shutdown()


@pytest.mark.cuda
@cuda
def test_pageable_cuda_training_equals_pinned():
    data = [token_batch(4, seed=k) for k in range(2)]
    masters = {}
    for kind in ("pinned", "pageable"):
        compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                     example_inputs=data[0], device="cuda",
                                     plan=PlanOptions(host_memory=kind))
        try:
            trainer = compiled.trainer()
            assert trainer.pin_host is (kind == "pinned")
            assert trainer.store.shadow.is_pinned() is (kind == "pinned")
            for b in data:
                compiled.step(b)
            masters[kind] = {n: t.clone() for n, t in trainer.masters().items()}
        finally:
            compiled.close()
    assert all(torch.equal(masters["pinned"][n], masters["pageable"][n]) for n in masters["pinned"])
