"""Golden plans, schedules and figures for shipped models: a refactor must change none of them.

Each case compiles a shipped model on the ``meta`` device (no weights) exactly as ``rpcompile
plan`` does, then compares with the files in ``tests/golden/plans/``:

- ``<case>.json``: the stage table, the proven per-worker device-memory peaks, and the
  simulator's figures for the lowered schedule ``Compiled.schedule`` (the one the runtime
  runs: one dealing period of steps; makespan, tokens/s, bubble split; for the async
  optimizer also the steady-state step of overlapping steps);
- ``<case>.schedule.csv``: ``Compiled.schedule``, action by action, with its edges.

A change that is meant to change a plan, a schedule or a figure regenerates the files with
``RPCOMPILE_REGEN_GOLDEN=1 python3 -m pytest tests/planner/test_golden.py`` and says in its commit
message which case changed and why; ``git diff tests/golden/plans`` shows what moved.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile.sim import simulate, simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.models import build_model

GOLDEN = Path(__file__).parents[1] / "golden" / "plans"
REGEN = bool(os.environ.get("RPCOMPILE_REGEN_GOLDEN"))

# name: (model, layers, hardware, gpus, microbatches, rounds, batch, seq, optimizer mode)
CASES = {
    "qwen3-1.7b_sync": ("qwen3-1.7b", 12, "rtx4090x8", 8, 9, 1, 36, 2048, "sync"),
    "qwen3-1.7b_async_r2": ("qwen3-1.7b", 12, "rtx4090x8", 8, 9, 2, 36, 2048, "async"),
    "llama3.1-8b_async": ("llama3.1-8b", 6, "rtx4090x8", 8, 9, 1, 18, 4096, "async"),
    "qwen3-tiny_sync_4gpu": ("qwen3-tiny", None, "rtx4090x8", 4, 5, 1, 20, 512, "sync"),
}


def _record(case: str) -> tuple[dict, str]:
    name, layers, hw, gpus, micro, rounds, batch, seq, mode = CASES[case]
    model = build_model(name, device="meta", layers=layers)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # The search effort that made these plans, so that they change only with the search.
    c = rpcompile.compile(model, gpus=gpus, microbatches=micro, hardware=hw,
                          example_inputs=ids, rounds=rounds, mode=mode, device="virtual",
                          search_effort="high")
    sim = simulate(c.schedule, c.plan, c.hardware)
    figures = {
        "makespan_ms": sim.makespan_ms,
        "tokens_per_s": sim.tokens_per_s,
        "bubble": sim.bubble,
        "bubble_fill": sim.bubble_fill,
        "bubble_steady": sim.bubble_steady,
        "bubble_drain": sim.bubble_drain,
    }
    if mode == "async":
        run = simulate_roundpipe(c.plan, c.hardware, steps=steady_steps(c.plan, rounds=rounds),
                                 rounds=rounds, optimizer="async")
        figures["steady_step_ms"] = steady_step_ms(run)
    doc = {
        "case": dict(zip(("model", "layers", "hardware", "gpus", "microbatches", "rounds",
                          "batch", "seq", "optimizer"), CASES[case])),
        "plan": c.plan.table().splitlines(),
        "stage_units": [[s.units[0], s.units[-1]] for s in c.plan.stages],
        "peak_bytes": [p.peak_bytes for p in c.memory],
        "figures": figures,
    }
    return doc, c.schedule.to_csv()


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_plan(case: str) -> None:
    doc, csv = _record(case)
    jpath, spath = GOLDEN / f"{case}.json", GOLDEN / f"{case}.schedule.csv"
    if REGEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        jpath.write_text(json.dumps(doc, indent=1) + "\n")
        spath.write_text(csv)
    want = json.loads(jpath.read_text())
    hint = f"golden case {case} changed (see this file's docstring to regenerate)"
    assert doc["case"] == want["case"], hint
    assert doc["plan"] == want["plan"], hint
    assert doc["stage_units"] == want["stage_units"], hint
    assert doc["peak_bytes"] == want["peak_bytes"], hint
    assert csv == spath.read_text(), hint
    assert doc["figures"].keys() == want["figures"].keys(), hint
    for k, v in want["figures"].items():
        assert math.isclose(doc["figures"][k], v, rel_tol=1e-9, abs_tol=1e-12), (k, hint)
