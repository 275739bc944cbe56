"""The compiler front half: capture, partition and split any model; the stage programs run by
the reference executor reproduce the eager model's loss and gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.capture.core import CaptureError, capture
from rpcompile.options import CaptureOptions
from tests.option_groups import grouped
from tests.tiny_models import ARCHS, SkipNet, eager_grads, hf_model, skipnet_batch, token_batch

BIT_EXACT = {"qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gpt_oss"}


def _check_against_eager(compiled, model, batch, parts, exact, loss_fn=None):
    loss, grads = compiled.reference_step(batch)
    ref_loss, ref_grads = eager_grads(model, batch, parts, loss_fn)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == names
    if exact:
        assert torch.equal(loss, ref_loss)
        for n in names:
            assert torch.equal(grads[n], ref_grads[n]), n
    else:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        for n in names:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architectures_match_eager_for_1_3_8_workers(arch):
    model = hf_model(arch)
    batch = token_batch(batch=6)
    first = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch)
    for gpus in (1, 3, 8):
        compiled = first if gpus == 3 else first.replan(gpus, microbatches=3)
        plan = compiled.plan
        plan.validate()
        assert plan.workers == gpus
        assert len(compiled.stages) == len(plan.stages)
        # Tied embeddings accumulate two contributions in another order than eager autograd.
        _check_against_eager(compiled, model, batch, 3, exact=arch in BIT_EXACT)


def test_moe_blocks_are_opaque_nodes():
    compiled = rpcompile.compile(hf_model("qwen3_moe"), gpus=2, example_inputs=token_batch(6))
    opaque = [
        n for n in compiled.capture.graph_module.graph.nodes
        if n.op == "call_function" and "rpcompile.opaque" in str(n.target)
    ]
    assert len(opaque) == 3  # one per decoder layer's MoE block
    assert compiled.capture.report.opaque == tuple(f"model.layers.{i}.mlp" for i in range(3))


def test_rounds_accumulate_like_eager():
    model = hf_model("llama")
    batch = token_batch(batch=8)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, rounds=2, example_inputs=batch)
    # Per-round accumulation changes the summation order: close, not bit-equal.
    _check_against_eager(compiled, model, batch, 4, exact=False)


def test_skip_connection_model():
    model = SkipNet()
    x, y = skipnet_batch(6)
    loss_fn = torch.nn.functional.cross_entropy
    first = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=(x, y),
                              loss_fn=loss_fn)
    for gpus in (1, 3, 8):
        compiled = first if gpus == 3 else first.replan(gpus, microbatches=3)
        assert compiled.capture.units[1:-1] == [f"blocks.{i}" for i in range(6)]
        _check_against_eager(compiled, model, (x, y), 3, exact=False, loss_fn=loss_fn)


def test_skip_connection_crosses_stages_as_a_value():
    model = SkipNet()
    x, y = skipnet_batch(6)
    compiled = rpcompile.compile(
        model, gpus=8, microbatches=3, example_inputs=(x, y),
        loss_fn=torch.nn.functional.cross_entropy,
    )
    # The embedding output is read by block 0 and by the head: some stage after the first
    # must receive it as an input, and a backward stage must send a gradient for it.
    received = [s for s in compiled.stages[1:] if s.value_inputs]
    assert received
    assert any(s.grad_inputs for s in compiled.stages if s.kind != "forward")


def test_sequential_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = torch.nn.functional.mse_loss
    compiled = rpcompile.compile(model, gpus=3, microbatches=2, example_inputs=(x, y),
                                 loss_fn=loss_fn)
    assert compiled.capture.units == ["prefix", *map(str, range(5)), "tail"]
    _check_against_eager(compiled, model, (x, y), 2, exact=False, loss_fn=loss_fn)


def test_stage_code_shows_boundaries():
    compiled = rpcompile.compile(hf_model("qwen3"), gpus=3, example_inputs=token_batch(8))
    code = compiled.stages[0].code
    assert "rpcompile.prefetch" in code and "rpcompile.offload" in code
    assert "rpcompile.record" in code
    assert "rpcompile.wait" in compiled.stages[1].code
    text = compiled.explain()
    for st in compiled.stages:
        assert st.name in text
    assert [r.name for r in compiled.history] == [
        "capture", "token-hits", "cost", "partition", "split", "dispatch",
        "upload", "transfers", "grads", "optimizer", "commit", "events", "staging"]
    assert compiled.schedule is compiled.history[-1].artifact  # the lowered schedule


def test_tied_embedding_is_one_master():
    model = hf_model("qwen3_tied")
    compiled = rpcompile.compile(model, gpus=3, example_inputs=token_batch(8))
    users = [s.name for s in compiled.stages if "model.embed_tokens.weight" in s.params]
    assert len(users) >= 2  # embedding and LM head read the same master
    assert all("lm_head.weight" not in s.params for s in compiled.stages)
    # The plan's figures for every stage that reads the tied weight include it.
    embed = model.get_parameter("model.embed_tokens.weight")
    for prog in compiled.stages:
        if "model.embed_tokens.weight" in prog.params:
            stage = compiled.plan.stages[prog.index]
            assert stage.weight_bytes >= embed.numel() * embed.element_size()
            if prog.kind != "forward":
                assert stage.grad_bytes >= embed.numel() * 4


def test_frozen_parameters_get_no_gradient():
    model = hf_model("qwen3")
    for n, p in model.named_parameters():
        if "mlp" in n:
            p.requires_grad_(False)
    compiled = rpcompile.compile(model, gpus=3, microbatches=2, example_inputs=token_batch(4))
    _check_against_eager(compiled, model, token_batch(4), 2, exact=True)
    frozen = {i.source for s in compiled.stages for i in s.inputs
              if i.kind == "param" and not i.requires_grad}
    assert frozen == {n for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(gpus=0), "gpus must be a positive integer"),
        (dict(gpus=2, microbatches=0), "microbatches must be a positive integer"),
        (dict(gpus=2, mode="eventually"), "mode must be one of 'sync', 'async'"),
        (dict(gpus=2, device="tpu"), "device must be"),
        (dict(gpus=2, example_inputs=torch.randn(2, 8)), "input_ids must hold integers"),
        (dict(gpus=2, example_inputs=torch.full((2, 8), 500)), "vocab_size"),
        (dict(gpus=2, example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long),
                                      "token_type_ids": torch.ones(2, 8)}), "unsupported batch keys"),
    ],
)
def test_bad_arguments_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rpcompile.compile(hf_model("qwen3", layers=1), **grouped(**kwargs))


def test_model_without_parameters_is_rejected():
    with pytest.raises(ValueError, match="no parameters"):
        rpcompile.compile(torch.nn.ReLU(), gpus=2, example_inputs=(torch.randn(2, 3),))


def test_non_hf_model_needs_inputs():
    with pytest.raises(ValueError, match="example_inputs"):
        rpcompile.compile(SkipNet(), gpus=2)


def test_example_batch_must_fill_the_microbatches():
    with pytest.raises(ValueError, match="too few to fill 3 microbatches x 2 rounds"):
        rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, microbatches=3, rounds=2,
                          example_inputs=token_batch(5))


class _Noisy(torch.nn.Module):
    """Adds Gaussian noise in training: a random op rpcompile cannot replay."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.randn_like(h) if self.training else h


def test_unreplayable_random_ops_are_refused_naming_the_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Noisy(), torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match=r"randn_like.*nn\.Dropout"):
        rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=(x, y),
                          loss_fn=torch.nn.functional.cross_entropy)


def test_hf_model_with_loss_fn_is_a_generic_model():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids, y = torch.randint(0, 100, (4, 8)), torch.randint(0, 2, (4,))

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits, target)

    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=(ids, y),
                                 loss_fn=loss_fn)
    assert compiled.capture.units[1:-1] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    _check_against_eager(compiled, model, (ids, y), 2, exact=False, loss_fn=loss_fn)


def test_batch_too_small_for_the_microbatches_is_rejected():
    compiled = rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, microbatches=3,
                                 example_inputs=token_batch(6))
    with pytest.raises(ValueError, match=r"2 sequences.*3 microbatches"):
        compiled.reference_step(token_batch(batch=2))


class _Branchy(torch.nn.Module):
    """Data-dependent Python control flow: export cannot trace through it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            return h * 2
        return -h


def test_data_dependent_modules_become_opaque():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Branchy(), torch.nn.Linear(4, 4), _Branchy())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    loss_fn = torch.nn.functional.mse_loss
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=(x, y),
                                 loss_fn=loss_fn)
    report = compiled.capture.report
    assert report.opaque == ("0", "2")
    assert report.strategy == "export" and report.dynamic == ("b",)
    assert sum("data-dependent" in why for _, why in report.attempts) == 2
    _check_against_eager(compiled, model, (x, y), 2, exact=True, loss_fn=loss_fn)


def test_capture_error_names_module_and_fix():
    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = _Branchy()

        def forward(self, x):
            h = self.a(x)
            if h.mean() > 0:  # the root's own data-dependent branch: nothing to make opaque
                return h.sum()
            return (-h).sum()

    with pytest.raises(CaptureError, match=r"could not capture Root.*units=\[\.\.\.\].*opaque="):
        capture(Root(), (torch.randn(2, 4),))


def _run_whole_graph(captured, ids):
    from rpcompile.capture.batch import bind_batch

    gm = captured.graph_module
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    bound = dict(zip(captured.inputs, bind_batch(captured, ids).values()))
    loss = gm(*[bound[k] if k in bound else captured.value_of(k) for k in names])[0]
    captured.model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in captured.model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_replicated_capture_equals_full_export(arch):
    from rpcompile.passes.cost import annotate_costs

    # The fewest layers that replicate: 2 exported + 4 copies for qwen3; gpt_oss alternates
    # sliding/full attention (period 2), so 4 exported + 4 copies.
    model = hf_model(arch, layers=8)
    ids = token_batch(4, 12)
    fast = capture(model, ids)
    full = capture(model, ids, replicate=False)
    assert fast.report.strategy == "export+replicate" and full.report.strategy == "export"
    assert fast.units == full.units
    assert fast.report.node_count == full.report.node_count
    loss_a, grads_a = _run_whole_graph(fast, ids)
    loss_b, grads_b = _run_whole_graph(full, ids)
    assert torch.equal(loss_a, loss_b)
    for name, g in grads_b.items():
        assert torch.equal(grads_a[name], g), name
    for a, b in zip(annotate_costs(fast), annotate_costs(full)):
        assert (a.forward_flops, a.backward_flops, a.saved_bytes, a.output_bytes) == (
            b.forward_flops, b.backward_flops, b.saved_bytes, b.output_bytes)


def test_a_fork_is_rewritten_without_touching_its_source():
    # Each plan (loss-chunk variant, shape) rewrites a fork of compile()'s capture; the
    # capture itself must come out of that unchanged, and both must still compute the loss.
    from rpcompile.passes.chunked_loss import chunk_lm_loss

    model = hf_model("qwen3", layers=8)  # replicated: 2 layers exported, 6 copied
    ids = token_batch(4, 12)
    source = capture(model, ids)
    nodes = [(n.name, n.target) for n in source.graph_module.graph.nodes]
    fork = source.fork()
    assert chunk_lm_loss(fork.graph_module, 8) == 1
    fork.inputs.append("extra")
    assert [(n.name, n.target) for n in source.graph_module.graph.nodes] == nodes
    assert "extra" not in source.inputs
    assert [(n.name, n.target) for n in fork.graph_module.graph.nodes] != nodes
    fork.inputs.pop()
    loss_a, grads_a = _run_whole_graph(source, ids)
    loss_b, grads_b = _run_whole_graph(fork, ids)
    torch.testing.assert_close(loss_a, loss_b)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, msg=name)


def test_stage_programs_retarget_to_another_device():
    # Export records the device it traced on (factory ops, metadata checks). A stage run on a
    # worker of another device must not mix devices: on "meta" every op would fail against a
    # leftover cpu constant, so running there proves every constant was rewritten.
    compiled = rpcompile.compile(hf_model("qwen3"), gpus=3, microbatches=3,
                                 example_inputs=token_batch(6))
    for prog in compiled.stages:
        gm = prog.on_device("meta")
        assert "device(type='cpu')" not in gm.code
        args = []
        for inp in prog.inputs:
            node = next(n for n in prog.graph_module.graph.nodes if n.name == inp.name)
            val = node.meta["val"]
            if isinstance(val, torch.Tensor):
                shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)
                         for d in val.shape]
                args.append(torch.empty(shape, dtype=val.dtype, device="meta"))
            else:
                args.append(int(val.node.hint) if isinstance(val, torch.SymInt) else val)
        outs = gm(*args)
        assert all(o.device.type == "meta" for o in outs if isinstance(o, torch.Tensor))


def test_units_may_be_attention_and_mlp_blocks():
    # A graph-level cut can fall inside a decoder layer: name each layer's blocks as units.
    model = hf_model("qwen3")
    batch = token_batch(batch=6)
    units = [f"model.layers.{i}.{block}" for i in range(3) for block in ("self_attn", "mlp")]
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                                 capture=CaptureOptions(units=units))
    assert list(compiled.capture.units) == ["prefix", *units, "tail"]
    compiled.plan.validate()
    _check_against_eager(compiled, model, batch, 3, exact=True)


class GateNet(torch.nn.Module):
    """A non-HF model whose every block reads a batch input (a per-sequence gate) directly, so
    stages after the first read the batch too."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        from tests.tiny_models import Block

        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) * gate
        return self.head(h)


def test_stages_after_the_first_receive_the_batch_inputs_they_read(monkeypatch):
    # Every stage's program reads the gate: each gets it from the host (an ``ids`` upload
    # sized by what it reads), and one step on virtual workers equals eager SGD.
    from rpcompile.planner.partition import build_plan
    from rpcompile.runtime.trainer import Trainer

    torch.manual_seed(0)
    model = GateNet()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 16, generator=g), torch.rand(6, 1, generator=g) + 0.5,
             torch.randint(0, 10, (6,), generator=g))
    loss_fn = torch.nn.functional.cross_entropy

    def fixed_cut(units, hw, *, microbatch_size, seq_len, costing, options, **_search):
        n = len(units)  # forward: prefix + 2 blocks, then 1 block; backward likewise
        return build_plan(units, (0, 3), (0, 3), n - 2, hw, options.gpus,
                          options.microbatches_per_round, microbatch_size, seq_len,
                          options.rounds, costing)

    monkeypatch.setattr(rpcompile.compiler.search, "partition", fixed_cut)
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                                 loss_fn=loss_fn, device="virtual")
    gate_key = compiled.capture.input_keys[1]
    assert all(gate_key in dict(s.batch_inputs) for s in compiled.plan.stages)
    host = {(f.dst_kind, f.dst_stage): f.bytes for f in compiled.schedule.flows
            if f.src_kind is None}
    assert len(host) == len(compiled.plan.stages)  # one host upload each, F2 included
    assert host[("F", 1)] == 2 * 1 * 4  # two sequences' fp32 gate
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_loss, ref_grads = eager_grads(model, batch, 3, loss_fn)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                         device="virtual")) as trainer:
        loss = trainer.step(batch)
        masters = trainer.masters()
    torch.testing.assert_close(torch.as_tensor(loss), ref_loss, rtol=1e-6, atol=1e-6)
    for n, p in before.items():
        torch.testing.assert_close(masters[n], p - 0.1 * ref_grads[n], rtol=1e-5, atol=1e-6,
                                   msg=n)
