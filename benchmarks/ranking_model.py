"""How the partitioner's ranking model compares with the simulator, on the paper's models.

The partitioner shortlists candidate plans by a cheap bound, ranks the shortlist (and its
local search) by the dispatch model ``rpcompile.planner.partition.predict_step_ms`` (about
0.1 ms a plan), and replays the best few in the simulator (``rpcompile.sim.simulate`` of the
lowered schedule, about 0.2 s a plan), which picks the winner. The two models are not one
model: this script measures how far apart they are on the candidates the partitioner
simulates, and whether the simulator's winner was the ranking model's first choice (if it was
not, the ranking could prune the plan the simulator would have chosen).

For each model and optimizer mode it prints the candidates simulated, how many the ranking
model put at or below their simulated time, the range of simulated / ranked, and the rank
the simulator's winner had in the ranking model's order (0: its first choice).

    python benchmarks/ranking_model.py [--models qwen3-1.7b llama3.1-8b] [--modes sync async]
                                       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rpcompile.hardware import get_hardware
from rpcompile.planner import partition as partition_module
from rpcompile.workloads.paper import get_model

MODELS = ["qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b"]


def compare(name: str, mode: str, hardware: str = "rtx4090x8") -> dict:
    """Partition ``name`` for ``mode`` (8 GPUs, 16 microbatches of 4 x 2,048 tokens, no
    boundary refinement) and pair each simulated candidate's ranked and simulated times."""
    pairs: list[tuple[float, float]] = []
    simulated_ms = partition_module._simulated_ms

    def recording(plan, hw, rounds, optimizer, capacity):
        out = simulated_ms(plan, hw, rounds, optimizer, capacity)
        pairs.append((plan.predicted_step_ms, out[0][0]))
        return out

    partition_module._simulated_ms = recording
    try:
        t0 = time.perf_counter()
        partition_module.partition(get_model(name).units(4, 2048), get_hardware(hardware), 8,
                                   16, optimizer=mode, refine=0)
        seconds = time.perf_counter() - t0
    finally:
        partition_module._simulated_ms = simulated_ms
    by_rank = sorted(pairs)
    winner = min(pairs, key=lambda p: p[1])
    ratios = [sim / ranked for ranked, sim in pairs]
    return {
        "model": name, "mode": mode, "candidates": len(pairs),
        "ranked_at_or_below_simulated": sum(r <= s + 1e-6 for r, s in pairs),
        "simulated_over_ranked_min": min(ratios), "simulated_over_ranked_max": max(ratios),
        "winner_rank_in_ranking": by_rank.index(winner), "partition_s": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/ranking_model.json"))
    args = ap.parse_args()
    rows = []
    for name in args.models:
        for mode in args.modes:
            row = compare(name, mode)
            rows.append(row)
            print(f"{name:14s} {mode:5s} {row['candidates']:3d} simulated, ranked <= simulated "
                  f"for {row['ranked_at_or_below_simulated']}, simulated/ranked "
                  f"{row['simulated_over_ranked_min']:.3f}-{row['simulated_over_ranked_max']:.3f}"
                  f", winner ranked #{row['winner_rank_in_ranking']} ({row['partition_s']:.0f} s)",
                  flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    worst = max(r["simulated_over_ranked_max"] for r in rows)
    firsts = sum(r["winner_rank_in_ranking"] == 0 for r in rows)
    print(f"ranking_model: {len(rows)} runs, simulator's winner was the ranking model's first "
          f"choice in {firsts}; simulated/ranked up to {worst:.3f} -> {args.json}")


if __name__ == "__main__":
    main()
