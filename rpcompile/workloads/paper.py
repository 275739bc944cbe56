"""The RoundPipe paper's five workloads as data: model shapes, measured per-layer times, batches.

Sections, in reading order:
  1. PaperModel   - one model: its shape (parameter and activation bytes follow from it) and
                    the per-layer times measured on one RTX 4090 for a 4 x 2048-token microbatch
  2. MODELS       - the five models (figures from the RoundPipe paper, arXiv 2604.27085)
  3. Workload     - the paper's training setups (global batch, microbatches, rounds)
  4. RoundPipe's own Qwen3-1.7B plan and its artifact's bubbles; the hop-time hardware

``PaperModel.units(b, s)`` turns a model into the ``UnitProfile`` list the partitioner and the
simulator read: a prefix unit (embedding), one unit per decoder layer, and the tail (final norm,
LM head and loss). Times scale linearly with the tokens in a microbatch (the table was measured
at 4 x 2048 tokens; attention's quadratic part is ignored, a few percent at 2048).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rpcompile.errors import InvalidInput
from rpcompile.ir import UnitProfile
from rpcompile.passes.chunked_loss import chunk_element_bytes

__all__ = [
    "MODELS", "PAPER_MODELS", "ROUNDPIPE_QWEN3_1_7B", "ROUNDPIPE_QWEN3_1_7B_BUBBLES", "WORKLOADS",
    "PaperModel", "Workload", "get_model", "hop_hardware", "roundpipe_qwen3_1_7b_plan",
]

# The table's microbatch: 4 sequences of 2048 tokens.
_TABLE_TOKENS = 4 * 2048
# We assume the tail computes its loss in token chunks of this size (logits of a whole
# 26k-token microbatch over a 150k vocabulary would not fit a 24 GB GPU otherwise).
_LOSS_CHUNK_TOKENS = 4096
_BF16_BYTES, _FP32_BYTES = 2, 4
# Bytes per token x vocabulary element of a tail that keeps its whole logits.
_WHOLE_LOGITS_BYTES = 6


# --------------------------------------------------------------------------------------------
# 1. PaperModel
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaperModel:
    """A decoder-only LM of the paper's evaluation, by shape and measured per-layer times.

    Dense layers: attention q, k, v, o (+ q/k norms for Qwen3), a 3-matrix gated MLP, two
    RMSNorms. MoE layers (``experts`` > 0): the same attention, ``experts`` gated experts of
    width ``ffn`` each, and a linear router. ``lora_rank`` > 0 means LoRA adapters on every
    linear layer of the decoder (attention, every expert's three matrices, the router; not the
    LM head, as PEFT's ``all-linear``): trainable parameters are the adapters only.
    ``base="nf4"`` (LoRA only): the frozen decoder linears (attention and every expert's or
    the MLP's matrices; not the router, the embedding or the LM head) are bitsandbytes NF4
    with double-quantized absmax (:func:`nf4_bytes`), kept and uploaded packed and dequantized
    to bf16 on the GPU (UnitProfile.packed_params, packed_bytes).
    Times (ms) are per layer for one microbatch of 4 x 2048 tokens on one RTX 4090;
    ``backward_ms`` excludes the recompute of the forward.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width, or one expert's width for MoE
    vocab: int
    forward_ms: float
    backward_ms: float
    head_forward_ms: float
    head_backward_ms: float
    hop_ms: float  # one activation moving between two GPUs through the host
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 0
    qk_norm: bool = False
    attention_bias: bool = False  # GPT-OSS: biases on q, k, v, o and on the experts
    lora_rank: int = 0
    base: str = "bf16"  # "bf16" | "nf4": how the frozen base's decoder linears are kept

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise InvalidInput(f"base must be one of {BASES}, got {self.base!r}")
        if self.base != "bf16" and not self.lora_rank:
            raise InvalidInput(f"{self.name}: a {self.base} base is frozen, so it needs LoRA "
                             "adapters (lora_rank > 0); full fine-tuning of a quantized base "
                             "is not supported")

    # -- parameters ----------------------------------------------------------------------
    def _linears(self, part: str = "layer") -> list[tuple[int, int, int]]:
        """(in, out, count) of every linear layer in one decoder layer (``part``: ``"layer"``,
        or only its ``"attention"`` or ``"mlp"`` block)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.hidden
        attn = [(h, q, 1), (h, kv, 1), (h, kv, 1), (q, h, 1)]
        if self.experts:
            mlp = [(h, self.ffn, self.experts), (h, self.ffn, self.experts),
                   (self.ffn, h, self.experts), (h, self.experts, 1)]
        else:
            mlp = [(h, self.ffn, 1), (h, self.ffn, 1), (self.ffn, h, 1)]
        return {"layer": attn + mlp, "attention": attn, "mlp": mlp}[part]

    def layer_params(self, part: str = "layer") -> int:
        """Base parameters of one decoder layer (weights, biases, norms), or of its attention
        block (with the input norm) or MLP block (with the post-attention norm)."""
        if part == "layer":
            return self.layer_params("attention") + self.layer_params("mlp")
        total = sum(i * o * n for i, o, n in self._linears(part))
        total += self.hidden  # the block's RMSNorm
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if part == "attention":
            if self.qk_norm:
                total += 2 * self.head_dim
            if self.attention_bias:
                total += q + 2 * kv + self.hidden + self.heads  # q,k,v,o biases + attention sinks
        elif self.attention_bias:
            total += self.experts * (2 * self.ffn + self.hidden) + self.experts  # expert, router biases
        return total

    def layer_packed(self, part: str = "layer") -> tuple[int, int]:
        """(elements, bytes) of one layer's (or block's) quantized weights: (0, 0) for a bf16
        base. The router stays bf16, as bitsandbytes leaves small linears the config skips."""
        if self.base == "bf16":
            return 0, 0
        weights = [(i * o, n) for i, o, n in self._linears(part) if o != self.experts]
        return (sum(e * n for e, n in weights), sum(nf4_bytes(e) * n for e, n in weights))

    def layer_lora_params(self, part: str = "layer") -> int:
        """LoRA adapter parameters of one decoder layer or block (0 without LoRA)."""
        return sum(self.lora_rank * (i + o) * n for i, o, n in self._linears(part))

    def attention_share(self, seq_len: int) -> float:
        """The attention block's share of a layer's FLOPs at ``seq_len`` (the rest is the MLP).

        Per token: 2 x in x out for each linear layer (top_k experts and the router for MoE)
        and 4 x (heads x head_dim) x seq_len / 2 for the causal score and value products (a
        query sees half the sequence on average; sliding windows are not modelled, which
        overstates GPT-OSS's attention a little). Norms, rotary and activations are ignored.
        """
        def flops(part: str) -> int:  # a token passes top_k of the experts
            return sum(2 * i * o * (1 if n == 1 else self.top_k)
                       for i, o, n in self._linears(part))

        attn = flops("attention") + 2 * self.heads * self.head_dim * seq_len
        mlp = flops("mlp")
        return attn / (attn + mlp)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm + LM head (the LM head is the embedding matrix when tied)."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def params(self) -> int:
        """All base parameters of the model, tied matrices counted once."""
        return self.embedding_params + self.layers * self.layer_params() + self.head_params

    def trainable_params(self) -> int:
        if self.lora_rank:
            return self.layers * self.layer_lora_params()
        return self.params()

    # -- activations and times -----------------------------------------------------------
    def activation_bytes(self, tokens: int) -> int:
        """The hidden state between two layers, bf16."""
        return tokens * self.hidden * 2

    def _layer_working_bytes(self, tokens: int, part: str = "layer") -> int:
        """bf16 values one layer (or block) keeps for its backward, plus its largest transient:
        the normalised inputs, q/k/v, the attention output, and the MLP's gate/up/act/down
        inputs (for MoE, top_k experts' worth per token). Flash attention: nothing quadratic
        in s."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        width = self.top_k * self.ffn if self.experts else self.ffn
        per_token = {"attention": 2 * self.hidden + 2 * q + 2 * kv,
                     "mlp": 2 * self.hidden + 4 * width}
        per_token["layer"] = per_token["attention"] + per_token["mlp"]
        return tokens * per_token[part] * 2

    def hop_ms_at(self, tokens: int) -> float:
        return self.hop_ms * tokens / _TABLE_TOKENS

    def units(self, microbatch_size: float = 4, seq_len: int = 2048, *,
              split_layers: bool = False,
              loss_chunk_tokens: int | None = _LOSS_CHUNK_TOKENS) -> tuple[UnitProfile, ...]:
        """Prefix (embedding), one unit per layer, tail (final norm + LM head + loss).

        ``split_layers``: two units per layer instead, its attention block (``layers.i.self_attn``,
        with the input norm) and its MLP block (``layers.i.mlp``, with the post-attention norm),
        the layer's measured times shared by :meth:`attention_share` (the table measured whole
        layers only). Units of one layer share ``group``, so the partitioner also tries cuts
        between whole layers. Only the residual stream crosses a cut between the two blocks.
        (``rpcompile.compile`` can be given such units with ``units=[...]`` naming each layer's
        attention and MLP modules; by default it cuts between layers.)

        ``loss_chunk_tokens``: the tail's working set holds the logits of this many tokens at
        a time (RoundPipe's chunked LM head and loss, and rpcompile's chunk-loss rewrite);
        ``None``: of the whole microbatch (a tail that rewrite does not apply to).

        ``microbatch_size`` may be fractional: the paper splits e.g. 128 sequences into 10
        microbatches, and times scale with the mean tokens per microbatch. The embedding
        lookup and its gradient were not measured; they are taken as free (a gather and a
        scatter-add, well under 1% of a layer). With tied embeddings the prefix owns the
        matrix and the tail borrows it (``UnitProfile.borrowed``): a stage with the tail
        uploads it and returns a gradient for it, the host holds it once.
        """
        tokens = microbatch_size * seq_len
        scale = tokens / _TABLE_TOKENS
        itokens = math.ceil(tokens)
        act = self.activation_bytes(itokens)
        lora = bool(self.lora_rank)
        emb = self.embedding_params
        # Rotary cos/sin (bf16) computed once in the prefix and read by every layer.
        rotary = itokens * self.head_dim * 2 * 2
        prefix = UnitProfile(
            name="prefix", forward_ms=0.0, backward_ms=0.0,
            trainable_params=0 if lora else emb, frozen_params=emb if lora else 0,
            output_bytes=act, shared_bytes=rotary, working_bytes=act,
        )
        parts = (("attention", ".self_attn"), ("mlp", ".mlp")) if split_layers else (("layer", ""),)
        share = {"layer": 1.0}
        if split_layers:
            share["attention"] = self.attention_share(seq_len)
            share["mlp"] = 1.0 - share["attention"]
        layer_units = []
        for i in range(self.layers):
            for part, suffix in parts:
                base, adapters = self.layer_params(part), self.layer_lora_params(part)
                packed_params, packed_bytes = self.layer_packed(part)
                layer_units.append(UnitProfile(
                    name=f"layers.{i}{suffix}", forward_ms=self.forward_ms * scale * share[part],
                    backward_ms=self.backward_ms * scale * share[part],
                    trainable_params=adapters if lora else base, frozen_params=base if lora else 0,
                    output_bytes=act, working_bytes=self._layer_working_bytes(itokens, part),
                    group=f"layers.{i}" if split_layers else "",
                    packed_params=packed_params, packed_bytes=packed_bytes,
                ))
        # The tail's own parameters: the final norm, and the LM head unless it is the
        # embedding. A tied head borrows the prefix's matrix (unit 0), as the capture marks a
        # tied HF model (rpcompile.compiler.profiles._borrowed_params): a stage holding the
        # tail but not the prefix still uploads it and returns its gradient, but it is one
        # parameter on the host (one master, one optimizer state, one shadow).
        head = self.head_params
        borrowed = ((0, emb, not lora),) if self.tied_embeddings else ()
        if loss_chunk_tokens is None:
            # bf16 logits of the whole microbatch and their fp32 gradient, plus the normalised
            # input (autograd's own linear + cross entropy; not re-measured).
            logits_bytes = itokens * self.vocab * _WHOLE_LOGITS_BYTES
        else:
            # The chunked kernel (rpcompile/passes/chunked_loss.py) in bf16: one chunk's fp32
            # softmax buffer and the bf16 copy it is cast from or to, forward or backward, and a
            # trainable head's fp32 gradient accumulator (measured: tests/passes/test_chunked_loss.py).
            chunk = min(itokens, loss_chunk_tokens)
            logits_bytes = chunk * self.vocab * chunk_element_bytes(_BF16_BYTES)
            if not lora:
                logits_bytes += _FP32_BYTES * self.vocab * self.hidden
        tail = UnitProfile(
            name="tail", forward_ms=self.head_forward_ms * scale,
            backward_ms=self.head_backward_ms * scale,
            trainable_params=0 if lora else head, frozen_params=head if lora else 0,
            output_bytes=0,
            working_bytes=logits_bytes + 2 * act, borrowed=borrowed,
        )
        return (prefix, *layer_units, tail)


BASES = ("bf16", "nf4")


def nf4_bytes(elements: int, blocksize: int = 64, absmax_blocksize: int = 256) -> int:
    """Host and upload bytes of one NF4 weight of ``elements`` with double-quantized absmax,
    as bitsandbytes stores it (rpcompile.capture.quantized.PackedWeight): two codes a byte, one
    uint8 absmax per ``blocksize`` weights, one fp32 scale per ``absmax_blocksize`` absmax,
    the 16-value code table, the 256-value absmax table and the fp32 offset, in whole 4-byte
    words."""
    blocks = -(-elements // blocksize)
    raw = (-(-elements // 2) + blocks + 4 * -(-blocks // absmax_blocksize) + 4 * 16
           + 4 * 256 + 4)
    return -(-raw // 4) * 4


# --------------------------------------------------------------------------------------------
# 2. MODELS
# --------------------------------------------------------------------------------------------

_MODEL_LIST = (
    PaperModel("qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128,
               ffn=6144, vocab=151936, forward_ms=7.43, backward_ms=15.83,
               head_forward_ms=22.07, head_backward_ms=43.71, hop_ms=1.6,
               tied_embeddings=True, qk_norm=True),
    PaperModel("llama3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
               ffn=14336, vocab=128256, forward_ms=18.50, backward_ms=41.21,
               head_forward_ms=37.23, head_backward_ms=74.50, hop_ms=3.2),
    PaperModel("gpt-oss-20b", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64,
               ffn=2880, vocab=201088, forward_ms=21.64, backward_ms=81.78,
               head_forward_ms=44.29, head_backward_ms=86.26, hop_ms=2.25,
               experts=32, top_k=4, attention_bias=True),
    PaperModel("qwen3-32b", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128,
               ffn=25600, vocab=151936, forward_ms=40.56, backward_ms=91.17,
               head_forward_ms=54.93, head_backward_ms=108.29, hop_ms=4.0, qk_norm=True),
    PaperModel("qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128,
               ffn=1536, vocab=151936, forward_ms=43.02, backward_ms=58.38,
               head_forward_ms=42.44, head_backward_ms=43.29, hop_ms=3.2,
               experts=128, top_k=8, qk_norm=True, lora_rank=32),
)
MODELS: dict[str, PaperModel] = {m.name: m for m in _MODEL_LIST}
PAPER_MODELS: tuple[str, ...] = tuple(MODELS)


def get_model(name: str) -> PaperModel:
    if name not in MODELS:
        raise InvalidInput(f"unknown paper model {name!r}; known: {', '.join(PAPER_MODELS)}")
    return MODELS[name]


# --------------------------------------------------------------------------------------------
# 3. Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One training setup: ``global_batch`` sequences of ``seq_len`` per optimizer step, cut
    into ``rounds`` accumulation rounds of ``microbatches`` microbatches each."""

    model: str
    global_batch: int
    microbatches: int
    rounds: int
    seq_len: int = 2048

    @property
    def microbatch_size(self) -> float:
        """Mean sequences per microbatch (the paper's splits are not always whole)."""
        return self.global_batch / (self.microbatches * self.rounds)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


# Global batches 512/256/128/128/64; 10 microbatches per round (16 for GPT-OSS). REFERENCE.md
# lists rounds as "4/2/1/2" for five models; we read them as 1.7B: 4, 8B: 2, GPT-OSS: 1,
# 32B: 2, and give 235B one round (64 sequences in 10 microbatches is already 6.4 per
# microbatch, like 32B's 128 / (2 x 10)).
WORKLOADS: dict[str, Workload] = {
    w.model: w for w in (
        Workload("qwen3-1.7b", global_batch=512, microbatches=10, rounds=4),
        Workload("llama3.1-8b", global_batch=256, microbatches=10, rounds=2),
        Workload("gpt-oss-20b", global_batch=128, microbatches=16, rounds=1),
        Workload("qwen3-32b", global_batch=128, microbatches=10, rounds=2),
        Workload("qwen3-235b-a22b", global_batch=64, microbatches=10, rounds=1),
    )
}


# --------------------------------------------------------------------------------------------
# 4. RoundPipe's own plan (the artifact's simulator input)
# --------------------------------------------------------------------------------------------

# RoundPipe's partition of Qwen3-1.7B (units: prefix, 28 layers, tail), as build_plan bounds:
# forward stages of 7 layers (the prefix rides with the first); backward the LM head alone,
# eight stages of 3 layers, then 2 and 2 layers with the prefix in the last.
ROUNDPIPE_QWEN3_1_7B = {
    "forward_bounds": (0, 8, 15, 22),
    "backward_bounds": (0, 3, 5, 8, 11, 14, 17, 20, 23, 26),
    "tail_start": 29,
}
# The artifact's simulator on that plan (8 GPUs, 16 microbatches of 4 x 2048, the paper's
# layer times): an isolated synchronous step and the asynchronous steady state, bubble %.
ROUNDPIPE_QWEN3_1_7B_BUBBLES = {"sync": 19.07, "fill": 7.51, "drain": 7.51, "steady": 4.05,
                                "async": 4.05}


def hop_hardware(model: PaperModel, microbatch_tokens: int = _TABLE_TOKENS):
    """RTX 4090 x 8 as the paper's simulator sees it: links that move one activation D2H +
    H2D in the table's hop time, no DMA latency, host memory bandwidth not a limit."""
    from dataclasses import replace

    from rpcompile.hardware import get_hardware

    link = 2 * model.activation_bytes(microbatch_tokens) / (model.hop_ms * 1e-3) / 1e9
    return replace(get_hardware("rtx4090x8"), name=f"rtx4090x8-hop{model.hop_ms:g}ms",
                   h2d_gbps=link, d2h_gbps=link, transfer_latency_us=0.0, host_mem_gbps=1e6)


def roundpipe_qwen3_1_7b_plan(hardware=None, workers: int = 8, microbatches: int = 16):
    """RoundPipe's own Qwen3-1.7B partition (ROUNDPIPE_QWEN3_1_7B) as a Plan, for
    microbatches of 4 x 2048 tokens on ``hardware`` (default: :func:`hop_hardware`)."""
    from rpcompile.planner.partition import build_plan

    model = MODELS["qwen3-1.7b"]
    hw = hardware or hop_hardware(model)
    b = ROUNDPIPE_QWEN3_1_7B
    return build_plan(model.units(4, 2048), b["forward_bounds"], b["backward_bounds"],
                      b["tail_start"], hw, workers, microbatches, 4, 2048,
                      notes=("RoundPipe's own partition (its artifact)",))
