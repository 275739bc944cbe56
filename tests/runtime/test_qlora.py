"""QLoRA trains end to end: a bitsandbytes-quantized base, kept packed on the host, uploaded
packed and rebuilt on each worker, under trainable PEFT LoRA adapters.

Every comparison is with eager PEFT + bitsandbytes on the CPU over the same global batches:
the model is loaded twice the Hugging Face way (a tiny fp32 checkpoint reloaded with
``BitsAndBytesConfig``, fp32 compute so the numerics are testable, then
``peft.get_peft_model``), one copy trained by rpcompile on virtual workers with chaos delays,
the other by eager autograd and ``torch.optim.SGD``, its ``lora_dropout`` calls made to apply
the masks the runtime drew (tests/capture/test_dropout.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.capture.dropout import record_masks
from rpcompile.options import TrainOptions
from rpcompile.runtime.trainer import Trainer
from tests.capture.test_dropout import _eager_dropout_uses, _full_masks
from tests.capture.test_quantized import CONFIGS as QUANTIZED
from tests.tiny_models import hf_model, sft_batch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
# bitsandbytes warns once that it cannot reach an optional CPU kernel hub; its fallback is used.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

CONFIGS = {k: QUANTIZED[k] for k in ("nf4-double", "nf4", "int8")}
LR = 0.5


def _checkpoint(tmp_path_factory, arch: str) -> str:
    root = tmp_path_factory.getbasetemp() / f"{arch}-fp32"
    if not root.exists():
        hf_model(arch, layers=2).save_pretrained(root)
    return str(root)


def _qlora(root: str, kind: str, seed: int = 1):
    """The checkpoint at ``root`` loaded with bitsandbytes ``kind`` (fp32 compute), with
    seeded non-zero LoRA adapters (dropout 0.1) on every quantized linear. (A MoE's experts
    are 3-D parameters, not linears: bitsandbytes leaves them as they are, and PEFT refuses
    dropout on adapters over parameters.)"""
    import transformers as tf

    config = tf.BitsAndBytesConfig(**CONFIGS[kind], bnb_4bit_compute_dtype=torch.float32)
    model = tf.AutoModelForCausalLM.from_pretrained(root, quantization_config=config,
                                                    dtype=torch.float32)
    torch.manual_seed(seed)
    targets = sorted({n.rsplit(".", 1)[-1] for n in _quantized(model)})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1,
                           init_lora_weights=False)
    return peft.get_peft_model(model, lora).base_model.model.train()


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _compile(model, batch):
    return rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=batch, optimizer=_sgd,
                             device="virtual", train=TrainOptions(chaos=3))


def _eager_step(eager, optimizer, compiled, batch, records, step):
    masks, _ = _full_masks(compiled, batch, records, step=step)
    optimizer.zero_grad()
    with _eager_dropout_uses(masks):
        loss = eager(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def _quantized(model) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


@pytest.mark.parametrize(("arch", "kind"), [("qwen3", "nf4-double"), ("llama", "nf4"),
                                            ("qwen3_moe", "nf4"), ("qwen3", "int8")])
def test_qlora_trains_like_eager_peft_bitsandbytes(tmp_path_factory, tmp_path, arch, kind):
    # Steps 0 and 1 on one trainer; step 2 on a new one, built from a fresh load (other
    # adapter values) and resumed from the first one's checkpoint.
    root = _checkpoint(tmp_path_factory, arch)
    model, eager = _qlora(root, kind), _qlora(root, kind)
    assert _quantized(model)
    eager_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=LR)
    batches = [sft_batch(6, 12, seed=s) for s in (4, 5, 6)]
    compiled = _compile(model, batches[0])
    assert compiled.capture.quantized and any(st.packed for st in compiled.trainer().store.stages)
    try:
        for step in (0, 1):
            with record_masks() as records:
                loss = compiled.step(batches[step])
            eager_loss = _eager_step(eager, eager_opt, compiled, batches[step], records, step)
            torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-6)
        compiled.save_checkpoint(tmp_path / "ckpt")
    finally:
        compiled.close()
    # The frozen base is not in the checkpoint: only the adapters' masters (and RNG).
    from safetensors import safe_open

    with safe_open(tmp_path / "ckpt" / "state.safetensors", "pt") as f:
        saved = {k.split("/", 1)[1] for k in f.keys() if k.startswith(("master/", "shadow/"))}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert saved == trainable

    resumed = _compile(_qlora(root, kind, seed=7), batches[0])
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        with record_masks() as records:
            loss = resumed.step(batches[2])
        eager_loss = _eager_step(eager, eager_opt, resumed, batches[2], records, 2)
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-6)
        masters = resumed.trainer().masters()
        assert set(masters) == trainable
        for name, p in eager.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=name)
    finally:
        resumed.close()


def test_rebuilt_weights_stay_within_the_proven_peak(tmp_path_factory):
    # Each worker is given exactly its proven peak. The rebuilt weights are accounted (the
    # worker allocates them), from a job's first compute to its EVICT: a worker's measured
    # peak passes the proof without working sets (held) by at most one stage's rebuilt
    # weights, and never the proven peak, over steps that overlap as a stream runs them.
    root = _checkpoint(tmp_path_factory, "qwen3")
    model = _qlora(root, "nf4-double")
    batches = [sft_batch(8, 12, seed=s) for s in range(4)]
    compiled = rpcompile.compile(model, gpus=3, microbatches=4, example_inputs=batches[0],
                                 optimizer=_sgd, device="virtual")
    proven = compiled.memory
    capacity = max(p.peak_bytes for p in proven)
    trainer = Trainer(compiled, train=replace(compiled.options.train, optimizer=_sgd,
                                              device="virtual", chaos=5),
                      plan=replace(compiled.options.plan, capacity_bytes=capacity))
    try:
        results = list(trainer.fit(batches))
        assert len(results) == 4
        store = trainer.store
        rebuilt = max(sum(w.dequantized_bytes(torch.float32) for w in st.formats.values())
                      for st in store.stages)
        assert rebuilt > 0
        measured = trainer.peak_bytes()
        held = trainer.predicted_peak_bytes(held=True)
        for w, got in enumerate(measured):
            assert held[w] < got <= held[w] + rebuilt, (w, got, held[w], rebuilt)
            assert got <= trainer.predicted_peak_bytes()[w]
    finally:
        trainer.close()
