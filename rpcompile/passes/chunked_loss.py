"""Chunked LM-head loss: the fused tail never holds a microbatch's full logits.

A causal LM's loss is ``cross_entropy(linear(hidden, lm_head.weight).float(), labels)``: its
``[tokens, vocab]`` logits (fp32 for the loss) are the largest tensor of a long-sequence step
(4 x 2,048 tokens x 151,936 vocabulary = 5 GB; 73K tokens, 22 GB in bf16). This pass rewrites
that pattern in the captured graph to :func:`linear_cross_entropy`, which computes the loss
``chunk`` tokens at a time: the forward keeps only each token's log-sum-exp, the backward
recomputes one chunk's logits at a time to form its gradient (softmax minus one-hot), then the
chunk's input and weight gradients. Peak memory of the head and loss falls from the whole
logits (plus their gradient) to one chunk's; the price is one more head matmul in backward.

The rewrite only matches the plain pattern (no bias, no logit soft-capping or scaling between
the head and the loss, no label smoothing, no class weights); anything else stays as captured.
The result equals the unchunked loss up to floating-point summation order (tests hold it within
1e-6 in fp32), so it is used only where the memory is needed (``compile(loss_chunk_tokens=)``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from rpcompile.capture.dropout import emit_like

__all__ = ["chunk_lm_loss", "linear_cross_entropy", "logits_bytes"]

_CE = torch.ops.aten.cross_entropy_loss.default
_LINEAR = torch.ops.aten.linear.default
_PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
                 torch.ops.aten._to_copy.default, torch.ops.aten.contiguous.default,
                 torch.ops.aten.alias.default}
_CHECK = torch.ops.aten._assert_tensor_metadata.default


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, chunk, mean):
        valid = target != ignore_index
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (x[rows] @ weight.t()).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[rows].clamp(min=0).unsqueeze(1)).squeeze(1)
            total = total + ((lse[rows] - picked) * valid[rows]).sum()
        count = valid.sum()
        ctx.save_for_backward(x, weight, target, lse, count)
        ctx.chunk, ctx.mean, ctx.ignore_index = chunk, mean, ignore_index
        return total / count if mean else total

    @staticmethod
    def backward(ctx, grad):
        x, weight, target, lse, count = ctx.saved_tensors
        scale = grad / count if ctx.mean else grad
        valid = (target != ctx.ignore_index).unsqueeze(1)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if need_x else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, x.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = (x[rows] @ weight.t()).float()
            probs = torch.exp(logits - lse[rows].unsqueeze(1))
            probs.scatter_add_(1, target[rows].clamp(min=0).unsqueeze(1),
                               -torch.ones_like(probs[:, :1]))
            g = (probs * valid[rows] * scale).to(x.dtype)
            if need_x:
                gx[rows] = g @ weight
            if need_w:
                gw += (g.t() @ x[rows]).float()
        return gx, None if gw is None else gw.to(weight.dtype), None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int, chunk: int, reduction: int) -> torch.Tensor:
    """``cross_entropy((x @ weight.T).float(), target, reduction=...)`` computed ``chunk`` rows
    at a time (``reduction``: aten's enum, 1 mean, 2 sum). ``x``: ``[tokens, hidden]``."""
    return _LinearCrossEntropy.apply(x, weight, target, ignore_index, chunk, reduction == 1)


def logits_bytes(captured, tokens: int) -> int:
    """Bytes of the fp32 logits the captured loss would hold for ``tokens`` tokens."""
    vocab = getattr(getattr(captured.model, "config", None), "vocab_size", 0) or 0
    return 4 * tokens * int(vocab)


def chunk_lm_loss(gm: fx.GraphModule, chunk: int) -> int:
    """Rewrite each ``cross_entropy(linear(x, W) [.float().view(-1, V)], target)`` of ``gm`` to
    :func:`linear_cross_entropy` with ``chunk`` tokens per chunk; returns how many."""
    if chunk < 1:
        raise ValueError(f"loss_chunk_tokens must be a positive number of tokens, got {chunk}")
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
