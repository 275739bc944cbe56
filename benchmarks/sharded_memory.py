"""Host bytes per trainable parameter per rank, replicated against sharded (``shard_optimizer``),
on 1, 2 and 3 processes on this machine (gloo, virtual workers, fp32, AdamW, two steps so the
optimizer state exists).

Every figure is measured from the tensors each rank holds, not from a formula: the master
buffer's storage, every optimizer state tensor's storage (each counted once), and the shadow
and gradient buffers. The memory report (``trainer.memory_report()``) is printed beside them
and must agree. With fp32 compute the shadow is 4 bytes per parameter; with bf16 it would be 2.

    PYTHONPATH=. python benchmarks/sharded_memory.py [--hidden 256] [--layers 4] [--ranks 1 2 3]
                                                    [--json benchmarks/results/sharded_memory.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _models import qwen3  # benchmarks/_models.py, beside this script
from _results import RESULTS, write_result

from rpcompile.options import PlanOptions


def _measure(trainer) -> dict:
    store = trainer.store
    params = sum(s.numel for s in store.trainable_slots)
    state: dict[int, int] = {}
    for entry in trainer.optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                state[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    report = trainer.memory_report()
    master = store.master.untyped_storage().nbytes()
    return {
        "trainable_params": params,
        "owned_params": sum(s.numel for s in store.owned_slots),
        "master": master / params,
        "optimizer": sum(state.values()) / params,
        "shadow": store.shadow.untyped_storage().nbytes() / params,
        "grad": store.grad.untyped_storage().nbytes() / params,
        "report_total": report.bytes_per_trainable_param,
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str,
          shard: bool) -> None:
    import torch.distributed as dist

    import rpcompile

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 512, (2 * world * 2, args.seq), generator=gen)
    share = {"input_ids": batch.tensor_split(world)[rank],
             "labels": batch.tensor_split(world)[rank]}
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers, tied=True), gpus=2,
                                 microbatches=2, example_inputs=share, device="virtual",
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                                 plan=PlanOptions(shard_optimizer=shard))
    try:
        for _ in range(2):
            compiled.step(share)
        torch.save(_measure(compiled.trainer()), os.path.join(out, f"rank{rank}.pt"))
    finally:
        compiled.close()
        if world > 1:
            dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--json", type=Path, default=RESULTS / "sharded_memory.json")
    args = parser.parse_args()
    import tempfile

    rows = []
    for world in args.ranks:
        for shard in (False, True):
            with tempfile.TemporaryDirectory() as out:
                mp.spawn(_rank, args=(world, _port(), args, out, shard), nprocs=world)
                ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
            for r, m in enumerate(ranks):
                rows.append({"ranks": world, "sharded": shard, "rank": r, **m})
    print(f"{'ranks':>5} {'state':>10} {'rank':>4} {'owned':>8} {'master':>7} {'optim':>7} "
          f"{'shadow':>7} {'grad':>7} {'total':>7} {'report':>7}   (bytes per trainable "
          "parameter)")
    for row in rows:
        total = row["master"] + row["optimizer"] + row["shadow"] + row["grad"]
        print(f"{row['ranks']:>5} {'sharded' if row['sharded'] else 'replicated':>10} "
              f"{row['rank']:>4} {row['owned_params'] / row['trainable_params']:>8.3f} "
              f"{row['master']:>7.2f} {row['optimizer']:>7.2f} {row['shadow']:>7.2f} "
              f"{row['grad']:>7.2f} {total:>7.2f} {row['report_total']:>7.2f}")
    path = write_result(args.json, {"args": {k: str(v) if isinstance(v, Path) else v
                                             for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
