"""Host bytes a replicated data-parallel checkpoint save costs each rank, on 2 processes on
this machine (gloo, virtual workers, fp32, AdamW, one step so the optimizer state exists).

Every rank calls ``save_checkpoint``; rank 0 writes. Measured per rank as the peak resident
set during the save above the resident set before it (Linux: the peak is reset through
``/proc/self/clear_refs`` just before the save and read from ``VmHWM`` after it), and printed
per trainable parameter. Rank 0 takes its state and serializes it; the other ranks take no
copy of theirs (a copy of masters and AdamW's two moments would be about 12 bytes per
parameter), they only agree on the outcome. ``PYTHONPATH`` picks the tree it measures:

    PYTHONPATH=. python benchmarks/dp_checkpoint_bytes.py [--hidden 512] [--layers 4]
                                                         [--json benchmarks/results/dp_checkpoint_bytes.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _models import qwen3  # benchmarks/_models.py, beside this script
from _results import RESULTS, write_result
from _setup import adamw, token_batches


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rank(rank: int, world: int, port: int, out: str, hidden: int, layers: int) -> None:
    import torch.distributed as dist

    import rpcompile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        batch = token_batches(1, 2 * world, 32)[0]
        share = batch.tensor_split(world)[rank]
        compiled = rpcompile.compile(qwen3(hidden, layers), gpus=2, microbatches=2,
                                     example_inputs=share, device="virtual", optimizer=adamw)
        compiled.step(share)
        trainer = compiled.trainer()
        params = sum(s.numel for s in trainer.store.trainable_slots)
        trainer.masters()  # every queued update done before the measurement starts
        with tempfile.TemporaryDirectory() as tmp:
            dist.barrier()
            before = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # the peak resident set starts again from now
            trainer.save_checkpoint(Path(tmp) / "ckpt")
            peak = _status("VmHWM")
        compiled.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "trainable_params": params, "save_peak_bytes": peak - before,
                       "bytes_per_param": (peak - before) / params}, fh)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", type=Path,
                    default=RESULTS / "dp_checkpoint_bytes.json")
    args = ap.parse_args()
    import rpcompile

    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, port, out, args.hidden, args.layers), nprocs=world)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
    print(f"rpcompile from {Path(rpcompile.__file__).parent}")
    print(f"replicated save, {ranks[0]['trainable_params']:,} trainable parameters, AdamW, fp32")
    for r in ranks:
        print(f"  rank {r['rank']}: peak host bytes during the save {r['save_peak_bytes']:>13,} "
              f"({r['bytes_per_param']:.2f} per trainable parameter)")
    write_result(args.json, {"tree": str(Path(rpcompile.__file__).parent),
                             "hidden": args.hidden, "layers": args.layers, "ranks": ranks})


if __name__ == "__main__":
    main()
