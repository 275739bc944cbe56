"""Child process of tests/runtime/test_checkpoint.py: trains a tiny model with a checkpoint every
``--every`` steps (CheckpointManager), logging each step's loss; ``--resume`` continues from
the newest complete checkpoint. ``--kill-in-write N`` SIGKILLs itself in the middle of the
checkpoint write at step N (the tensor file written, the manifest not yet); ``--kill-after N``
right after step N (between writes)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import rpcompile
from rpcompile.options import TrainOptions
from rpcompile.runtime.checkpoint import CheckpointManager, writing
from tests.tiny_models import hf_model, token_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-in-write", type=int, default=-1)
    ap.add_argument("--kill-after", type=int, default=-1)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6),
                                 device="virtual", mode=args.mode,
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                                 train=TrainOptions(timeout_s=120))
    root = Path(args.root)
    manager = CheckpointManager(root / "ckpts", keep_last=2)
    start = 0
    if args.resume:
        latest = manager.latest()
        if latest is not None:
            start = compiled.load_checkpoint(latest)["next_step"]
    if args.kill_in_write >= 0:
        original = writing._fsync_and_hash

        def killing(path):
            if compiled.trainer().steps_done == args.kill_in_write:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(path)

        writing._fsync_and_hash = killing
    with open(root / "losses.txt", "a") as log:
        for step in range(start, args.steps):
            loss = compiled.step(token_batch(6, seed=100 + step))
            log.write(f"{step} {float(loss).hex()}\n")
            log.flush()
            if (step + 1) % args.every == 0:
                manager.save(compiled, step + 1, extra={"next_step": step + 1})
            if step == args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    from safetensors.torch import save_file

    masters = {k: v.clone() for k, v in compiled.trainer().masters().items()}
    save_file(masters, str(root / "final.safetensors"))
    compiled.close()


if __name__ == "__main__":
    main()
