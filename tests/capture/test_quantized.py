"""Quantized frozen bases (bitsandbytes NF4 / FP4 / int8 under PEFT LoRA adapters).

The models are built the Hugging Face way: a tiny Qwen3 saved in fp32 and
reloaded with ``BitsAndBytesConfig``, then wrapped by ``peft.get_peft_model``. Every comparison
is with what bitsandbytes itself computes on the CPU: the eager PEFT model's loss and adapter
gradients, ``bitsandbytes.functional.dequantize_4bit`` and bitsandbytes' int8 training matmul.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from rpcompile.capture import RefusedModel, capture
from rpcompile.capture.quantized import DEQUANTIZE_OPS
from tests.tiny_models import hf_model

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
# bitsandbytes warns once that it cannot reach an optional CPU kernel hub; its fallback is used.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

CONFIGS = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                       bnb_4bit_use_double_quant=True),
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                       bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


@functools.cache
def _checkpoint(tmp_root: str) -> str:
    hf_model("qwen3", layers=2).save_pretrained(tmp_root)
    return tmp_root


def quantized_model(tmp_path_factory, kind: str, *, lora: bool = True, **lora_kw):
    """A tiny Qwen3 loaded with bitsandbytes ``kind`` (a CONFIGS key), fp32 compute, with
    seeded non-zero LoRA adapters on every linear of the base (``lora=False``: none)."""
    import transformers as tf

    root = _checkpoint(str(tmp_path_factory.getbasetemp() / "qwen3-fp32"))
    config = tf.BitsAndBytesConfig(**CONFIGS[kind], bnb_4bit_compute_dtype=torch.float32)
    model = tf.AutoModelForCausalLM.from_pretrained(root, quantization_config=config,
                                                    dtype=torch.float32)
    if not lora:
        return model
    torch.manual_seed(1)
    kw = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
              init_lora_weights=False) | lora_kw
    return peft.get_peft_model(model, peft.LoraConfig(**kw)).base_model.model.train()


def _graph_loss(captured, batch):
    gm = captured.graph_module
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in captured.inputs:
            values.append(batch[captured.input_keys[captured.inputs.index(node.name)]])
        else:
            values.append(captured.value_of(node.name))
    out = gm(*values)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_captured_quantized_lora_equals_eager_peft_bitsandbytes(tmp_path_factory, kind):
    model = quantized_model(tmp_path_factory, kind)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    captured = capture(model, batch)

    dequantize = [n for n in captured.graph_module.graph.nodes if n.target in DEQUANTIZE_OPS]
    linears = [n for n, m in model.named_modules()
               if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert len(dequantize) == len(linears) == 14
    assert sorted(captured.quantized) == sorted(f"{n}.weight" for n in linears)
    for packed in captured.quantized.values():
        assert packed.format == kind.split("-")[0]
        assert packed.packed is model.get_parameter(
            next(k for k, v in captured.quantized.items() if v is packed))
        assert not packed.packed.requires_grad
    assert not any("bitsandbytes" in str(n.target) for n in captured.graph_module.graph.nodes)

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    eager = model(**batch).loss
    eager_grads = torch.autograd.grad(eager, trainable)
    graph = _graph_loss(captured, captured.example_batch)
    graph_grads = torch.autograd.grad(graph, trainable)
    # The example batch is the whole step: the graph's loss is Hugging Face's.
    torch.testing.assert_close(graph, eager, rtol=0, atol=0)
    for ours, theirs in zip(graph_grads, eager_grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_full_fine_tuning_of_a_quantized_model_is_refused(tmp_path_factory):
    model = quantized_model(tmp_path_factory, "nf4", lora=False)
    with pytest.raises(RefusedModel, match="full fine-tuning of a quantized model"):
        capture(model)


def test_other_quantization_methods_are_refused(tmp_path_factory):
    model = hf_model("qwen3", layers=1)
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(RefusedModel, match=r"quantized with gptq.*BitsAndBytesConfig"):
        capture(model)


def test_an_int8_linear_with_trainable_fp16_weights_is_refused():
    model = hf_model("qwen3", layers=1)
    old = model.model.layers[0].mlp.down_proj
    new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=False,
                              has_fp16_weights=True)
    model.model.layers[0].mlp.down_proj = new
    with pytest.raises(RefusedModel, match="has_fp16_weights=True"):
        capture(model)


def test_an_unknown_integer_weight_is_refused():
    model = hf_model("qwen3", layers=1)
    layer = model.model.layers[0].mlp
    layer.down_proj.weight = torch.nn.Parameter(
        torch.zeros_like(layer.down_proj.weight, dtype=torch.int8), requires_grad=False)
    with pytest.raises(RefusedModel, match=r"down_proj\.weight has dtype torch\.int8"):
        capture(model)


# -- the kernels ------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_dequantize_4bit_is_bit_identical_to_bitsandbytes(quant_type, nested, blocksize):
    import bitsandbytes.functional as BF

    from rpcompile.capture.quantized import state_4bit
    from rpcompile.runtime import kernels

    # 300 x 130 weights: a partial last block and more than 256 blocks, so the second-level
    # scale of a double-quantized absmax changes inside the tensor. One large outlier.
    weight = torch.randn(300, 130, generator=torch.Generator().manual_seed(2)) * 0.02
    weight[3, 5] = 0.3
    packed, quant = BF.quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type,
                                     compress_statistics=nested)
    state = dict(state_4bit(quant))
    assert (quant.nested, quant.absmax.numel() > 256) == (nested, True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        quant.dtype = dtype
        expected = BF.dequantize_4bit(packed, quant)
        for backend in ("torch", "triton"):  # triton: the interpreter, on these CPU tensors
            out = torch.full((300 * 130,), float("nan"), dtype=dtype)
            got = kernels.dequantize_4bit(
                packed, state["code"], state["absmax"], shape=quant.shape, blocksize=blocksize,
                dtype=dtype, absmax_code=state.get("absmax_code"),
                absmax_scale=state.get("absmax_scale"), absmax_offset=state.get("absmax_offset"),
                absmax_blocksize=quant.state2.blocksize if nested else 0, out=out,
                backend=backend)
            assert got.data_ptr() == out.data_ptr() and got.shape == expected.shape
            assert torch.equal(_bits(got), _bits(expected)), (dtype, backend)


def test_dequantize_int8_is_bit_identical_to_bitsandbytes_training_matmul():
    import bitsandbytes.functional as BF
    from bitsandbytes.autograd._functions import MatMul8bitFp

    from rpcompile.runtime import kernels

    weight = torch.randn(70, 96, generator=torch.Generator().manual_seed(3))
    cb, scb, _ = BF.int8_vectorwise_quant(weight.half())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        state = bnb.MatmulLtState()
        state.CB, state.SCB, state.has_fp16_weights = cb, scb, False
        # What bitsandbytes trains with on the CPU: linear(x, its dequantized weight); x = I
        # reads that weight back exactly (each output is one product by 1, plus zeros).
        expected = MatMul8bitFp.apply(torch.eye(96, dtype=dtype), cb, None, None, state).t()
        for backend in ("torch", "triton"):
            got = kernels.dequantize_int8(cb, scb, dtype=dtype, backend=backend)
            assert torch.equal(_bits(got), _bits(expected)), (dtype, backend)


@pytest.mark.parametrize("options", ["launch", "triton default"])
def test_dequantize_4bit_compiles_for_sm90_without_a_fused_multiply_add(options):
    # bitsandbytes rounds absmax_code[a] * absmax_scale before adding the offset; a fused
    # multiply-add would round once. The interpreter never fuses, so this compiles the kernel
    # ahead of time for an H100/H200 with the launch's options and reads the PTX.
    import re

    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rpcompile.runtime.kernels import dequantize, programs

    programs._triton_kernels(interpret=True)  # binds the module's `tl`
    fn = triton.jit(programs._dequantize_4bit_kernel)
    signature = {"packed_ptr": "*u8", "code_ptr": "*fp32", "absmax_ptr": "*u8",
                 "absmax_code_ptr": "*fp32", "absmax_scale_ptr": "*fp32",
                 "absmax_offset_ptr": "*fp32", "out_ptr": "*bf16", "n": "i64",
                 "blocksize": "i32", "absmax_blocksize": "i32"}
    constants = {"BLOCK": 4096, "NESTED": True, "OUT_DTYPE": triton.language.bfloat16,
                 "OUT_IS_BF16": True}
    source = ASTSource(fn, signature | dict.fromkeys(constants, "constexpr"),
                       constexprs=constants)
    chosen = dequantize._DEQUANTIZE_OPTIONS if options == "launch" else {}
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=chosen).asm["ptx"]
    fused = re.findall(r"\bfma\.rn\.f32", ptx)
    assert bool(fused) == (options == "triton default")


# -- cost, stage figures, host figure and the host store ---------------------------------------


def _compiled(model):
    import rpcompile
    from tests.tiny_models import token_batch

    return rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                             device="virtual")


def test_cost_counts_packed_bytes_and_no_dequantized_activation(tmp_path_factory):
    # The same adapters over the fp32 base and over its NF4 copy: FLOPs and saved activations
    # are equal (a dequantized weight is a weight, not an activation); parameters are counted
    # at their dequantized size, and the layer's packed bytes are its bitsandbytes tensors'.
    import transformers as tf

    from rpcompile.passes.cost import annotate_costs

    quantized = quantized_model(tmp_path_factory, "nf4-double")
    root = _checkpoint(str(tmp_path_factory.getbasetemp() / "qwen3-fp32"))
    plain = tf.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    torch.manual_seed(1)
    plain = peft.get_peft_model(plain, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
        init_lora_weights=False)).base_model.model.train()
    q_units, p_units = annotate_costs(capture(quantized)), annotate_costs(capture(plain))
    for q, p in zip(q_units, p_units):
        assert (q.trainable_params, q.frozen_params) == (p.trainable_params, p.frozen_params)
        assert q.flops_at(2, 7) == p.flops_at(2, 7)
        assert q.bytes_at(2, 7)["saved"] == p.bytes_at(2, 7)["saved"]
        layer = q.name.startswith("model.layers.")
        weights = [m.weight for n, m in quantized.named_modules()
                   if isinstance(m, bnb.nn.Linear4bit) and n.startswith(q.name + ".")]
        assert len(weights) == (7 if layer else 0)
        assert q.packed_params == sum(w.quant_state.shape.numel() for w in weights)
        state_bytes = [w.nbytes + sum(t.nbytes for t in (
            w.quant_state.code, w.quant_state.absmax, w.quant_state.state2.code,
            w.quant_state.state2.absmax, w.quant_state.offset)) for w in weights]
        assert q.packed_bytes == sum(-(-b // 4) * 4 for b in state_bytes)
        assert p.packed_params == p.packed_bytes == 0


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_host_store_keeps_quantized_weights_packed_and_uploads_what_dequantizes(
        tmp_path_factory, kind):
    from bitsandbytes.functional import dequantize_4bit

    from rpcompile.passes.memory import host_memory
    from rpcompile.runtime import kernels
    from rpcompile.runtime.memory import HostStore

    model = quantized_model(tmp_path_factory, kind)
    compiled = _compiled(model)
    quantized = compiled.capture.quantized
    # What bitsandbytes trains with (fp32 compute), read before the store shares the tensors.
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            expected[f"{name}.weight"] = dequantize_4bit(module.weight, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            # Its training matmul on the identity reads the weight it multiplies by back.
            with torch.no_grad():
                expected[f"{name}.weight"] = module(torch.eye(module.in_features)).t()
    assert sorted(expected) == sorted(quantized)
    stage_params = [[(i.source, model.get_parameter(i.source)) for i in p.inputs
                     if i.kind == "param"] for p in compiled.stages]
    with pytest.raises(ValueError, match="kept packed only when given in packed="):
        HostStore.build(stage_params, grad_stages=[1, 2])
    store = HostStore.build(stage_params, grad_stages=[1, 2], packed=quantized)

    dense = sum(p.numel() for n, p in model.named_parameters() if n not in quantized)
    assert store.shadow.numel() == dense
    assert store.packed.nbytes == sum(w.packed_bytes for w in quantized.values())
    report = store.memory_report()
    for stage, buffers in zip(compiled.stages, store.stages):
        names = [i.source for i in stage.inputs if i.source in quantized]
        assert buffers.packed_layout.names == tuple(sorted(
            names, key=lambda n: store.packed_weights[n].packed.data_ptr()))
        # What a worker uploads: the stage's packed segments end to end.
        upload = torch.cat(list(buffers.packed)) if buffers.packed else torch.empty(
            0, dtype=torch.uint8)
        for name, weight in buffers.packed_views(upload.clone()).items():
            for backend in ("torch", "triton"):
                got = kernels.dequantize_packed(weight, torch.float32, backend=backend)
                assert torch.equal(got, expected[name]), (name, backend)
    # The plan's figures are the store's bytes: uploads per stage and the host's shadows.
    assert report.upload_bytes == tuple(st.weight_bytes for st in compiled.plan.stages)
    assert host_memory(compiled.plan, "sync").shadows == store.shadow.nbytes + store.packed.nbytes
    store.add_shadow_pair()  # async: a second copy of the trainable shadow (the adapters')
    assert host_memory(compiled.plan, "async").shadows == (
        store.shadow.nbytes + store.packed.nbytes + store.shadow_pair.nbytes)
    # The module's packed weights are views of the store's records: one copy on the host.
    lo, n = store.packed.data_ptr(), store.packed.nbytes
    for name in quantized:
        assert lo <= model.get_parameter(name).data_ptr() < lo + n


def test_paper_model_nf4_bytes_are_what_bitsandbytes_stores():
    import bitsandbytes.functional as BF

    from rpcompile.capture.quantized import PackedWeight, state_4bit
    from rpcompile.workloads.paper import MODELS, nf4_bytes

    for shape in [(300, 130), (64, 64), (7, 1000)]:
        packed, quant = BF.quantize_4bit(torch.randn(shape), blocksize=64, quant_type="nf4",
                                         compress_statistics=True)
        weight = PackedWeight("nf4", shape, packed, state_4bit(quant), 64, 256)
        assert nf4_bytes(shape[0] * shape[1]) == weight.packed_bytes
    model = MODELS["qwen3-235b-a22b"]
    with pytest.raises(ValueError, match="needs LoRA adapters"):
        type(model)(**{**model.__dict__, "lora_rank": 0, "base": "nf4"})
