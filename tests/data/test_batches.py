"""Real fine-tuning batches: padding masks, -100 labels, uneven splits, rounds, inputs bound by
name, and the errors a batch gets at the door. Every numerical check is against eager Hugging
Face training on the whole global batch (``model(**batch).loss``), which shares nothing with
the capture."""

from __future__ import annotations

import copy

import pytest
import torch

import rpcompile
from rpcompile.options import PlanOptions, TrainOptions
from tests.tiny_models import SkipNet, eager_batch_grads, hf_model, sft_batch, token_batch


def _adamw(params):
    # Adam divides each gradient element by its own magnitude: an element whose gradient is
    # ~1e-8 turns a 1e-9 difference of summation order (microbatches vs one whole batch, which
    # no pipeline can avoid) into an update difference of order lr. eps bounds that gain at
    # lr / eps; the gradients themselves agree to ~1e-8 (see the token-mean test below).
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _eager_training(model, batches, optimizer=_adamw):
    opt = optimizer(list(model.parameters()))
    losses = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(**b, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _max_weight_diff(compiled, eager):
    masters = compiled.trainer().masters()
    return max(float((masters[n] - p.detach()).abs().max())
               for n, p in eager.named_parameters() if n in masters)


@pytest.mark.parametrize(
    ("arch", "workers", "left"),
    [("qwen3", 1, False), ("qwen3", 3, True), ("qwen3", 8, False), ("llama", 3, True),
     ("qwen3_moe", 3, False), ("qwen3_tied", 8, True)],
)
def test_runtime_trains_like_eager_hf_on_padded_sft_batches(arch, workers, left):
    # 7 sequences over 2 microbatches x 2 rounds: an uneven split (2, 2, 2, 1) whose
    # microbatches hold different numbers of labelled tokens.
    model = hf_model(arch)
    eager = copy.deepcopy(model)
    batches = [sft_batch(7, 12, left=left, seed=10 + k) for k in range(3)]
    compiled = rpcompile.compile(model, gpus=workers, microbatches=2, rounds=2,
                                 example_inputs=batches[0], optimizer=_adamw, device="virtual",
                                 train=TrainOptions(chaos=workers))
    try:
        losses = [float(compiled.step(b)) for b in batches]
        expected = _eager_training(eager, batches)
        assert losses == pytest.approx(expected, abs=1e-6)
        assert _max_weight_diff(compiled, eager) < 1e-5
    finally:
        compiled.close()


def test_step_loss_is_the_global_token_mean_not_a_mean_of_microbatch_means():
    model = hf_model("qwen3")
    batch = sft_batch(6, 12, seed=3)
    counts = (batch["labels"][:, 1:] != -100).sum(dim=1)
    assert len(set(counts.tolist())) > 1  # microbatches differ in labelled tokens
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch)
    loss, grads = compiled.reference_step(batch)
    eager_loss, eager_grads = eager_batch_grads(model, batch)
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-6)
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    per_mb = [model(**{k: v[i:i + 2] for k, v in batch.items()}).loss for i in (0, 2, 4)]
    assert abs(float(torch.stack(per_mb).mean()) - float(eager_loss)) > 1e-4


def test_labels_that_differ_from_the_example_inputs_reach_the_loss():
    # Regression: compiled from plain token ids (labels = ids), stepped with other labels.
    model = hf_model("llama")
    eager = copy.deepcopy(model)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6),
                                 optimizer=_adamw, device="virtual")
    steps = []
    for k in range(2):
        x = token_batch(6, seed=20 + k)
        y = token_batch(6, seed=40 + k)
        y[:, :5] = -100
        steps.append({"input_ids": x, "labels": y})
    ref_loss, _ = compiled.reference_step(steps[0])
    try:
        losses = [float(compiled.step(b)) for b in steps]
        expected = _eager_training(eager, steps)
        assert float(ref_loss) == pytest.approx(expected[0], abs=1e-6)
        assert losses == pytest.approx(expected, abs=1e-6)
        assert _max_weight_diff(compiled, eager) < 1e-5
    finally:
        compiled.close()


@pytest.mark.parametrize("alias", ["same-tensor", "view"])
def test_aliased_or_view_example_inputs_keep_two_arguments(alias):
    model = hf_model("qwen3")
    big = token_batch(12)
    ids = big[:6]  # a view
    example = {"input_ids": ids, "labels": ids} if alias == "same-tensor" else ids
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=example)
    assert compiled.capture.input_keys[:2] == ["input_ids", "labels"]
    other = token_batch(6, seed=9)
    other[:, :3] = -100
    batch = {"input_ids": ids, "labels": other}
    loss, _ = compiled.reference_step(batch)
    torch.testing.assert_close(loss, eager_batch_grads(model, batch)[0], rtol=0, atol=1e-6)


def test_a_loss_fn_model_compiles_from_views_of_a_larger_batch():
    """A share of a larger batch (tensor_split: a view with a storage offset) once gave export
    a size symbol no batch dimension names, and the cost pass failed on it."""
    import torch.nn.functional as F

    from tests.tiny_models import skipnet_batch

    model = SkipNet()
    x, y = skipnet_batch(12)
    xs, ys = x.tensor_split(2)[1], y.tensor_split(2)[1]
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=(xs, ys),
                                 loss_fn=F.cross_entropy)
    loss, _ = compiled.reference_step((xs, ys))
    want = sum(F.cross_entropy(model(a), b) for a, b in zip(xs.tensor_split(3), ys.tensor_split(3)))
    torch.testing.assert_close(loss, want / 3, rtol=0, atol=1e-6)


def test_int32_token_ids_train_as_int64():
    model = hf_model("qwen3")
    batch = sft_batch(4, 10, seed=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=batch)
    narrow = {k: v.int() for k, v in batch.items()}
    assert torch.equal(compiled.reference_step(narrow)[0], compiled.reference_step(batch)[0])


def test_batches_smaller_than_the_plan_run_and_larger_ones_are_refused():
    model = hf_model("qwen3")
    eager = copy.deepcopy(model)
    # dynamic=False: a larger batch is refused, not planned for anew (tests/test_plan_shapes.py)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=sft_batch(6, 12),
                                 optimizer=_adamw, device="virtual",
                                 plan=PlanOptions(dynamic=False))
    try:
        with pytest.raises(ValueError, match=r"longer|larger than the plan's shape.*12 tokens"):
            compiled.step(sft_batch(6, 16))
        with pytest.raises(ValueError, match="larger than the plan's shape"):
            compiled.step(sft_batch(8, 12))
        assert compiled.trainer().steps_done == 0
        small = [sft_batch(5, 9, seed=5), sft_batch(4, 12, seed=6)]
        losses = [float(compiled.step(b)) for b in small]
        assert losses == pytest.approx(_eager_training(eager, small), abs=1e-6)
    finally:
        compiled.close()


def test_padded_batch_on_a_graph_without_a_mask_is_refused():
    compiled = rpcompile.compile(hf_model("qwen3"), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4))
    padded = sft_batch(4, 12, seed=1)
    padded["attention_mask"][0, -2:] = 0
    with pytest.raises(ValueError, match=r"example batch.*attention_mask"):
        compiled.reference_step(padded)
    # An all-ones mask masks nothing: it is dropped and the step is the unmasked one.
    ones = {"input_ids": padded["input_ids"], "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    assert torch.equal(compiled.reference_step(ones)[0],
                       compiled.reference_step(padded["input_ids"])[0])


@pytest.fixture(scope="module")
def door():
    """One compiled model for every bad batch: a refused batch runs nothing, so each case
    starts from a trainer that has taken no step (each case checks that it still has not)."""
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=sft_batch(4, 12), device="virtual")
    yield compiled
    compiled.close()


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (torch.zeros(0, 12, dtype=torch.long), "the batch is empty"),
        ({"input_ids": token_batch(4), "labels": None}, "labels=None"),
        ({"input_ids": token_batch(4), "labels": torch.full((4, 12), -100)},
         "no token of this batch is labelled"),
        ({"input_ids": token_batch(4), "labels": torch.full((4, 12), 300)}, "-100"),
        (token_batch(4).float(), r"convert with input_ids\.long\(\)"),
        ({"input_ids": token_batch(4), "attention_mask": torch.full((4, 12), 2)},
         "1 \\(real token\\) and 0"),
        ({"input_ids": token_batch(4), "token_type_ids": token_batch(4)}, "unsupported batch keys"),
    ],
)
def test_bad_batches_are_refused_before_anything_runs(door, batch, match):
    with pytest.raises(ValueError, match=match):
        door.step(batch)
    assert door.trainer().steps_done == 0


def test_plain_module_without_loss_fn_names_loss_fn():
    x, y = torch.randn(4, 16), torch.randint(0, 10, (4,))
    with pytest.raises(rpcompile.CaptureError, match=r"no loss_fn was given.*loss_fn="):
        rpcompile.compile(SkipNet(), gpus=2, microbatches=2, example_inputs=(x, y))
    with pytest.raises(ValueError, match=r"not a scalar.*loss_fn"):
        rpcompile.compile(SkipNet(), gpus=2, microbatches=2, example_inputs=(x,))


def test_router_aux_loss_is_refused_with_the_fix():
    model = hf_model("qwen3_moe")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits = False"):
        rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4))


def test_loss_fn_models_keep_the_mean_of_microbatch_means_on_uneven_splits():
    torch.manual_seed(0)
    model = SkipNet()
    x, y = torch.randn(5, 16), torch.randint(0, 10, (5,))
    loss_fn = torch.nn.functional.cross_entropy
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=(x, y),
                                 loss_fn=loss_fn)
    loss, _ = compiled.reference_step((x, y))
    means = [loss_fn(model(xs), ys) for xs, ys in zip(x.tensor_split(2), y.tensor_split(2))]
    torch.testing.assert_close(loss, torch.stack(means).mean(), rtol=0, atol=1e-6)


class _LogitsOnly(torch.nn.Module):
    """Looks like a causal LM (config, output embeddings) but returns no loss, or a loss that
    ignores ``num_items_in_batch``."""

    def __init__(self, with_loss: bool) -> None:
        super().__init__()
        self.lm = hf_model("qwen3", layers=2)
        self.config = self.lm.config
        self.with_loss = with_loss

    def get_output_embeddings(self):
        return self.lm.lm_head

    def forward(self, input_ids, labels=None, **kwargs):
        return self.lm(input_ids=input_ids, labels=labels if self.with_loss else None)


def test_a_causal_lm_without_a_usable_loss_names_loss_fn():
    with pytest.raises(ValueError, match=r"returned no loss.*loss_fn"):
        rpcompile.compile(_LogitsOnly(False), gpus=2, microbatches=2,
                          example_inputs=token_batch(4))
    with pytest.raises(ValueError, match=r"ignores num_items_in_batch.*loss_fn"):
        rpcompile.compile(_LogitsOnly(True), gpus=2, microbatches=2,
                          example_inputs=token_batch(4))


class _TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 20)

    def forward(self, x, weight):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h), weight


def _weighted_token_sum(out, target):
    logits, weight = out
    tok = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                            ignore_index=-100, reduction="none")
    return (tok.view(target.shape).sum(dim=1) * weight).sum()


def test_loss_fn_models_get_a_token_mean_from_a_weight_input():
    # The recipe of docs/batches.md section 2: the normalisation travels as data.
    torch.manual_seed(0)
    model = _TokenModel()
    x = torch.randint(0, 20, (6, 8))
    y = torch.randint(0, 20, (6, 8))
    y[:3, :5] = -100
    compiled = rpcompile.compile(model, gpus=3, microbatches=3,
                                 example_inputs=(x, torch.ones(6), y), loss_fn=_weighted_token_sum)
    for labels in (y, y.masked_fill(torch.arange(8) < 6, -100)):
        weight = torch.full((6,), 3 / int((labels != -100).sum()))
        loss, _ = compiled.reference_step((x, weight, labels))
        expected = torch.nn.functional.cross_entropy(model(x, weight)[0].flatten(0, 1),
                                                     labels.flatten(), ignore_index=-100)
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)


def test_evaluate_is_the_eager_eval_loss_and_changes_nothing():
    torch.manual_seed(0)
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=4,
                                             n_positions=32, attn_implementation="eager"))
    model.train()  # dropout in the graph: evaluate must turn it off
    batches = [sft_batch(7, 12, left=True, seed=k) for k in range(2)]
    compiled = rpcompile.compile(model, gpus=3, microbatches=2, rounds=2,
                                 example_inputs=batches[0], device="virtual",
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        compiled.step(batches[0])
        before = {n: t.clone() for n, t in compiled.trainer().masters().items()}
        loss = compiled.evaluate(batches[1])
        short = compiled.evaluate({k: v[:2] for k, v in batches[1].items()})  # < 4 sequences
        after = compiled.trainer().masters()
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert compiled.trainer().steps_done == 1
        compiled.sync_to_model()
    finally:
        compiled.close()
    model.eval()
    with torch.no_grad():
        want = model(**batches[1]).loss
        want_short = model(**{k: v[:2] for k, v in batches[1].items()}).loss
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(short, want_short, rtol=0, atol=1e-6)
