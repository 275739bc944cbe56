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

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcompile.errors import InvalidInput, RPCompileError

__all__ = ["IGNORE_INDEX", "DataError", "Example", "detect_format", "encode_record",
           "read_records", "record_location"]

IGNORE_INDEX = -100  # Hugging Face's cross-entropy skips this label

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text"}
FORMATS = ("text", "prompt-completion", "messages")
# Chat roles of the ShareGPT layout, and the keys of its turns, with their names here.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
_SHAREGPT_KEYS = {"from": "role", "value": "content"}


class DataError(RPCompileError, ValueError):
    """A data file or one of its records cannot be used; the message names the file, the
    record (its line in a JSON Lines file) and the field."""


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
    """The records of a JSONL, JSON, CSV, Parquet or text file, read with ``datasets``.
    Raises :class:`DataError` for a missing, empty or unreadable file (a malformed JSON line
    is named by its line number)."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    kind = _LOADERS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"cannot read {path}: use a .jsonl, .json, .csv, .parquet or .txt file")
    if kind != "parquet" and not path.read_bytes().strip():
        raise DataError(f"{path} is empty: it holds no records")
    extra = {"sample_by": "paragraph"} if kind == "text" else {}
    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(kind, data_files=str(path), split="train", **extra)
    except Exception as exc:  # datasets and pyarrow raise many types; each is reported
        if kind == "json":
            _raise_json_error(path)
        cause = exc.__cause__ or exc
        raise DataError(
            f"cannot read {path}: {type(cause).__name__}: {cause}. Every record must hold "
            "the same fields, each of one type in every record"
        ) from None
    records = list(dataset)
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def _json_lines(path: Path) -> list[int]:
    """The line number (from 1) of each record of a JSON Lines file: its non-blank lines."""
    return [n for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def _is_json_lines(path: Path) -> bool:
    head = path.read_text().lstrip()[:1]
    return path.suffix.lower() == ".jsonl" or head not in ("[", "")


def _raise_json_error(path: Path) -> None:
    """Name the first malformed line of a JSON or JSON Lines file (``datasets`` reports a
    position in a block of rows instead)."""
    text = path.read_text()
    if _is_json_lines(path):
        lines = text.splitlines()
        for number in _json_lines(path):
            try:
                value = json.loads(lines[number - 1])
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number}: not valid JSON ({err.msg} at column "
                                f"{err.colno}): each line must be one JSON object") from None
            if not isinstance(value, dict):
                raise DataError(f"{path} line {number}: a JSON {type(value).__name__}, not an "
                                "object: each line must be one record {field: value}")
    else:
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {err.lineno}: not valid JSON ({err.msg} at column "
                            f"{err.colno})") from None
    raise DataError(f"cannot read {path}: its records differ in their fields' types (a field "
                    "that is a string in one record and a number or list in another); give "
                    "each field one type in every record")


def record_location(path: str | Path, index: int) -> str:
    """Where record ``index`` (from 0) of ``path`` is, for an error message: ``FILE line N``
    for JSON Lines, ``FILE record N`` / ``row N`` / ``paragraph N`` (from 1) otherwise."""
    path = Path(path)
    kind = _LOADERS.get(path.suffix.lower())
    if kind == "json" and _is_json_lines(path):
        lines = _json_lines(path)
        if index < len(lines):
            return f"{path} line {lines[index]}"
    unit = {"csv": "row", "parquet": "row", "text": "paragraph"}.get(kind or "", "record")
    return f"{path} {unit} {index + 1}"


def detect_format(columns: Iterable[str]) -> str:
    """``"messages"``, ``"prompt-completion"`` or ``"text"`` from a record's columns."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if {"prompt", "completion"} <= cols:
        return "prompt-completion"
    if "text" in cols:
        return "text"
    raise InvalidInput(
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
        text, spans = _as_text(_field(record, "text", fmt)), None
        eos = True
    elif fmt == "prompt-completion":
        text, start, eos = _prompt_completion(_field(record, "prompt", fmt),
                                              _field(record, "completion", fmt), tokenizer)
        spans = [(start, len(text))]
    elif fmt == "messages":
        text, spans = _conversation(_field(record, "messages", fmt), tokenizer)
        eos = False
    else:
        raise InvalidInput(f"unknown format {fmt!r}; one of {FORMATS}")
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


_NEEDS = {"text": "'text'", "prompt-completion": "'prompt' and 'completion'",
          "messages": "'messages'"}


def _field(record: dict[str, Any], name: str, fmt: str) -> Any:
    """``record[name]``; a record without it (a JSON file's records are read with the union of
    their fields, a missing one as None) is refused, listing the fields it has."""
    value = record.get(name)
    if value is None:
        present = [k for k, v in record.items() if v is not None]
        raise InvalidInput(f"the record has no {name!r} field (it has "
                         f"{', '.join(present) or 'none'}): every record of a {fmt} file "
                         f"needs {_NEEDS[fmt]} (the format is read from the first record)")
    return value


def _as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"'text' must be a string, got {type(value).__name__}")
    return value


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInput(
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
        _check_messages(prompt, "prompt")
        _check_messages(completion, "completion")
        head = _render(tokenizer, prompt, generation_prompt=True)
        whole = _render(tokenizer, prompt + completion, generation_prompt=False)
        _check_prefix(head, whole)
        return whole, len(head), False
    raise InvalidInput(f"'prompt' and 'completion' must both be strings or both lists of "
                     f"messages, got a {type(prompt).__name__} and a "
                     f"{type(completion).__name__}")


def _check_messages(messages: Any, field: str) -> None:
    """A list of ``{"role", "content"}`` dicts with the roles chat templates know; ShareGPT's
    layout (``from``/``value``, roles ``human``/``gpt``) is named with its renaming."""
    if not isinstance(messages, list):
        raise InvalidInput(f"{field!r} must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") is None \
                or message.get("content") is None:
            keys = sorted(k for k, v in message.items() if v is not None) \
                if isinstance(message, dict) else []
            hint = ""
            if set(_SHAREGPT_KEYS) <= set(keys):
                hint = " (ShareGPT's layout: rename 'from' to 'role' and 'value' to 'content')"
            raise InvalidInput(f"{field!r} message {i + 1} is not a {{'role', 'content'}} dict "
                             f"(it has {', '.join(keys) or type(message).__name__}){hint}")
    odd = sorted({m["role"] for m in messages} & set(_SHAREGPT_ROLES))
    if odd:
        renames = ", ".join(f"{r!r} to {_SHAREGPT_ROLES[r]!r}" for r in odd)
        raise InvalidInput(f"{field!r} has the role(s) {', '.join(map(repr, odd))} (ShareGPT's "
                         f"names): rename {renames}; chat templates and the completion-only "
                         "loss know 'system', 'user' and 'assistant'")


def _conversation(messages: Any, tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    _check_messages(messages, "messages")
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
        roles = ", ".join(sorted({str(m["role"]) for m in messages}))
        raise InvalidInput(f"the conversation has no 'assistant' message (its roles: {roles}): "
                         "nothing to learn from it")
    return whole, spans


def _check_prefix(head: str, whole: str) -> None:
    if not whole.startswith(head):
        raise InvalidInput(
            "the tokenizer's chat template renders the start of a conversation differently "
            "from the whole conversation (some templates rewrite earlier turns), so the "
            "assistant tokens cannot be located; pass --no-completion-only to train on every "
            "token, or use a template that renders turns independently"
        )
