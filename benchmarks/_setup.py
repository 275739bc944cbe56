"""Setup shared by the runtime benchmarks (``sync_updates.py``, ``async_updates.py``,
``runtime_overhead.py``): the small Qwen3 they time, its batches and their optimizer.
Not a benchmark itself."""

from __future__ import annotations

import torch


def small_qwen3(hidden: int, layers: int):
    """A seeded Qwen3 of ``layers`` decoder layers of width ``hidden`` (vocabulary 512)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), head_dim=64, use_cache=False,
        attn_implementation="sdpa",
    )
    return tf.Qwen3ForCausalLM(cfg)


def token_batches(count: int, batch: int, seq: int) -> list[torch.Tensor]:
    """``count`` seeded batches of random token ids, ``[batch, seq]`` each."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (batch, seq), generator=gen) for _ in range(count)]


def adamw(params):
    """The benchmarks' optimizer: fused AdamW at lr 1e-4."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True)
