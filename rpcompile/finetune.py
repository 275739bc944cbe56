"""``rpcompile train``: fine-tune a checkpoint folder on a data file, with the RoundPipe runtime.

Sections, in reading order:

1. options: one table (:data:`OPTIONS`) gives every option's default and help; the command-line
   parser, the YAML file (``--config``) and the saved ``config.yaml`` all use it. Precedence:
   defaults < the no-argument demo's values (when no ``--model`` is given) < the resumed run's
   ``config.yaml`` < ``--config`` < flags.
2. model and tokenizer: a local folder (``AutoModelForCausalLM`` / ``AutoTokenizer``), a name in
   the local Hugging Face cache, or a shipped config (built with random weights and a byte-level
   tokenizer, written to ``OUT/base/`` and loaded from there like any folder); optional LoRA.
3. the run (:class:`_Job`): the run folder it owns (rpcompile.run_folder; a resume is checked
   against the run's identity), data (rpcompile.data), the model in training mode,
   ``rpcompile.compile``, an LR scheduler on ``compiled.optimizer``, the step loop with eval,
   checkpoints and logs, then ``OUT/final/`` (written whole, then moved into place). SIGINT and
   SIGTERM stop it at a step boundary with a checkpoint (rpcompile.interrupts).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shutil
import sys
import time
import types
import warnings
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
from rpcompile.options import FLAT, PlanOptions, TrainOptions

__all__ = ["DEMO", "OPTIONS", "add_train_arguments", "plan_cache_option", "resolve_options",
           "run"]


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


def model_folder(spec: str, out: Path) -> Path | None:
    """The folder ``--model spec`` is loaded from: ``spec`` itself, ``OUT/base`` for a shipped
    config (built there by a new run), or the snapshot in the local Hugging Face cache; None
    when there is none yet (a shipped config not built yet, an id not in the cache)."""
    from rpcompile.workloads.models import list_models

    path = Path(spec)
    if path.is_dir():
        return path
    if spec in list_models():
        return out / "base" if (out / "base" / "config.json").is_file() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:  # not in the cache, or not a repository id: load_model says which
        return None


def load_model(spec: str, out: Path, dtype: Any, seed: int,
               quantize: str = "none") -> tuple[Any, Any, str]:
    """(model, tokenizer, folder it was loaded from). A shipped config is built into
    ``OUT/base`` once (a new run) and loaded from there (a resumed one). ``quantize``
    (``"nf4"``, ``"int8"``): the linears but the LM head loaded quantized by bitsandbytes
    (:func:`quantization_config`), on the host."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpcompile.workloads.models import list_models

    path = Path(spec)
    if not path.is_dir() and spec in list_models():
        if (out / "base" / "config.json").is_file():
            path = out / "base"
        else:
            path = _write_shipped(spec, out / "base", seed)
            print(f"train: built {spec} with random weights (seed {seed}) into {path}/",
                  file=sys.stderr)
    local = path.is_dir()
    source = str(path) if local else spec
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        quantized = {} if quantize == "none" else dict(
            quantization_config=quantization_config(quantize, dtype), device_map={"": "cpu"})
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True,
                                                     **quantized)
    except (OSError, ValueError) as err:
        if not local and "/" not in spec:
            raise InvalidInput(
                f"--model {spec!r} is not a folder, not a shipped config "
                f"({', '.join(list_models())}) and not in the local Hugging Face cache"
            ) from err
        raise InvalidInput(
            f"cannot load --model {spec}: {err}. A model folder needs config.json, the weights "
            "(safetensors) and a tokenizer (tokenizer.json / tokenizer_config.json); nothing is "
            "downloaded"
        ) from err
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise InvalidInput(f"the tokenizer of {spec} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.vocab_size:
        raise InvalidInput(
            f"the tokenizer of {spec} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )
    model.config.use_cache = False
    return model, tokenizer, source


def quantization_config(quantize: str, dtype: Any) -> Any:
    """The ``BitsAndBytesConfig`` of ``--quantize``: QLoRA's NF4 with double-quantized absmax,
    computing in ``dtype``; or LLM.int8() weights (``has_fp16_weights=False``). bitsandbytes
    keeps the LM head in full precision (transformers leaves it out)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"--quantize {quantize} needs bitsandbytes: "
                          "pip install 'rpcompile[qlora]'") from exc
    from transformers import BitsAndBytesConfig

    if quantize == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise InvalidInput(f"--quantize must be none, nf4 or int8, got {quantize!r}")


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


class _Log:
    """metrics.jsonl (one JSON object per line) and the ``--report-to`` reporters, from
    ``start`` on: lines of a resumed run's later steps (written before it was stopped) are
    dropped first."""

    def __init__(self, out: Path, start: int, report_to: str, config: dict[str, Any]) -> None:
        from rpcompile.loggers import open_reporters, parse_report_to

        self.path = out / "metrics.jsonl"
        kept = []
        if start and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.records = [json.loads(line) for line in kept]
        self.reporters = open_reporters(parse_report_to(report_to), out, config, start)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        metrics = {k: v for k, v in record.items() if k != "step" and v is not None}
        for reporter in self.reporters:
            reporter.log(metrics, record["step"])

    def summary(self, metrics: dict[str, Any]) -> None:
        for reporter in self.reporters:
            reporter.summary({k: v for k, v in metrics.items() if v is not None})

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()
        self.reporters = []


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
    """Run ``rpcompile train`` (see the module doc); returns the exit status: 0, or 130 / 143
    when SIGINT / SIGTERM stopped it (rpcompile.interrupts)."""
    from transformers.utils import logging as hf_logging

    from rpcompile.interrupts import Interrupts

    opts, checkpoint = resolve_options(args)
    origin = functools.partial(option_origin, args)
    _check(opts, origin)
    hf_logging.disable_progress_bar()  # one bar: ours
    rank, world, started = _join_ranks()
    stop = Interrupts()
    try:
        # Data parallel: a signal stops every rank at once (torchrun forwards it to each); the
        # ranks would not stop after the same step, so no checkpoint is written then.
        with stop.installed(world == 1):
            return _Job(opts, checkpoint, rank, world, origin, stop).run()
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


def _dtype_name(name: str, device: str) -> str:
    return {"auto": "bf16" if device == "cuda" else "fp32"}.get(name, name)


class _Job:
    """One ``rpcompile train``: set up (the run folder, model, data, compile, resume), train,
    then write ``final/`` and the report; a signal ends it with a checkpoint (:meth:`_stop`).
    A new run that fails or is stopped before its first step leaves no folder behind."""

    def __init__(self, opts: dict[str, Any], checkpoint: Path | None, rank: int, world: int,
                 origin: Any, stop: Any) -> None:
        self.opts, self.checkpoint, self.rank, self.world = opts, checkpoint, rank, world
        self.lead = rank == 0  # only rank 0 writes: metrics, checkpoints, final/, the report
        self.origin, self.stop = origin, stop
        self.out = Path(opts["out"])
        # The run resumed: its folder, which the job goes on in unless --out branches it.
        self.source = checkpoint.parent.parent if checkpoint is not None else self.out
        self.branch = self.source.resolve() != self.out.resolve()
        self.compiled: Any = None
        self.log: _Log | None = None
        self.manager: Any = None
        self.folder: Any = None
        self.committed = 0  # the last step the trainer and the job's bookkeeping both hold
        self.writing: Path | None = None  # the output being written, for a refused write

    def run(self) -> int:
        from rpcompile.run_folder import RunFolder

        resuming = self.checkpoint is not None
        self.folder = (RunFolder.resume(self.out) if resuming and not self.branch else
                       RunFolder.start(self.out, overwrite=self.opts["overwrite"],
                                       lead=self.lead))
        try:
            try:
                self._setup()
            except KeyboardInterrupt:
                if self.lead:
                    self.folder.abandon()
                    print(f"train: {self.stop.name} before the first step: stopped, nothing "
                          "saved" + (f"; the run can still be resumed from {self.checkpoint}"
                                     if resuming else ""), file=sys.stderr)
                return self.stop.status
            except BaseException:
                if self.lead:
                    self.folder.abandon()
                raise
            try:
                return self._train()
            except KeyboardInterrupt:  # again, while the checkpoint of a stop was written
                latest = self._checkpoints().latest() if self.lead else None
                print(f"train: {self.stop.name} while saving: the latest checkpoint is "
                      f"{latest}" + (f"; go on with: rpcompile train --resume {self.out}"
                                     if latest is not None else ""), file=sys.stderr)
                return self.stop.status
        finally:
            if self.log is not None:
                self.log.close()
            if self.compiled is not None:
                self.compiled.close()

    # -- set up ---------------------------------------------------------------------------
    def _setup(self) -> None:
        import torch

        import rpcompile
        from rpcompile import data as rpdata
        from rpcompile.capture.batch import masks_documents

        opts, out, lead, world = self.opts, self.out, self.lead, self.world
        device = opts["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "virtual"
            if device == "virtual" and lead:
                print("train: no CUDA device; running on virtual CPU workers", file=sys.stderr)
        workers = opts["workers"] or (torch.cuda.device_count() if device == "cuda" else 4)
        dtype = _torch_dtype(opts["dtype"], device)
        seed = opts["seed"]
        opts["data"] = opts["data"] or str(rpdata.shipped_corpus())
        dtype_name = _dtype_name(opts["dtype"], device)
        identity = None
        if lead and self.checkpoint is not None:  # refused before anything is loaded
            identity = self._identity(dtype_name, self.source)
            self._check_same_run(identity)
            base = self.source / "base"
            if self.branch and model_folder(opts["model"], self.source) == base:
                shutil.copytree(base, out / "base")  # a shipped config's built weights
        model, tokenizer = self._load_model(dtype, seed)
        if lead and identity is None:  # a shipped config's folder is there now
            identity = self._identity(dtype_name, out)
        self.tokenizer = tokenizer
        data_path = opts["data"]
        prepared = rpdata.prepare(
            data_path, tokenizer, completion_only=opts["completion_only"],
            eval_split=0.0 if opts["eval_data"] else opts["eval_split"],
            eval_path=opts["eval_data"], seed=seed,
        )
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        seq = opts["seq"] = opts["seq"] or min(2048, limit, -(-prepared.longest() // 64) * 64)
        packed = opts["packing"] == "on" or (opts["packing"] == "auto"
                                             and prepared.format == "text")
        pad_id = tokenizer.pad_token_id
        dropped = 0
        if packed:
            rows, truncated, dropped = rpdata.pack(prepared.train, seq, pad_id, seed)
            note = f"packed into {len(rows.rows)} rows of {seq}, attention per document"
        else:
            rows, truncated, dropped = rpdata.pad_rows(prepared.train, seq, pad_id)
            note = f"one per row, padded to {rpdata.bucket_lengths(seq, opts['buckets'])}"
        if rows.split:
            note += f"; {rows.split} long texts split into pieces of {seq} tokens"
        if truncated:
            note += f"; {truncated} truncated to {seq} tokens"
        if dropped:
            note += f"; {dropped} dropped (nothing left to predict after truncation)"
        micro = opts["microbatches"] = opts["microbatches"] or workers + 1
        batch_size = opts["batch"] = opts["batch"] or micro * opts["rounds"] * world
        if batch_size < micro * opts["rounds"] * world:
            # An uneven split is fine (the loss is the global token mean either way); an
            # empty microbatch is not.
            raise InvalidInput(f"--batch {batch_size} is smaller than microbatches x rounds"
                             + (" x ranks" if world > 1 else "")
                             + f" = {micro} x {opts['rounds']}"
                             + (f" x {world}" if world > 1 else "")
                             + ": every microbatch needs a sequence")
        _check_rows(rows, batch_size, prepared, dropped, packed, opts, data_path)
        self.iterator = rpdata.BatchIterator(rows, batch_size, seed, buckets=opts["buckets"])
        self.total = opts["steps"] or max(
            1, math.ceil(opts["epochs"] * self.iterator.batches_per_epoch))
        # Every rank draws the same global batches (same seed) and trains on its share of
        # each; the plan is for the largest share, and rank 0 alone evaluates, in batches of
        # that size.
        share = -(-batch_size // world)
        self.eval_sets = rpdata.eval_batches(prepared.eval, seq, pad_id, share)
        if lead:
            print(f"train: {data_path}: {len(prepared.train)} {prepared.format} examples "
                  f"({note}), {len(prepared.eval)} eval; {self.total} steps of {batch_size} x "
                  f"{seq} tokens, {self.iterator.batches_per_epoch} per epoch"
                  + (f", each of {world} ranks training on its share" if world > 1 else ""),
                  file=sys.stderr)

        if opts["lora"]:
            model = add_lora(model, opts["lora"], opts["lora_alpha"], opts["lora_dropout"],
                             seed)
        # from_pretrained returns the model in eval mode: train it as its config says (dropout
        # on, replayed exactly in recompute).
        model.train()
        lr = opts["lr"] or (2e-4 if opts["lora"] else 2e-5)
        example = {"input_ids": torch.zeros(share, seq, dtype=torch.long)}
        example["labels"] = example["input_ids"].clone()
        if packed:
            example["position_ids"] = torch.arange(seq).expand(share, seq).clone()
        if lead:
            sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
            print(f"train: compiling {type(model).__name__} ({sum(n for n, _ in sizes):,} "
                  f"parameters, {sum(n for n, t in sizes if t):,} trainable) for {workers} "
                  f"{device} workers, a step of {share} x {seq} tokens in {micro} "
                  f"microbatches x {opts['rounds']} rounds (capture, cost model, partition "
                  "search)", file=sys.stderr)
        began = time.perf_counter()
        self.compiled = compiled = rpcompile.compile(
            model, example, gpus=workers, microbatches=micro, rounds=opts["rounds"],
            device=device, mode=opts["mode"], search_effort=opts["search_effort"],
            optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=opts["weight_decay"],
                                                  fused=True),
            max_grad_norm=opts["max_grad_norm"] or None,
            plan=PlanOptions(recompute=opts["recompute"], shard_optimizer=opts["shard_optimizer"],
                             undo_journal=opts["undo_journal"], host_memory=opts["host_memory"],
                             plan_cache=plan_cache_option(opts["plan_cache"]),
                             progress=False if opts["quiet"] else None),
            train=TrainOptions(chaos=opts["chaos"], kernels=opts["kernels"],
                               loss_scale=True if dtype == torch.float16 else None),
        )
        if packed and not masks_documents(compiled.capture):
            compiled.close()
            raise InvalidInput(
                f"--packing on needs attention confined to each document, and "
                f"{type(model).__name__}'s captured graph builds no attention mask from "
                "position_ids (its attention ignores where a packed document starts), so a token "
                "would attend to the earlier documents of its row: train it with --packing off"
            )
        self.sharded = compiled.trainer().sharded
        self.predicted = _predicted_step_seconds(compiled)
        # The cost model's FLOPs of one step (forward and backward of every unit, recompute
        # not counted) over the whole global batch: the numerator of the MFU.
        self.flops_per_step = batch_size * sum(sum(u.flops_at(1, seq))
                                               for u in compiled.unit_costs)
        if lead:
            print(f"train: compiled in {time.perf_counter() - began:.1f}s", file=sys.stderr)
            print(compiled.plan, file=sys.stderr)
            print(f"train: transfers: "
                  f"{compiled.hardware.describe_host_memory('--host-memory pageable')}",
                  file=sys.stderr)
        warmup = opts["warmup_steps"] if opts["warmup_steps"] is not None \
            else round(0.03 * self.total)
        self.factor = lr_lambda(opts["schedule"], warmup, self.total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(compiled.optimizer, self.factor)
        self.start = 0
        if opts["save_every"]:
            self.manager = self._checkpoints()
        if self.checkpoint is not None:
            self._resume()
        self.committed = self.start
        if lead:
            (out / "config.yaml").write_text(_dump_yaml(opts))
            self.folder.record(identity)
            self.log = _Log(out, self.start, opts["report_to"], opts)

    def _checkpoints(self) -> Any:
        from rpcompile.runtime.checkpoint import CheckpointManager

        # Data parallel: a checkpoint save is a collective (every rank takes part, rank 0
        # writes).
        return CheckpointManager(self.out / "checkpoints", keep_last=self.opts["keep_last"])

    def _load_model(self, dtype: Any, seed: int) -> tuple[Any, Any]:
        spec = self.opts["model"]
        if self.world > 1:
            import torch.distributed as dist

            if not self.lead:
                dist.barrier()  # rank 0 writes a shipped model's folder first; the others read
                from rpcompile.workloads.models import list_models

                if spec in list_models() and not Path(spec).is_dir():
                    spec = str(self.out / "base")
            model, tokenizer, _ = load_model(spec, self.out, dtype, seed,
                                             self.opts["quantize"])
            if self.lead:
                dist.barrier()
            return model, tokenizer
        model, tokenizer, _ = load_model(spec, self.out, dtype, seed, self.opts["quantize"])
        return model, tokenizer

    # -- the run's identity (rpcompile.run_folder) ---------------------------------------------
    def _identity(self, dtype: str, root: Path) -> dict[str, Any] | None:
        """What run.json records: the model's fingerprint, the data files' sha256 and the
        compute dtype. A new run of a shipped config has no model folder yet (it is built
        into OUT/base): its fingerprint is taken once it is written (:meth:`_resume` never
        sees that case)."""
        from rpcompile.run_folder import file_sha256, model_fingerprint

        opts = self.opts
        files = {}
        for key in ("data", "eval_data"):
            path = opts[key]
            if path is None:
                files[key] = None
            elif not Path(path).is_file():
                raise InvalidInput(f"data file {path} does not exist")
            else:
                files[key] = {"path": str(path), "sha256": file_sha256(path)}
        folder = model_folder(opts["model"], root)
        return {"model": {"name": opts["model"],
                          "fingerprint": None if folder is None else model_fingerprint(folder)},
                **files, "dtype": dtype}

    def _check_same_run(self, identity: dict[str, Any]) -> None:
        """A resume goes on only with the run's model, data and trajectory options; each
        refusal names the option, where its value came from and the run's own value."""
        from rpcompile.run_folder import MAY_CHANGE, RUN_FILE, read_identity

        run_dir = self.source
        config = run_dir / "config.yaml"
        saved = _load_yaml(config, run=True) if config.is_file() else {}

        def given(name: str) -> str:
            source = self.origin(name)
            return source if source.startswith("--") else f"{name} (from {source})"

        for option in OPTIONS:
            name = option.name
            if name in MAY_CHANGE or name in ("model", "data", "eval_data", "out") \
                    or name not in saved or self.opts[name] == saved[name]:
                continue
            raise InvalidInput(
                f"{given(name)} is {self.opts[name]!r}, but the run in {run_dir} trained with "
                f"{saved[name]!r} ({config}): it changes the training, so a resumed run keeps "
                f"the run's value. Leave it out to go on with {saved[name]!r}, or start a new "
                "run with it (a new --out, or --overwrite)")
        recorded = read_identity(run_dir)
        if recorded is None or "model" not in recorded:
            print(f"train: {run_dir} has no {RUN_FILE} with the run's model and data: they "
                  "are not checked against the run's", file=sys.stderr)
            return
        for key in ("data", "eval_data"):
            theirs, ours = recorded.get(key), identity[key]
            if (theirs is None) != (ours is None) or (theirs and theirs["sha256"] !=
                                                      ours["sha256"]):
                flag = "--" + key.replace("_", "-")
                was = "none" if theirs is None else f"{theirs['path']} (sha256 " \
                    f"{theirs['sha256'][:12]}...)"
                now = "none" if ours is None else f"{ours['path']} (sha256 " \
                    f"{ours['sha256'][:12]}...)"
                raise InvalidInput(
                    f"{given(key)}: the run in {run_dir} trained on {was}, this resume would "
                    f"train on {now}: a resumed run goes on with the same data. Give {flag} "
                    "the run's file (moved files are found by content), or start a new run "
                    "(a new --out, or --overwrite)")
        theirs, ours = recorded["model"], identity["model"]
        if ours["fingerprint"] is None:
            raise InvalidInput(
                f"the model of the run in {run_dir} ({theirs['name']}) is not there "
                + (f"(its {run_dir}/base/ is missing)" if theirs["name"] == ours["name"] and
                   not Path(ours["name"]).is_dir() else "(moved or deleted?)")
                + ": give --model the folder it moved to")
        if ours["fingerprint"] != theirs["fingerprint"]:
            raise InvalidInput(
                f"{given('model')}: {ours['name']} is not the model the run in {run_dir} "
                f"started from ({theirs['name']}: another config, tokenizer or set of weight "
                "files); give --model that model's folder, or start a new run (a new --out, "
                "or --overwrite)")
        if identity["dtype"] != recorded["dtype"]:
            raise InvalidInput(
                f"the run in {run_dir} computed in {recorded['dtype']}; --dtype "
                f"{self.opts['dtype']} on {self.opts['device']} workers computes in "
                f"{identity['dtype']}, which changes the training: pass --dtype "
                f"{recorded['dtype']}")

    def _resume(self) -> None:
        from rpcompile.runtime.checkpoint import CheckpointManager

        if self.lead:
            for path, why in CheckpointManager(self.source / "checkpoints").skipped():
                print(f"train: skipped {path}: {why}", file=sys.stderr)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", RuntimeWarning)
            extra = self.compiled.load_checkpoint(self.checkpoint) or {}
        for warning in said:  # e.g. saved under another plan (other --workers): one line
            if self.lead:
                print(f"train: {warning.message}", file=sys.stderr)
        self.start = int(extra["step"])
        self.iterator.load_state(extra["data"])
        self.scheduler.load_state_dict(extra["scheduler"])
        # The learning rate of the next update is the schedule's at the step reached, for
        # this run's total: the saved rate itself when the total is the run's, the schedule
        # of a run of the new total when --steps extends it (never the 0 a finished cosine
        # or linear schedule ends at).
        for group, base in zip(self.compiled.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.factor(self.scheduler.last_epoch)
        if self.lead:
            print(f"train: resumed from {self.checkpoint} at step {self.start}",
                  file=sys.stderr)

    # -- training ---------------------------------------------------------------------------
    def _train(self) -> int:
        from safetensors import SafetensorError
        from tqdm import tqdm

        opts, lead, compiled = self.opts, self.lead, self.compiled
        self.began = time.perf_counter()
        self.tokens, self.seconds = 0, 0.0
        self.stop.graceful = True
        try:
            if self.start == 0:
                self._evaluate(0)
            with tqdm(total=self.total, initial=self.start, desc="train", unit="step",
                      disable=not lead) as bar:
                self.bar = bar
                while self.committed < self.total and not self.stop.requested:
                    self._steps(self._next_stop(self.committed))
                    if self.stop.requested:
                        break
                    step = self.committed
                    if opts["eval_every"] and step % opts["eval_every"] == 0 \
                            and step != self.total:
                        self._evaluate(step)
                    if self.manager is not None and (step % opts["save_every"] == 0
                                                     or step == self.total):
                        self._save(step)
            if self.stop.requested:
                return self._stop()
            # Every step is done: a signal now stops at once (with a checkpoint of the last
            # step, from which a resume writes final/).
            self.stop.graceful = False
            self._evaluate(self.total)
            self._write_final()
            if lead:
                summary = _write_report(self.out, self.log.records, opts,
                                        time.perf_counter() - self.began,
                                        self.tokens / max(self.seconds, 1e-9), compiled,
                                        compiled.trainer().schedule, self._mfu())
                self.log.summary(summary)
        except KeyboardInterrupt:
            return self._stop()
        except (OSError, SafetensorError) as err:
            # safetensors reports a refused write (a full disk) as its own error, without
            # the file's name.
            what = getattr(err, "filename", None) or self.writing or "a file"
            raise InvalidInput(self._failed(f"cannot write {what}: "
                                          f"{getattr(err, 'strerror', None) or err}")) from None
        return 0

    def _next_stop(self, step: int) -> int:
        """The first step after ``step`` at which the loop evaluates or saves, or the last."""
        ends = [self.total]
        for every in (self.opts["eval_every"], self.opts["save_every"] if self.manager else 0):
            if every:
                ends.append((step // every + 1) * every)
        return min(ends)

    def _mfu(self) -> dict[str, float | None]:
        """Model FLOPs utilization of the training steps: the cost model's FLOPs per step times
        the steps, over their measured seconds and the peak of every worker of every rank."""
        hardware = self.compiled.hardware
        steps = self.committed - self.start
        peak = hardware.matmul_tflops * 1e12 * self.compiled.workers * self.world
        achieved = self.flops_per_step * steps / self.seconds if self.seconds > 0 else None
        return {"flops_per_step": float(self.flops_per_step),
                "peak_flops_per_s": peak,
                "mfu": None if achieved is None else achieved / peak}

    def _steps(self, until: int) -> None:
        """Train steps ``committed + 1 .. until`` as one stream (``Compiled.fit``): each batch
        is drawn and bound while the steps before it run, the learning-rate scheduler steps as
        each step commits, and the loop books each result as it comes. The stream ends drained
        at ``until`` (the loop evaluates or saves there). A first signal stops the drawing: the
        steps in flight commit and are booked, and the loop stops. A second one discards them
        (``KeyboardInterrupt``): the job then holds the steps that committed, and the data
        position is rewound to the batch of the first step not committed."""
        first = self.committed + 1
        # Per step from ``first``, made as its batch is drawn: the data position before its
        # batch, then its tokens and target tokens over the whole global batch and the epoch
        # the data is in once it is drawn. Its learning rate: noted as the step before it
        # committed.
        drawn: dict[int, list[Any]] = {}
        rates = {first: self.compiled.optimizer.param_groups[0]["lr"]}
        hooked = [first - 1]  # the steps the scheduler has stepped for (on the host queue)

        def batches() -> Any:
            step = first
            while True:
                drawn[step] = [self.iterator.state()]
                batch = next(self.iterator)
                drawn[step] += [batch["input_ids"].numel(),
                                int((batch["labels"][:, 1:] != -100).sum()),
                                self.iterator.epoch]
                step += 1
                yield batch if self.world == 1 else {
                    k: v.tensor_split(self.world)[self.rank] for k, v in batch.items()}

        def stepped() -> None:  # on the host queue, as each step commits
            self.scheduler.step()
            hooked[0] += 1
            rates[hooked[0] + 1] = self.compiled.optimizer.param_groups[0]["lr"]

        stream = self.compiled.fit(batches(), steps=until - self.committed,
                                   scheduler=types.SimpleNamespace(step=stepped))
        try:
            for result in stream:
                self._book(result, self.committed + 1, drawn, rates)
                if self.stop.requested:
                    stream.end()  # no batch drawn after this; the steps in flight go on
        except KeyboardInterrupt:
            done = hooked[0]  # committed, booked or not
            if done > self.committed:
                print(f"train: steps {self.committed + 1}..{done} committed as the run was "
                      "interrupted; their losses are not logged", file=sys.stderr)
                self.committed = done
            if done + 1 in drawn:  # the discarded steps' batches are drawn again on resume
                self.iterator.load_state(drawn[done + 1][0])
            raise

    def _book(self, result: Any, step: int, drawn: dict[int, Any],
              rates: dict[int, float]) -> None:
        """Log step ``step``'s result (its loss is the global batch's on every rank)."""
        with self.stop.deferred():
            _position, tokens, target, epoch = drawn.pop(step)
            step_lr = rates.pop(step)
            loss = float(result.loss)
            self.committed = step
            self.seconds += result.seconds
            self.tokens += tokens
            rate = self.tokens / self.seconds  # training steps only, not eval or saving
            norm = None if result.grad_norm is None else float(result.grad_norm)
            # The fraction of the target tokens (those the loss averages over) whose argmax
            # logit is their label, counted where the tail computes the loss.
            correct = result.correct_tokens
            accuracy = None if correct is None or not target else correct / target
            record = {"step": step, "loss": loss, "lr": step_lr, "grad_norm": norm,
                      "token_accuracy": accuracy, "tokens": tokens, "target_tokens": target,
                      "tokens_per_s": rate, "epoch": epoch,
                      "step_seconds": result.seconds,
                      "predicted_step_seconds": self.predicted}
            if self.log is not None:
                self.log.write(record)
            shown = {"loss": f"{loss:.3f}", "tok_s": f"{rate:,.0f}", "lr": f"{step_lr:.2e}"}
            if norm is not None:
                shown["gnorm"] = f"{norm:.2f}"
            if accuracy is not None:
                shown["acc"] = f"{accuracy:.3f}"
            self.bar.set_postfix(shown)
            self.bar.update()

    def _evaluate(self, step: int) -> None:
        from tqdm import tqdm

        if not self.eval_sets:
            return
        # Sharded: every rank takes part in gathering the masters; rank 0 evaluates.
        masters = self.compiled.trainer().gather_masters() if self.sharded else None
        if self.lead:
            value = _evaluate(self.compiled, self.eval_sets, masters)
            self.log.write({"step": step, "eval_loss": value})
            tqdm.write(f"step {step}: eval loss {value:.4f}", file=sys.stderr)

    def _save(self, step: int) -> Path:
        from rpcompile.runtime.checkpoint import CheckpointError

        if self.manager is None:
            self.manager = self._checkpoints()
        try:
            return self.manager.save(self.compiled, step, extra={
                "step": step, "data": self.iterator.state(),
                "scheduler": self.scheduler.state_dict(), "epoch": self.iterator.epoch,
            }, per_rank=self.sharded and self.opts["checkpoint_per_rank"])
        except CheckpointError as err:
            raise InvalidInput(self._failed(str(err))) from None

    def _failed(self, what: str) -> str:
        """The message of a run stopped by a failed write: what failed, the checkpoint a
        resume goes on from, and the command."""
        latest = self._checkpoints().latest() if self.lead else None
        where = (f"the latest checkpoint is {latest}: make room (or make {self.out} "
                 f"writable) and go on with: rpcompile train --resume {self.out}"
                 if latest is not None else "no checkpoint of it was written")
        return f"{what}. The run stopped after step {self.committed}; {where}"

    def _stop(self) -> int:
        """A signal stopped the loop: checkpoint the last committed step (one process) and say
        how to go on."""
        step, out = self.committed, self.out
        if self.world > 1:
            print(f"train: {self.stop.name} after step {step}: every rank stops; go on from "
                  f"the latest checkpoint with: rpcompile train --resume {out}",
                  file=sys.stderr)
            return self.stop.status
        if step == 0:
            self.folder.abandon()
            print(f"train: {self.stop.name} before the first step ended: stopped, nothing "
                  "saved", file=sys.stderr)
            return self.stop.status
        existing = self._checkpoints().latest()
        if existing is not None and existing.name == self._checkpoints().path_for(step).name:
            saved = existing
        else:
            saved = self._save(step)
        print(f"train: {self.stop.name}: stopped after step {step} of {self.total}, saved "
              f"{saved}; go on with: rpcompile train --resume {out}", file=sys.stderr)
        return self.stop.status

    def _write_final(self) -> None:
        """``final/``, written whole into a fresh folder and then moved into place, so that
        it never holds files of an earlier write (an adapter beside full weights)."""
        from rpcompile.runtime.checkpoint import replace_folder

        partial = self.out / ".final.partial"
        self.writing = self.out / "final"
        if self.lead:
            shutil.rmtree(partial, ignore_errors=True)
        try:
            if self.lead or self.sharded:  # sharded: a collective (the masters gathered)
                self.compiled.save_pretrained(partial, merge=self.opts["merge"])
            if self.lead:
                self.tokenizer.save_pretrained(partial)
                replace_folder(partial, self.out / "final")
        except BaseException:
            if self.lead:  # a final/ written in part is no model: leave none behind
                shutil.rmtree(partial, ignore_errors=True)
            raise
        self.writing = None


def _check_rows(rows: Any, batch_size: int, prepared: Any, dropped: int, packed: bool,
                opts: dict[str, Any], data_path: str) -> None:
    """Refuse data that gives fewer rows than one batch, naming the cause: examples that
    --seq truncated to nothing to predict, an eval split that took most of the data, or
    simply too little data for --batch."""
    n = len(rows.rows)
    if n >= batch_size:
        return
    train, held = len(prepared.train), len(prepared.eval)
    causes = []
    if dropped:
        longest = max(len(e) for e in prepared.train)
        causes.append(f"{dropped} of the {train} training examples keep no token to predict "
                      f"once truncated to --seq {rows.seq_len} (their prompts are longer; the "
                      f"longest example has {longest} tokens): use a larger --seq, or "
                      "--no-completion-only")
    if held and not opts["eval_data"] and held >= train:
        causes.append(f"--eval-split {opts['eval_split']} holds out {held} of the "
                      f"{train + held} examples for eval, leaving {train} to train on: use a "
                      "smaller --eval-split, or give --eval-data FILE")
    if not causes:
        made = f"packed into {n} rows of --seq {rows.seq_len}" if packed else f"{n} rows"
        causes.append(f"{train} training examples make {made}: use a smaller --batch"
                      + (" or --seq" if packed else "") + ", or more data")
    raise InvalidInput(f"{data_path} gives {n} training rows, fewer than one batch of --batch "
                     f"{batch_size}: " + "; ".join(causes))


def _dump_yaml(opts: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump({o.name: opts[o.name] for o in OPTIONS}, sort_keys=False)


def _predicted_step_seconds(compiled: Any) -> float | None:
    """The simulator's time per step of the schedule the workers run, on the compile's
    hardware profile (None when a multi-rank schedule has no link to time its reductions)."""
    from rpcompile.sim import simulate

    sched = compiled.trainer().schedule
    if sched.ranks > 1 and compiled.hardware.link is None:
        return None
    return simulate(sched, compiled.plan, compiled.hardware).makespan_ms / sched.steps / 1e3


def _write_report(out: Path, records: list[dict[str, Any]], opts: dict[str, Any],
                  elapsed: float, tokens_per_s: float, compiled: Any, sched: Any,
                  mfu: dict[str, float | None]) -> dict[str, Any]:
    """Write summary.json, loss.png and the schedule files; returns the summary."""
    from rpcompile.loggers import parse_report_to
    from rpcompile.sim import simulate

    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    values = [v for _, v in losses]
    # The first and last n steps, n up to 10 and never overlapping (one step: its loss).
    n = max(1, min(10, len(values) // 2))
    first = sum(values[:n]) / max(1, len(values[:n]))
    last = sum(values[-n:]) / max(1, len(values[-n:]))
    summary = {"model": opts["model"], "data": opts["data"], "steps": len(values),
               "seconds": elapsed, "tokens_per_s": tokens_per_s,
               "loss_first": first, "loss_last": last, "loss_steps_averaged": n,
               "eval_loss_first": evals[0][1] if evals else None,
               "eval_loss_last": evals[-1][1] if evals else None,
               "hardware": compiled.hardware.name, **mfu}
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
          f"({tokens_per_s:,.0f} tokens/s in the steps), loss {first:.3f} -> {last:.3f} "
          + ("(one step)" if len(values) < 2 else "(first/last step)" if n == 1
             else f"(mean of first/last {n} steps)")
          + f"{eval_text}; wrote {out}/final/ (from_pretrained), metrics.jsonl, loss.png, "
          f"summary.json, config.yaml, {wrote}"
          + "".join(f", {name}" for name in parse_report_to(opts["report_to"])))
    return summary


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
