"""Dropout is replayed: the recompute of every backward stage draws the forward's masks.

Each test trains one step on virtual workers whose plan has several backward stages (so most
layers are recomputed), records the masks the runtime's forwards drew, then runs the *eager*
Hugging Face / PEFT model on the whole batch with its dropout calls made to apply exactly those
masks. The step's loss and gradients (read from an SGD(lr=1) update) must equal eager
autograd's: that holds only if every recompute and every backward used the forward's mask."""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

import rpcompile
from rpcompile.capture.batch import bind_batch, split_batch
from rpcompile.capture.dropout import _mix, record_masks
from rpcompile.options import CaptureOptions, TrainOptions
from rpcompile.planner.partition import build_plan
from tests.tiny_models import hf_model, sft_batch, token_batch


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def _tiny(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    if kind == "gpt2":  # nn.Dropout on embeddings, residuals and attention weights
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=64,
            attn_implementation="eager"))
    if kind == "sdpa":  # scaled_dot_product_attention(dropout_p=0.1)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, attention_dropout=0.1,
                                                  attn_implementation="sdpa", **common))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        base = hf_model("qwen3", layers=4)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                               target_modules=["q_proj", "v_proj"]))
    raise ValueError(kind)


def _full_masks(compiled, batch, records, step=0):
    """Per dropout node (salt), the whole batch's mask: each microbatch's recorded mask, all
    draws of one (node, microbatch) being identical, concatenated along the batch."""
    drawn = defaultdict(list)
    for salt, seed, keep in records:
        drawn[(salt, seed)].append(keep)
    parts = split_batch(bind_batch(compiled.capture, batch, step=step),
                        compiled.microbatches * compiled.rounds)
    full, redrawn = [], 0
    for salt in range(len(compiled.capture.random_ops)):
        masks = []
        for mb in parts:
            got = drawn[(salt, _mix(int(mb["rp_rng"][0]), salt))]
            assert got, f"dropout {salt} drew no mask for a microbatch"
            for other in got[1:]:
                assert torch.equal(other, got[0]), f"dropout {salt}: recompute drew another mask"
            redrawn += len(got) > 1
            masks.append(got[0])
        full.append(torch.cat(masks))
    return full, redrawn


@contextlib.contextmanager
def _eager_dropout_uses(masks):
    """Make eager F.dropout and F.scaled_dot_product_attention apply ``masks`` in call order."""
    order = iter(masks)
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def fixed_dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        keep = next(order)
        assert keep.shape == x.shape
        return x * keep.to(x.dtype) * (1.0 / (1.0 - p))

    def fixed_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        if dropout_p == 0:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        scores = q @ k.transpose(-2, -1) * (scale or q.shape[-1] ** -0.5)
        if is_causal:
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf"))
                      if attn_mask.dtype == torch.bool else scores + attn_mask)
        # A query that sees no key (left padding) attends to nothing, as in torch's SDPA.
        blind = torch.isneginf(scores).all(-1, keepdim=True)
        probs = scores.masked_fill(blind, 0.0).softmax(-1).masked_fill(blind, 0.0)
        return fixed_dropout(probs, dropout_p) @ v

    F.dropout, F.scaled_dot_product_attention = fixed_dropout, fixed_sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    assert next(order, None) is None, "eager drew fewer dropout masks than the graph holds"


@pytest.mark.parametrize(("kind", "left"), [("gpt2", False), ("sdpa", False), ("sdpa", True),
                                            ("lora", True)])
def test_recompute_replays_the_forwards_dropout_masks(kind, left, monkeypatch):
    # Left padding gives SDPA queries that see no key: torch's SDPA returns 0 there, not NaN.
    model = _tiny(kind)
    model.train()
    eager = copy.deepcopy(model)
    batch = sft_batch(6, 12, left=left, seed=4)
    # Layers recomputed in two backward stages, whatever the search would pick: a fixed cut
    # (forward: prefix + one layer, then the rest; backward: prefix + one layer, then up to
    # the tail of the last layer and the head).
    def fixed_cut(units, hw, *, microbatch_size, seq_len, costing, options, **_search):
        n = len(units)
        return build_plan(units, (0, 2), (0, 2), n - 2, hw, options.gpus,
                          options.microbatches_per_round, microbatch_size, seq_len,
                          options.rounds, costing)

    monkeypatch.setattr(rpcompile.compiler.search, "partition", fixed_cut)
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                                 optimizer=_sgd, device="virtual", train=TrainOptions(chaos=2))
    assert len(compiled.capture.random_ops) > 0
    backward = [s for s in compiled.stages if s.kind == "backward"]
    assert len(backward) == 2  # layers are recomputed in backward stages
    try:
        before = {n: t.clone() for n, t in compiled.trainer().masters().items()}
        with record_masks() as records:
            loss = compiled.step(batch)
        after = compiled.trainer().masters()
        masks, redrawn = _full_masks(compiled, batch, records)
        assert redrawn > 0  # some masks were drawn again by a recompute
        with _eager_dropout_uses(masks):
            eager_loss = eager(**batch, use_cache=False).loss
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=0, atol=1e-6)
        for name, p in eager.named_parameters():
            if name in before:
                torch.testing.assert_close(before[name] - after[name], p.grad, rtol=1e-5,
                                           atol=1e-6, msg=name)
    finally:
        compiled.close()


def test_masks_repeat_within_a_step_and_change_between_steps():
    model = _tiny("gpt2")
    model.train()
    batch = token_batch(6)
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch)
    a, _ = compiled.reference_step(batch, step=0)
    b, _ = compiled.reference_step(batch, step=0)
    c, _ = compiled.reference_step(batch, step=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Without dropout (eval mode) the masks vanish from the graph: nothing to replay.
    model.eval()
    assert rpcompile.compile(model, gpus=3, microbatches=3,
                             example_inputs=batch).capture.random_ops == ()


def test_lora_with_dropout_trains_and_its_loss_falls():
    model = _tiny("lora")
    model.train()
    batch = sft_batch(6, 12, seed=8)
    compiled = rpcompile.compile(
        model, gpus=3, microbatches=3, example_inputs=batch, device="virtual",
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    try:
        losses = [float(compiled.step(batch)) for _ in range(12)]
    finally:
        compiled.close()
    assert losses[-1] < losses[0] - 0.3, losses


def test_dropout_inside_an_opaque_block_is_refused_naming_it():
    model = hf_model("qwen3", layers=2)
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.3))
    with pytest.raises(ValueError, match=r"opaque block model\.layers\.0\.mlp .*eval mode"):
        rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                          capture=CaptureOptions(opaque=["model.layers.0.mlp"]))


def test_inplace_dropout_is_refused_with_its_fix_and_p_one_drops_everything():
    from rpcompile.capture.dropout import seeded_dropout

    model = hf_model("qwen3", layers=2)
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(
        torch.nn.SiLU(), torch.nn.Dropout(0.3, inplace=True))
    with pytest.raises(ValueError, match="inplace=False"):
        rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4))
    x = torch.randn(3, 4, requires_grad=True)
    out = seeded_dropout(x, torch.tensor([5]), 1.0, 0)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(3, 4)) and torch.equal(x.grad, torch.zeros(3, 4))
