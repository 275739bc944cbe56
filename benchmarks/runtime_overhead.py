"""Runtime overhead on this CPU: step time of the RoundPipe runtime with ONE virtual worker over
eager training with the same activation recompute, and the executor's cost per action.

Three ways to run the same fp32 training step (same model, batch, microbatch split, fused
AdamW), timed in one process, interleaved, median of ``--steps`` steps after warm-up:

  eager-ckpt   the Hugging Face model with gradient checkpointing (each decoder layer's forward
               recomputed in backward, as RoundPipe's backward stages do), gradient
               accumulation over the microbatches, optimizer.step()
  reference    rpcompile's reference executor: the stage programs run one after another on the
               calling thread (recompute included), then optimizer.step()
  runtime      compiled.step(): the lowered schedule on 1 virtual worker (four stream threads,
               events, transfers as copies, host gradient accumulation, optimizer driver)

ratio = runtime / eager-ckpt (target <= 1.10); per action = (runtime - reference) / actions in
one step.

    python benchmarks/runtime_overhead.py [--hidden 256] [--layers 4] [--seq 256] [--batch 8]
                                          [--microbatches 2] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _models import qwen3  # benchmarks/_models.py, beside this script
from _results import RESULTS, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=RESULTS / "runtime_overhead.json")
    args = ap.parse_args()

    import rpcompile

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (args.batch, args.seq), generator=gen)
               for _ in range(args.steps + 2)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    # eager with gradient checkpointing
    eager = qwen3(args.hidden, args.layers)
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager.train()
    eager_opt = adamw(eager.parameters())

    def eager_step(ids):
        for chunk in ids.chunk(args.microbatches):
            loss = eager(input_ids=chunk, labels=chunk).loss
            (loss / args.microbatches).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    # reference executor + optimizer over the model's own parameters
    ref_model = qwen3(args.hidden, args.layers)
    compiled_ref = rpcompile.compile(ref_model, gpus=1, microbatches=args.microbatches,
                                     example_inputs=batches[0])
    ref_params = dict(ref_model.named_parameters())
    ref_opt = adamw(list(ref_params.values()))

    def reference_step(ids):
        _, grads = compiled_ref.reference_step(ids, params=ref_params)
        for name, p in ref_params.items():
            p.grad = grads.get(name)
        ref_opt.step()

    # the runtime on one virtual worker
    run_model = qwen3(args.hidden, args.layers)
    compiled = rpcompile.compile(run_model, gpus=1, microbatches=args.microbatches,
                                 example_inputs=batches[0], device="virtual", optimizer=adamw)

    def runtime_step(ids):
        compiled.step(ids)

    runners = {"eager-ckpt": eager_step, "reference": reference_step, "runtime": runtime_step}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for i, ids in enumerate(batches):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn(ids)
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    actions = sum(1 for _ in compiled.trainer().schedule.all_actions()) // max(
        1, compiled.trainer().schedule.steps)
    compiled.close()

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["runtime"] / med["eager-ckpt"]
    per_action_us = (med["runtime"] - med["reference"]) / actions * 1e3
    result = {
        "config": vars(args) | {"json": str(args.json)},
        "median_step_ms": med,
        "ratio_runtime_over_eager_ckpt": ratio,
        "ratio_reference_over_eager_ckpt": med["reference"] / med["eager-ckpt"],
        "actions_per_step": actions,
        "executor_us_per_action": per_action_us,
        "torch_threads": torch.get_num_threads(),
    }
    write_result(args.json, result)
    print("median step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
    print(f"runtime_overhead: runtime / eager-with-recompute = {ratio:.3f} (target <= 1.10); "
          f"executor {per_action_us:.0f} us per action over {actions} actions/step -> {args.json}")


if __name__ == "__main__":
    main()
