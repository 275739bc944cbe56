"""CUDA readiness check of the runtime: the fine-tuning command, exactness on the GPU, then a
bf16 step-time comparison.

    python benchmarks/gpu_check.py [--json gpu_check.json] [--workers 1 2 4] [--skip-bench]

0. The job. ``rpcompile train`` on a small Qwen3 checkpoint folder (hidden 256, 4 layers, random
   weights, the byte-level tokenizer; no weights can be downloaded) with the prompt/completion
   file ``examples/ledger.jsonl``: 40 steps in bf16 on the CUDA workers (fp32 with
   ``--virtual``). Reports the eval loss before and after, tokens/s and seconds; the check fails
   when the eval loss does not fall or ``final/`` is missing.

1. Exactness. For 1, 2 and 4 workers sharing the GPU(s), tiny fp32 Qwen3 / Llama / Qwen3-MoE /
   tied-embedding Qwen3 models train 3 steps with AdamW on CUDA workers. Their masters must
   equal, bit for bit, a reference that runs the same stage programs on the same device one
   after another (``rpcompile.runtime.reference.reference_step(..., device=...)``) with the same AdamW
   on fp32 CPU masters; the max abs difference is reported when they do not. They must also be
   close to plain eager training of the model on the device (same microbatches, AdamW there):
   ``|masters - eager| / |masters - initial|`` below 1e-2 (kernels and summation order differ,
   so bits do not match there).
2. Speed. A bf16 Qwen3 (default hidden 1024, 8 layers, seq 1024) is timed with
   ``kernels="triton"`` and ``kernels="torch"``: seconds per step and tokens/s (median of the
   timed steps after a warm-up step).

``--host-memory pageable`` runs sections 1 and 2 from pageable host memory
(``host_memory="pageable"``: the host store and the workers' staging not pinned); the JSON and
the summary say which was used. Exactness must hold either way.

Without CUDA the script prints that nothing was checked and exits 0. ``--virtual`` runs the
same code on virtual CPU workers (the reference and eager on the CPU; the bench only with
``--bench-virtual``, tiny sizes advised: Triton runs in its interpreter there), to test the
script itself. Writes JSON and prints a one-line summary; exit code 1 when a check failed.
Sized to take a few minutes on one H200.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests/
from tests.tiny_models import hf_model  # the models the CPU tests use

ARCHS = ("qwen3", "llama", "qwen3_moe", "qwen3_tied")
LR = 1e-3
EAGER_REL_TOL = 1e-2


def tiny_model(arch: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    return hf_model(arch, seed=seed, layers=layers, vocab_size=256)


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def check_exact(arch: str, workers: int, trainer_device: str, device: torch.device,
                steps: int, host_memory: str = "pinned") -> dict:
    import rpcompile
    from rpcompile.capture.batch import bind_batch
    from rpcompile.runtime.reference import reference_step
    from rpcompile.runtime.trainer import Trainer

    start = time.perf_counter()
    model = tiny_model(arch)
    eager = copy.deepcopy(model)
    microbatches = workers + 1
    data = [tokens(2 * microbatches, 16, 256, seed=100 + k) for k in range(steps)]
    compiled = rpcompile.compile(model, gpus=workers, microbatches=microbatches,
                                 example_inputs=data[0])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    with Trainer(compiled, adamw, device=trainer_device, kernels="auto",
                 host_memory=host_memory) as trainer:
        pinned = trainer.pin_host
        losses = [float(trainer.step(b)) for b in data]
        masters = {n: t.clone() for n, t in trainer.masters().items()}
        # The transfer staging: exact-size buffers, registered with the driver on a pinned
        # run (rpcompile.runtime.memory.HostStaging): torch must see them as pinned, or every
        # download would be a synchronous pageable copy.
        staging = trainer.executor.staging
        spare = staging.take(4096)
        staging_pinned = spare.is_pinned()
        staging.give(spare)
        staging_figure = {"held_bytes": staging.held_bytes, "buffers": staging.registered,
                          "planned_bytes": compiled.host.transfers,
                          "pinned": staging_pinned,
                          "pinned_as_asked": staging_pinned == pinned}

    # Reference: the same stage programs on the same device, one after another; AdamW on fp32
    # CPU masters like the trainer's host optimizer.
    params = {n: t.clone() for n, t in initial.items()}
    optimizer = adamw(list(params.values()))
    ref_losses = []
    for k, b in enumerate(data):
        batch = bind_batch(compiled.capture, b, step=k)
        loss, grads = reference_step(compiled.stages, compiled.capture, params, batch,
                                     compiled.microbatches, compiled.rounds, device=device)
        for n, p in params.items():
            p.grad = grads[n].cpu() if n in grads else None
        optimizer.step()
        ref_losses.append(float(loss))

    # Eager: the module itself on the device, same microbatches, AdamW there.
    eager.to(device)
    eager_opt = adamw(list(eager.parameters()))
    for b in data:
        eager_opt.zero_grad(set_to_none=True)
        for part in b.to(device).chunk(microbatches):
            (eager(input_ids=part, labels=part).loss / microbatches).backward()
        eager_opt.step()
    eager_params = {n: p.detach().cpu() for n, p in eager.named_parameters()}

    ref_diff = max(float((masters[n] - params[n].detach()).abs().max()) for n in masters)
    eager_diff = max(float((masters[n] - eager_params[n]).abs().max()) for n in masters)
    moved = sum(float((masters[n] - initial[n]).norm() ** 2) for n in masters) ** 0.5
    off = sum(float((masters[n] - eager_params[n]).norm() ** 2) for n in masters) ** 0.5
    rel = off / moved if moved else float("inf")
    return {
        "arch": arch,
        "workers": workers,
        "host_memory": host_memory,
        "pinned": pinned,
        "staging": staging_figure,
        "bit_identical": all(torch.equal(masters[n], params[n].detach()) for n in masters),
        "losses_identical": losses == ref_losses,
        "max_abs_diff_vs_reference": ref_diff,
        "max_abs_diff_vs_eager": eager_diff,
        "rel_diff_vs_eager": rel,
        "close_to_eager": rel < EAGER_REL_TOL,
        "seconds": round(time.perf_counter() - start, 2),
    }


def bench(trainer_device: str, hidden: int, layers: int, seq: int, workers: int,
          microbatch_size: int, steps: int, host_memory: str = "pinned") -> dict:
    import transformers as tf

    import rpcompile
    from rpcompile.runtime.trainer import Trainer

    heads = max(1, hidden // 64)
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 2), head_dim=64,
                            attn_implementation="sdpa", use_cache=False)
    model = tf.Qwen3ForCausalLM(config).to(torch.bfloat16)
    microbatches = workers
    batch = microbatch_size * microbatches
    data = [tokens(batch, seq, config.vocab_size, seed=k) for k in range(steps + 1)]
    start = time.perf_counter()
    compiled = rpcompile.compile(model, gpus=workers, microbatches=microbatches,
                                 example_inputs=data[0])
    compile_s = time.perf_counter() - start
    result = {"hidden": hidden, "layers": layers, "seq": seq, "workers": workers,
              "microbatches": microbatches, "batch": batch,
              "params": sum(p.numel() for p in model.parameters()),
              "host_memory": host_memory,
              "compile_seconds": round(compile_s, 2)}
    for kernels in ("triton", "torch"):
        with Trainer(compiled, lambda p: torch.optim.AdamW(p, lr=1e-4), device=trainer_device,
                     kernels=kernels, host_memory=host_memory) as trainer:
            trainer.step(data[0])  # warm-up: Triton compiles, allocator settles
            times = []
            for b in data[1:]:
                t0 = time.perf_counter()
                trainer.step(b)
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        result[kernels] = {"step_seconds": round(step_s, 4),
                           "tokens_per_s": round(batch * seq / step_s, 1),
                           "steps_timed": len(times)}
    return result


def check_finetune(trainer_device: str, workers: int) -> dict:
    """``rpcompile train --model FOLDER --data examples/ledger.jsonl`` (section 0)."""
    import tempfile

    import transformers as tf

    from rpcompile.cli import main as cli
    from rpcompile.data import byte_tokenizer

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "ckpt", Path(tmp) / "run"
        tokenizer = byte_tokenizer()
        torch.manual_seed(0)
        tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=264, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        dtype = "bf16" if trainer_device == "cuda" else "fp32"
        rc = cli(["train", "--model", str(folder), "--data", str(root / "examples/ledger.jsonl"),
                  "--out", str(out), "--steps", "40", "--batch", str(2 * (workers + 1)),
                  "--workers", str(workers), "--device", trainer_device, "--dtype", dtype,
                  "--lr", "1e-3", "--eval-every", "20", "--save-every", "0",
                  "--no-tensorboard"])
        if rc != 0:
            return {"error": f"rpcompile train exited {rc}"}
        summary = json.loads((out / "summary.json").read_text())
        row = {"workers": workers, "dtype": dtype, "steps": summary["steps"],
               "seconds": round(summary["seconds"], 1),
               "tokens_per_s": round(summary["tokens_per_s"]),
               "eval_loss_first": summary["eval_loss_first"],
               "eval_loss_last": summary["eval_loss_last"],
               "final_saved": (out / "final" / "model.safetensors").is_file()}
    row["ok"] = row["final_saved"] and row["eval_loss_last"] < row["eval_loss_first"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CUDA readiness check: exactness of the runtime on the GPU against a "
                    "same-device reference and eager training, then bf16 step time with "
                    "kernels='triton' vs 'torch'.")
    parser.add_argument("--json", default="gpu_check.json", help="where to write the results")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                        help="worker counts of the exactness check (they share the GPUs)")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--steps", type=int, default=3, help="training steps per check")
    parser.add_argument("--skip-bench", action="store_true", help="exactness only")
    parser.add_argument("--bench-hidden", type=int, default=1024)
    parser.add_argument("--bench-layers", type=int, default=8)
    parser.add_argument("--bench-seq", type=int, default=1024)
    parser.add_argument("--bench-workers", type=int, default=2)
    parser.add_argument("--bench-microbatch", type=int, default=2,
                        help="sequences per microbatch (microbatches = workers)")
    parser.add_argument("--bench-steps", type=int, default=3, help="timed steps per backend")
    parser.add_argument("--host-memory", default="pinned", choices=["pinned", "pageable"],
                        help="host memory of the exactness and speed runs (default: pinned)")
    parser.add_argument("--virtual", action="store_true",
                        help="run on virtual CPU workers (tests this script; checks no GPU)")
    parser.add_argument("--bench-virtual", action="store_true",
                        help="with --virtual, also run the bench (use tiny --bench-* sizes)")
    args = parser.parse_args(argv)

    if args.virtual:
        trainer_device, device, name = "virtual", torch.device("cpu"), "virtual CPU workers"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing was "
              "checked. Run it on a GPU machine (or with --virtual to test the script).")
        return 0
    else:
        trainer_device, device = "cuda", torch.device("cuda")
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"

    begin = time.perf_counter()
    results: dict = {"device": name, "torch": torch.__version__,
                     "host_memory": args.host_memory, "exact": []}
    try:
        results["finetune"] = check_finetune(trainer_device, max(args.workers))
    except Exception as exc:
        results["finetune"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results["finetune"]), flush=True)
    for workers in args.workers:
        for arch in args.archs:
            try:
                row = check_exact(arch, workers, trainer_device, device, args.steps,
                                  args.host_memory)
            except Exception as exc:  # report every check, not just the first failure
                row = {"arch": arch, "workers": workers, "error": f"{type(exc).__name__}: {exc}"}
            results["exact"].append(row)
            print(json.dumps(row), flush=True)
    if not args.skip_bench and (not args.virtual or args.bench_virtual):
        try:
            results["bench"] = bench(trainer_device, args.bench_hidden, args.bench_layers,
                                     args.bench_seq, args.bench_workers, args.bench_microbatch,
                                     args.bench_steps, args.host_memory)
        except Exception as exc:
            results["bench"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(results["bench"]), flush=True)
    results["seconds"] = round(time.perf_counter() - begin, 1)
    Path(args.json).write_text(json.dumps(results, indent=2))

    rows = results["exact"]
    errors = [r for r in rows if "error" in r]
    exact = [r for r in rows if r.get("bit_identical")]
    close = [r for r in rows if r.get("close_to_eager")]
    staged = [r for r in rows if r.get("staging", {}).get("pinned_as_asked")]
    worst = max((r.get("max_abs_diff_vs_reference", 0.0) for r in rows if "error" not in r),
                default=0.0)
    job = results["finetune"]
    job_text = (f"train: eval loss {job['eval_loss_first']:.3f} -> {job['eval_loss_last']:.3f}, "
                f"{job['tokens_per_s']} tok/s; " if "error" not in job else
                f"train failed: {job['error']}; ")
    summary = (f"gpu_check on {name} ({args.host_memory} host memory): {job_text}"
               f"{len(exact)}/{len(rows)} bit-identical to the same-device "
               f"reference (worst max abs diff {worst:.3g}), {len(close)}/{len(rows)} close to "
               f"eager, {len(staged)}/{len(rows)} with staging pinned as asked, "
               f"{len(errors)} errors")
    bench_row = results.get("bench")
    if bench_row and "error" not in bench_row:
        summary += (f"; bf16 h{bench_row['hidden']} L{bench_row['layers']} s{bench_row['seq']}: "
                    f"triton {bench_row['triton']['tokens_per_s']:.0f} tok/s "
                    f"({bench_row['triton']['step_seconds']:.3f} s/step), torch "
                    f"{bench_row['torch']['tokens_per_s']:.0f} tok/s "
                    f"({bench_row['torch']['step_seconds']:.3f} s/step)")
    elif bench_row:
        summary += f"; bench failed: {bench_row['error']}"
    summary += f"; {results['seconds']} s; JSON in {args.json}"
    print(summary)
    ok = not errors and len(exact) == len(rows) and len(close) == len(rows)
    ok = ok and len(staged) == len(rows)
    ok = ok and bool(job.get("ok"))
    ok = ok and not (bench_row and "error" in bench_row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
