"""Planning at scale: N servers training data parallel, one RoundPipe pipeline each.

Each server runs the same pipeline on its share of the global batch (``N x`` one server's
batch). :func:`simulate_nodes` lowers the plan for ``N`` ranks, as the runtime runs it
(:func:`~rpcompile.passes.lower.add_reductions`: a REDUCE action per gradient stage and step
on the host's network lane, after the stage's last ACC; the step's updates wait for them),
replays that schedule on the hardware profile joined to the other servers by the link (the
simulator times each REDUCE as a ring all-reduce on the link and charges gloo's host-memory
traffic, :func:`rpcompile.sim.engine.simulate`), and sets its steady state beside one
server's:

- ``step_ms``: the N-server steady step (:func:`~rpcompile.sim.runs.steady_step_ms`);
- ``added_ms``: what data parallel adds to one server's steady step (the reductions the
  backward jobs and the next steps do not hide, and their host-memory traffic);
- ``link_busy_ms``: the REDUCE actions' time per step (longer than the ring time alone when
  host memory is contended);
- tokens/s of all N servers and the scaling efficiency, one server's step time over this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, Link, get_hardware, get_link
from rpcompile.ir import Plan
from rpcompile.sim.engine import (
    GLOO_BROADCAST_HOST_BYTES_PER_BYTE,
    GLOO_HOST_BYTES_PER_BYTE,
    GLOO_REDUCE_HOST_BYTES_PER_BYTE,
)
from rpcompile.sim.result import SimResult
from rpcompile.sim.runs import simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.sim.sharding import shadow_gather_bytes

__all__ = ["NodeScaling", "simulate_nodes"]


@dataclass(frozen=True)
class NodeScaling:
    """What :func:`simulate_nodes` predicts (times in ms, per steady step)."""

    nodes: int
    link: str
    gradient_bytes: int  # fp32 gradients reduced per step (the REDUCE actions' bytes)
    reductions: int  # REDUCE actions per step (one per gradient stage)
    sharded: bool  # host state sharded: REDUCE to the owners, the shadows broadcast at SHADOW
    shadow_bytes: int  # sharded: updated shadow bytes broadcast per step (0 otherwise)
    host_traffic_bytes: int  # host-memory traffic of the reductions per step (gloo's copies)
    one_server_step_ms: float
    link_busy_ms: float  # the REDUCE actions' time per step (sharded: not the broadcasts)
    added_ms: float  # step_ms - one_server_step_ms
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
                f"{self.reductions} reductions"
                + (f" to their owners and {self.shadow_bytes / 2**30:.1f} GiB of shadows "
                   "broadcast (sharded)" if self.sharded else "")
                + f", {self.link_busy_ms:.1f} ms of reductions on the link, "
                f"{self.added_ms:+.1f} ms per step against one server)")


def simulate_nodes(plan: Plan, hardware: Hardware | str, nodes: int, link: Link | str, *,
                   tokens_per_step: int, optimizer: str = "async", rounds: int = 1,
                   steps: int | None = None, one_server: SimResult | None = None,
                   sharded: bool = False) -> NodeScaling:
    """N servers of ``hardware`` joined by ``link``, each running ``plan`` (see the module
    doc). ``steps``: steps to replay (default :func:`steady_steps`, at least 3);
    ``one_server``: the single-server run of the same steps, if already simulated;
    ``tokens_per_step`` is one server's; ``sharded``: the servers shard their host state
    (``shard_optimizer``, sync mode): the replay times a reduce of each REDUCE's gradients to
    their owners and the updated shadows' broadcast at each SHADOW."""
    if nodes < 1:
        raise InvalidInput(f"nodes must be at least 1, got {nodes}")
    link = get_link(link)
    hw = get_hardware(hardware).with_link(link)
    steps = steps or steady_steps(plan, rounds=rounds)
    if steps < 3:
        raise InvalidInput("simulate_nodes needs a run of 3 steps or more (a steady state); "
                         "see rpcompile.sim.steady_steps")
    one = one_server or simulate_roundpipe(plan, hw, steps=steps, optimizer=optimizer,
                                           rounds=rounds)
    if one.schedule.steps != steps or one.schedule.ranks != 1:
        raise InvalidInput(f"one_server must be a one-rank run of {steps} steps")
    run = one if nodes == 1 else simulate_roundpipe(plan, hw, steps=steps, optimizer=optimizer,
                                                    rounds=rounds, ranks=nodes,
                                                    sharded=sharded)
    one_step, step_ms = steady_step_ms(one), steady_step_ms(run)
    k = steps - 2  # a steady step's reductions
    reds = [a for a in run.schedule.network if a.step == k]
    grads = sum(a.bytes for a in reds)
    busy = sum(run.timeline[a][1] - run.timeline[a][0] for a in reds)
    shadows = 0
    if run.schedule.sharded:
        shadows = sum(n for a, n in shadow_gather_bytes(run.schedule, plan).items()
                      if a.step == k)
        traffic = (GLOO_REDUCE_HOST_BYTES_PER_BYTE * (nodes - 1) / nodes * grads
                   + GLOO_BROADCAST_HOST_BYTES_PER_BYTE * shadows)
    else:
        traffic = GLOO_HOST_BYTES_PER_BYTE * (nodes - 1) / nodes * grads
    return NodeScaling(
        nodes=nodes, link=link.key, gradient_bytes=grads, reductions=len(reds),
        sharded=run.schedule.sharded, shadow_bytes=shadows,
        host_traffic_bytes=int(traffic),
        one_server_step_ms=one_step, link_busy_ms=busy, added_ms=step_ms - one_step,
        step_ms=step_ms, tokens_per_step=tokens_per_step * nodes,
        one_server_tokens_per_s=tokens_per_step * 1e3 / one_step,
        tokens_per_s=tokens_per_step * nodes * 1e3 / step_ms, efficiency=one_step / step_ms,
    )
