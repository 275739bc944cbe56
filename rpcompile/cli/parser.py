"""The command line's parser: ``rpcompile plan | train | models | hardware``, each flag with
its default in its help (``train``'s flags come from rpcompile.finetune's options table)."""

from __future__ import annotations

import argparse
from pathlib import Path


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that gives each option's default: its value, or (None) what its text says."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default in (None, False, argparse.SUPPRESS) \
                or "(default" in text:
            return text
        return text + " (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    from rpcompile.choices import HOST_MEMORY, MODES, RECOMPUTE_MODES, SEARCH_EFFORTS, flag_type

    ap = argparse.ArgumentParser(
        prog="rpcompile",
        description="Compile PyTorch / Hugging Face models into RoundPipe training programs.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan",
        help="plan, schedule and simulate a shipped model on a hardware profile",
        description="Build a shipped model from its config on the meta device (no weights), "
                    "compile it for a hardware profile and simulate the schedule the "
                    "runtime runs: the stage table, predicted tokens/s and bubble of one "
                    "step (and the steady state), device and host memory, how "
                    "the partition search ended and the longest sequence that fits. With no "
                    "--batch it doubles the sequences per microbatch while the simulated "
                    "tokens/s rises more than 5% and the plan fits, and says so. --out writes "
                    "the schedule (CSV, Perfetto JSON, PNG), plan.txt and summary.json.",
        formatter_class=_DefaultsFormatter,
    )
    plan.add_argument("--model", required=True, help="a shipped model (see `rpcompile models`)")
    plan.add_argument("--hardware", default="rtx4090x8", help="profile (see `rpcompile hardware`)")
    plan.add_argument("--gpus", type=int, default=None,
                      help="workers (default: the profile's GPU count)")
    plan.add_argument("--seq", type=int, default=2048, help="sequence length (tokens)")
    plan.add_argument("--batch", type=int, default=None,
                      help="global batch in sequences per optimizer step (default: double the "
                           "sequences per microbatch from 1 while the simulated tokens/s rises "
                           "more than 5%%, up to 64, while the plan fits the GPUs and host "
                           "RAM); a batch that does not divide is split as evenly as possible "
                           "and every microbatch is timed at the largest one's size")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="microbatches per round (default: gpus + 1)")
    plan.add_argument("--rounds", type=int, default=1, help="rounds per step (accumulation)")
    plan.add_argument("--schedule", default="roundpipe",
                      choices=["roundpipe", "gpipe", "1f1b", "interleaved", "looped-bfs"],
                      help="RoundPipe, or a weight-bound baseline on the same simulator")
    plan.add_argument("--optimizer", default="sync", type=flag_type("mode"), choices=MODES,
                      help="exact updates (sync, as `rpcompile train` and compile() default "
                           "to) or one step stale, overlapping the next step (async; also "
                           "simulates a steady state of several steps)")
    plan.add_argument("--lora", type=int, default=None, metavar="R",
                      help="LoRA adapters of rank R on every linear layer but the LM head, "
                           "the base frozen (default: the model config's: qwen3-235b-a22b "
                           "has r=32; 0: full fine-tuning)")
    plan.add_argument("--quantize", default="none", choices=("none", "nf4"),
                      help="with LoRA: the frozen base's decoder linears in bitsandbytes NF4 "
                           "(double-quantized absmax), kept and uploaded packed. A model "
                           "built on the meta device has no quantized weights to capture, "
                           "so nf4 plans the paper model's unit profiles "
                           "(rpcompile.workloads.paper, base nf4: the paper's per-layer "
                           "times, packed bytes as bitsandbytes stores them) at the paper "
                           "workload's batch, microbatches and rounds unless --batch / "
                           "--microbatches are given, and prints host memory, tokens/s, the "
                           "proven device peak and the longest sequence that fits (searches "
                           "capped at --max-simulations, default 24 replays)")
    plan.add_argument("--layers", type=int, default=None,
                      help="override the model depth (quick experiments; default: the config's)")
    plan.add_argument("--out", type=Path, default=None,
                      help="folder for schedule.csv, schedule.json (Perfetto), schedule.png, "
                           "plan.txt and summary.json (default: print only)")
    plan.add_argument("--recompute", default="auto", type=flag_type("recompute"),
                      choices=RECOMPUTE_MODES,
                      help="how backward stages recompute their forward: stage (all layers' "
                           "activations for one backward), layer (one layer at a time, one "
                           "more forward) or auto (stage unless that plan does not fit, "
                           "then the faster plan that fits, cut again by stage or by layer)")
    plan.add_argument("--search-effort", default="normal", type=flag_type("search_effort"),
                      choices=SEARCH_EFFORTS,
                      help="what the partition search spends: normal (a few simulator "
                           "replays), high (up to 1024 sync, 32 async) or exhaustive "
                           "(until its plan is proven the fastest of its candidates)")
    plan.add_argument("--max-simulations", type=int, default=None, metavar="N",
                      help="cap the partitioner's simulator replays per search instead of "
                           "the effort's; a search stopped before its proof says so, with "
                           "the most a plan it did not replay could be faster")
    plan.add_argument("--plan-cache", default=None, metavar="DIR|off",
                      help="where searched plans are kept and found again (default: "
                           "$RPCOMPILE_CACHE_DIR, else ~/.cache/rpcompile/plans); off: search "
                           "every time")
    plan.add_argument("--quiet", action="store_true",
                      help="no progress lines from the compile (capture, searches, cache)")
    plan.add_argument("--no-fit-search", action="store_true",
                      help="skip the search for the longest sequence that fits")
    plan.add_argument("--longest", action="store_true",
                      help="search the longest sequence that fits (one sequence per "
                           "microbatch unless --batch is given) and print it, what limits "
                           "the next length, and the memory-first plan (every unit its own "
                           "stage) proven to fit at that length")
    plan.add_argument("--host-ram", type=float, default=None, metavar="GIB",
                      help="host RAM of the target server in GiB (default: the profile's, "
                           "else this machine's); the plan's host memory is checked against it")
    plan.add_argument("--no-undo-journal", action="store_true",
                      help="plan a run without the optimizer's undo journal (undo_journal="
                           "False): 14 bytes per trainable parameter less host memory and no "
                           "journal copy in each update's time, but a failed step then ends "
                           "the run (restore the last checkpoint)")
    plan.add_argument("--host-memory", default="pinned", type=flag_type("host_memory"),
                      choices=HOST_MEMORY,
                      help="host memory the run copies from and to: pinned (page-locked "
                           "host store and staging) or pageable (nothing pinned, as "
                           "RoundPipe's pin_model=\"off\"; every transfer timed at the "
                           "profile's pageable bandwidth, which the profile must have; the "
                           "same static host bytes)")
    plan.add_argument("--nodes", type=int, default=1,
                      help="servers training data parallel (one pipeline each, on its share "
                           "of a --nodes times larger global batch); N > 1 also simulates "
                           "the schedule lowered for N ranks (REDUCE actions on the link) "
                           "and prints the tokens/s of N servers and the scaling efficiency "
                           "against one")
    plan.add_argument("--shard-optimizer", action="store_true",
                      help="with --nodes N: the servers shard their masters and optimizer "
                           "state (ZeRO-1 style, --optimizer sync): each REDUCE is timed as "
                           "gloo's reduce to the gradients' owners and each SHADOW also "
                           "broadcasts the updated shadows")
    plan.add_argument("--link", default="eth100",
                      help="the network between servers for --nodes: eth25 or eth100 (25 / "
                           "100 Gbit/s Ethernet)")

    train = sub.add_parser(
        "train",
        help="fine-tune a checkpoint folder on a data file with the RoundPipe runtime",
        description="Fine-tune a Hugging Face checkpoint folder on a data file (JSONL, JSON, "
                    "CSV, Parquet or text) over RoundPipe workers, and write final/ "
                    "(from_pretrained), checkpoints, metrics.jsonl, TensorBoard events and "
                    "loss.png. With no arguments: build the tiny shipped Qwen3 (byte-level), "
                    "write it as a checkpoint folder and fine-tune it on the shipped text. "
                    "Options come from the defaults, then --config run.yaml, then the flags. "
                    "--out holds one run (another run's folder is refused: --overwrite, "
                    "--resume). Ctrl-C or SIGTERM stops after the step in flight (twice: at "
                    "once), saves a checkpoint of the last finished step and exits 130 / 143; "
                    "--resume goes on from it.",
    )
    from rpcompile.finetune import add_train_arguments

    add_train_arguments(train)

    models = sub.add_parser("models", help="list the shipped model configs")
    hardware = sub.add_parser("hardware",
                              help="list the hardware profiles and the inter-server links")
    for command in (plan, models, hardware):
        command.add_argument("--json", action="store_true",
                             help="print the report as one JSON object instead of text (plan: "
                                  "the figures summary.json holds)")
    return ap
