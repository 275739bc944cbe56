"""Batches: what a user passes to ``compile``/``step``, checked and bound to the graph's inputs.

Sections, in reading order:
  1. normalize_batch(): a user's batch -> an ordered dict of named tensors (checked at the door)
  2. bind_batch(): that dict -> exactly the captured graph's batch inputs, by name
  3. split_batch(): cut a step's batch into microbatches (as evenly as possible)

A causal LM's batch carries ``input_ids``, optionally ``labels`` (``-100`` = not scored),
``attention_mask`` (1 = real token, 0 = padding, right or left) and ``position_ids`` (packed
documents: positions restart at 0 at each document; without an attention mask Hugging Face then
confines attention to each document, and the captured graph builds that mask). Two inputs are
added here, never by the user: ``num_items_in_batch``, the number of labelled tokens of the *whole* step (every
microbatch of every round), which the model's own loss divides its token-loss sum by, so that the
microbatch losses add up to Hugging Face's token mean over the whole batch; and, when the
captured graph holds dropout, ``rp_rng``, one seed per sequence from which every dropout mask of
the step is drawn (see :mod:`rpcompile.capture.dropout`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rpcompile.errors import InvalidInput

__all__ = [
    "NUM_ITEMS",
    "RNG",
    "bind_batch",
    "count_labelled",
    "largest_microbatch",
    "masks_documents",
    "normalize_batch",
    "split_batch",
]

NUM_ITEMS = "num_items_in_batch"
RNG = "rp_rng"
IGNORE_INDEX = -100
_CAUSAL_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


# ---------------------------------------------------------------------------------------------
# 1. normalize_batch
# ---------------------------------------------------------------------------------------------


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM (or a PEFT wrapper of one): takes input_ids and labels."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vocab_size", None) is None:
        return False
    head = getattr(model, "get_output_embeddings", None)
    # Every PreTrainedModel has the method; only language-model heads return a module.
    return callable(head) and head() is not None


def normalize_batch(
    model: nn.Module, batch: Any, loss_fn: Callable | None, *, causal: bool | None = None
) -> dict[str, torch.Tensor]:
    """Turn what the user passes into an ordered dict of batch tensors (dim 0 = sequences).

    Causal LM: ``input_ids`` [batch, seq] (int64; int32 is widened), ``labels`` (default: the
    ids, with ``-100`` where ``attention_mask`` is 0), ``attention_mask`` (kept only when given),
    then ``num_items_in_batch`` (labelled tokens after the one-token shift, as Hugging Face's
    loss counts them). Any other model: a tensor or a tuple of tensors, keys ``arg0``, ``arg1``...
    """
    if causal is None:
        causal = loss_fn is None and is_causal_lm(model)
    if causal:
        return _causal_batch(model, batch)
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if isinstance(batch, Mapping):
        raise InvalidInput("a non-HF model's batch must be a tuple of tensors, not a dict")
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise InvalidInput(
            "a model's batch must be a tensor or a tuple of tensors (model inputs, then the "
            "target when loss_fn is given); got " + describe(batch)
        )
    if loss_fn is not None and len(batch) < 2:
        raise InvalidInput("with loss_fn, the batch must be (inputs..., target)")
    sizes = {t.shape[0] if t.dim() else None for t in batch}
    if len(sizes) != 1 or None in sizes:
        raise InvalidInput(
            "every batch tensor needs the same leading batch dimension; got shapes "
            + ", ".join(str(tuple(t.shape)) for t in batch)
        )
    if 0 in sizes:
        raise InvalidInput("the batch is empty (0 samples): there is nothing to train on")
    # Copies, as for a causal LM's batch: a view (a share of a larger batch, with a storage
    # offset) would give export a size symbol of its own that no batch dimension names.
    return {f"arg{i}": t.clone() for i, t in enumerate(batch)}


def _causal_batch(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise InvalidInput(
            "a causal LM batch must be a LongTensor of token ids [batch, seq] or a dict with "
            "'input_ids' (and optionally 'labels', 'attention_mask'); got " + describe(batch)
        )
    unknown = sorted(set(batch) - set(_CAUSAL_KEYS))
    if unknown:
        raise InvalidInput(
            f"unsupported batch keys {unknown}: rpcompile trains on 'input_ids', 'labels', "
            "'attention_mask' and 'position_ids'; drop the other keys"
        )
    if "labels" in batch and batch["labels"] is None:
        raise InvalidInput(
            "labels=None: a training step needs labels. Omit the key to train on the inputs "
            "themselves (padding excluded), or pass a tensor with -100 at the tokens that must "
            "not be scored"
        )
    ids = _token_tensor(batch["input_ids"], "input_ids")
    if ids.shape[0] == 0:
        raise InvalidInput("the batch is empty (0 sequences): there is nothing to train on")
    if ids.shape[1] < 2:
        raise InvalidInput("sequences must have at least 2 tokens to have a next-token loss")
    vocab = model.config.vocab_size
    if not ids.is_meta and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise InvalidInput(
            f"token ids must lie in [0, {vocab}) (the model's vocab_size); found "
            f"{int(ids.min())}..{int(ids.max())}"
        )
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = _token_tensor(mask, "attention_mask", allow_bool=True)
        if mask.shape != ids.shape:
            raise InvalidInput(f"attention_mask shape {tuple(mask.shape)} must equal input_ids "
                             f"shape {tuple(ids.shape)}")
        if not mask.is_meta and bool(((mask != 0) & (mask != 1)).any()):
            raise InvalidInput("attention_mask must hold 1 (real token) and 0 (padding) only")
        mask = mask.long()
    positions = batch.get("position_ids")
    if positions is not None:
        positions = _token_tensor(positions, "position_ids")
        if positions.shape != ids.shape:
            raise InvalidInput(f"position_ids shape {tuple(positions.shape)} must equal input_ids "
                             f"shape {tuple(ids.shape)}")
    if "labels" in batch:
        labels = _token_tensor(batch["labels"], "labels")
        if labels.shape != ids.shape:
            raise InvalidInput(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(ids.shape)}"
            )
        if not labels.is_meta:
            bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
            if bool(bad.any()):
                raise InvalidInput(f"labels must lie in [0, {vocab}) or be -100 (not scored); "
                                 f"found {int(labels[bad][0])}")
    else:
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    # Distinct tensors for distinct arguments: an alias (labels that *are* input_ids) or a view
    # must never let the capture merge two model inputs into one placeholder.
    out = {"input_ids": ids.clone(), "labels": labels.clone()}
    if mask is not None:
        out["attention_mask"] = mask.clone()
    if positions is not None:
        out["position_ids"] = positions.clone()
    out[NUM_ITEMS] = count_labelled(out["labels"])
    if not ids.is_meta and int(out[NUM_ITEMS]) == 0:
        raise InvalidInput(
            "no token of this batch is labelled (every label after the first position is "
            "-100), so its loss is undefined: check the labels (prompt masking, padding side)"
        )
    return out


def count_labelled(labels: torch.Tensor) -> torch.Tensor:
    """Tokens scored by a causal LM's loss: labels shift left by one, ``-100`` is skipped."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def _token_tensor(t: Any, name: str, allow_bool: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise InvalidInput(f"{name} must be a tensor of shape [batch, seq]; got " + describe(t))
    if t.dtype in (torch.int64,) or (allow_bool and t.dtype == torch.bool):
        return t
    if allow_bool and t.is_floating_point():
        return t  # a 0./1. mask; its values are checked by the caller
    if t.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        return t.long()  # lossless: the same values as the int64 the embedding expects
    raise InvalidInput(
        f"{name} must hold integers (int64, or int32 which is widened); got {t.dtype}: "
        f"convert with {name}.long()"
    )


# ---------------------------------------------------------------------------------------------
# 2. bind_batch
# ---------------------------------------------------------------------------------------------


def bind_batch(captured: Any, batch: Any, *, step: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` as the captured graph's batch inputs, keyed and ordered by
    ``captured.input_keys``: a mask the graph does not take is dropped when it masks nothing
    (else refused), a mask it takes is filled with ones when absent; ``position_ids`` likewise
    (dropped when they count 0..seq-1 in every row, filled so when absent); ``rp_rng`` holds the
    dropout seeds of optimizer step ``step``."""
    from rpcompile.capture.dropout import step_seeds

    normal = normalize_batch(captured.model, batch, captured.loss_fn,
                             causal=captured.loss_reduction == "sum")
    keys = captured.input_keys
    if "attention_mask" in normal and "attention_mask" not in keys:
        if bool((normal["attention_mask"] == 0).any()):
            raise InvalidInput(
                "this batch pads (attention_mask has zeros) but the model was compiled with an "
                "example batch without attention_mask, so its graph has no padding mask: "
                "compile with an example batch that carries attention_mask"
            )
        del normal["attention_mask"]
    if "attention_mask" in keys and "attention_mask" not in normal:
        normal["attention_mask"] = torch.ones_like(normal["input_ids"])
    if "position_ids" in normal and "position_ids" not in keys:
        if not torch.equal(normal["position_ids"], _counting(normal["input_ids"])):
            raise InvalidInput(
                "this batch restarts position_ids (packed documents) but the model was compiled "
                "with an example batch without position_ids, so its graph has no per-document "
                "attention mask: compile with an example batch that carries position_ids"
            )
        del normal["position_ids"]
    if "position_ids" in keys and "position_ids" not in normal:
        normal["position_ids"] = _counting(normal["input_ids"])
    if RNG in keys:
        first = next(iter(normal.values()))
        normal[RNG] = step_seeds(captured.dropout_seed, step, first.shape[0])
    missing = [k for k in keys if k not in normal]
    if missing:
        raise InvalidInput(f"the batch lacks {missing}, which the compiled graph reads")
    return {k: normal[k] for k in keys}


def masks_documents(captured: Any) -> bool:
    """Whether every layer of the captured graph reads an attention mask built from
    ``position_ids``: a value computed from them and from no weight or token, whose last two
    dimensions are both the sequence (Hugging Face's block-diagonal causal mask for packed
    documents). A model whose attention ignores the positions, or builds its mask from the
    sequence alone, lets a packed token attend to the earlier documents of its row."""
    if "position_ids" not in captured.input_keys:
        return False
    graph = captured.graph_module.graph
    by_name = {n.name: n for n in graph.find_nodes(op="placeholder")}
    keys = captured.input_keys
    start = by_name[captured.inputs[keys.index("position_ids")]]
    tokens = by_name[captured.inputs[keys.index("input_ids")]]
    seq = tokens.meta["val"].shape[1]
    # Attention scores also depend on the positions (through rotary tables), but through the
    # weights too: only what the positions alone determine can be the mask.
    weighted = {by_name[n] for n in (*captured.params, *captured.buffers) if n in by_name}
    weighted.add(tokens)
    derived, masks = {start}, set()
    for node in graph.nodes:  # topological order: one pass finds every descendant
        # Values flow through tensors only: a shape read from a tensor (the batch size of the
        # embeddings or of the positions) carries none of its values.
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if any(a in weighted for a in inputs):
            weighted.add(node)
            continue
        if node is start or not any(a in derived for a in inputs):
            continue
        derived.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 2 \
                and str(val.shape[-1]) == str(seq) and str(val.shape[-2]) == str(seq):
            masks.add(node)
    layers = range(1, len(captured.units) - 1)
    readers = {n.meta.get("rp_unit") for m in masks for n in m.users}
    return bool(masks) and all(unit in readers for unit in layers)


def _counting(ids: torch.Tensor) -> torch.Tensor:
    """The positions of one document per row, 0..seq-1 (the model's default)."""
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).clone()


# ---------------------------------------------------------------------------------------------
# 3. split_batch
# ---------------------------------------------------------------------------------------------


def split_batch(batch: Mapping[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Cut every batch tensor along dim 0 into ``parts`` microbatches as evenly as possible
    (``torch.tensor_split``: the first ``size % parts`` get one sequence more); 0-dim tensors
    (``num_items_in_batch``) go to every microbatch whole."""
    if parts < 1:
        raise InvalidInput(f"cannot split a batch into {parts} microbatches")
    size = next(t for t in batch.values() if t.dim()).shape[0]
    if size < parts:
        raise InvalidInput(
            f"a batch of {size} sequences cannot fill {parts} microbatches (microbatches x "
            f"rounds); pass at least {parts} sequences, or lower microbatches/rounds"
        )
    chunks = {k: v.tensor_split(parts, dim=0) if v.dim() else (v,) * parts
              for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def largest_microbatch(sequences: int, parts: int) -> int:
    """Sequences in the largest of ``parts`` microbatches of :func:`split_batch` (the shape a
    plan is made for and checked against)."""
    return -(-sequences // parts)


def describe(x: Any) -> str:
    """A short description of what the user passed, for error messages."""
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    if isinstance(x, Mapping):
        return "dict(" + ", ".join(f"{k}={describe(v)}" for k, v in x.items()) + ")"
    if isinstance(x, (tuple, list)):
        return type(x).__name__ + "(" + ", ".join(describe(v) for v in x) + ")"
    return type(x).__name__
