"""TRL's ``SFTTrainer`` on rpcompile workers: ``from rpcompile.trl import SFTTrainer``.

The constructor is TRL's, plus one keyword, ``rpcompile={...}``: rpcompile's options by name,
the fields of its option groups (``gpus``, ``mode``, ``device``, ``microbatches``, ``rounds``,
``recompute``, ...), from which the trainer builds the groups it compiles with.
TRL prepares the data (text, prompt/completion, conversations through the chat template,
completion-only and assistant-only labels) and transformers' ``Trainer`` runs the loop (epochs
or ``max_steps``, accumulation groups, callbacks, logging, evaluation, checkpoints,
``save_model``, ``push_to_hub``). One thing changes: an optimizer step is one
``compiled.step(global_batch)`` on the workers, and the optimizer and learning-rate scheduler
the configuration asks for are built by transformers' own code over rpcompile's fp32 host
masters.

[Note: one step per accumulation group] transformers' loop hands ``training_step`` the
``gradient_accumulation_steps`` batches of an optimizer step one at a time and marks the last
(``accelerator.sync_gradients``). The trainer keeps the earlier ones and, at the last, joins
them into one global batch and runs the whole step: forward, backward, clipping and the update,
the loss being the token mean over the whole group (``num_items_in_batch``, as TRL computes
it). The loop's own ``optimizer.step()`` then finds the update done (``_StepTaken``) and its
scheduler step sets the next step's learning rate, which the next ``compiled.step`` reads when
it begins.

This leans on transformers 5's ``Trainer`` hooks (private methods such as
``_clip_grad_norm``, ``_save_optimizer_and_scheduler``), hence the pinned ``trl`` extra.

Sections, in reading order:
  1. SFTTrainer
  2. the fields that cannot apply on the workers
  3. batches: an accumulation group -> one global batch
  4. the host optimizer: HF's parameter groups over the masters, and its view in the loop
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow.compute
import torch
import trl
from datasets import Dataset
from transformers.trainer import SCHEDULER_NAME

import rpcompile
from rpcompile.errors import InvalidInput, InvalidType, StateError
from rpcompile.options import FLAT, CaptureOptions, PlanOptions, TrainOptions

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled

__all__ = ["RPCOMPILE_STATE", "SFTTrainer"]

# The folder inside a ``checkpoint-N`` directory that holds rpcompile's checkpoint (masters,
# optimizer state, step counter, RNG), written where transformers writes ``optimizer.pt``.
RPCOMPILE_STATE = "rpcompile"
IGNORE_INDEX = -100

# compile() keywords the trainer sets itself: from the configuration, the data and the model.
_SET_BY_TRAINER = {
    "example_inputs": "the plan's batch shape comes from the datasets",
    "optimizer": "built from SFTConfig(optim, learning_rate, weight_decay, adam_*)",
    "max_grad_norm": "set SFTConfig(max_grad_norm)",
    "loss_fn": "the model's own causal-LM loss is TRL's loss",
    "compute_dtype": "the model's dtype is the compute dtype (see SFTConfig bf16/fp16)",
    "process_group": "one process trains; data parallel is not available through TRL here",
    "ranks": "one process trains; data parallel is not available through TRL here",
    "shard_optimizer": "one process trains; data parallel is not available through TRL here",
    "link": "one process trains; data parallel is not available through TRL here",
}


# =============================================================================================
# 1. SFTTrainer
# =============================================================================================


class SFTTrainer(trl.SFTTrainer):
    """``trl.SFTTrainer`` whose optimizer steps run on rpcompile workers (see the module doc).

    ``rpcompile``: rpcompile's options by name (fields of :class:`~rpcompile.PlanOptions`,
    :class:`~rpcompile.TrainOptions`, :class:`~rpcompile.CaptureOptions`). ``gpus`` defaults
    to every visible CUDA GPU, else 4 virtual CPU workers; ``microbatches`` to ``gpus + 1`` (at
    most the global batch), ``rounds`` to 1. The global batch of a step is ``per_device_train_batch_size x
    gradient_accumulation_steps`` sequences, cut into ``microbatches x rounds`` microbatches;
    the plan is made for that many sequences of the longest prepared example (train and eval).
    The compiled model is ``trainer.compiled`` (built on first use: ``train``, ``evaluate``).
    """

    def __init__(self, *args: Any, rpcompile: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        bound = inspect.signature(trl.SFTTrainer.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        _refuse_arguments(given)
        config, model = given["args"], given["model"]
        if config is None:  # TRL's default configuration, made here to be seen before TRL
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
            config = trl.SFTConfig(f"{name.split('/')[-1]}-SFT")
        _refuse_fields(config)  # before TRL loads the model and prepares the data
        config = copy.copy(config)  # the user's own stays as given
        # The GPUs are the workers: transformers must not replicate the module over them
        # (nn.DataParallel, which TRL refuses), as it does not for a model-parallel one.
        config._n_gpu = min(config.n_gpu, 1)
        if isinstance(model, str) and isinstance(config, trl.SFTConfig) \
                and "device_map" not in (config.model_init_kwargs or {}):
            # TRL would spread a model it loads over the GPUs; the workers take it from the host.
            config.model_init_kwargs = {**(config.model_init_kwargs or {}), "device_map": "cpu"}
        given["args"] = config
        self.rpcompile_options = _compile_options(rpcompile)
        self._compiled: Compiled | None = None
        self._group: list[dict[str, Any]] = []  # the accumulation group's batches so far
        self._grad_norm: float | None = None
        self._plan_rows = 0
        self._optimizer_choice: tuple[Any, dict[str, Any]] = (None, {})
        super().__init__(**{k: v for k, v in given.items() if k != "self"})
        _refuse_model(self.model, self.args, self.aux_loss_enabled)
        _refuse_world(self.args)
        self._plan_rows = _plan_rows(self.args, self.rpcompile_options)
        # The optimizer the configuration asks for, checked now; built over the masters later.
        self._optimizer_choice = self.optimizer_cls_and_kwargs or \
            self.get_optimizer_cls_and_kwargs(self.args, self.model)
        _refuse_optimizer(self.args, *self._optimizer_choice)

    # -- the compiled model ------------------------------------------------------------------
    @property
    def compiled(self) -> Any:
        """The :class:`rpcompile.Compiled` model the steps run on (compiled on first use)."""
        if self._compiled is None:
            options = dict(self.rpcompile_options)
            rows = self._plan_rows
            if options.get("microbatches") is None:
                options["microbatches"] = min(options["gpus"] + 1, rows // options["rounds"])
            if self.model.dtype == torch.float16 and options.get("loss_scale") is None:
                options["loss_scale"] = True  # fp16 compute needs it
            training = self.model.training
            self.model.train()  # the training loss (with its dropout) is what is captured
            options.update(optimizer=self._host_optimizer,
                           max_grad_norm=self.args.max_grad_norm or None)
            groups: dict[str, dict[str, Any]] = {"capture": {}, "plan": {}, "train": {}}
            for name, value in options.items():
                groups[FLAT[name]][name] = value
            try:
                self._compiled = rpcompile.compile(
                    self.model, _example_batch(self, rows),
                    capture=CaptureOptions(**groups["capture"]),
                    plan=PlanOptions(**groups["plan"]), train=TrainOptions(**groups["train"]))
            finally:
                self.model.train(training)
        return self._compiled

    def _discard_compiled(self) -> None:
        """Drop the compiled model after the module's weights were replaced (a checkpoint or
        the best model loaded into it): the next use compiles again from those weights."""
        if self._compiled is not None:
            self._compiled.close()
            self._compiled = None
            self.optimizer = None
            if self._created_lr_scheduler:
                self.lr_scheduler = None

    # -- training: one compiled step per accumulation group -----------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()  # SFTTrainer.log reads the mode to tell train from eval metrics
        self._group.append(inputs)
        self._count_tokens(inputs)
        if not self.accelerator.sync_gradients:  # not the group's last batch yet
            return torch.zeros((), device=self.args.device)
        group, self._group = self._group, []
        compiled = self.compiled
        batch = global_batch(group, self._pad_id(), compiled.microbatches * compiled.rounds)
        # The one call per optimizer step; a streaming step API (several steps in flight)
        # would take the group here and hand back the loss of the step it completes.
        loss = compiled.step(batch)
        last = compiled.trainer().last
        self._grad_norm = last.grad_norm
        # TRL's mean_token_accuracy, counted in the workers' loss over the whole group (TRL
        # averages it over the group's batches: the same figure without accumulation).
        target = batch["labels"][:, 1:]
        labelled = int((target != -100).sum())
        if last.correct_tokens is not None:
            self._metrics["train"]["mean_token_accuracy"].append(
                last.correct_tokens / labelled if labelled else 0.0)
        return loss.detach().to(self.args.device)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._group = []  # a group left by a stopped run is dropped, as its gradients would be
        return super().train(*args, **kwargs)

    def _count_tokens(self, inputs: Mapping[str, Any]) -> None:
        # TRL's "num_tokens": the non-padding tokens trained on so far.
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        self._total_train_tokens += tokens
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def _pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        raise StateError(
            "rpcompile.trl.SFTTrainer computes each step's loss on the workers "
            "(training_step); an eager compute_loss on the host model would be another "
            "training path. Evaluate with trainer.evaluate()")

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # the step clipped on the host already

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float | None:
        # The step's pre-clip norm, measured when it clips (max_grad_norm > 0); None: not logged.
        return self._grad_norm

    def create_optimizer(self, model: torch.nn.Module | None = None) -> Any:
        if self.optimizer is None:
            self.optimizer = _StepTaken(self.compiled.optimizer)
            self._check_master_names()
        return self.optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        # transformers' get_scheduler over the host optimizer (a scheduler needs the real one).
        return super().create_scheduler(num_training_steps,
                                         optimizer=optimizer or self.compiled.optimizer)

    # -- evaluation ---------------------------------------------------------------------------
    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: list[str] | None = None
                        ) -> tuple[torch.Tensor, None, None]:
        """The batch's loss (its token mean, as TRL's eval loss) from ``compiled.evaluate``,
        in pieces of at most the plan's global batch, weighted by their labelled tokens."""
        compiled = self.compiled
        batch = model_inputs(inputs)
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for start in range(0, batch["input_ids"].shape[0], self._plan_rows):
            piece = {k: v[start:start + self._plan_rows] for k, v in batch.items()}
            labelled = int((piece["labels"][:, 1:] != IGNORE_INDEX).sum())
            if labelled:
                total += compiled.evaluate(piece).double() * labelled
                count += labelled
        loss = (total / max(count, 1)).float()
        return loss.to(self.args.device), None, None

    # -- checkpoints and saving ---------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._compiled is not None:
            self._compiled.sync_to_model()  # the trained masters into the module first
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save:
            return
        self.compiled.save_checkpoint(os.path.join(output_dir, RPCOMPILE_STATE))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, RPCOMPILE_STATE)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isdir(state):
            if os.path.isfile(scheduler):
                raise InvalidInput(
                    f"{checkpoint} holds an optimizer state but no {RPCOMPILE_STATE}/ folder: "
                    "it was not written by rpcompile.trl.SFTTrainer, whose host optimizer it "
                    "cannot restore; resume it with the trainer that wrote it, or start from "
                    "its weights (model=<that folder>) without resume_from_checkpoint")
            return  # saved with save_only_model: the weights alone, as transformers does
        self.compiled.load_checkpoint(state)
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._discard_compiled()

    def _load_best_model(self) -> None:
        super()._load_best_model()
        self._discard_compiled()

    # -- placement: the model stays on the host ------------------------------------------------
    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        # The workers upload each stage's weights for its jobs; the module stays on the host.
        return

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        # Batches stay on the host (the workers take them from there) and no autocast wraps
        # the module: its dtype is the compute dtype.
        out.update(device_placement=False, mixed_precision="no")
        return out

    # -- the host optimizer ----------------------------------------------------------------------
    def _host_optimizer(self, masters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """transformers' optimizer (``optim``, ``learning_rate``, ``weight_decay``, ``adam_*``,
        ``optim_args``, or ``optimizer_cls_and_kwargs``) with its two parameter groups (weight
        decay, and none for biases and norms), over the fp32 masters."""
        names = master_names(self._compiled)
        if [tuple(p.shape) for p in masters] != [s for _, s in names]:
            raise StateError(
                "the host masters do not follow the stage programs' parameter order that "
                "rpcompile.trl assumes; this trainer needs updating for this rpcompile")
        by_name = {name: p for (name, _), p in zip(names, masters)}
        optimizer_cls, optimizer_kwargs = self._optimizer_choice
        decay = set(self.get_decay_parameter_names(self.model))
        # In the model's parameter order, as transformers groups them.
        order = [n for n, _ in self.model.named_parameters() if n in by_name]
        groups = [
            {"params": [by_name[n] for n in order if n in decay],
             "weight_decay": self.args.weight_decay},
            {"params": [by_name[n] for n in order if n not in decay], "weight_decay": 0.0},
        ]
        return optimizer_cls(groups, **optimizer_kwargs)

    def _check_master_names(self) -> None:
        store = self.compiled.trainer().store
        held = [s.name for s in store.owned_slots]
        assumed = [n for n, _ in master_names(self.compiled)]
        if held != assumed:
            raise StateError(
                "the host store's parameter order differs from the one the optimizer groups "
                f"were built for ({held[:3]} vs {assumed[:3]}); this trainer needs updating "
                "for this rpcompile")


# =============================================================================================
# 2. the fields that cannot apply on the workers
# =============================================================================================

# (field, is it asking for something here, why it cannot apply, what to do)
_REFUSED_FIELDS: tuple[tuple[str, Any, str, str], ...] = (
    ("deepspeed", lambda v: v is not None,
     "rpcompile keeps the fp32 masters and the optimizer on the host and streams the weights "
     "to the GPUs itself", "remove it"),
    ("fsdp", lambda v: bool(v), "rpcompile's workers hold no weights between jobs; there is "
     "nothing to shard", "remove it"),
    ("parallelism_config", lambda v: v is not None, "one rpcompile pipeline per process",
     "remove it"),
    ("torch_compile", bool, "the workers run rpcompile's own stage programs",
     "set torch_compile=False"),
    ("use_liger_kernel", bool, "Liger patches the module's layers after the capture",
     "set use_liger_kernel=False"),
    ("neftune_noise_alpha", lambda v: v is not None,
     "NEFTune draws random noise in a forward hook, which the captured graph cannot replay",
     "remove it"),
    ("label_smoothing_factor", lambda v: v > 0, "the workers compute the model's own "
     "cross-entropy", "set label_smoothing_factor=0"),
    ("loss_type", lambda v: v != "nll", "the workers compute the model's own negative "
     "log-likelihood", "use loss_type='nll'"),
    ("packing", bool, "packed rows need per-document positions and attention, which the "
     "workers do not take", "set packing=False"),
    ("padding_free", bool, "padding-free batches carry position_ids, which the workers do "
     "not take", "set padding_free=False"),
    ("activation_offloading", bool, "RoundPipe already keeps only stage boundaries and "
     "recomputes the rest", "set activation_offloading=False"),
    ("activation_checkpointing_kwargs", bool, "RoundPipe's recompute is by stage or by layer "
     "(rpcompile={'recompute': ...})", "remove them"),
    ("gradient_checkpointing_kwargs", bool, "RoundPipe's recompute is by stage or by layer "
     "(rpcompile={'recompute': ...})", "remove them"),
    ("auto_find_batch_size", bool, "the plan's memory is proven for one batch shape",
     "set the batch size"),
    ("fp16_full_eval", bool, "evaluation runs in the model's dtype on the workers",
     "set fp16_full_eval=False"),
    ("bf16_full_eval", bool, "evaluation runs in the model's dtype on the workers",
     "set bf16_full_eval=False"),
    ("torch_empty_cache_steps", lambda v: v is not None, "the workers free each job's memory "
     "when it ends", "remove it"),
)


def _refuse_fields(config: Any) -> None:
    problems = []
    for name, asks, why, fix in _REFUSED_FIELDS:
        value = getattr(config, name, None)
        if value is not None and asks(value):
            problems.append(f"{name}={value!r}: {why} ({fix})")
    if problems:
        raise InvalidInput("rpcompile.trl.SFTTrainer cannot apply these SFTConfig fields: "
                         + "; ".join(problems))


def _refuse_arguments(given: Mapping[str, Any]) -> None:
    reasons = {
        "optimizers": "an optimizer built over the module's parameters; the trainer builds "
                      "one over rpcompile's host masters from SFTConfig (or pass "
                      "optimizer_cls_and_kwargs)",
        "compute_loss_func": "the workers compute the model's own loss",
        "compute_metrics": "the workers give the eval loss, not the logits",
        "preprocess_logits_for_metrics": "the workers give the eval loss, not the logits",
    }
    unset = {"optimizers": (None, None)}
    problems = [f"{name}: {why}" for name, why in reasons.items()
                if given.get(name) is not None and given.get(name) != unset.get(name)]
    if problems:
        raise InvalidInput("rpcompile.trl.SFTTrainer cannot take " + "; ".join(problems))


def _refuse_model(model: torch.nn.Module, config: Any, aux_loss: bool) -> None:
    dtype = model.dtype
    for flag, wanted in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if getattr(config, flag) and dtype != wanted:
            raise InvalidInput(
                f"SFTConfig({flag}=True) asks for {wanted} compute, but the model's weights are "
                f"{dtype}: rpcompile computes in the model's dtype and keeps fp32 masters on "
                f"the host. Load the model in {wanted} (model.to({wanted}), or "
                f"model_init_kwargs={{'dtype': {wanted}}}) to train in it, or set "
                f"{flag}=False to train in {dtype}")
    if aux_loss:
        raise InvalidInput(
            "the model adds a router auxiliary loss (SFTConfig.router_aux_loss_coef, or its "
            "config's), a per-batch statistic that does not split into microbatches: set "
            "router_aux_loss_coef=0.0")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise InvalidInput(
            f"the model's parameters are on {sorted(devices)}: rpcompile keeps the model on "
            "the host (CPU) and uploads each stage's weights to the workers; load it on the CPU "
            "(for a model TRL loads: model_init_kwargs={'device_map': 'cpu'})")


def _refuse_world(config: Any) -> None:
    if config.world_size > 1:
        raise InvalidInput(
            f"{config.world_size} processes were launched (torchrun / accelerate launch): "
            "rpcompile.trl.SFTTrainer trains in one process, whose workers are every GPU of the "
            "server; launch it with python")


def _refuse_optimizer(config: Any, optimizer_cls: Any, kwargs: Mapping[str, Any]) -> None:
    takes_model = {"params", "model", "optimizer_dict"} & set(kwargs)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)) \
            or takes_model:
        raise InvalidInput(
            f"SFTConfig(optim={config.optim!r}) builds its optimizer from the model "
            f"({sorted(takes_model) or type(optimizer_cls).__name__}), not as a torch optimizer "
            "over parameters; rpcompile runs the optimizer over its host masters: choose a "
            "torch optimizer (adamw_torch, adamw_torch_fused, sgd, adafactor, ...)")


def _compile_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``rpcompile={...}``: the fields of rpcompile's option groups by name (a flat mapping, as
    a configuration is; the trainer builds the groups), with the trainer's defaults (every
    visible GPU, else 4 virtual workers; one round)."""
    options = dict(options or {})
    known = set(FLAT) | {"example_inputs"}
    owned = sorted(set(options) & set(_SET_BY_TRAINER))
    if owned:
        raise InvalidInput("rpcompile={...} cannot set " + "; ".join(
            f"{k} ({_SET_BY_TRAINER[k]})" for k in owned))
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidType(f"rpcompile={{...}} got unknown option(s) {', '.join(unknown)}; the "
                        "options are the fields of rpcompile's option groups: "
                        + ", ".join(sorted(known - set(_SET_BY_TRAINER))))
    if options.get("gpus") is None:
        options["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 4
    if options.get("rounds") is None:
        options["rounds"] = 1
    return options


def _plan_rows(config: Any, options: Mapping[str, Any]) -> int:
    """The global batch: per_device_train_batch_size x gradient_accumulation_steps sequences,
    which must fill every microbatch of a round and every round."""
    rows = config.per_device_train_batch_size * config.gradient_accumulation_steps
    parts = (options.get("microbatches") or 1) * options["rounds"]
    if rows < parts:
        raise InvalidInput(
            f"a step's global batch is per_device_train_batch_size x "
            f"gradient_accumulation_steps = {rows} sequences, fewer than the {parts} "
            f"microbatches x rounds of rpcompile={{...}}: every microbatch needs a sequence")
    return rows


# =============================================================================================
# 3. batches: an accumulation group -> one global batch
# =============================================================================================

_MODEL_KEYS = ("input_ids", "labels", "attention_mask")


def model_inputs(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A collated batch as the workers take it: ``input_ids``, ``labels`` (-100: not scored),
    ``attention_mask``. TRL builds the labels during dataset preparation (completion-only and
    assistant-only masks are folded in there), so nothing else may remain."""
    other = sorted(set(batch) - set(_MODEL_KEYS))
    if other:
        raise InvalidInput(
            f"the batch carries {other}, which the workers do not take (they compute positions "
            "from the sequence and the loss from labels, -100 where not scored): use TRL's "
            "collator without packing or padding_free, or fold masks into 'labels'")
    out = {k: batch[k] for k in _MODEL_KEYS if k in batch}
    if "labels" not in out:
        ids = out["input_ids"]
        mask = out.get("attention_mask")
        out["labels"] = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    return out


def global_batch(group: Sequence[Mapping[str, Any]], pad_id: int, rows: int
                 ) -> dict[str, torch.Tensor]:
    """The batches of one accumulation group as one batch: each padded to the group's longest
    (padding: ``pad_id``, label -100, mask 0; on the side the batches pad), then concatenated.
    A group of fewer than ``rows`` sequences (an epoch's last) gets rows of padding with no
    label, which add nothing to the loss or the gradients but fill every microbatch."""
    batches = [model_inputs(b) for b in group]
    length = max(b["input_ids"].shape[1] for b in batches)
    left = any("attention_mask" in b and bool((b["attention_mask"][:, 0] == 0).any())
               for b in batches)
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    keys = [k for k in _MODEL_KEYS if all(k in b for b in batches)]

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        extra = length - t.shape[1]
        if extra == 0:
            return t
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    out = {k: torch.cat([padded(b[k], fill[k]) for b in batches]) for k in keys}
    short = rows - out["input_ids"].shape[0]
    if short > 0:
        out["input_ids"] = torch.cat([out["input_ids"], out["input_ids"].new_full(
            (short, length), pad_id)])
        out["labels"] = torch.cat([out["labels"], out["labels"].new_full(
            (short, length), IGNORE_INDEX)])
        if "attention_mask" in out:  # attended padding: a fully masked row has no softmax
            out["attention_mask"] = torch.cat([out["attention_mask"],
                                               out["attention_mask"].new_ones((short, length))])
    return out


def _example_batch(trainer: SFTTrainer, rows: int) -> dict[str, torch.Tensor]:
    """The plan's shape: ``rows`` sequences of the longest prepared example of the train and
    eval datasets (``max_length`` for a dataset without a length)."""
    datasets = [trainer.train_dataset]
    evals = trainer.eval_dataset
    datasets += list(evals.values()) if isinstance(evals, Mapping) else [evals] * (evals
                                                                                   is not None)
    longest = 0
    for data in datasets:
        if isinstance(data, Dataset) and "input_ids" in data.column_names:
            lengths = pyarrow.compute.list_value_length(data.data.column("input_ids"))
            longest = max(longest, pyarrow.compute.max(lengths).as_py() or 0)
        elif trainer.args.max_length is None:
            raise InvalidInput(
                "the training data has no length to plan for (an IterableDataset): set "
                "SFTConfig(max_length=...), the longest sequence a batch may hold")
        else:
            longest = max(longest, trainer.args.max_length)
    multiple = trainer.args.pad_to_multiple_of
    if isinstance(multiple, int) and multiple > 1:
        longest = -(-longest // multiple) * multiple
    longest = max(longest, 2)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# =============================================================================================
# 4. the host optimizer
# =============================================================================================


def master_names(compiled: Compiled) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each trainable master in the host store's order: the stage programs'
    parameters in stage order, each tensor once (a tied weight under its first name)."""
    seen: set[int] = set()
    out = []
    for program in compiled.stages:
        for name in program.params:
            tensor = compiled.model.get_parameter(name)
            if id(tensor) in seen or not tensor.requires_grad:
                continue
            seen.add(id(tensor))
            out.append((name, tuple(tensor.shape)))
    return out


class _StepTaken:
    """The host optimizer as transformers' loop holds it: its parameter groups and state are
    the real optimizer's (the scheduler, logging and callbacks read them), but ``step`` and
    ``zero_grad`` do nothing, because the update already ran inside ``compiled.step``, in the
    schedule's host actions. Not a ``torch.optim.Optimizer``, so accelerate leaves it as is."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None
