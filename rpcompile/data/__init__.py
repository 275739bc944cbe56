"""Training data for ``rpcompile train``: read a file, encode its records (formats.py), make
batches by packing or padding with a seeded, resumable order (batches.py). ``corpus.txt`` in
this folder is the shipped text of the no-argument demo.

See docs/data.md for the formats, the choice between packing and padding, and resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcompile.data.batches import (
    BatchIterator,
    Rows,
    bucket_lengths,
    collate,
    eval_batches,
    pack,
    pad_rows,
    split_eval,
)
from rpcompile.data.formats import (
    IGNORE_INDEX,
    DataError,
    Example,
    detect_format,
    encode_record,
    read_records,
    record_location,
)
from rpcompile.data.tokenizer import byte_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "BatchIterator",
    "DataError",
    "Example",
    "Prepared",
    "Rows",
    "bucket_lengths",
    "byte_tokenizer",
    "collate",
    "detect_format",
    "encode_record",
    "eval_batches",
    "pack",
    "pad_rows",
    "prepare",
    "read_records",
    "record_location",
    "shipped_corpus",
    "split_eval",
]


def shipped_corpus() -> Path:
    """The text the no-argument ``rpcompile train`` fine-tunes on."""
    return Path(__file__).with_name("corpus.txt")


@dataclass(frozen=True)
class Prepared:
    """Encoded data, ready for batching."""

    format: str
    train: tuple[Example, ...]
    eval: tuple[Example, ...]

    def longest(self) -> int:
        return max(len(e) for e in (*self.train, *self.eval))


def prepare(
    path: str | Path, tokenizer: Any, *, completion_only: bool = True, eval_split: float = 0.0,
    eval_path: str | Path | None = None, seed: int = 0,
) -> Prepared:
    """Read and encode ``path``; hold out ``eval_split`` of it (seeded), or read the eval
    examples from ``eval_path``. Raises :class:`DataError` naming the file, the record and
    the field of the first record that cannot be used."""
    fmt, examples = _encode_file(path, tokenizer, completion_only)
    if eval_path is not None:
        held = _encode_file(eval_path, tokenizer, completion_only)[1]
        return Prepared(fmt, tuple(examples), tuple(held))
    train, held = split_eval(examples, eval_split, seed)
    return Prepared(fmt, tuple(train), tuple(held))


def _encode_file(path: str | Path, tokenizer: Any, completion_only: bool
                 ) -> tuple[str, list[Example]]:
    records = read_records(path)
    try:
        fmt = detect_format(records[0])
    except ValueError as err:
        raise DataError(f"{path}: {err}") from None
    examples = []
    for index, record in enumerate(records):
        try:
            examples.append(encode_record(record, tokenizer, fmt, completion_only))
        except ValueError as err:
            raise DataError(f"{record_location(path, index)}: {err}") from None
    return fmt, examples
