"""Chunked LM-head loss: the fused tail never holds a microbatch's full logits.

A causal LM's loss is ``cross_entropy(linear(hidden, lm_head.weight).float(), labels)``: its
``[tokens, vocab]`` logits (fp32 for the loss) are the largest tensor of a long-sequence step
(4 x 2,048 tokens x 151,936 vocabulary = 5 GB; 73K tokens, 22 GB in bf16). This pass rewrites
that pattern in the captured graph to :func:`linear_cross_entropy`, which computes the loss
``chunk`` tokens at a time: the forward keeps only each token's log-sum-exp, the backward
recomputes one chunk's logits at a time to form its gradient (softmax minus one-hot), then the
chunk's input and weight gradients. Peak memory of the head and loss falls from the whole
logits (plus their gradient) to one chunk's: :func:`chunk_element_bytes` per chunk x vocabulary
element (4 in fp32, 6 in bf16), forward and backward, plus a narrower trainable weight's fp32
gradient accumulator; the price is one more head matmul in backward.

The rewrite only matches the plain pattern (no bias, no logit soft-capping or scaling between
the head and the loss, no label smoothing, no class weights); anything else stays as captured.
The result equals the unchunked loss up to floating-point summation order (tests hold it within
1e-6 in fp32), so it is used only where the memory is needed (``compile(loss_chunk_tokens=)``).

**Token hits.** :func:`count_token_hits` gives the graph a second output beside the loss: how
many labelled tokens (target != ignore_index) have their label as the argmax of their logits,
the numerator of the token accuracy a step logs. It is counted where the logits are: over the
whole logits the captured loss holds, or chunk by chunk inside :func:`linear_cross_entropy`
(``count_hits=True``), so the logits never exist whole for it either. The count reads the
logits and changes nothing the loss computes; its tensors are a token-long integer vector or
less, per chunk in the chunked form.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from rpcompile.capture.dropout import emit_like
from rpcompile.errors import InvalidInput

__all__ = ["SOFTMAX_BYTES", "TOKEN_HITS", "chunk_element_bytes", "chunk_lm_loss",
           "count_token_hits", "linear_cross_entropy", "logits_bytes"]

_CE = torch.ops.aten.cross_entropy_loss.default
_LINEAR = torch.ops.aten.linear.default
_PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
                 torch.ops.aten._to_copy.default, torch.ops.aten.contiguous.default,
                 torch.ops.aten.alias.default}
_CHECK = torch.ops.aten._assert_tensor_metadata.default
# The name of the graph's second output (the tail stage's, rpcompile.passes.split).
TOKEN_HITS = "correct_tokens"


# Bytes the kernel holds per chunk x vocabulary element, besides its inputs, saved values and
# returned gradients (measured: tests/passes/test_chunked_loss.py::
# test_the_kernels_measured_peak_is_what_the_cost_model_charges, live tensor storages, forward and
# backward separately). The softmax runs in fp32 on the logits rounded to the working dtype, as
# ``cross_entropy(logits.float())`` does: a chunk's fp32 logits (4 bytes), and while a narrower
# working dtype is cast to or from them, its copy too (2 more for bf16/fp16). Every step after
# the matmul works in place on that one fp32 buffer, and each chunk's buffers are freed before
# the next chunk's matmul, so no two chunks are ever live together.
SOFTMAX_BYTES = 4


def chunk_element_bytes(elem: int) -> int:
    """Peak bytes per chunk x vocabulary element, forward and backward alike, for a working
    dtype of ``elem`` bytes: the fp32 softmax buffer, plus the working-dtype copy it is cast
    from (the matmul's output) or to (the gradient fed to the backward matmuls)."""
    return SOFTMAX_BYTES + (elem if elem < SOFTMAX_BYTES else 0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, chunk, mean, count_hits):
        valid = target != ignore_index
        safe = torch.where(valid, target, 0).unsqueeze(1)  # any in-range index for ignored rows
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        hits = torch.zeros((), dtype=torch.int64, device=x.device)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _fp32_logits(x[rows], weight)
            picked = logits.gather(1, safe[rows]).squeeze(1)
            if count_hits:  # before the softmax below works in place on the logits
                hits += ((logits.argmax(dim=1) == target[rows]) & valid[rows]).sum()
            top = logits.amax(dim=1, keepdim=True)
            top.masked_fill_(top.isinf(), 0.0)  # a row of -inf logits: as torch.logsumexp
            lse_rows = lse[rows]
            torch.sum(logits.sub_(top).exp_(), dim=1, out=lse_rows)
            lse_rows.log_().add_(top.squeeze(1))
            del logits, top
            total += ((lse_rows - picked) * valid[rows]).sum()
        count = valid.sum()
        ctx.save_for_backward(x, weight, target, lse, count)
        ctx.chunk, ctx.mean, ctx.ignore_index = chunk, mean, ignore_index
        ctx.mark_non_differentiable(hits)
        return total / count if mean else total, hits

    @staticmethod
    def backward(ctx, grad, _hits):
        x, weight, target, lse, count = ctx.saved_tensors
        scale = grad / count if ctx.mean else grad
        valid = target != ctx.ignore_index
        safe = torch.where(valid, target, 0).unsqueeze(1)
        row_scale = (valid * scale).to(torch.float32).unsqueeze(1)  # 0 for ignored tokens
        minus_one = torch.full((min(ctx.chunk, x.shape[0]), 1), -1.0, dtype=torch.float32,
                               device=x.device)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if need_x else None
        # The weight gradient sums over chunks in fp32 (an accumulator the size of the weight when
        # the weight is narrower; for an fp32 weight it is the gradient itself).
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, x.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            xr = x[rows]
            probs = _fp32_logits(xr, weight)
            probs.sub_(lse[rows].unsqueeze(1)).exp_()  # softmax, in place
            probs.scatter_add_(1, safe[rows], minus_one[:probs.shape[0]])  # minus one-hot
            probs.mul_(row_scale[rows])
            g = probs.to(x.dtype)  # the same buffer for fp32
            del probs  # a narrower working dtype: only its gradient copy stays
            if need_x:
                torch.mm(g, weight, out=gx[rows])
            if need_w:
                if gw.dtype == g.dtype:
                    gw.addmm_(g.t(), xr)
                else:
                    # The chunk's product in the working dtype, by blocks of vocabulary rows that
                    # fit the fp32 buffer just freed (room for a cast of each block, too): one
                    # block while hidden <= 2/3 of the chunk (Qwen3-1.7B at 4,096 tokens), two
                    # for Llama-3.1-8B or Qwen3-32B there, never a weight-sized temporary.
                    block = max(1, SOFTMAX_BYTES * g.numel() // (6 * weight.shape[1]))
                    for v in range(0, gw.shape[0], block):
                        gw[v:v + block] += g[:, v:v + block].t() @ xr
            del g  # (no view of it may outlive the chunk: it would keep the buffer)
        return gx, None if gw is None else gw.to(weight.dtype), None, None, None, None, None


def _fp32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(x @ weight.T).float()``: rounded to the working dtype, as the captured loss rounds them,
    then one fp32 buffer (the working-dtype copy is freed on return)."""
    return (x @ weight.t()).float()


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int, chunk: int, reduction: int,
                         count_hits: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``cross_entropy((x @ weight.T).float(), target, reduction=...)`` computed ``chunk`` rows
    at a time (``reduction``: aten's enum, 1 mean, 2 sum). ``x``: ``[tokens, hidden]``.
    ``count_hits``: return ``(loss, hits)``, hits the int64 count of tokens with a target
    (not ``ignore_index``) whose logits' argmax is that target."""
    loss, hits = _LinearCrossEntropy.apply(x, weight, target, ignore_index, chunk,
                                           reduction == 1, count_hits)
    return (loss, hits) if count_hits else loss


def logits_bytes(captured, tokens: int) -> int:
    """Bytes of the fp32 logits the captured loss would hold for ``tokens`` tokens."""
    vocab = getattr(getattr(captured.model, "config", None), "vocab_size", 0) or 0
    return 4 * tokens * int(vocab)


def chunk_lm_loss(gm: fx.GraphModule, chunk: int) -> int:
    """Rewrite each ``cross_entropy(linear(x, W) [.float().view(-1, V)], target)`` of ``gm`` to
    :func:`linear_cross_entropy` with ``chunk`` tokens per chunk; returns how many."""
    if chunk < 1:
        raise InvalidInput(f"loss_chunk_tokens must be a positive number of tokens, got {chunk}")
    done = 0
    for ce in list(gm.graph.find_nodes(op="call_function", target=_CE)):
        match = _match(ce)
        if match is None:
            continue
        linear, chain = match
        x, weight = linear.args[0], linear.args[1]
        hidden = int(weight.meta["val"].shape[1])
        reduction = ce.args[3] if len(ce.args) > 3 else ce.kwargs.get("reduction", 1)
        ignore = ce.args[4] if len(ce.args) > 4 else ce.kwargs.get("ignore_index", -100)
        with gm.graph.inserting_before(ce):
            flat = emit_like(gm, ce, torch.ops.aten.reshape.default, (x, [-1, hidden]))
            new = gm.graph.call_function(
                linear_cross_entropy, (flat, weight, ce.args[1], ignore, chunk, reduction))
        new.meta.update({k: v for k, v in ce.meta.items() if k != "val"})
        new.meta["val"] = ce.meta["val"]
        ce.replace_all_uses_with(new)
        gm.graph.erase_node(ce)
        for node in [*chain, linear]:  # the logits chain, now unread
            for check in [u for u in node.users if u.target is _CHECK]:
                gm.graph.erase_node(check)
            if not node.users:
                gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def count_token_hits(gm: fx.GraphModule) -> bool:
    """Add the token hits of the graph's one cross-entropy loss (the module doc) as the
    graph's second output, after the loss: over the logits the captured loss reads when they
    are whole (argmax, compared with the target where it is not ignored, summed), inside the
    chunked loss otherwise. Returns False, the graph unchanged, when the graph has no such
    loss (none, several, or logits that are not ``[tokens, vocabulary]``)."""
    losses = [n for n in gm.graph.nodes if n.op == "call_function"
              and (n.target is _CE or n.target is linear_cross_entropy)]
    if len(losses) != 1:
        return False
    ce = losses[0]
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = output.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    if len(outs) != 1:
        return False
    aten = torch.ops.aten
    with gm.graph.inserting_before(ce.next):
        if ce.target is linear_cross_entropy:
            new = gm.graph.call_function(linear_cross_entropy, (*ce.args[:6], True))
            new.meta.update({k: v for k, v in ce.meta.items() if k != "val"})
            with ce.meta["val"].fake_mode:
                count = torch.zeros((), dtype=torch.int64, device=ce.meta["val"].device)
            new.meta["val"] = (ce.meta["val"], count)
            loss = emit_like(gm, ce, operator.getitem, (new, 0))
            hits = emit_like(gm, ce, operator.getitem, (new, 1))
            ce.replace_all_uses_with(loss)
            gm.graph.erase_node(ce)
        else:
            logits, target = ce.args[0], ce.args[1]
            if logits.meta["val"].dim() != 2:
                return False
            ignore = ce.args[4] if len(ce.args) > 4 else ce.kwargs.get("ignore_index", -100)
            top = emit_like(gm, ce, aten.argmax.default, (logits, 1))
            right = emit_like(gm, ce, aten.eq.Tensor, (top, target))
            labelled = emit_like(gm, ce, aten.ne.Scalar, (target, ignore))
            both = emit_like(gm, ce, aten.logical_and.default, (right, labelled))
            hits = emit_like(gm, ce, aten.sum.default, (both,))
    # An output is computed in the loss's unit, as the loss is (rpcompile.capture.units).
    hits.meta["rp_unit"] = outs[0].meta.get("rp_unit", hits.meta.get("rp_unit"))
    output.args = ((outs[0], hits),)
    gm.graph.lint()
    gm.recompile()
    return True


def _match(ce: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The linear feeding ``ce`` through shape/dtype-only ops, and those ops (nearest first)."""
    weight_arg = ce.args[2] if len(ce.args) > 2 else ce.kwargs.get("weight")
    smoothing = ce.args[5] if len(ce.args) > 5 else ce.kwargs.get("label_smoothing", 0.0)
    reduction = ce.args[3] if len(ce.args) > 3 else ce.kwargs.get("reduction", 1)
    if weight_arg is not None or smoothing or reduction not in (1, 2):
        return None
    chain: list[fx.Node] = []
    node = ce.args[0]
    while isinstance(node, fx.Node) and node.target in _PASS_THROUGH:
        if len([u for u in node.users if u.target is not _CHECK]) != 1:
            return None  # the logits are read elsewhere too: they must exist whole
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is _LINEAR):
        return None
    if len(node.args) > 2 and node.args[2] is not None:
        return None  # a biased head
    if len([u for u in node.users if u.target is not _CHECK]) != 1:
        return None
    if node.args[1].meta["val"].dim() != 2:
        return None
    return node, chain
