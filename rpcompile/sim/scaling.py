"""Planning at scale: N servers training data parallel, one RoundPipe pipeline each.

Each server runs the same pipeline on its share of the global batch (``N x`` one server's
batch), and the fp32 gradients are all-reduced across servers over the inter-server
:class:`~rpcompile.hardware.Link`, as the runtime does (:mod:`rpcompile.runtime.distributed`):
a stage's reduction starts when its gradients are home (its ``OPT`` action's start in the
single-server timeline), the reductions queue on the one link in that order (ring all-reduce,
:meth:`Link.allreduce_ms`), and the step's updates wait for them.

:func:`simulate_nodes` takes a single-server simulation of several steps and one of its steady
steps, replays the reductions of that step on the link, and reports:

- ``exposed_ms``: how long the last reduction ends after the last gradients are home (the
  part of the communication the remaining backward jobs did not hide);
- ``step_ms``: one server's steady step plus ``exposed_ms`` (an upper bound: the exposed time
  is assumed to delay the next step by its whole length), and never less than the time the
  link is busy per step (beyond it the reductions queue up from step to step);
- tokens/s of all N servers and the scaling efficiency, one server's step time over this one.

This is a post-pass over the simulated timeline, not yet actions of the lowered schedule:
the schedule has no network stream to put them on (docs/distributed.md says what is missing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rpcompile.hardware import Link, get_link
from rpcompile.sim.result import SimResult
from rpcompile.sim.runs import steady_step_ms

__all__ = ["NodeScaling", "simulate_nodes"]


@dataclass(frozen=True)
class NodeScaling:
    """What :func:`simulate_nodes` predicts (times in ms)."""

    nodes: int
    link: str
    gradient_bytes: int  # fp32 gradients all-reduced per step
    reductions: int  # all-reduces per step (one per gradient stage)
    one_server_step_ms: float
    link_busy_ms: float  # the reductions' time on the link, per step
    exposed_ms: float
    step_ms: float
    tokens_per_step: int  # of all servers
    one_server_tokens_per_s: float
    tokens_per_s: float
    efficiency: float  # one server's step time over this step time (1.0: linear scaling)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.nodes} servers over {self.link}: {self.step_ms:.1f} ms per step, "
                f"{self.tokens_per_s:,.0f} tokens/s ({self.efficiency * 100:.1f}% scaling "
                f"efficiency; {self.gradient_bytes / 2**30:.1f} GiB of gradients in "
                f"{self.reductions} all-reduces, {self.link_busy_ms:.1f} ms on the link, "
                f"{self.exposed_ms:.1f} ms exposed)")


def simulate_nodes(run: SimResult, nodes: int, link: Link | str, *, tokens_per_step: int,
                   gradient_bytes: int | None = None, step: int | None = None) -> NodeScaling:
    """N servers like the one ``run`` simulated (see the module doc). ``run`` must have at
    least 3 steps (a steady state); ``step`` is the steady step whose reductions are replayed
    (default: the one before the last); ``tokens_per_step`` is one server's.

    ``gradient_bytes``: the model's fp32 gradient bytes with each parameter once (its
    masters' bytes). A parameter several stages use (a tied embedding and LM head) is in each
    of their ``OPT`` actions' bytes but reduced once, after the last of them, as the runtime
    does; the excess over ``gradient_bytes`` is taken off the earliest reductions."""
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, got {nodes}")
    link = get_link(link)
    sched = run.schedule
    if sched.steps < 3:
        raise ValueError("simulate_nodes needs a run of 3 steps or more (a steady state); "
                         "see rpcompile.sim.steady_steps")
    k = sched.steps - 2 if step is None else step
    home = sorted((run.timeline[a][0], a.bytes) for a in sched.host
                  if a.kind == "OPT" and a.step == k and a.bytes > 0)
    if not home:
        raise ValueError(f"step {k} of the run has no optimizer actions with gradients")
    excess = 0 if gradient_bytes is None else sum(b for _, b in home) - gradient_bytes
    if excess < 0:
        raise ValueError(f"gradient_bytes {gradient_bytes} exceeds the step's optimizer "
                         f"actions' {sum(b for _, b in home)} bytes")
    for i, (ready, nbytes) in enumerate(home):
        cut = min(excess, nbytes)
        home[i] = (ready, nbytes - cut)
        excess -= cut
    one_step = steady_step_ms(run)
    free = busy = 0.0
    for ready, nbytes in home:
        took = link.allreduce_ms(nbytes, nodes)
        free = max(free, ready) + took
        busy += took
    exposed = max(0.0, free - home[-1][0]) if nodes > 1 else 0.0
    step_ms = max(one_step + exposed, busy)
    one_rate = tokens_per_step * 1e3 / one_step
    return NodeScaling(
        nodes=nodes, link=link.key, gradient_bytes=int(sum(b for _, b in home)),
        reductions=len(home), one_server_step_ms=one_step, link_busy_ms=busy,
        exposed_ms=exposed, step_ms=step_ms, tokens_per_step=tokens_per_step * nodes,
        one_server_tokens_per_s=one_rate, tokens_per_s=tokens_per_step * nodes * 1e3 / step_ms,
        efficiency=one_step / step_ms,
    )
