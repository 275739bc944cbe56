"""Examples to fixed-size training batches: packing or padding to length buckets, a seeded
shuffle per epoch, and an iterator whose position is a small dict that a checkpoint keeps.

**Padding** (one example per row): each row is right-padded with the pad token, its padding
labels are ``IGNORE_INDEX``. With causal attention a token never attends to a later position, so
right padding changes no real token's logits and needs no attention mask. With ``buckets > 1`` a
batch is padded only to the smallest of ``buckets`` lengths (evenly spaced up to ``seq_len``)
that holds its longest example, and examples are grouped by length within windows of 64 batches
before the batches are shuffled, so little of a batch is padding.

**Packing** (whole documents side by side): examples are taken in a seeded order and each is
put in the current row while it fits, else in a new one. A text example (every token a target)
longer than ``seq_len`` is split into pieces of ``seq_len`` tokens, each a document of its own,
so a long text trains whole; an example with a prompt is truncated like a padded one (a later
piece of its completion would lack the prompt). A row's batch carries ``position_ids`` that restart at 0 at each
document (and at the padding that ends the row), and no attention mask: Hugging Face then builds a
block-diagonal causal mask from the restarts, so a token attends only to its own document. The
first label of each document is ``IGNORE_INDEX``, so the previous document's last token predicts
nothing: every token's loss, and the count of labelled tokens, equal those of the documents
trained one per row.

**Order**: epoch ``e`` permutes the rows with a generator seeded by ``(seed, e)``; the iterator's
``state()`` is ``{"epoch", "batch", "seed"}`` and ``load_state`` resumes from exactly that batch.
Each epoch's last partial batch is dropped, so every step sees ``batch_size`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.data.formats import IGNORE_INDEX, Example
from rpcompile.errors import InvalidInput

__all__ = [
    "BatchIterator", "Rows", "bucket_lengths", "collate", "eval_batches", "pack", "pad_rows",
    "split_eval",
]

_GROUP_WINDOW = 64  # batches per length-grouping window


def split_eval(
    examples: Sequence[Any], fraction: float, seed: int
) -> tuple[list[Any], list[Any]]:
    """(train, eval): a seeded ``fraction`` of the examples (at least one) held out."""
    if not 0 <= fraction < 1:
        raise InvalidInput(f"the eval split must be a fraction in [0, 1), got {fraction}")
    if fraction == 0 or len(examples) < 2:
        return list(examples), []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(fraction * len(examples)))
    held = sorted(order[:n_eval])
    kept = sorted(order[n_eval:])
    return [examples[i] for i in kept], [examples[i] for i in held]


@dataclass(frozen=True)
class Rows:
    """Training rows before batching: each an ``Example`` no longer than ``seq_len``; packed
    rows also give the lengths of the documents side by side in each row, and how many long
    texts were split into pieces."""

    rows: tuple[Example, ...]
    seq_len: int
    pad_id: int
    packed: bool
    documents: tuple[tuple[int, ...], ...] = ()
    split: int = 0


def pack(examples: Sequence[Example], seq_len: int, pad_id: int,
         seed: int) -> tuple[Rows, int, int]:
    """Whole examples side by side in rows of up to ``seq_len`` tokens, in a seeded order, long
    texts split into pieces (see the module doc); returns (rows, truncated, dropped) as
    :func:`pad_rows`, and ``rows.split`` says how many texts were split."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    pieces: list[Example] = []
    split = 0
    for i in order:
        ex = examples[i]
        if len(ex) <= seq_len or ex.targets < len(ex) - 1:  # short, or has a prompt: whole/cut
            pieces.append(ex)
            continue
        split += 1
        for start in range(0, len(ex), seq_len):
            pieces.append(Example(ex.input_ids[start:start + seq_len],
                                  ex.labels[start:start + seq_len]))
    rows: list[Example] = []
    documents: list[tuple[int, ...]] = []
    ids: list[int] = []
    labels: list[int] = []
    lengths: list[int] = []

    def close_row() -> None:
        if lengths:
            rows.append(Example(tuple(ids), tuple(labels)))
            documents.append(tuple(lengths))
            ids.clear(), labels.clear(), lengths.clear()

    kept, truncated, dropped = _cut(pieces, seq_len)
    for ex in kept:
        if len(ids) + len(ex) > seq_len:
            close_row()
        ids.extend(ex.input_ids)
        # Nothing precedes a document's first token in its own row: no earlier token of the
        # packed row may predict it.
        labels.extend((IGNORE_INDEX, *ex.labels[1:]))
        lengths.append(len(ex))
    close_row()
    return Rows(tuple(rows), seq_len, pad_id, packed=True, documents=tuple(documents),
                split=split), truncated, dropped


def pad_rows(examples: Sequence[Example], seq_len: int, pad_id: int) -> tuple[Rows, int, int]:
    """One row per example, cut at ``seq_len``; returns (rows, truncated, dropped): examples
    longer than ``seq_len`` are truncated, and dropped when nothing to predict is left."""
    rows, truncated, dropped = _cut(examples, seq_len)
    return Rows(tuple(rows), seq_len, pad_id, packed=False), truncated, dropped


def _cut(examples: Sequence[Example], seq_len: int) -> tuple[list[Example], int, int]:
    """The examples cut at ``seq_len``, without those left with nothing to predict; with how
    many were truncated and how many dropped."""
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex) > seq_len:
            truncated += 1
            ex = Example(ex.input_ids[:seq_len], ex.labels[:seq_len])
        if ex.targets == 0:
            dropped += 1
            continue
        kept.append(ex)
    return kept, truncated, dropped


def bucket_lengths(seq_len: int, buckets: int) -> list[int]:
    """``buckets`` row lengths evenly spaced up to ``seq_len`` (multiples of 8 but the last)."""
    if buckets < 1:
        raise InvalidInput(f"buckets must be at least 1, got {buckets}")
    lengths = {seq_len}
    for k in range(1, buckets):
        lengths.add(min(seq_len, -(-seq_len * k // buckets // 8) * 8 or 8))
    return sorted(lengths)


def collate(rows: Sequence[Example], length: int, pad_id: int,
            documents: Sequence[Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` ``[len(rows), length]``, right-padded; with ``documents``
    (each row's document lengths) also ``position_ids`` restarting at 0 at each document and at
    the row's padding."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        n = min(len(row), length)
        ids[r, :n] = torch.tensor(row.input_ids[:n])
        labels[r, :n] = torch.tensor(row.labels[:n])
    batch = {"input_ids": ids, "labels": labels}
    if documents is not None:
        positions = torch.empty((len(rows), length), dtype=torch.long)
        for r, lengths in enumerate(documents):
            parts = [n for n in lengths if n] + [length - sum(lengths)]
            positions[r] = torch.cat([torch.arange(n) for n in parts if n])
        batch["position_ids"] = positions
    return batch


class BatchIterator:
    """Endless, deterministic batches of ``batch_size`` rows (see the module doc)."""

    def __init__(self, rows: Rows, batch_size: int, seed: int, buckets: int = 1) -> None:
        if batch_size < 1:
            raise InvalidInput(f"the batch size must be at least 1, got {batch_size}")
        if len(rows.rows) < batch_size:
            raise InvalidInput(
                f"the data gives {len(rows.rows)} training rows, fewer than one batch of "
                f"{batch_size}: use a smaller --batch or more data"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.lengths = [rows.seq_len] if rows.packed else bucket_lengths(rows.seq_len, buckets)
        self.epoch = 0
        self.batch = 0
        self._order: list[list[int]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows.rows) // self.batch_size

    def state(self) -> dict[str, int]:
        """The position: the next batch is batch ``batch`` of epoch ``epoch``."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed}

    def load_state(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise InvalidInput(
                f"the checkpoint's data order was shuffled with seed {state['seed']}, this run "
                f"uses {self.seed}; resume with --seed {state['seed']}"
            )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._order = None

    def _epoch_order(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.rows.rows), generator=gen).tolist()
        if len(self.lengths) > 1:
            # Group by length inside windows so a batch's rows need the same bucket.
            window = _GROUP_WINDOW * self.batch_size
            perm = [i for w in range(0, len(perm), window)
                    for i in sorted(perm[w:w + window], key=lambda i: -len(self.rows.rows[i]))]
        n = self.batches_per_epoch
        batches = [perm[b * self.batch_size:(b + 1) * self.batch_size] for b in range(n)]
        if len(self.lengths) > 1:
            shuffle = torch.randperm(n, generator=gen).tolist()
            batches = [batches[i] for i in shuffle]
        return batches

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        chosen = self._order[self.batch]
        rows = [self.rows.rows[i] for i in chosen]
        documents = [self.rows.documents[i] for i in chosen] if self.rows.packed else None
        longest = max(len(r) for r in rows)
        length = next(n for n in self.lengths if n >= longest)
        self.batch += 1
        if self.batch == len(self._order):
            self.epoch, self.batch, self._order = self.epoch + 1, 0, None
        return collate(rows, length, self.rows.pad_id, documents)


def eval_batches(
    examples: Sequence[Example], seq_len: int, pad_id: int, batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """The eval examples in order, in batches of up to ``batch_size``, each padded to its longest
    row (eval runs the eager forward, which takes any shape)."""
    rows, _, _ = pad_rows(examples, seq_len, pad_id)
    return [
        collate(rows.rows[i:i + batch_size], max(len(r) for r in rows.rows[i:i + batch_size]),
                pad_id)
        for i in range(0, len(rows.rows), batch_size)
    ]
