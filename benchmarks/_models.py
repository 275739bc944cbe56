"""The small Qwen3 the CPU benchmarks time (sync_updates, runtime_overhead, sharded_memory):
one definition, so their figures are of the same model."""

from __future__ import annotations

import torch


def qwen3(hidden: int, layers: int, *, tied: bool = False):
    """A seeded Qwen3 causal LM: ``hidden`` wide, ``layers`` deep, a 512-token vocabulary,
    64-wide heads; ``tied``: the LM head shares the embedding."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), head_dim=64, use_cache=False,
        tie_word_embeddings=tied, attn_implementation="sdpa",
    )
    return tf.Qwen3ForCausalLM(cfg)
