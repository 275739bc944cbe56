"""What the partition search spends and shows: the search effort's budgets reach the search,
a search limited by the tail's memory says so, a smaller loss chunk is searched only when that
could change the plan, and the status line shows only on a terminal."""

from __future__ import annotations

import io
import random

import pytest

import rpcompile
import rpcompile.compiler.chunks as chunks_module
import rpcompile.compiler.search as compile_search
from rpcompile.cli import _parser
from rpcompile.hardware import get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.options import CaptureOptions, PlanOptions
from rpcompile.planner.partition import (
    SEARCH_BUDGETS,
    TAIL_MEMORY_NOTE,
    partition,
    tail_memory_bound,
)
from rpcompile.planner.partition import search as search_module
from tests.tiny_models import hf_model, sft_batch

GIB = 2**30


def _units(tail_working: int) -> list[UnitProfile]:
    """A prefix, three layers of 3 GiB working set each and a tail of ``tail_working``."""
    rng = random.Random(3)
    units = [UnitProfile("prefix", 0.0, 0.0, trainable_params=2**20, output_bytes=2**24)]
    for i in range(3):
        fwd = rng.uniform(2.0, 6.0)
        units.append(UnitProfile(f"layers.{i}", fwd, 2 * fwd, trainable_params=2**22,
                                 output_bytes=2**24, working_bytes=3 * GIB))
    units.append(UnitProfile("tail", 5.0, 9.0, trainable_params=2**22, output_bytes=2**24,
                             working_bytes=tail_working))
    return units


def test_a_search_limited_by_the_tails_memory_says_so():
    # A 20 GiB tail working set leaves no room for a layer beside it in the fused tail (22.5
    # GiB usable): the search notes that memory of the tail ruled candidates out. With a
    # 1 GiB tail every tail start fits and nothing of the tail limits the search.
    hw = get_hardware("rtx4090x8")
    big = partition(_units(20 * GIB), hw, PlanOptions(gpus=3, microbatches=4, mode="sync"))
    small = partition(_units(GIB), hw, PlanOptions(gpus=3, microbatches=4, mode="sync"))
    assert TAIL_MEMORY_NOTE in big.notes and tail_memory_bound(big)
    assert TAIL_MEMORY_NOTE not in small.notes and not tail_memory_bound(small)
    assert [len(s.units) for s in big.stages if s.kind == "tail"] == [1]


def test_the_search_effort_sets_the_searchs_budget(monkeypatch):
    # The effort's budget reaches the search: replays per grid and local-search plans; an
    # explicit max_simulations replaces the effort's cap; an unknown effort is refused.
    seen = []
    real_best, real_search = search_module._best_simulated, search_module._search

    def best(pools, hw, rounds, optimizer, capacity, max_simulations, *rest):
        seen.append(("replays", max_simulations))
        return real_best(pools, hw, rounds, optimizer, capacity, max_simulations, *rest)

    def search(seeds, make, limit, budget, *rest, **kw):
        seen.append(("local", budget))
        return real_search(seeds, make, limit, budget, *rest, **kw)

    monkeypatch.setattr(search_module, "_best_simulated", best)
    monkeypatch.setattr(search_module, "_search", search)
    hw = get_hardware("rtx4090x8")
    for effort, budget in SEARCH_BUDGETS.items():
        seen.clear()
        partition(_units(GIB), hw, options=PlanOptions(gpus=3, microbatches=4,
                                                       search_effort=effort))
        assert len(seen) == 2 and seen[0] == ("local", budget.local_search), effort
        cap = seen[1][1]
        assert (cap.replays, cap.computes) == (budget.replays["sync"] or search_module._NO_CAP,
                                               budget.replay_computes), effort
    seen.clear()
    partition(_units(GIB), hw, options=PlanOptions(gpus=3, microbatches=4, max_simulations=3,
                                                   search_effort="high"))
    assert (seen[1][1].replays, seen[1][1].computes) == (3, 0)  # the explicit cap alone
    assert SEARCH_BUDGETS["normal"].local_search < SEARCH_BUDGETS["high"].local_search
    with pytest.raises(ValueError, match="search_effort must be one of 'normal', 'high', "
                                         "'exhaustive'"):
        PlanOptions(search_effort="max")


def test_a_smaller_loss_chunk_is_searched_only_when_memory_could_change_the_plan(monkeypatch):
    # "auto" plans the whole logits and each smaller chunk. A chunk smaller than one already
    # planned, whose units differ only by a smaller tail working set, is not searched when
    # the larger one's search was not limited by memory: it would find the same plan.
    monkeypatch.setattr(chunks_module, "AUTO_CHUNK_TOKENS", (32, 8))
    monkeypatch.setattr(chunks_module, "AUTO_CHUNK_ABOVE_BYTES", 0)
    searched = []
    real = compile_search.partition

    def counting(profiles, *args, **kwargs):
        searched.append(profiles[-1].working_bytes)
        return real(profiles, *args, **kwargs)

    monkeypatch.setattr(compile_search, "partition", counting)
    batch = sft_batch(4, 64)
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=batch, device="virtual")
    assert len(searched) == 2, searched  # the whole logits and 32-token chunks
    note = compiled.plan.notes[-1]
    assert "8-token chunks: not searched" in note, note
    # What the skipped search would have found: the 32-token chunks' plan, by its figure.
    eight = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                              example_inputs=batch, device="virtual",
                              capture=CaptureOptions(loss_chunk_tokens=8))
    assert f"32-token chunks: {eight.plan.predicted_step_ms:.1f} ms" in note, note


def test_the_search_status_line_shows_only_on_a_terminal(monkeypatch):
    hw = get_hardware("rtx4090x8")

    def shown(progress, tty):
        err = io.StringIO()
        err.isatty = lambda: tty
        monkeypatch.setattr("sys.stderr", err)
        partition(_units(GIB), hw, options=PlanOptions(gpus=3, microbatches=4,
                                                       progress=progress))
        return err.getvalue()

    assert "candidates replayed" in shown(None, True)
    assert "candidates replayed" in shown(True, True)
    assert shown(None, False) == "" and shown(True, False) == "" and shown(False, True) == ""


def test_plan_and_train_take_the_search_and_cache_flags():
    ap = _parser()
    plan = ap.parse_args(["plan", "--model", "qwen3-1.7b", "--search-effort", "exhaustive",
                          "--plan-cache", "off", "--quiet"])
    assert (plan.search_effort, plan.plan_cache, plan.quiet) == ("exhaustive", "off", True)
    train = ap.parse_args(["train", "--search-effort", "high", "--plan-cache", "/tmp/plans",
                           "--quiet"])
    assert (train.search_effort, train.plan_cache, train.quiet) == ("high", "/tmp/plans", True)
    assert ap.parse_args(["train"]).search_effort is None  # the option's default applies
    with pytest.raises(SystemExit):
        ap.parse_args(["plan", "--model", "qwen3-1.7b", "--search-effort", "max"])
    from rpcompile.finetune import plan_cache_option

    assert plan_cache_option(None) is True and plan_cache_option("off") is False
    assert str(plan_cache_option("/tmp/plans")) == "/tmp/plans"
