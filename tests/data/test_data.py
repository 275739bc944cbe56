"""The data pipeline: formats, completion-only labels, packing/padding, seeded resumable order."""

from __future__ import annotations

import json

import pytest
import torch

from rpcompile.data import (
    IGNORE_INDEX,
    BatchIterator,
    DataError,
    Example,
    byte_tokenizer,
    encode_record,
    pack,
    pad_rows,
    prepare,
    read_records,
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_chat_prompt_tokens_are_ignored_completion_tokens_are_targets(tok):
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo"}]}
    ex = encode_record(record, tok, "messages")
    # By hand: <|im_start|>=257 "user\n" "hi" <|im_end|>=258 "\n", then the assistant header
    # <|im_start|> "assistant\n" (prompt), then "yo" <|im_end|> "\n" (completion).
    prompt = [257, *b"user\n", *b"hi", 258, 10, 257, *b"assistant\n"]
    completion = [*b"yo", 258, 10]
    assert list(ex.input_ids) == prompt + completion
    assert list(ex.labels) == [IGNORE_INDEX] * len(prompt) + completion
    everything = encode_record(record, tok, "messages", completion_only=False)
    assert list(everything.labels) == prompt + completion


def test_multi_turn_chat_labels_every_assistant_turn(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    ex = encode_record({"messages": msgs}, tok, "messages")
    targets = bytes(t for t in ex.labels if 0 <= t < 256)
    assert targets == b"b\nd\n"  # each assistant content and the newline after <|im_end|>
    assert sum(1 for t in ex.labels if t == 258) == 2


def test_prompt_completion_and_text(tok):
    ex = encode_record({"prompt": "2+2=", "completion": "4"}, tok, "prompt-completion")
    assert list(ex.input_ids) == [*b"2+2=4", tok.eos_token_id]
    assert list(ex.labels) == [IGNORE_INDEX] * 4 + [ord("4"), tok.eos_token_id]
    text = encode_record({"text": "ab"}, tok, "text")
    assert list(text.labels) == list(text.input_ids) == [97, 98, tok.eos_token_id]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_read_formats(tmp_path, suffix):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pandas as pd

        frame = pd.DataFrame(rows)
        frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    assert read_records(path) == rows


def test_unknown_columns_name_the_formats(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="'prompt' and 'completion'"):
        prepare(path, tok)


_PAIR = json.dumps({"prompt": "q", "completion": "a"})
_CHAT = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(("name", "text", "words"), [
    ("empty.jsonl", "\n", ["empty.jsonl is empty", "no records"]),
    ("cut.jsonl", f'{_PAIR}\n\n{{"prompt": "q", "completion" "a"}}\n',
     ["cut.jsonl line 3", "not valid JSON", "one JSON object"]),
    ("list.jsonl", f"{_PAIR}\n[1, 2]\n", ["list.jsonl line 2", "not an object"]),
    ("arr.json", '[{"prompt": "q",\n  "completion": }]', ["arr.json line 2", "not valid JSON"]),
    ("missing.jsonl", f'{_PAIR}\n{_PAIR}\n{{"prompt": "q"}}\n',
     ["missing.jsonl line 3", "no 'completion' field", "it has prompt",
      "needs 'prompt' and 'completion'"]),
    ("typo.jsonl", f'{_PAIR}\n{{"prompt": "q", "completoin": "a"}}\n',
     ["typo.jsonl line 2", "no 'completion' field", "it has prompt, completoin"]),
    ("types.jsonl", f'{_PAIR}\n{{"prompt": "q", "completion": ["a"]}}\n',
     ["types.jsonl line 2", "must both be strings or both lists", "a str and a list"]),
    ("roles.jsonl", json.dumps({"messages": [{"role": "human", "content": "q"},
                                             {"role": "gpt", "content": "a"}]}) + "\n",
     ["roles.jsonl line 1", "'gpt', 'human'", "rename 'gpt' to 'assistant', 'human' to 'user'"]),
    ("sharegpt.jsonl", json.dumps({"messages": [{"from": "human", "value": "q"}]}) + "\n",
     ["sharegpt.jsonl line 1", "message 1", "rename 'from' to 'role' and 'value' to 'content'"]),
    ("noreply.jsonl", json.dumps({"messages": list(_CHAT)}) + "\n"
     + json.dumps({"messages": [_CHAT[0]]}) + "\n",
     ["noreply.jsonl line 2", "no 'assistant' message", "roles: user"]),
    ("rows.csv", "prompt,completion\nq,a\nq,\n", ["rows.csv row 2", "no 'completion' field"]),
])
def test_a_bad_data_file_is_refused_naming_the_file_record_and_field(tmp_path, tok, name,
                                                                     text, words):
    """Each message names the file, the record (its line in a JSON Lines file, counting the
    blank lines it skips) and the field, and says what the file needs."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as info:
        prepare(path, tok)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for word in words:
        assert word in message, (word, message)
    assert "Traceback" not in message and "position" not in message


def test_chat_data_needs_a_chat_template(tok):
    plain = byte_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_record({"messages": [{"role": "assistant", "content": "x"}]}, plain, "messages")


def _examples(n: int, seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 20, (1,), generator=gen))
        ids = tuple(range(i, i + length))
        out.append(Example(ids, (IGNORE_INDEX, IGNORE_INDEX, *ids[2:])))
    return out


def test_packing_keeps_documents_whole_with_positions_restarting_at_each():
    examples = _examples(30)
    rows, truncated, dropped = pack(examples, 16, pad_id=0, seed=1)
    assert (truncated, dropped) == (sum(len(e) > 16 for e in examples), 0) > (0, 0)
    kept = sorted(e.input_ids[:16] for e in examples)
    found = []
    for row, lengths in zip(rows.rows, rows.documents):
        assert sum(lengths) == len(row) <= 16
        start = 0
        for n in lengths:
            found.append(row.input_ids[start:start + n])
            # A document's first label is never scored, so no earlier document predicts it.
            assert row.labels[start] == IGNORE_INDEX
            start += n
    assert sorted(found) == kept
    # The labelled tokens are those of the documents trained one per row.
    assert sum(r.targets for r in rows.rows) == sum(
        Example(e.input_ids[:16], e.labels[:16]).targets for e in examples)
    batch = next(BatchIterator(rows, 4, seed=0))
    assert batch["input_ids"].shape == batch["position_ids"].shape == (4, 16)
    for r in range(4):
        positions = batch["position_ids"][r].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0]
        assert all(positions[i] == positions[i - 1] + 1 for i in range(16) if i not in starts)
        assert (batch["labels"][r, starts] == IGNORE_INDEX).all()


def test_packing_splits_a_long_text_into_pieces_and_truncates_a_prompted_example():
    text = Example(tuple(range(40)), tuple(range(40)))  # every token a target
    prompted = Example(tuple(range(100, 140)), (IGNORE_INDEX,) * 5 + tuple(range(105, 140)))
    rows, truncated, dropped = pack([text, prompted], 16, pad_id=0, seed=0)
    assert (rows.split, truncated, dropped) == (1, 1, 0)
    docs = []
    for row, lengths in zip(rows.rows, rows.documents):
        start = 0
        for n in lengths:
            docs.append(row.input_ids[start:start + n])
            assert row.labels[start] == IGNORE_INDEX  # each piece starts a document
            start += n
    # The text trains whole, in pieces of 16, 16 and 8 tokens; the prompted example is cut.
    assert sorted(docs) == sorted([tuple(range(0, 16)), tuple(range(16, 32)),
                                   tuple(range(32, 40)), tuple(range(100, 116))])


def test_padding_truncates_drops_and_masks_padding():
    long = Example(tuple(range(40)), tuple(range(40)))
    prompt_only = Example(tuple(range(40)), (IGNORE_INDEX,) * 30 + tuple(range(30, 40)))
    rows, truncated, dropped = pad_rows([long, prompt_only, *_examples(3)], 16, pad_id=999)
    assert (truncated, dropped, len(rows.rows)) == (2, 1, 4)
    batch = next(BatchIterator(rows, 4, seed=0))
    assert batch["input_ids"].shape == (4, 16)
    padding = batch["input_ids"] == 999
    assert padding.sum() == 4 * 16 - 16 - sum(len(r) for r in rows.rows[1:])
    assert (batch["labels"][padding] == IGNORE_INDEX).all()


@pytest.mark.parametrize("buckets", [1, 3])
def test_order_is_seeded_and_resumes_exactly(buckets):
    rows, _, _ = pad_rows(_examples(50), 24, pad_id=0)
    run = BatchIterator(rows, 4, seed=7, buckets=buckets)
    first = [next(run) for _ in range(30)]  # crosses two epochs of 12 batches
    again = BatchIterator(rows, 4, seed=7, buckets=buckets)
    for _ in range(17):
        next(again)
    state = again.state()
    resumed = BatchIterator(rows, 4, seed=7, buckets=buckets)
    resumed.load_state(json.loads(json.dumps(state)))
    for expected in first[17:]:
        got = next(resumed)
        assert torch.equal(got["input_ids"], expected["input_ids"])
        assert torch.equal(got["labels"], expected["labels"])
    other = BatchIterator(rows, 4, seed=8, buckets=buckets)
    assert not all(torch.equal(next(other)["input_ids"], b["input_ids"]) for b in first[:3])
    if buckets > 1:
        assert {b["input_ids"].shape[1] for b in first} > {24}  # shorter buckets are used
    with pytest.raises(ValueError, match="--seed 7"):
        BatchIterator(rows, 4, seed=8).load_state(state)
