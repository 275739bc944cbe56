"""CUDA readiness check of the runtime, sized for one short window on one H100/H200.

    python benchmarks/gpu_check.py [--quick] [--json gpu_check.json] [--budget-s S]

Sections, each timed, in this order:

0. machine   torch / Triton / transformers versions, the GPU, and ``hardware.probe``'s figures
             (bf16 matmul TFLOP/s, pinned and pageable host<->device copy GB/s).
1. finetune  ``rpcompile train`` on a small Qwen3 checkpoint folder (hidden 256, 4 layers,
             random weights, the byte-level tokenizer) with ``examples/ledger.jsonl``: 40 steps in
             bf16 (fp32 with ``--virtual``); the eval loss must fall and ``final/`` be written.
             It reads the data with the ``datasets`` package: where that is not installed the
             section is skipped with a line saying so, and the others still decide the result.
2. exact     For each worker count (they share the GPU) and tiny fp32 Qwen3 / Llama / Qwen3-MoE
             / tied Qwen3, ``steps`` AdamW steps on CUDA workers. The masters must equal, bit
             for bit, a reference that runs the same stage programs on the same device one after
             another (``reference_step(..., device=...)``) with AdamW on fp32 CPU masters, and
             so must the losses; they must be close to eager training of the model on the device
             (``|masters - eager| / |masters - initial|`` < 1e-2: other kernels, other sums).
             cuBLAS runs with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, set here before
             CUDA starts) and torch's deterministic algorithms are on, so a mismatch is
             rpcompile's. Each row also says whether the staging buffers were pinned as asked
             and how many host registrations fell back to the caching allocator.
3. kernels   The transfer-path kernels alone, Triton against torch, on the device
             (``benchmarks/transfer_kernels.py``'s measurement: ms, GB/s, fraction of a plain
             copy of the same traffic).
4. bench     A bf16 Qwen3 (default hidden 1024, 8 layers, seq 1024, ~166M parameters) trained
             with ``kernels="triton"`` and ``kernels="torch"``, fused AdamW on the host: median
             seconds per step, tokens/s, and per action kind the median milliseconds a step spends
             in its timeline entries (``StepResult.timeline``: the tail ``T`` and backward ``B``
             jobs hold the gradient accumulation, ``SHADOW`` the host refresh), so the kernels'
             share is not lost in the whole step. On CUDA those entries time the host's side of
             an action (a launch returns before its kernel ends); section 3 times the kernels on
             the device. Whether both backends reach the same masters is reported.

``--quick`` runs 2 workers, 2 steps, a 16M-element kernel measurement and a hidden-512, 4-layer
bench. ``--budget-s`` (default 330, 160 with ``--quick``) bounds the run: a section (or an
exactness case) that would not fit in what is left is skipped with a line saying so, and the
run then counts as incomplete. docs/gpu.md gives the one command for a lent GPU machine.

``--host-memory pageable`` runs sections 2 and 4 from pageable host memory. Without CUDA the
script prints that nothing was checked and exits 0. ``--virtual`` runs the same code on virtual
CPU workers (the bench only with ``--bench-virtual``, tiny sizes advised: Triton runs in its
interpreter there), to test the script itself. Writes JSON and prints a one-line summary; exit
code 1 when a check failed or the run was incomplete.
"""

from __future__ import annotations

import os

# cuBLAS chooses how to split a reduction by the workspace it has; a fixed workspace gives every
# stream the same results. Set before torch initializes CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, for tests/
from tests.tiny_models import hf_model  # noqa: E402 - the models the CPU tests use

ARCHS = ("qwen3", "llama", "qwen3_moe", "qwen3_tied")
LR = 1e-3
EAGER_REL_TOL = 1e-2
# What each mode runs unless an option says otherwise.
FULL = dict(workers=[1, 2, 4], steps=3, kernel_elements=64 * 2**20, bench_hidden=1024,
            bench_layers=8, bench_seq=1024, bench_steps=3, budget_s=330.0)
QUICK = dict(workers=[2], steps=2, kernel_elements=16 * 2**20, bench_hidden=512,
             bench_layers=4, bench_seq=512, bench_steps=2, budget_s=160.0)
# Rough lower bounds of a section's seconds on one H100, used only to skip a section that
# cannot finish inside the budget.
NEEDS_S = {"finetune": 60.0, "kernels": 30.0, "bench": 60.0}


def tiny_model(arch: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    return hf_model(arch, seed=seed, layers=layers, vocab_size=256)


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class Registrations:
    """Counts the host memory registrations that fell back to the caching allocator (their
    RuntimeWarning, rpcompile.runtime.memory), from any thread, while active."""

    def __enter__(self) -> Registrations:
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)
        self.fallbacks = [str(w.message) for w in self._seen
                          if "caching pinned allocator" in str(w.message)]
        for w in self._seen:  # everything else is shown as it would have been
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


# ============================================================================================
# Sections
# ============================================================================================


def versions() -> dict:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": version("triton"),
            "transformers": version("transformers"), "datasets": version("datasets"),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def check_machine(trainer_device: str) -> dict:
    from rpcompile.hardware import probe

    cuda = trainer_device == "cuda"
    hw = probe("cuda") if cuda else probe("cpu", size=256, repeats=1, min_seconds=0.005)
    row = {"gpu": hw.gpu, "gpus": hw.gpus, "memory_gib": round(hw.memory_gib, 1),
           "matmul_dtype": "bf16" if cuda else "fp32", "matmul_tflops": hw.matmul_tflops,
           "h2d_gbps": round(hw.h2d_gbps, 1), "d2h_gbps": round(hw.d2h_gbps, 1),
           "pageable_h2d_gbps": round(hw.pageable_h2d_gbps, 1),
           "pageable_d2h_gbps": round(hw.pageable_d2h_gbps, 1),
           "host_mem_gbps": round(hw.host_mem_gbps, 1),
           "optimizer_params_per_s": round(hw.optimizer_params_per_s)}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        row["capability"] = f"{props.major}.{props.minor}"
    return row


def check_finetune(trainer_device: str, workers: int) -> dict:
    """``rpcompile train --model FOLDER --data examples/ledger.jsonl`` (section 1)."""
    import tempfile

    import transformers as tf

    from rpcompile.cli import main as cli
    from rpcompile.data import byte_tokenizer

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
        rc = cli(["train", "--model", str(folder), "--data", str(ROOT / "examples/ledger.jsonl"),
                  "--out", str(out), "--steps", "40", "--batch", str(2 * (workers + 1)),
                  "--workers", str(workers), "--device", trainer_device, "--dtype", dtype,
                  "--lr", "1e-3", "--eval-every", "20", "--save-every", "0",
                  "--report-to", "none"])
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

    with Registrations() as registrations, Trainer(compiled,
                                                   train=replace(compiled.options.train,
                                                                 optimizer=adamw,
                                                                 device=trainer_device,
                                                                 kernels="auto"),
                                                   plan=replace(compiled.options.plan,
                                                                host_memory=host_memory)) as trainer:
        pinned = trainer.pin_host
        losses = [trainer.step(b) for b in data]
        masters = {n: t.clone() for n, t in trainer.masters().items()}
        # The transfer staging: a buffer per staging slot, registered with the driver on a
        # pinned run (rpcompile.runtime.memory.HostStaging): torch must see them as pinned,
        # or every download would be a synchronous pageable copy. Every slot is free here.
        staging = trainer.executor.staging
        spare = staging.take(min(4096, staging.slots[0]), slot=0)
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
        ref_losses.append(loss)

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
        "registration_fallbacks": len(registrations.fallbacks),
        "bit_identical": all(torch.equal(masters[n], params[n].detach()) for n in masters),
        "losses_identical": all(torch.equal(a.cpu(), b.cpu())
                                for a, b in zip(losses, ref_losses)),
        "max_abs_diff_vs_reference": ref_diff,
        "max_abs_diff_vs_eager": eager_diff,
        "rel_diff_vs_eager": rel,
        "close_to_eager": rel < EAGER_REL_TOL,
        "seconds": round(time.perf_counter() - start, 2),
    }


def check_kernels(device: torch.device, elements: int) -> dict:
    import importlib.util

    path = ROOT / "benchmarks" / "transfer_kernels.py"
    spec = importlib.util.spec_from_file_location("transfer_kernels", path)
    transfer_kernels = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = transfer_kernels  # its dataclasses look their module up
    spec.loader.exec_module(transfer_kernels)
    repeats = 20 if device.type == "cuda" else 2
    copy_gbps, rows = transfer_kernels.measure(device, elements, repeats,
                                               ["triton", "torch"])
    out = {"elements": elements, "copy_gbps": round(copy_gbps, 1), "kernels": {}}
    for m in rows:
        out["kernels"].setdefault(m.kernel, {})[m.backend] = {
            "ms": round(m.median_ms, 4), "gbps": round(m.gbps, 1),
            "of_copy": round(m.fraction_of_copy, 3)}
    return out


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
              "host_memory": host_memory, "optimizer": "AdamW(fused=True) on the host",
              "compile_seconds": round(compile_s, 2)}
    masters = {}
    for kernels in ("triton", "torch"):
        with Trainer(compiled,
                     train=replace(compiled.options.train,
                                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
                                   device=trainer_device, kernels=kernels),
                     plan=replace(compiled.options.plan, host_memory=host_memory)) as trainer:
            trainer.step(data[0])  # warm-up: Triton compiles, allocators settle
            times, per_kind = [], {}
            for b in data[1:]:
                t0 = time.perf_counter()
                trainer.step(b)
                times.append(time.perf_counter() - t0)
                spent: dict[str, float] = {}
                for action, (begin, end) in trainer.last.timeline.items():
                    spent[action.kind] = spent.get(action.kind, 0.0) + end - begin
                for kind, ms in spent.items():
                    per_kind.setdefault(kind, []).append(ms)
            masters[kernels] = {n: t.clone() for n, t in trainer.masters().items()}
        step_s = statistics.median(times)
        result[kernels] = {"step_seconds": round(step_s, 4),
                           "tokens_per_s": round(batch * seq / step_s, 1),
                           "steps_timed": len(times),
                           "timeline_ms": {k: round(statistics.median(v), 2)
                                           for k, v in sorted(per_kind.items())}}
    result["masters_equal"] = all(torch.equal(masters["triton"][n], masters["torch"][n])
                                  for n in masters["torch"])
    return result


# ============================================================================================
# Driver
# ============================================================================================


class Run:
    """The results, the clock against the budget, and one printed line per event. The JSON is
    rewritten after every section, so a run stopped from outside leaves what it measured."""

    def __init__(self, budget_s: float, results: dict, path: Path) -> None:
        self.begin = time.perf_counter()
        self.budget_s = budget_s
        self.results, self.path = results, path
        self.sections: dict[str, dict] = {}
        self.incomplete: list[str] = []
        results["sections"], results["incomplete"] = self.sections, self.incomplete

    def save(self) -> None:
        self.results["seconds"] = round(self.elapsed(), 1)
        self.path.write_text(json.dumps(self.results, indent=2))

    def elapsed(self) -> float:
        return time.perf_counter() - self.begin

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def fits(self, name: str, needs_s: float) -> bool:
        if self.left() >= needs_s:
            return True
        self.incomplete.append(name)
        self.say(f"{name}: skipped: {self.left():.0f} s of the {self.budget_s:.0f} s budget "
                 f"left, it needs about {needs_s:.0f} s")
        return False

    def section(self, name: str, fn: Callable[[], dict]) -> dict:
        self.say(f"{name}: start")
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as exc:  # report every section, not just the first failure
            row = {"error": f"{type(exc).__name__}: {exc}"}
        seconds = round(time.perf_counter() - start, 1)
        self.sections[name] = {"seconds": seconds}
        self.say(f"{name}: {seconds} s {json.dumps(row)}")
        return row

    def skip(self, name: str, reason: str) -> dict:
        self.sections[name] = {"skipped": reason}
        self.say(f"{name}: skipped: {reason}")
        return {"skipped": reason}

    def record(self, name: str, row: dict) -> None:
        """Keep ``row`` as the results' ``name`` (appended, for the exactness rows) and save."""
        if isinstance(self.results.get(name), list):
            self.results[name].append(row)
        else:
            self.results[name] = row
        self.save()


def _missing(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CUDA readiness check, sized for one short window on one GPU: versions and "
                    "probe figures, the fine-tuning command, exactness against a same-device "
                    "reference and eager training, the transfer kernels alone, and bf16 step "
                    "time with kernels='triton' vs 'torch'.")
    parser.add_argument("--json", default="gpu_check.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true",
                        help="fewer cases and smaller sizes (budget 160 s instead of 330 s)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the run may take; sections that would not fit are "
                             "skipped and the run counts as incomplete (default 330, quick 160)")
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="worker counts of the exactness check, sharing the GPUs "
                             "(default 1 2 4; quick: 2)")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per exactness case (default 3; quick: 2)")
    parser.add_argument("--skip-finetune", action="store_true", help="no section 1")
    parser.add_argument("--skip-bench", action="store_true",
                        help="no timing sections (kernels and bench): exactness only")
    parser.add_argument("--kernel-elements", type=int, default=None,
                        help="elements of the kernel measurement (default 64M; quick: 16M)")
    parser.add_argument("--bench-hidden", type=int, default=None)
    parser.add_argument("--bench-layers", type=int, default=None)
    parser.add_argument("--bench-seq", type=int, default=None)
    parser.add_argument("--bench-workers", type=int, default=2)
    parser.add_argument("--bench-microbatch", type=int, default=2,
                        help="sequences per microbatch (microbatches = workers)")
    parser.add_argument("--bench-steps", type=int, default=None,
                        help="timed steps per backend (default 3; quick: 2)")
    parser.add_argument("--host-memory", default="pinned", choices=["pinned", "pageable"],
                        help="host memory of the exactness and bench runs (default: pinned)")
    parser.add_argument("--virtual", action="store_true",
                        help="run on virtual CPU workers (tests this script; checks no GPU)")
    parser.add_argument("--bench-virtual", action="store_true",
                        help="with --virtual, also run the bench (use tiny --bench-* sizes)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.virtual:
        args.kernel_elements = min(args.kernel_elements, 1 << 16)  # the interpreter is slow

    if args.virtual:
        trainer_device, device, name = "virtual", torch.device("cpu"), "virtual CPU workers"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing was "
              "checked. Run it on a GPU machine (or with --virtual to test the script).")
        return 0
    else:
        trainer_device, device = "cuda", torch.device("cuda")
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"

    results: dict = {"device": name, "versions": versions(), "mode":
                     "quick" if args.quick else "full", "budget_s": args.budget_s,
                     "host_memory": args.host_memory, "exact": []}
    run = Run(args.budget_s, results, Path(args.json))
    run.say(f"gpu_check on {name}: " + ", ".join(f"{k} {v}" for k, v in
                                                 results["versions"].items()))
    run.record("machine", run.section("machine", lambda: check_machine(trainer_device)))

    if args.skip_finetune:
        run.record("finetune", run.skip("finetune", "--skip-finetune"))
    elif _missing("datasets"):
        run.record("finetune", run.skip(
            "finetune", "the `datasets` package is not installed (rpcompile.data reads the "
                        "data file with it); the other sections decide the result"))
    elif run.fits("finetune", NEEDS_S["finetune"]):
        run.record("finetune", run.section(
            "finetune", lambda: check_finetune(trainer_device, max(args.workers))))

    # Exactness: torch's deterministic kernels where it has them (others only warn), so a
    # difference between two runs of the same programs is rpcompile's.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    exact_start = time.perf_counter()
    slowest = 10.0
    try:
        for workers in args.workers:
            for arch in args.archs:
                case = f"exact {arch} x{workers}"
                if not run.fits(case, slowest):
                    continue
                row = run.section(case, lambda arch=arch, workers=workers: check_exact(
                    arch, workers, trainer_device, device, args.steps, args.host_memory))
                row.setdefault("arch", arch)
                row.setdefault("workers", workers)
                slowest = max(slowest, run.sections[case]["seconds"])
                run.record("exact", row)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    run.sections["exact"] = {"seconds": round(time.perf_counter() - exact_start, 1)}

    if args.skip_bench:
        run.record("kernels", run.skip("kernels", "--skip-bench"))
        run.record("bench", run.skip("bench", "--skip-bench"))
    else:
        if run.fits("kernels", NEEDS_S["kernels"]):
            run.record("kernels", run.section(
                "kernels", lambda: check_kernels(device, args.kernel_elements)))
        if args.virtual and not args.bench_virtual:
            run.record("bench", run.skip("bench", "virtual workers (--bench-virtual runs it)"))
        elif run.fits("bench", NEEDS_S["bench"]):
            run.record("bench", run.section("bench", lambda: bench(
                trainer_device, args.bench_hidden, args.bench_layers, args.bench_seq,
                args.bench_workers, args.bench_microbatch, args.bench_steps,
                args.host_memory)))
    ok, summary = verdict(results, name, args.host_memory)
    results["ok"] = ok
    run.save()
    print(summary + f"; {results['seconds']} s; JSON in {args.json}")
    return 0 if ok else 1


def verdict(results: dict, name: str, host_memory: str) -> tuple[bool, str]:
    """Whether every check that ran passed and nothing was cut for time, and the summary."""
    rows = results["exact"]
    errors = [r for r in rows if "error" in r]
    exact = [r for r in rows if r.get("bit_identical") and r.get("losses_identical")]
    close = [r for r in rows if r.get("close_to_eager")]
    staged = [r for r in rows if r.get("staging", {}).get("pinned_as_asked")]
    fallbacks = sum(r.get("registration_fallbacks", 0) for r in rows)
    worst = max((r.get("max_abs_diff_vs_reference", 0.0) for r in rows if "error" not in r),
                default=0.0)
    parts = [f"gpu_check on {name} ({host_memory} host memory)"]
    machine = results.get("machine", {})
    if "error" in machine:
        parts.append(f"machine failed: {machine['error']}")
    else:
        parts.append(f"matmul {machine['matmul_tflops']:.3g} TFLOP/s, H2D/D2H "
                     f"{machine['h2d_gbps']}/{machine['d2h_gbps']} GB/s pinned, "
                     f"{machine['pageable_h2d_gbps']}/{machine['pageable_d2h_gbps']} pageable")
    job = results.get("finetune", {})
    if "skipped" in job:
        parts.append("train skipped")
    elif "error" in job:
        parts.append(f"train failed: {job['error']}")
    elif job:
        parts.append(f"train: eval loss {job['eval_loss_first']:.3f} -> "
                     f"{job['eval_loss_last']:.3f}, {job['tokens_per_s']} tok/s")
    parts.append(f"{len(exact)}/{len(rows)} bit-identical (masters and losses) to the "
                 f"same-device reference (worst max abs diff {worst:.3g}), {len(close)}/"
                 f"{len(rows)} close to eager, {len(staged)}/{len(rows)} with staging pinned "
                 f"as asked, {fallbacks} registration fallbacks, {len(errors)} errors")
    kernels = results.get("kernels", {})
    if "error" in kernels:
        parts.append(f"kernels failed: {kernels['error']}")
    elif "kernels" in kernels:
        ratios = [v["torch"]["ms"] / v["triton"]["ms"] for v in kernels["kernels"].values()
                  if v["triton"]["ms"] > 0]
        low = min(v["triton"]["of_copy"] for v in kernels["kernels"].values())
        where = " (Triton's interpreter, not GPU figures)" if "virtual" in name else ""
        parts.append(f"kernels{where}: triton {min(ratios):.2f}-{max(ratios):.2f}x the speed "
                     f"of torch, at >= {low:.0%} of a copy")
    bench_row = results.get("bench", {})
    if "error" in bench_row:
        parts.append(f"bench failed: {bench_row['error']}")
    elif "triton" in bench_row:
        def backward_ms(row: dict) -> float:  # the tail and backward jobs: where grads add up
            return row["timeline_ms"].get("T", 0.0) + row["timeline_ms"].get("B", 0.0)

        t, r = bench_row["triton"], bench_row["torch"]
        parts.append(f"bf16 h{bench_row['hidden']} L{bench_row['layers']} s{bench_row['seq']}: "
                     f"triton {t['step_seconds']:.3f} s/step (T+B {backward_ms(t):.1f} ms), "
                     f"torch {r['step_seconds']:.3f} s/step (T+B {backward_ms(r):.1f} ms), "
                     f"masters equal {bench_row['masters_equal']}")
    if results["incomplete"]:
        parts.append(f"INCOMPLETE (budget): {', '.join(results['incomplete'])}")
    ok = (not errors and len(exact) == len(rows) and len(close) == len(rows)
          and len(staged) == len(rows) and not results["incomplete"]
          and "error" not in machine and "error" not in kernels and "error" not in bench_row
          and ("skipped" in job or bool(job.get("ok"))))
    parts.append("ok" if ok else "FAILED")
    return ok, "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
