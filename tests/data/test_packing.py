"""Packed rows train exactly like their documents one per row: positions restart at each
document, Hugging Face's block-diagonal causal mask is built inside the captured graph, and the
step's loss averages over the same labelled tokens."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.capture.batch import masks_documents
from rpcompile.data import BatchIterator, Example, pack
from rpcompile.data.formats import IGNORE_INDEX
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model

SEQ = 16
ROWS = 6  # per step: 3 microbatches x 2 rounds of 1 row


def _documents(n: int = 30) -> list[Example]:
    gen = torch.Generator().manual_seed(7)
    docs = []
    for _ in range(n):
        ids = tuple(torch.randint(0, 128, (int(torch.randint(3, 9, (1,), generator=gen)),),
                                  generator=gen).tolist())
        labels = (IGNORE_INDEX, *ids[1:]) if len(docs) % 3 else ids  # some prompt masking
        docs.append(Example(ids, labels))
    return docs


def _unpacked(rows, documents_of, examples) -> dict[str, torch.Tensor]:
    """The documents of a packed batch, each its own right-padded row (as --packing off)."""
    docs = [examples[i] for i in documents_of]
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = torch.tensor(d.input_ids)
        labels[r, :len(d)] = torch.tensor(d.labels)
    return {"input_ids": ids, "labels": labels}


def _packed_steps(steps: int):
    """(packed batch, the same documents unpacked) for ``steps`` steps."""
    examples = _documents()
    rows, _, _ = pack(examples, SEQ, pad_id=0, seed=3)
    # Which example each packed document is: match by content, in row order.
    by_ids = {e.input_ids: i for i, e in enumerate(examples)}
    iterator = BatchIterator(rows, ROWS, seed=0)
    out = []
    for _ in range(steps):
        batch = next(iterator)
        docs = []
        for r in range(ROWS):
            starts = [*(batch["position_ids"][r] == 0).nonzero().flatten().tolist(), SEQ]
            for a, b in itertools.pairwise(starts):
                key = tuple(batch["input_ids"][r, a:b].tolist())
                if key in by_ids:  # the row's padding is no document
                    docs.append(by_ids[key])
        assert len(docs) > ROWS  # rows hold several documents each
        out.append((batch, _unpacked(rows, docs, examples)))
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_rows_train_like_their_documents_one_per_row(arch):
    model = hf_model(arch, layers=2)
    eager = copy.deepcopy(model)
    data = _packed_steps(3)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, rounds=2,
                                 example_inputs=data[0][0])
    assert masks_documents(compiled.capture)
    optimizer = _sgd(eager.parameters())
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=_sgd, device="virtual",
                                         chaos=5)) as trainer:
        for packed, unpacked in data:
            got = trainer.step(packed)
            optimizer.zero_grad()
            want = eager(**unpacked).loss  # HF's token mean over the documents' own rows
            want.backward()
            optimizer.step()
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        masters = trainer.masters()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_packed_rows_without_restarting_positions_leak_across_documents():
    """The comparison above sees a leak: the same rows with positions counting on through the
    row (one mask for the whole row) give another loss."""
    model = hf_model("qwen3", layers=2)
    packed, unpacked = _packed_steps(1)[0]
    with torch.no_grad():
        alone = model(**unpacked).loss
        confined = model(**packed).loss
        leaking = model(input_ids=packed["input_ids"], labels=packed["labels"]).loss
    torch.testing.assert_close(confined, alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(leaking, alone, rtol=1e-3, atol=1e-3)


def test_a_graph_whose_mask_ignores_positions_is_refused_for_packing(monkeypatch):
    import transformers.masking_utils as masking

    packed, _ = _packed_steps(1)[0]
    # A model whose attention does not read packed documents from position_ids: positions
    # still drive the rotary tables, but no mask is built from them.
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    captured = rpcompile.capture(hf_model("qwen3", layers=2), packed)
    assert "position_ids" in captured.input_keys and not masks_documents(captured)


def test_restarting_positions_on_a_graph_without_them_are_refused():
    packed, _ = _packed_steps(1)[0]
    plain = {k: v for k, v in packed.items() if k != "position_ids"}
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=3,
                                 example_inputs=plain)
    with pytest.raises(ValueError, match="compile with an example batch that carries "
                                         "position_ids"):
        compiled.reference_step(packed)
    counting = dict(plain, position_ids=torch.arange(SEQ).expand(ROWS, SEQ))
    loss, _ = compiled.reference_step(counting)  # positions 0..seq-1: the model's own
    torch.testing.assert_close(loss, compiled.reference_step(plain)[0])


def test_train_refuses_packing_for_a_model_whose_mask_ignores_positions(tmp_path, monkeypatch,
                                                                       capsys):
    import transformers.masking_utils as masking

    from rpcompile.cli import main
    from tests.finetune.test_finetune import _tiny_checkpoint

    data = tmp_path / "text.jsonl"
    data.write_text("".join(f'{{"text": "document {i} " }}\n' for i in range(40)))
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    assert main(["train", "--model", str(_tiny_checkpoint(tmp_path / "ckpt")),
                 "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1",
                 "--workers", "2", "--packing", "on", "--report-to", "none"]) == 2
    err = capsys.readouterr().err
    assert "Qwen3ForCausalLM" in err and "--packing off" in err
