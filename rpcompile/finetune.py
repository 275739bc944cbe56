"""``rpcompile train``: fine-tune a checkpoint folder on a data file, with the RoundPipe runtime.

Sections, in reading order:

1. options: one table (:data:`OPTIONS`) gives every option's default and help; the command-line
   parser, the YAML file (``--config``) and the saved ``config.yaml`` all use it. Precedence:
   defaults < the no-argument demo's values (when no ``--model`` is given) < the resumed run's
   ``config.yaml`` < ``--config`` < flags.
2. model and tokenizer: a local folder (``AutoModelForCausalLM`` / ``AutoTokenizer``), a name in
   the local Hugging Face cache, or a shipped config (built with random weights and a byte-level
   tokenizer, written to ``OUT/base/`` and loaded from there like any folder); optional LoRA.
3. the run: data (rpcompile.data), ``rpcompile.compile``, an LR scheduler on
   ``compiled.optimizer``, the step loop with eval, checkpoints and logs, then ``OUT/final/``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rpcompile.choices import (
    CHOICES,
    DEVICES,
    HOST_MEMORY,
    KERNELS,
    MODES,
    RECOMPUTE_MODES,
    check_choice,
    check_option,
    flag_type,
)
from rpcompile.options import FLAT, PlanOptions

__all__ = ["DEMO", "OPTIONS", "add_train_arguments", "resolve_options", "run"]


# ---------------------------------------------------------------------------------------------
# 1. options
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    type: Any = str
    choices: tuple[str, ...] | None = None


OPTIONS: tuple[Option, ...] = (
    Option("model", None, "checkpoint folder (config, safetensors weights, tokenizer), a model "
           "in the local Hugging Face cache, or a shipped config (`rpcompile models`: built with "
           "random weights); none: the demo, a tiny byte-level Qwen3"),
    Option("data", None, "JSONL, JSON, CSV, Parquet or .txt file of records {text}, "
           "{prompt, completion} or {messages}; none: the shipped text"),
    Option("eval_data", None, "a separate eval file (instead of --eval-split)"),
    Option("out", "runs/train", "output folder: final/, checkpoints/, metrics.jsonl, "
           "tensorboard/, loss.png, config.yaml, summary.json, schedule.*"),
    Option("lora", 0, "LoRA rank on every linear layer but the LM head (0: full fine-tune)", int),
    Option("lora_alpha", None, "LoRA alpha (none: 2 x rank)", float),
    Option("lora_dropout", 0.0, "dropout on the LoRA adapters' input", float),
    Option("merge", False, "with --lora: write final/ as merged full weights, not an adapter", bool),
    Option("lr", None, "peak learning rate of AdamW (none: 2e-5, or 2e-4 with --lora)", float),
    Option("weight_decay", 0.0, "AdamW weight decay", float),
    Option("schedule", "cosine", "learning-rate schedule after the warmup", str,
           ("cosine", "linear", "constant")),
    Option("warmup_steps", None, "linear warmup steps (none: 3%% of the run)", int),
    Option("epochs", 1.0, "passes over the training data (ignored when --steps is given)", float),
    Option("steps", None, "optimizer steps (none: from --epochs)", int),
    Option("batch", None, "global batch, in sequences per optimizer step "
           "(none: microbatches x rounds)", int),
    Option("microbatches", None, "microbatches per round (none: workers + 1)", int),
    Option("rounds", 1, "rounds per step (gradient accumulation)", int),
    Option("seq", None, "sequence length in tokens; longer examples are truncated (padding) or "
           "continue in the next row (packing) (none: the longest example, rounded up to 64, "
           "at most 2048)", int),
    Option("packing", "auto", "pack rows end to end (on) or one example per padded row (off); "
           "auto: pack {text} data, pad prompt/completion and chat data", str,
           ("auto", "on", "off")),
    Option("buckets", 4, "padding: pad each batch to the smallest of N lengths up to --seq "
           "(1: every batch to --seq)", int),
    Option("completion_only", True, "loss on completions / assistant turns only "
           "(--no-completion-only: on every token)", bool),
    Option("eval_split", 0.1, "fraction of the data held out for eval loss (0: none)", float),
    Option("eval_every", 50, "eval loss every N steps (and at the start and the end; 0: start "
           "and end only)", int),
    Option("save_every", 200, "checkpoint every N steps into OUT/checkpoints (0: none)", int),
    Option("keep_last", 2, "checkpoints kept", int),
    Option("max_grad_norm", 1.0, "clip gradients to this global norm (0: no clipping)", float),
    Option("mode", "sync", "optimizer: exact (sync) or one step stale, overlapped (async)", str,
           MODES),
    Option("undo_journal", True, "keep the optimizer's undo journal, so a failed step is "
           "undone and training goes on (--no-undo-journal: 14 bytes per trainable parameter "
           "less host memory and no journal copy in each update, but a failed step ends the "
           "run: --resume from the last checkpoint)", bool),
    Option("host_memory", "pinned", "host memory the run copies from and to: pinned "
           "(page-locked host store and staging on CUDA) or pageable (nothing pinned, as "
           "RoundPipe's pin_model=off: slower transfers, the same static host bytes; virtual workers "
           "compute the same either way)", str, HOST_MEMORY),
    Option("shard_optimizer", False, "under torchrun: each rank keeps the fp32 masters and "
           "optimizer state of 1/N of the parameters (ZeRO-1 style; --mode sync); evaluation "
           "and final/ gather the masters from every rank; one process: no change", bool),
    Option("checkpoint_per_rank", False, "with --shard-optimizer under torchrun: each rank "
           "writes its own shard's file into each checkpoint and rank 0 a manifest listing "
           "them (no rank gathers the whole state; OUT must be on a file system every server "
           "can write); a resume on any number of ranks reads only the files holding its "
           "shard; one process: one file as usual", bool),
    Option("recompute", "auto", "how backward stages recompute their forward: stage (all "
           "layers at once), layer (one layer at a time, one more forward), auto (stage unless "
           "that plan does not fit, then the faster plan that fits, by stage or layer)", str,
           RECOMPUTE_MODES),
    Option("dtype", "auto", "compute dtype (auto: bf16 on CUDA, fp32 on virtual workers)", str,
           ("auto", "fp32", "bf16", "fp16")),
    Option("workers", None, "workers (none: the CUDA GPUs, or 4 virtual)", int),
    Option("device", "auto", "auto (CUDA when present, else virtual CPU workers), cuda, virtual",
           str, DEVICES),
    Option("kernels", "auto", "transfer-path kernels: auto (Triton on CUDA only), torch, triton",
           str, KERNELS),
    Option("chaos", None, "seed for random delays on virtual workers (tests the protocol)", int),
    Option("seed", 0, "seed of the weights built, LoRA init, eval split and data order", int),
    Option("tensorboard", True, "write TensorBoard event files into OUT/tensorboard", bool),
)
_BY_NAME = {o.name: o for o in OPTIONS}

# What the no-argument `rpcompile train` runs: the shipped tiny Qwen3 on the shipped text.
DEMO: dict[str, Any] = {"model": "qwen3-tiny", "steps": 100, "batch": 20, "seq": 128,
                        "lr": 3e-3, "workers": 4, "device": "virtual", "eval_every": 25,
                        "save_every": 0}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` command's flags; each defaults to None so that a flag given can be told
    from one left out (it then overrides the YAML file)."""
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML file with any of these options (flags override it)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="continue a run: its output folder (latest checkpoint) or one "
                             "checkpoint folder; options default to the run's config.yaml")
    for o in OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        shown = "none" if o.default is None else o.default
        if o.name in DEMO:
            shown = f"{shown}; demo: {DEMO[o.name]}"
        text = f"{o.help} (default: {shown})"
        if o.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            # An option's own choices (compile's too) are checked by its one rule.
            kind = flag_type(o.name) if o.name in CHOICES else o.type
            parser.add_argument(flag, type=kind, choices=o.choices, default=None, help=text)


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of option: value")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _BY_NAME:
            raise ValueError(f"{path}: unknown option {key!r}; known: {', '.join(_BY_NAME)}")
        option = _BY_NAME[name]
        if value is not None and option.type in (int, float) and not isinstance(value, bool):
            value = option.type(value)
        if option.choices:
            try:  # an option of compile's by its one rule, the others in the same words
                if name in CHOICES:
                    check_option(name, value)
                else:
                    check_choice(name, value, option.choices)
            except ValueError as err:
                raise ValueError(f"{path}: {_cli_words(str(err))}") from None
        out[name] = value
    return out


def resolve_options(args: argparse.Namespace) -> tuple[dict[str, Any], Path | None]:
    """The run's options (see the module doc for precedence) and the checkpoint to resume."""
    flags = {o.name: getattr(args, o.name) for o in OPTIONS
             if getattr(args, o.name, None) is not None}
    from_file = _load_yaml(args.config) if args.config else {}
    checkpoint = None
    resumed: dict[str, Any] = {}
    if args.resume is not None:
        checkpoint, run_dir = _find_checkpoint(args.resume)
        saved = run_dir / "config.yaml"
        if saved.is_file():
            resumed = _load_yaml(saved)
        resumed.setdefault("out", str(run_dir))
    opts = {o.name: o.default for o in OPTIONS}
    if "model" not in {**resumed, **from_file, **flags}:
        opts.update(DEMO)
    opts.update(resumed)
    opts.update(from_file)
    opts.update(flags)
    return opts, checkpoint


def _find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) from a run folder or a checkpoint folder."""
    from rpcompile.runtime.checkpoint import CheckpointManager

    if (path / "checkpoints").is_dir():
        latest = CheckpointManager(path / "checkpoints").latest()
        if latest is None:
            raise ValueError(f"{path}/checkpoints holds no checkpoint to resume from")
        return Path(latest), path
    if path.is_dir() and path.parent.name == "checkpoints":
        return path, path.parent.parent
    raise ValueError(
        f"--resume {path}: give a run's output folder (with checkpoints/) or one of its "
        "checkpoint folders; runs save checkpoints with --save-every N"
    )


# ---------------------------------------------------------------------------------------------
# 2. model and tokenizer
# ---------------------------------------------------------------------------------------------


def _torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _write_shipped(name: str, folder: Path, seed: int) -> Path:
    """Build a shipped config with seeded random weights, give it the byte-level tokenizer and
    save both as a checkpoint folder (the starting point of the demo)."""
    import torch

    from rpcompile.data import byte_tokenizer
    from rpcompile.workloads.models import build_model

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    model = build_model(name, device="cpu", dtype=torch.float32, lora=False)
    if model.config.vocab_size < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8, mean_resizing=False)
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_model(spec: str, out: Path, dtype: Any, seed: int) -> tuple[Any, Any, str]:
    """(model, tokenizer, folder it was loaded from)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpcompile.workloads.models import list_models

    path = Path(spec)
    if not path.is_dir() and spec in list_models():
        path = _write_shipped(spec, out / "base", seed)
        print(f"train: built {spec} with random weights (seed {seed}) into {path}/",
              file=sys.stderr)
    local = path.is_dir()
    source = str(path) if local else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        if not local and "/" not in spec:
            raise ValueError(
                f"--model {spec!r} is not a folder, not a shipped config "
                f"({', '.join(list_models())}) and not in the local Hugging Face cache"
            ) from err
        raise ValueError(
            f"cannot load --model {spec}: {err}. A model folder needs config.json, the weights "
            "(safetensors) and a tokenizer (tokenizer.json / tokenizer_config.json); nothing is "
            "downloaded"
        ) from err
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {spec} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer of {spec} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )
    model.config.use_cache = False
    return model, tokenizer, source


def add_lora(model: Any, rank: int, alpha: float | None, dropout: float, seed: int) -> Any:
    """PEFT LoRA adapters on every linear layer but the LM head (seeded init)."""
    import torch

    try:
        import peft
    except ImportError as exc:
        raise ImportError("--lora needs peft: pip install 'rpcompile[lora]'") from exc
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------
# 3. the run
# ---------------------------------------------------------------------------------------------


def lr_lambda(kind: str, warmup: int, total: int):
    """The multiplier of the peak learning rate at scheduler step ``k`` (the update of step
    ``k + 1``): linear warmup over ``warmup`` steps, then cosine or linear decay to 0 at
    ``total``, or constant."""

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def option_origin(args: argparse.Namespace, name: str) -> str:
    """Where option ``name``'s value came from (see :func:`resolve_options`'s precedence),
    for error messages: its flag, the ``--config`` file, the resumed run's ``config.yaml``,
    or the default."""
    flag = "--" + name.replace("_", "-")
    if getattr(args, name, None) is not None:
        return flag
    if args.config is not None and name in _load_yaml(args.config):
        return f"{args.config} (--config)"
    if args.resume is not None:
        saved = _find_checkpoint(args.resume)[1] / "config.yaml"
        if saved.is_file() and name in _load_yaml(saved):
            return f"the resumed run's {saved}"
    return "the default"


def _check(opts: dict[str, Any], origin: Any = None) -> None:
    """Refuse options that cannot run together; ``origin(name)`` says where an option's
    value came from (:func:`option_origin`) when the message should say it."""
    for name in ("rounds", "buckets", "keep_last"):
        if opts[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {opts[name]}")
    for name in ("steps", "batch", "microbatches", "workers", "seq", "lora"):
        if opts[name] is not None and opts[name] < (0 if name == "lora" else 1):
            raise ValueError(f"--{name} must be positive, got {opts[name]}")
    for name in ("eval_every", "save_every", "warmup_steps"):
        if opts[name] is not None and opts[name] < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {opts[name]}")
    if opts["merge"] and not opts["lora"]:
        raise ValueError("--merge merges LoRA adapters; it needs --lora R")
    if opts["checkpoint_per_rank"] and not opts["shard_optimizer"]:
        # Writing needs sharding; reading does not (a resume reads a per-rank checkpoint on
        # any ranks, sharded or not), so a resumed run may leave it out: refused, not dropped
        # quietly, because the checkpoints it writes would then be of another kind.
        source = "--checkpoint-per-rank" if origin is None else origin("checkpoint_per_rank")
        where = source if source == "--checkpoint-per-rank" else \
            f"checkpoint_per_rank: true (from {source})"
        raise ValueError(f"{where} writes each rank's shard of a sharded state: it needs "
                         "--shard-optimizer (without it every rank holds the whole state and "
                         "rank 0 writes it); or pass --no-checkpoint-per-rank to write whole "
                         "checkpoints (resuming from per-rank files needs no sharding)")
    _check_plan_options(opts)


# The train options that are PlanOptions fields under the same name: PlanOptions validates them
# (each rule lives there once), and _cli_words puts its message in the command line's words.
_PLAN_OPTIONS = tuple(f.name for f in fields(PlanOptions) if f.name in _BY_NAME)
# Every train option that is an option of compile's under the same name (of any group), and
# the table's own options with choices: the names _cli_words translates.
_WORDS = tuple(sorted({name for name in _BY_NAME if name in FLAT or _BY_NAME[name].choices},
                      key=len, reverse=True))


def _check_plan_options(opts: dict[str, Any]) -> None:
    """Refuse what :class:`~rpcompile.options.PlanOptions` refuses (``--shard-optimizer``
    with ``--mode async``, say) before anything is loaded, in the CLI's words."""
    try:
        PlanOptions(**{name: opts[name] for name in _PLAN_OPTIONS})
    except ValueError as err:
        raise ValueError(_cli_words(str(err))) from None


def _cli_words(message: str) -> str:
    """An option group's or an option rule's ``message`` in ``rpcompile train``'s words, the
    one place option names are translated: ``mode='sync'`` -> ``--mode sync``,
    ``shard_optimizer=False`` -> ``--no-shard-optimizer``, ``shard_optimizer=True`` and a bare
    ``shard_optimizer`` -> ``--shard-optimizer`` (a bare one-word name only where it opens
    the message, so that prose such as "sync mode" is left alone)."""
    names = "|".join(_WORDS)

    def flag(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        dashed = "--" + name.replace("_", "-")
        if value is None:
            return dashed if "_" in name or m.start() == 0 else m.group(0)
        if value == "False":
            return "--no-" + dashed[2:]
        if value == "True":
            return dashed
        return f"{dashed} {value.strip(chr(39))}"

    return re.sub(rf"\b({names})\b(?:=('[^']*'|\w+))?", flag, message)


class _Log:
    """metrics.jsonl (one JSON object per line) and TensorBoard, from ``start`` on: lines of a
    resumed run's later steps (written before it was stopped) are dropped first."""

    def __init__(self, out: Path, start: int, tensorboard: bool) -> None:
        self.path = out / "metrics.jsonl"
        kept = []
        if start and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.records = [json.loads(line) for line in kept]
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"),
                                        purge_step=start + 1 if start else None)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    group = "eval" if key.startswith("eval") else "train"
                    self.writer.add_scalar(f"{group}/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _evaluate(compiled: Any, batches: list[dict[str, Any]],
              masters: dict[str, Any] | None = None) -> float | None:
    """Token-weighted mean loss over the eval batches (each batch's loss is its token mean);
    ``masters``: the weights to evaluate (sharded: gathered from every rank)."""
    from rpcompile.data import IGNORE_INDEX

    total = count = 0.0
    for batch in batches:
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        if n:
            total += float(compiled.evaluate(batch, masters=masters)) * n
            count += n
    return total / count if count else None


def run(args: argparse.Namespace) -> int:
    """Run ``rpcompile train`` (see the module doc); returns the exit status."""
    from transformers.utils import logging as hf_logging

    opts, checkpoint = resolve_options(args)
    _check(opts, functools.partial(option_origin, args))
    hf_logging.disable_progress_bar()  # one bar: ours
    rank, world, started = _join_ranks()
    try:
        return _run(opts, checkpoint, rank, world)
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()


def _join_ranks() -> tuple[int, int, bool]:
    """(rank, world size, whether this call started the process group). Under ``torchrun``
    (``WORLD_SIZE`` > 1 in the environment) every rank joins the default gloo group and the
    run is data parallel (rpcompile.runtime.distributed); otherwise (0, 1, False)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), True


def _run(opts: dict[str, Any], checkpoint: Path | None, rank: int, world: int) -> int:
    import torch
    from tqdm import tqdm

    import rpcompile
    from rpcompile import data as rpdata

    lead = rank == 0  # only rank 0 writes: metrics, checkpoints, final/, the report
    out = Path(opts["out"])
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    device = opts["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "virtual"
        if device == "virtual" and lead:
            print("train: no CUDA device; running on virtual CPU workers", file=sys.stderr)
    workers = opts["workers"] or (torch.cuda.device_count() if device == "cuda" else 4)
    dtype = _torch_dtype(opts["dtype"], device)
    seed = opts["seed"]

    if world > 1:
        import torch.distributed as dist

        spec = opts["model"]
        if not lead:
            dist.barrier()  # rank 0 writes a shipped model's folder first; the others read it
            from rpcompile.workloads.models import list_models

            if spec in list_models() and not Path(spec).is_dir():
                spec = str(out / "base")
        model, tokenizer, source = load_model(spec, out, dtype, seed)
        if lead:
            dist.barrier()
    else:
        model, tokenizer, source = load_model(opts["model"], out, dtype, seed)
    opts["model"] = source  # a built shipped model is resumed from its folder
    data_path = opts["data"] = opts["data"] or str(rpdata.shipped_corpus())
    prepared = rpdata.prepare(
        data_path, tokenizer, completion_only=opts["completion_only"],
        eval_split=0.0 if opts["eval_data"] else opts["eval_split"],
        eval_path=opts["eval_data"], seed=seed,
    )
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
    seq = opts["seq"] or min(2048, limit, -(-prepared.longest() // 64) * 64)
    packed = opts["packing"] == "on" or (opts["packing"] == "auto" and prepared.format == "text")
    pad_id = tokenizer.pad_token_id
    if packed:
        rows = rpdata.pack(prepared.train, seq, pad_id, seed)
        note = f"packed into {len(rows.rows)} rows of {seq}"
    else:
        rows, truncated, dropped = rpdata.pad_rows(prepared.train, seq, pad_id)
        note = f"one per row, padded to {rpdata.bucket_lengths(seq, opts['buckets'])}"
        if truncated:
            note += f"; {truncated} truncated to {seq} tokens"
        if dropped:
            note += f"; {dropped} dropped (nothing left to predict after truncation)"
    micro = opts["microbatches"] or workers + 1
    batch_size = opts["batch"] or micro * opts["rounds"] * world
    if batch_size < micro * opts["rounds"] * world:
        # An uneven split is fine (the loss is the global token mean either way); an empty
        # microbatch is not.
        raise ValueError(f"--batch {batch_size} is smaller than microbatches x rounds"
                         + (" x ranks" if world > 1 else "") + f" = {micro} x {opts['rounds']}"
                         + (f" x {world}" if world > 1 else "")
                         + ": every microbatch needs a sequence")
    iterator = rpdata.BatchIterator(rows, batch_size, seed, buckets=opts["buckets"])
    total = opts["steps"] or max(1, math.ceil(opts["epochs"] * iterator.batches_per_epoch))
    # Every rank draws the same global batches (same seed) and trains on its share of each;
    # the plan is for the largest share, and rank 0 alone evaluates, in batches of that size.
    share = -(-batch_size // world)
    eval_sets = rpdata.eval_batches(prepared.eval, seq, pad_id, share)
    if lead:
        print(f"train: {data_path}: {len(prepared.train)} {prepared.format} examples ({note}), "
              f"{len(prepared.eval)} eval; {total} steps of {batch_size} x {seq} tokens, "
              f"{iterator.batches_per_epoch} per epoch"
              + (f", each of {world} ranks training on its share" if world > 1 else ""),
              file=sys.stderr)

    if opts["lora"]:
        model = add_lora(model, opts["lora"], opts["lora_alpha"], opts["lora_dropout"], seed)
    lr = opts["lr"] or (2e-4 if opts["lora"] else 2e-5)
    example = {"input_ids": torch.zeros(share, seq, dtype=torch.long)}
    example["labels"] = example["input_ids"].clone()
    manager = None
    # Data parallel: a checkpoint save is a collective (every rank takes part, rank 0 writes).
    if opts["save_every"]:
        from rpcompile.runtime.checkpoint import CheckpointManager

        manager = CheckpointManager(out / "checkpoints", keep_last=opts["keep_last"])
    compiled = rpcompile.compile(
        model, gpus=workers, microbatches=micro, rounds=opts["rounds"], example_inputs=example,
        device=device, mode=opts["mode"], chaos=opts["chaos"], kernels=opts["kernels"],
        recompute=opts["recompute"], loss_scale=True if dtype == torch.float16 else None,
        optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=opts["weight_decay"],
                                              fused=True),
        max_grad_norm=opts["max_grad_norm"] or None, shard_optimizer=opts["shard_optimizer"],
        undo_journal=opts["undo_journal"], host_memory=opts["host_memory"],
    )
    sharded = compiled.trainer().sharded
    if lead:
        print(compiled.plan, file=sys.stderr)
        print(f"train: transfers: "
              f"{compiled.hardware.describe_host_memory('--host-memory pageable')}",
              file=sys.stderr)
    log = None
    try:
        warmup = opts["warmup_steps"] if opts["warmup_steps"] is not None else round(0.03 * total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            compiled.optimizer, lr_lambda(opts["schedule"], warmup, total))
        start = 0
        if checkpoint is not None:
            extra = compiled.load_checkpoint(checkpoint) or {}
            start = int(extra["step"])
            iterator.load_state(extra["data"])
            scheduler.load_state_dict(extra["scheduler"])
            # The optimizer's param_groups come back with the checkpoint; set the scheduler's lr
            # explicitly so the next update uses the saved schedule position either way.
            for group, value in zip(compiled.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = value
            if lead:
                print(f"train: resumed from {checkpoint} at step {start}", file=sys.stderr)
        if lead:
            (out / "config.yaml").write_text(_dump_yaml(opts))

        log = _Log(out, start, opts["tensorboard"]) if lead else None
        t0 = time.perf_counter()
        done_tokens, step_seconds = 0, 0.0

        def evaluate(step: int) -> None:
            if not eval_sets:
                return
            # Sharded: every rank takes part in gathering the masters; rank 0 evaluates.
            masters = compiled.trainer().gather_masters() if sharded else None
            if lead:
                value = _evaluate(compiled, eval_sets, masters)
                log.write({"step": step, "eval_loss": value})
                tqdm.write(f"step {step}: eval loss {value:.4f}", file=sys.stderr)

        if start == 0:
            evaluate(0)
        with tqdm(total=total, initial=start, desc="train", unit="step", disable=not lead) as bar:
            for step in range(start + 1, total + 1):
                batch = next(iterator)
                step_lr = compiled.optimizer.param_groups[0]["lr"]
                t_step = time.perf_counter()
                mine = batch if world == 1 else {
                    k: v.tensor_split(world)[rank] for k, v in batch.items()}
                loss = float(compiled.step(mine))  # the global batch's loss on every rank
                scheduler.step()
                step_seconds += time.perf_counter() - t_step
                done_tokens += batch["input_ids"].numel()
                rate = done_tokens / step_seconds  # training steps only, not eval or saving
                norm = getattr(compiled.trainer().last, "grad_norm", None)
                norm = None if norm is None else float(norm)
                record = {"step": step, "loss": loss, "lr": step_lr, "grad_norm": norm,
                          "tokens": batch["input_ids"].numel(),
                          "target_tokens": int((batch["labels"][:, 1:] != -100).sum()),
                          "tokens_per_s": rate, "epoch": iterator.epoch}
                if log is not None:
                    log.write(record)
                shown = {"loss": f"{loss:.3f}", "tok_s": f"{rate:,.0f}", "lr": f"{step_lr:.2e}"}
                if norm is not None:
                    shown["gnorm"] = f"{norm:.2f}"
                bar.set_postfix(shown)
                bar.update()
                if opts["eval_every"] and step % opts["eval_every"] == 0 and step != total:
                    evaluate(step)
                if manager is not None and (step % opts["save_every"] == 0 or step == total):
                    manager.save(compiled, step, extra={
                        "step": step, "data": iterator.state(),
                        "scheduler": scheduler.state_dict(), "epoch": iterator.epoch,
                    }, per_rank=sharded and opts["checkpoint_per_rank"])
        evaluate(total)
        final = out / "final"
        if lead or sharded:  # sharded: a collective (the masters gathered), rank 0 writes
            compiled.save_pretrained(final, merge=opts["merge"])
        if lead:
            tokenizer.save_pretrained(final)
        trainer = compiled.trainer()
        sched = trainer.schedule
    finally:
        if log is not None:
            log.close()
        compiled.close()
    elapsed = time.perf_counter() - t0
    if not lead:
        return 0
    _write_report(out, log.records, opts, elapsed, done_tokens / max(step_seconds, 1e-9),
                  compiled, sched)
    return 0


def _dump_yaml(opts: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump({k: v for k, v in opts.items()}, sort_keys=False)


def _write_report(out: Path, records: list[dict[str, Any]], opts: dict[str, Any],
                  elapsed: float, tokens_per_s: float, compiled: Any, sched: Any) -> None:
    from rpcompile.sim import simulate

    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    values = [v for _, v in losses]
    first = sum(values[:10]) / max(1, min(10, len(values)))
    last = sum(values[-10:]) / max(1, min(10, len(values)))
    summary = {"model": opts["model"], "data": opts["data"], "steps": len(values),
               "seconds": elapsed, "tokens_per_s": tokens_per_s,
               "loss_first10": first, "loss_last10": last,
               "eval_loss_first": evals[0][1] if evals else None,
               "eval_loss_last": evals[-1][1] if evals else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_loss(losses, evals, out / "loss.png")
    sched.dump(out / "schedule.csv")
    wrote = "schedule.csv/.json/.png"
    if sched.ranks > 1 and compiled.hardware.link is None:
        # Its REDUCE actions have no link to be timed on: the timeline is left out, not
        # simulated on a made-up network.
        wrote = "schedule.csv"
        print(f"train: schedule.json/.png not written: the schedule reduces across "
              f"{sched.ranks} ranks and the hardware profile {compiled.hardware.name!r} has no "
              "inter-server link to time them on (give the profile a link, e.g. "
              "Hardware.with_link('eth100'), to simulate it)")
    else:
        sim = simulate(sched, compiled.plan, compiled.hardware)
        for ext in ("json", "png"):
            sim.dump(out / f"schedule.{ext}")
    eval_text = (f", eval loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f}" if evals else "")
    print(f"train: {len(values)} steps in {elapsed:.1f}s with eval and saving "
          f"({tokens_per_s:,.0f} tokens/s in the steps), loss {first:.3f} -> {last:.3f} (mean of first/last 10 steps)"
          f"{eval_text}; wrote {out}/final/ (from_pretrained), metrics.jsonl, loss.png, "
          f"summary.json, config.yaml, {wrote}"
          + (", tensorboard/" if opts["tensorboard"] else ""))


def plot_loss(losses: list[tuple[int, float]], evals: list[tuple[int, float]], path: Path) -> None:
    """Training loss per step, and the eval loss where it was measured."""
    from rpcompile.viz import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if losses:
        ax.plot(*zip(*losses), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("rpcompile train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
