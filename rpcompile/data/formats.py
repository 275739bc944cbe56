"""Reading a data file and turning each record into token ids and labels.

Files: JSONL/JSON, CSV, Parquet (read with the ``datasets`` library) and plain text (one record per
paragraph). Records, in the formats TRL's SFT trainer reads:

- ``{"text": ...}``: language modelling, every token is a target.
- ``{"prompt": ..., "completion": ...}``: strings, or lists of chat messages (then rendered with
  the tokenizer's chat template); with ``completion_only`` the prompt's tokens are not targets.
- ``{"messages": [{"role", "content"}, ...]}``: rendered with the tokenizer's chat template; with
  ``completion_only`` only the assistant turns (their content and end-of-turn marker) are targets.

Which tokens are targets is decided on characters, not on separately tokenized pieces: the
record is rendered to one string, tokenized once with offsets, and a token is a target when its
first character lies in a target span. So the ids are exactly what the tokenizer gives the whole
text, and a token merged across a prompt/completion boundary belongs to the side it starts in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["IGNORE_INDEX", "Example", "detect_format", "encode_record", "read_records"]

IGNORE_INDEX = -100  # Hugging Face's cross-entropy skips this label

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text"}
FORMATS = ("text", "prompt-completion", "messages")


@dataclass(frozen=True)
class Example:
    """One encoded record: token ids and labels (``IGNORE_INDEX`` where no loss is taken)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def targets(self) -> int:
        """Tokens that are predicted (a label at position 0 is never used: nothing precedes it)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL, JSON, CSV, Parquet or text file, read with ``datasets``."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    kind = _LOADERS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"cannot read {path}: use a .jsonl, .json, .csv, .parquet or .txt file")
    extra = {"sample_by": "paragraph"} if kind == "text" else {}
    datasets.disable_progress_bars()
    dataset = datasets.load_dataset(kind, data_files=str(path), split="train", **extra)
    return list(dataset)


def detect_format(columns: Iterable[str]) -> str:
    """``"messages"``, ``"prompt-completion"`` or ``"text"`` from a record's columns."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "prompt-completion"
    if "text" in cols:
        return "text"
    raise ValueError(
        f"records with columns {sorted(cols)} are in no known format: give each record "
        "'text', or 'prompt' and 'completion', or 'messages' (a list of {'role', 'content'})"
    )


def encode_record(
    record: dict[str, Any], tokenizer: Any, fmt: str, completion_only: bool = True
) -> Example:
    """Token ids and labels of one record (see the module doc). Text and prompt/completion
    records end with the tokenizer's end-of-text token, which is a target; chat records end as
    their template ends them."""
    if fmt == "text":
        text, spans = _as_text(record["text"]), None
        eos = True
    elif fmt == "prompt-completion":
        text, start, eos = _prompt_completion(record["prompt"], record["completion"], tokenizer)
        spans = [(start, len(text))]
    elif fmt == "messages":
        text, spans = _conversation(record["messages"], tokenizer)
        eos = False
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if not completion_only:
        spans = None
    enc = tokenizer(text, add_special_tokens=fmt != "messages", return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if spans is None:
        labels = list(ids)
    else:
        labels = [
            tok if any(s <= begin < e for s, e in spans) and end > begin else IGNORE_INDEX
            for tok, (begin, end) in zip(ids, enc["offset_mapping"])
        ]
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return Example(tuple(ids), tuple(labels))


def _as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"a 'text' field must be a string, got {type(value).__name__}")
    return value


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the data holds chat messages but the tokenizer has no chat template; give the "
            "model folder a tokenizer with one (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja), or convert the data to prompt/completion strings"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _prompt_completion(prompt: Any, completion: Any, tokenizer: Any) -> tuple[str, int, bool]:
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt + completion, len(prompt), True
    if isinstance(prompt, list) and isinstance(completion, list):
        head = _render(tokenizer, prompt, generation_prompt=True)
        whole = _render(tokenizer, prompt + completion, generation_prompt=False)
        _check_prefix(head, whole)
        return whole, len(head), False
    raise ValueError("'prompt' and 'completion' must both be strings or both lists of messages")


def _conversation(messages: Any, tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise ValueError("'messages' must be a list of {'role': ..., 'content': ...} dicts")
    whole = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The assistant turn is what rendering it adds to the conversation before it (with the
        # generation prompt, which is the turn's header).
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        _check_prefix(head, upto)
        _check_prefix(upto, whole)
        spans.append((len(head), len(upto)))
    if not spans:
        raise ValueError("a conversation has no assistant message: nothing to learn from it")
    return whole, spans


def _check_prefix(head: str, whole: str) -> None:
    if not whole.startswith(head):
        raise ValueError(
            "the tokenizer's chat template renders the start of a conversation differently "
            "from the whole conversation (some templates rewrite earlier turns), so the "
            "assistant tokens cannot be located; pass --no-completion-only to train on every "
            "token, or use a template that renders turns independently"
        )
