"""``rpcompile train``'s options: one table (:data:`OPTIONS`) gives every option's default and
help; the command-line parser, the YAML file (``--config``) and the saved ``config.yaml`` all
use it. Precedence: defaults < the no-argument demo's values (when no ``--model`` is given) <
the resumed run's ``config.yaml`` < ``--config`` < flags. Options that cannot run together are
refused here, before anything is loaded, in the command line's words."""

from __future__ import annotations

import argparse
import math
import re
import sys
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
    SEARCH_EFFORTS,
    check_choice,
    check_option,
    flag_type,
)
from rpcompile.errors import InvalidInput
from rpcompile.options import FLAT, PlanOptions


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
    Option("out", "runs/train", "output folder of one run: final/, checkpoints/, "
           "metrics.jsonl, tensorboard/, loss.png, config.yaml, run.json, summary.json, "
           "schedule.*; a folder holding another run is refused (see --overwrite, --resume)"),
    Option("lora", 0, "LoRA rank on every linear layer but the LM head (0: full fine-tune)", int),
    Option("lora_alpha", None, "LoRA alpha (none: 2 x rank)", float),
    Option("lora_dropout", 0.0, "dropout on the LoRA adapters' input", float),
    Option("merge", False, "with --lora: write final/ as merged full weights, not an adapter", bool),
    Option("quantize", "none", "with --lora: load the frozen base quantized by bitsandbytes "
           "(QLoRA): nf4 (4-bit NormalFloat, double-quantized absmax) or int8, kept packed on "
           "the host and uploaded packed; final/ is an adapter for that quantized base", str,
           ("none", "nf4", "int8")),
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
    Option("seq", None, "sequence length in tokens; longer examples are truncated "
           "(none: the longest example, rounded up to 64, at most 2048)", int),
    Option("packing", "auto", "whole examples side by side in a row, each attending only to "
           "itself (on), or one example per padded row (off); "
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
    Option("search_effort", "normal", "what the partition search spends: normal (a few replays), "
           "high or exhaustive (until its plan is proven the fastest)", str, SEARCH_EFFORTS),
    Option("plan_cache", None, "folder where searched plans are kept and found again (none: "
           "$RPCOMPILE_CACHE_DIR, else ~/.cache/rpcompile/plans; off: search every time)"),
    Option("quiet", False, "no progress lines from the compile (capture, search, cache)", bool),
    Option("chaos", None, "seed for random delays on virtual workers (tests the protocol)", int),
    Option("seed", 0, "seed of the weights built, LoRA init, eval split and data order", int),
    Option("report_to", "tensorboard", "where to log metrics besides metrics.jsonl: a comma-"
           "separated list of tensorboard, wandb, mlflow, trackio, or none", str),
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
                        help="continue a run in its own folder (wherever it now is; --out "
                             "NEW branches it into a new folder instead): the folder (latest "
                             "checkpoint) or one checkpoint folder; options come from the "
                             "run's config.yaml, and only those that do not change the "
                             "training (steps, epochs, eval and save cadence, workers, "
                             "device, ...; docs/finetune.md) may be given anew")
    parser.add_argument("--overwrite", action="store_true", default=False,
                        help="start a new run in --out even if it holds another run: that "
                             "run's files are deleted first (without it such a folder is "
                             "refused)")
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


def plan_cache_option(value: str | None) -> bool | Path:
    """``--plan-cache`` (``rpcompile train`` and ``plan``): the default folder (None), off, or
    a folder (``PlanOptions.plan_cache``)."""
    if value is None:
        return True
    return False if value.lower() in ("off", "0", "false", "no") else Path(value)


# Keys a run folder's config.yaml may hold that an option has replaced: key -> (the option,
# the option's value for each value of the key). A run folder keeps its config.yaml for good,
# so its resume reads them; a --config file names the option instead (refused with its name).
_REPLACED = {"tensorboard": ("report_to", {True: "tensorboard", False: "none"})}


def _load_yaml(path: Path, run: bool = False, notices: list[str] | None = None,
               ) -> dict[str, Any]:
    """The options of a YAML file, each checked against its type and choices; every refusal
    names the file, the key, the value and what the key takes. A key set to null is left out
    (the option keeps its value from the layers below). ``run``: the file is a run folder's
    own config.yaml, whose replaced keys (:data:`_REPLACED`) are read as the option that
    replaced them, a line saying so appended to ``notices``."""
    import yaml

    if not path.is_file():
        raise InvalidInput(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise InvalidInput(f"{path} is not valid YAML{at}: {problem}; write one "
                         "'option: value' per line") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} must hold a mapping of option: value, not a "
                         f"{type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in _REPLACED and name not in _BY_NAME:
            option, values = _REPLACED[name]
            if not run or value not in values or option in data:
                raise InvalidInput(
                    f"{path}: {key}: {option} replaces it: write {option}: "
                    + " or ".join(f"{v}" for v in values.values()))
            if notices is not None:
                notices.append(f"{path} says {key}: {str(value).lower()}, which {option} "
                               f"replaces: the run goes on with {option}: {values[value]}")
            key, name, value = option, option, values[value]
        if name not in _BY_NAME:
            raise InvalidInput(f"{path}: unknown option {key!r}; known: {', '.join(_BY_NAME)}")
        if value is None:
            continue
        option = _BY_NAME[name]
        try:
            value = _coerce(option, value)
        except ValueError as err:
            raise InvalidInput(f"{path}: {key}: {err}") from None
        if option.choices:
            try:  # an option of compile's by its one rule, the others in the same words
                if name in CHOICES:
                    check_option(name, value)
                else:
                    check_choice(name, value, option.choices)
            except ValueError as err:
                raise InvalidInput(f"{path}: {_cli_words(str(err))}") from None
        out[name] = value
    return out


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _coerce(option: Option, value: Any) -> Any:
    """``value`` as ``option``'s type: an int option takes an integer (or its digits as a
    string), a float option a number (``3e-4``, which YAML reads as a string, included), a
    bool option true or false, a string option a string or a number (a folder named 2024)."""
    kind = option.type
    wrong = ValueError(f"{value!r} is not {_TYPE_WORDS[kind]}"
                       + (" (YAML reads yes, no, on, off, true and false as booleans)"
                          if isinstance(value, bool) else "")
                       + f": {option.help}")
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if isinstance(value, (bool, list, dict)):
        raise wrong
    if kind is str:
        return str(value)
    try:
        number = float(value) if kind is float else int(str(value).strip())
    except ValueError:
        if kind is int and isinstance(value, float) and value.is_integer():
            return int(value)
        raise wrong from None
    if kind is float and not math.isfinite(number):
        raise wrong
    return number


def resolve_options(args: argparse.Namespace) -> tuple[dict[str, Any], Path | None]:
    """The run's options (see the module doc for precedence) and the checkpoint to resume.
    A resumed run goes on in the run folder it is resumed from, wherever that now is, unless
    ``--out`` names another folder: the run then branches into that one (a new run folder)."""
    flags = {o.name: getattr(args, o.name) for o in OPTIONS
             if getattr(args, o.name, None) is not None}
    from_file = _load_yaml(args.config) if args.config else {}
    overwrite = bool(getattr(args, "overwrite", False))
    checkpoint = None
    resumed: dict[str, Any] = {}
    if args.resume is not None:
        checkpoint, run_dir = _find_checkpoint(args.resume)
        saved = run_dir / "config.yaml"
        if saved.is_file():
            notices: list[str] = []
            resumed = _load_yaml(saved, run=True, notices=notices)
            for line in notices:
                print(f"train: {line}", file=sys.stderr)
        given = flags.get("out", from_file.get("out"))
        branch = given is not None and Path(given).resolve() != run_dir.resolve()
        if not branch:
            if overwrite:
                raise InvalidInput(f"--overwrite starts a new run; --resume {args.resume} goes "
                                 f"on with one in {run_dir}: give one of them (or --out NEW "
                                 "to branch the run into another folder)")
            _refuse_later_checkpoints(checkpoint)
        resumed["out"] = str(given) if branch else str(run_dir)
    opts = {o.name: o.default for o in OPTIONS}
    if "model" not in {**resumed, **from_file, **flags}:
        opts.update(DEMO)
    opts.update(resumed)
    opts.update(from_file)
    opts.update(flags)
    if args.resume is not None:
        opts["out"] = resumed["out"]
    opts["overwrite"] = overwrite
    return opts, checkpoint


def _find_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) from a run folder or a checkpoint folder."""
    from rpcompile.runtime.checkpoint import CheckpointManager

    if (path / "checkpoints").is_dir():
        manager = CheckpointManager(path / "checkpoints")
        latest = manager.latest()
        if latest is None:
            skipped = "".join(f"; {p.name} is skipped: {why}" for p, why in manager.skipped())
            raise InvalidInput(f"{path}/checkpoints holds no checkpoint to resume from{skipped}")
        return Path(latest), path
    if path.is_dir() and path.parent.name == "checkpoints":
        return path, path.parent.parent
    raise InvalidInput(
        f"--resume {path}: give a run's output folder (with checkpoints/) or one of its "
        "checkpoint folders; runs save checkpoints with --save-every N, and when stopped "
        "with Ctrl-C or SIGTERM"
    )


def _refuse_later_checkpoints(checkpoint: Path) -> None:
    """A run that goes on in its own folder from a checkpoint with later ones beside it would
    save beside checkpoints of the trajectory it leaves (and --keep-last would keep those)."""
    from rpcompile.runtime.checkpoint import CheckpointManager

    later = [p for p in CheckpointManager(checkpoint.parent).checkpoints()
             if p.name > checkpoint.name]
    if later:
        raise InvalidInput(
            f"--resume {checkpoint}: {checkpoint.parent} also holds later checkpoints "
            f"({', '.join(p.name for p in later)}) of the run that went on from it, and a "
            f"resumed run goes on in the same folder: delete those to go on from "
            f"{checkpoint.name} instead (rm -r {' '.join(str(p) for p in later)}), give "
            f"--out NEW to branch into a new folder, or resume {checkpoint.parent.parent} to "
            "go on from the latest")


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
        if saved.is_file() and name in _load_yaml(saved, run=True):
            return f"the resumed run's {saved}"
    return "the default"


def _check(opts: dict[str, Any], origin: Any = None) -> None:
    """Refuse options that cannot run together; ``origin(name)`` says where an option's
    value came from (:func:`option_origin`) when the message should say it."""

    def refuse(name: str, rule: str) -> None:
        flag = "--" + name.replace("_", "-")
        source = flag if origin is None else origin(name)
        where = "" if source == flag else f" (from {source})"
        raise InvalidInput(f"{flag} {rule}, got {opts[name]!r}{where}")

    from rpcompile.loggers import parse_report_to, require

    require(parse_report_to(opts["report_to"]))
    for name in ("rounds", "buckets", "keep_last"):
        if opts[name] < 1:
            refuse(name, "must be at least 1")
    for name in ("steps", "batch", "microbatches", "workers", "seq", "lora"):
        if opts[name] is not None and opts[name] < (0 if name == "lora" else 1):
            refuse(name, "must be positive" if name != "lora" else
                   "must be a rank >= 1, or 0 for a full fine-tune")
    for name in ("eval_every", "save_every", "warmup_steps", "weight_decay", "max_grad_norm"):
        if opts[name] is not None and opts[name] < 0:
            refuse(name, "must be >= 0")
    for name in ("eval_split", "lora_dropout"):
        if not 0 <= opts[name] < 1:
            refuse(name, "must be a fraction in [0, 1)")
    for name in ("lr", "epochs", "lora_alpha"):
        if opts[name] is not None and not opts[name] > 0:
            refuse(name, "must be positive")
    if opts["merge"] and not opts["lora"]:
        raise InvalidInput("--merge merges LoRA adapters; it needs --lora R")
    if opts["quantize"] != "none" and not opts["lora"]:
        raise InvalidInput(
            f"--quantize {opts['quantize']} quantizes the frozen base under LoRA adapters; it "
            "needs --lora R (full fine-tuning of a quantized base is not supported: its "
            "weights cannot be trained). Pass --lora R, or leave out --quantize")
    if opts["quantize"] != "none" and opts["merge"]:
        raise InvalidInput(
            f"--merge with --quantize {opts['quantize']}: merging the adapters into a "
            "quantized base rounds them away into its codes. Leave out --merge: final/ is "
            "then the adapter, which PEFT loads onto the same quantized base (or merges into "
            "the full-precision checkpoint)")
    if opts["checkpoint_per_rank"] and not opts["shard_optimizer"]:
        # Writing needs sharding; reading does not (a resume reads a per-rank checkpoint on
        # any ranks, sharded or not), so a resumed run may leave it out: refused, not dropped
        # quietly, because the checkpoints it writes would then be of another kind.
        source = "--checkpoint-per-rank" if origin is None else origin("checkpoint_per_rank")
        where = source if source == "--checkpoint-per-rank" else \
            f"checkpoint_per_rank: true (from {source})"
        raise InvalidInput(f"{where} writes each rank's shard of a sharded state: it needs "
                         "--shard-optimizer (without it every rank holds the whole state and "
                         "rank 0 writes it); or pass --no-checkpoint-per-rank to write whole "
                         "checkpoints (resuming from per-rank files needs no sharding)")
    _check_plan_options(opts)


# The train options that are PlanOptions fields under the same name: PlanOptions validates them
# (each rule lives there once), and _cli_words puts its message in the command line's words.
_PLAN_OPTIONS = tuple(f.name for f in fields(PlanOptions)
                      if f.name in _BY_NAME and f.name != "plan_cache")  # checked as its flag maps it


# Every train option that is an option of compile's under the same name (of any group), and
# the table's own options with choices: the names _cli_words translates.
_WORDS = tuple(sorted({name for name in _BY_NAME if name in FLAT or _BY_NAME[name].choices},
                      key=len, reverse=True))


def _check_plan_options(opts: dict[str, Any]) -> None:
    """Refuse what :class:`~rpcompile.options.PlanOptions` refuses (``--shard-optimizer``
    with ``--mode async``, say) before anything is loaded, in the CLI's words."""
    try:
        PlanOptions(**{name: opts[name] for name in _PLAN_OPTIONS},
                    **{"plan_cache": plan_cache_option(opts["plan_cache"])})
    except ValueError as err:
        raise InvalidInput(_cli_words(str(err))) from None


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


def _dump_yaml(opts: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump({o.name: opts[o.name] for o in OPTIONS}, sort_keys=False)
