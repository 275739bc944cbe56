"""The paper workloads' parameter counts (rpcompile.workloads.paper): a tied LM head is one
parameter, owned by the prefix and borrowed by the tail, as the capture marks a tied Hugging
Face model, so masters, optimizer state, gradients and host memory count it once while the
tail's stage still uploads the matrix and returns its gradient."""

from __future__ import annotations

from dataclasses import replace

import torch

import rpcompile
from rpcompile.passes.memory import host_memory
from rpcompile.workloads.paper import MODELS, PaperModel, roundpipe_qwen3_1_7b_plan
from tests.tiny_models import hf_model


def test_a_tied_head_is_counted_once_and_borrowed_by_the_tail():
    model = MODELS["qwen3-1.7b"]
    assert model.tied_embeddings
    units = model.units(4, 2048)
    emb = model.embedding_params
    # Each unit's own parameters add up to the model's, the shared matrix once (1.72 B).
    assert sum(u.trainable_params for u in units) == model.trainable_params() == model.params()
    assert 1.7e9 < model.trainable_params() < 1.75e9
    prefix, tail = units[0], units[-1]
    assert prefix.trainable_params == emb and not prefix.borrowed
    assert tail.trainable_params == model.hidden  # the final norm
    assert tail.borrowed == ((0, emb, True),)
    # RoundPipe's plan puts the tail alone in its stage: it uploads the matrix (bf16) and
    # sends back its fp32 gradient; the host holds one master of it.
    plan = roundpipe_qwen3_1_7b_plan()
    stage = next(s for s in plan.stages if s.kind == "tail")
    assert stage.units == (len(units) - 1,)
    assert stage.weight_bytes == 2 * (model.hidden + emb)
    assert stage.grad_bytes == 4 * (model.hidden + emb)
    assert stage.trainable_weight_bytes == stage.weight_bytes
    assert host_memory(plan, "async").masters == 4 * model.trainable_params()


def test_an_untied_head_is_the_tails_own():
    model = MODELS["llama3.1-8b"]
    assert not model.tied_embeddings
    units = model.units(4, 2048)
    assert sum(u.trainable_params for u in units) == model.trainable_params()
    assert units[-1].trainable_params == model.hidden + model.vocab * model.hidden
    assert not any(u.borrowed for u in units)


def test_with_lora_a_tied_head_is_borrowed_frozen():
    model = replace(MODELS["qwen3-1.7b"], lora_rank=8)
    units = model.units(4, 2048)
    assert sum(u.frozen_params for u in units) == model.params()
    assert sum(u.trainable_params for u in units) == model.trainable_params()
    assert units[-1].borrowed == ((0, model.embedding_params, False),)


def test_the_paper_units_have_the_shape_a_captured_tied_model_gets():
    """A tiny tied Qwen3 captured and planned, against a PaperModel of the same shape: the
    same units, each with the same own parameters, and the tail borrowing the embedding."""
    hf = hf_model("qwen3_tied")
    cfg = hf.config
    paper = PaperModel(
        "tiny", layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        ffn=cfg.intermediate_size, vocab=cfg.vocab_size, forward_ms=1.0, backward_ms=2.0,
        head_forward_ms=1.0, head_backward_ms=2.0, hop_ms=0.1, tied_embeddings=True,
        qk_norm=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    compiled = rpcompile.compile(hf, gpus=2, microbatches=2,
                                 example_inputs={"input_ids": ids, "labels": ids},
                                 device="virtual")
    try:
        captured = compiled.plan.units
    finally:
        compiled.close()
    ours = paper.units(2, 8)
    assert len(captured) == len(ours)
    assert [u.trainable_params for u in captured] == [u.trainable_params for u in ours]
    assert [u.frozen_params for u in captured] == [u.frozen_params for u in ours]
    assert [u.borrowed for u in captured] == [u.borrowed for u in ours]
    assert sum(u.trainable_params for u in captured) == sum(p.numel() for p in hf.parameters())


def test_a_weight_bound_baseline_keeps_a_copy_of_the_tied_matrix_on_the_tails_gpu():
    from rpcompile.sim.baselines import pipeline_stages

    model = MODELS["qwen3-1.7b"]
    units = model.units(4, 2048)
    stages = pipeline_stages(units, 8)
    first, last = stages[0], stages[-1]
    assert 0 in first.units and len(units) - 1 in last.units
    own = sum(units[u].params for u in last.units)
    # The last GPU holds the matrix it reads (bf16) and its gradient, as Megatron does.
    assert last.weight_bytes == 2 * (own + model.embedding_params)
    assert last.grad_bytes == 2 * (own + model.embedding_params)
    assert first.weight_bytes == 2 * sum(units[u].params for u in first.units)


def test_more_chunks_than_layers_deal_blocks_with_the_tail_alone_last():
    """Interleaved baselines at the artifact's v = ceil(28 / 8) = 4 chunks per GPU: 32 chunks
    over Qwen3-1.7B's 56 attention/MLP blocks, none empty, the LM head (4 blocks' worth)
    alone in the last; the schedule builds and replays."""
    from rpcompile.sim import simulate_pipeline
    from rpcompile.sim.baselines import head_layer_equivalents, pipeline_stages
    from rpcompile.workloads.paper import hop_hardware

    model = MODELS["qwen3-1.7b"]
    blocks = model.units(4, 2048, split_layers=True)
    assert head_layer_equivalents(blocks) == 4
    stages = pipeline_stages(blocks, 32)
    assert [u for s in stages for u in s.units] == list(range(len(blocks)))
    assert all(s.units for s in stages)
    assert stages[-1].units == (len(blocks) - 1,)
    sizes = [len(s.units) for s in stages[1:-1]]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)  # even, larger last
    for kind in ("interleaved", "looped-bfs"):
        r = simulate_pipeline(blocks, hop_hardware(model), kind, workers=8, microbatches=16,
                              chunks=4)
        assert 0 < r.bubble < 1
