"""A longer chaos soak than CI's (tests/chaos_soak.py): random architectures, 1-8 virtual
workers, sync and async, chaos delays, and faults injected into computes, uploads, downloads,
the host's gradient accumulation and the optimizer's own step(). Prints runs, steps, faults
injected / fired / survived and divergences from the reference (masters after the applied
batches), and writes them as JSON.

    python benchmarks/soak.py [--runs 40] [--steps 6] [--seed 0] [--fault-rate 0.4] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import RESULTS, write_result  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40, help="training runs (default 40)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run choices (default 0)")
    ap.add_argument("--fault-rate", type=float, default=0.4,
                    help="chance that a step gets a fault (default 0.4)")
    ap.add_argument("--json", type=Path, default=RESULTS / "soak.json",
                    help="where to write the figures")
    args = ap.parse_args()
    import torch

    from tests.chaos_soak import soak

    torch.set_num_threads(1)
    result = soak(args.runs, args.steps, args.seed, args.fault_rate)
    out = write_result(args.json, asdict(result))
    for line in result.divergences:
        print("DIVERGED:", line)
    print(f"soak: {result.runs} runs, {result.steps} steps, faults {result.faults_injected} "
          f"injected / {result.faults_fired} fired / {result.faults_survived} survived, "
          f"{len(result.divergences)} divergences, {result.seconds:.0f} s; wrote {out}")
    sys.exit(1 if result.divergences else 0)


if __name__ == "__main__":
    main()
