"""Tiny models for tests: Hugging Face architectures built from configs (no hub), plus a
plain nn.Module with long skip connections. Hidden sizes stay <= 128 so CPU tests are fast."""

from __future__ import annotations

import torch
from torch import nn

ARCHS = ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gpt_oss", "qwen3_tied"]

_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager", use_cache=False,
)


def hf_model(arch: str, seed: int = 0, layers: int = 3, vocab_size: int = 128) -> nn.Module:
    """A tiny ``arch`` model (one of ARCHS) with seeded random weights; also used by
    benchmarks/gpu_check.py."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(_COMMON, num_hidden_layers=layers, vocab_size=vocab_size)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **kw))
    if arch == "qwen3_tied":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, tie_word_embeddings=True, **kw))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=8, **kw))
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **kw))
    if arch == "gpt_oss":
        kw = dict(kw, intermediate_size=32)
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, **kw))
    raise ValueError(arch)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class SkipNet(nn.Module):
    """A non-HF model whose layer 1 output feeds layer 5 (a long skip connection) and whose
    input embedding is read again by the head."""

    def __init__(self, width: int = 32, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        first = h
        skip = None
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                skip = h
            if i == len(self.blocks) - 2:
                h = h + skip
        return self.head(torch.cat([h, first], dim=-1))


def skipnet_batch(batch: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)


def token_batch(batch: int = 6, seq: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def eager_grads(model: nn.Module, batch, parts: int, loss_fn=None):
    """Loss and gradients of plain eager gradient accumulation over ``parts`` microbatches.

    A causal LM (``loss_fn`` None) is trained as Hugging Face's Trainer does it: each
    microbatch's loss is the sum of its token losses over the labelled tokens of the *whole*
    batch (``num_items_in_batch``), so the step's loss is the global token mean. A ``loss_fn``
    model averages per microbatch, then over microbatches. ``batch``: token ids, a dict
    (``input_ids``, ``labels``, ``attention_mask``), or a tuple for ``loss_fn`` models."""
    model.zero_grad(set_to_none=True)
    losses = []
    if loss_fn is None:
        batch = dict(batch) if isinstance(batch, dict) else {"input_ids": batch}
        batch.setdefault("labels", batch["input_ids"])
        items = (batch["labels"][:, 1:] != -100).sum()
        chunks = [dict(zip(batch, c)) for c in zip(*(t.tensor_split(parts) for t in batch.values()))]
        for chunk in chunks:
            loss = model(**chunk, num_items_in_batch=items, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        total = torch.stack(losses).sum()
    else:
        for chunk in zip(*(t.tensor_split(parts) for t in batch)):
            loss = loss_fn(model(*chunk[:-1]), chunk[-1])
            (loss / parts).backward()
            losses.append(loss.detach())
        total = torch.stack(losses).sum() / parts
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def eager_batch_grads(model: nn.Module, batch: dict):
    """``model(**batch).loss`` on the whole batch at once, and its gradients: what a user
    calls eager training (Hugging Face's token mean over the batch)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def sft_batch(batch: int = 7, seq: int = 12, left: bool = False, seed: int = 1,
              vocab: int = 128) -> dict[str, torch.Tensor]:
    """A supervised fine-tuning batch: each sequence has random padding (``left`` or right,
    ``attention_mask`` 0, label -100, pad id 0) and a random prompt whose labels are -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for i in range(batch):
        pad = int(torch.randint(0, seq // 2, (1,), generator=g))
        prompt = int(torch.randint(1, seq // 2, (1,), generator=g))
        if left:
            mask[i, :pad] = 0
            labels[i, : pad + prompt] = -100
        else:
            if pad:
                mask[i, seq - pad :] = 0
                labels[i, seq - pad :] = -100
            labels[i, :prompt] = -100
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
