"""The schedule as data: per-worker action lists, the host's lanes, the dataflow and the
edges between actions (Schedule), its unit-time dry run (DryRun) and the error a broken
invariant raises (ScheduleError). Its CSV, JSON and file forms are in
:mod:`rpcompile.ir.serialize`."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rpcompile.errors import InvalidInput, RPCompileError
from rpcompile.ir.actions import RELEASE_EDGES, Action, Edge, Flow
from rpcompile.ir.serialize import ScheduleFormats

__all__ = [
    "DryRun",
    "Schedule",
    "ScheduleError",
]


@dataclass(frozen=True)
class DryRun:
    """Unit-time replay: every ready queue head runs in one step. ``blocked`` lists the heads
    left waiting when no queue can move (a deadlock); empty when everything ran."""

    steps: dict[Action, int]
    blocked: tuple[Action, ...]

    @property
    def ok(self) -> bool:
        return not self.blocked


_EDGE_DST = operator.attrgetter("dst")
# The action places of the last schedule made (Schedule._places): (a weak reference to it,
# its action tuples, the places), dropped with that schedule.
_LAST_PLACES: list[tuple | None] = [None]


def _forget_places(ref: weakref.ref) -> None:
    last = _LAST_PLACES[0]
    if last is not None and last[0] is ref:
        _LAST_PLACES[0] = None


@dataclass(frozen=True)
class Schedule(ScheduleFormats):
    """Per-worker action lists, a host action list, the dataflow and the edges between actions.

    ``actions[w]`` is worker ``w``'s list; the actions of one stream run in this order. ``host``
    is the host queue. ``passes`` names the lowering passes applied so far (empty: compute only).
    ``stage_units`` is (first unit, last unit) per stage; ``stage_workers`` is the worker a stage
    is bound to (baselines) or None (RoundPipe: any worker). ``ranks`` is how many processes
    train data parallel, each running this schedule on its share of the batch; with more than
    one, ``network`` is the host's network lane (REDUCE actions, in order). ``sharded``: the
    ranks shard the masters and optimizer state (``shard_optimizer``): each REDUCE reduces its
    gradients to their owners, and each SHADOW also brings the other ranks' updated shadows.
    ``repeat_from``, ``repeat_until``: how a run cycles through the schedule (:meth:`step_of`;
    the runtime's schedule, rpcompile.passes.schedule.runtime_cycle): steps ``repeat_from ..
    repeat_until-1`` over and over; the steps after ``repeat_until`` (0: none) are never run
    as such, they give the last repeated step the waits into the step after it that a long
    run has. ``staging``: the host staging slot of each download (of the steps
    rpcompile.passes.staging.slot_step names), ``staging_bytes`` each slot's size (both empty
    until the ``staging`` pass assigns them; rpcompile.passes.staging).
    """

    kind: str
    workers: int
    microbatches: int
    rounds: int
    steps: int
    optimizer: str
    stage_names: tuple[str, ...]
    stage_units: tuple[tuple[int, int], ...]
    flows: tuple[Flow, ...]
    actions: tuple[tuple[Action, ...], ...]
    host: tuple[Action, ...] = ()
    edges: tuple[Edge, ...] = ()
    stage_workers: tuple[int, ...] | None = None
    passes: tuple[str, ...] = ()
    network: tuple[Action, ...] = ()
    ranks: int = 1
    sharded: bool = False
    repeat_from: int = 0
    repeat_until: int = 0
    staging: tuple[tuple[Action, int], ...] = ()
    staging_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sharded and self.ranks < 2:
            raise InvalidInput("a sharded schedule is data parallel: it needs ranks > 1")
        if not 0 <= self.repeat_from < self.run_steps <= self.steps:
            raise InvalidInput(f"the schedule's repeated steps {self.repeat_from}.."
                             f"{self.run_steps - 1} must lie within its {self.steps} steps")
        # Edges are kept in one canonical order (by the waiting action's place in the lists,
        # then as given) so that equal schedules compare equal after a CSV or JSON round trip.
        # Every lowering pass makes a schedule whose edges mostly come in that order already:
        # those keep their tuple.
        if self.edges:
            edges = self.edges if isinstance(self.edges, tuple) else tuple(self.edges)
            keys = self._edge_places(edges)
            if not all(map(operator.le, keys, itertools.islice(keys, 1, None))):
                order = sorted(range(len(keys)), key=keys.__getitem__)
                edges = tuple(map(edges.__getitem__, order))
            if edges is not self.edges:
                object.__setattr__(self, "edges", edges)

    def _edge_places(self, edges: tuple[Edge, ...]) -> list[int]:
        """Each edge's waiting action's place in :meth:`all_actions` (past the end: not in
        the lists). Found by the object's identity first (passes build their edges from the
        listed actions, and an id hashes in C where an Action's hash is Python code), and by
        equality for an edge that holds an equal copy (a schedule read back from a file).
        A schedule made from another by changing its edges only (most lowering steps) has the
        same action tuples: the places made for that one, while it lives, serve this one.
        Only tuples are matched, by identity, so nothing can have changed in between."""
        lists = (self.actions, self.host, self.network)
        last = _LAST_PLACES[0]
        if last is not None and last[0]() is not None and all(map(operator.is_, last[1],
                                                                  lists)):
            places = last[2]
        else:
            places = dict(zip(map(id, itertools.chain(
                itertools.chain.from_iterable(self.actions), self.host, self.network)),
                itertools.count()))
            if all(type(x) is tuple for x in (*lists, *self.actions)):
                _LAST_PLACES[0] = (weakref.ref(self, _forget_places), lists, places)
        keys = list(map(places.get, map(id, map(_EDGE_DST, edges))))
        if None in keys:
            by_value = dict(zip(self.all_actions(), itertools.count()))
            end = len(by_value)
            for n, key in enumerate(keys):
                if key is None:
                    keys[n] = by_value.get(edges[n].dst, end)
        return keys

    # -- views ---------------------------------------------------------------------------
    @property
    def run_steps(self) -> int:
        """The steps a run executes (:meth:`step_of`): ``repeat_until``, else ``steps``."""
        return self.repeat_until or self.steps

    def step_of(self, run_step: int) -> int:
        """The schedule step that step ``run_step`` of a run executes: itself while it is
        below :attr:`run_steps`, then ``repeat_from .. run_steps-1`` over and over. An edge
        from step ``j - d`` into step ``j`` means the action of the run's step
        ``run_step - d``, as the step that run step executes holds it."""
        end = self.run_steps
        if run_step < end:
            return run_step
        return self.repeat_from + (run_step - self.repeat_from) % (end - self.repeat_from)

    def all_actions(self) -> Iterator[Action]:
        for lst in self.actions:
            yield from lst
        yield from self.host
        yield from self.network

    def queues(self) -> dict[tuple[int | None, str], tuple[Action, ...]]:
        """(worker, stream) -> that stream's actions in order; the host queue is (None, 'host'),
        the network lane (None, 'network')."""
        out: dict[tuple[int | None, str], list[Action]] = {}
        for w, lst in enumerate(self.actions):
            for a in lst:
                out.setdefault((w, a.stream), []).append(a)
        if self.host:
            out[(None, "host")] = list(self.host)
        if self.network:
            out[(None, "network")] = list(self.network)
        return {k: tuple(v) for k, v in out.items()}

    def waits(self) -> dict[Action, list[Edge]]:
        """dst action -> the edges it waits on."""
        out: dict[Action, list[Edge]] = {}
        for e in self.edges:
            out.setdefault(e.dst, []).append(e)
        return out

    def releases(self) -> dict[Action, Action]:
        """D2H -> the compute before whose start the device memory it sent home is given back:
        for a job's gradients, the target of its ``grad_slot`` / ``grad_pair`` edge (the
        worker's gradient slots); for a value, the target of its ``sent`` edge (rpcompile
        .passes.lower), in its step or a later one (steps overlap). Memory whose D2H has
        none (a run's last jobs, a plan without the waits) is given back when the download
        (and every local reader) is done. The proof, the simulator and the runtime all read
        this one map, so what a worker holds is a property of the schedule, not of how fast
        its downloads run."""
        return {e.src: e.dst for e in self.edges if e.kind in RELEASE_EDGES}

    def replace(self, **changes: object) -> Schedule:
        return dataclasses.replace(self, **changes)

    # -- dry run -------------------------------------------------------------------------
    def dry_run(self) -> DryRun:
        """Replay with unit durations: at each step every queue whose head has all its waits
        finished (in earlier steps) runs that head. Every stream is taken as in order here, the
        strictest reading: if this finishes, so does any runtime that also lets a transfer lane
        pick any ready transfer (it has fewer constraints). Gives each action the step index
        :meth:`grid` shows."""
        queues = list(self.queues().values())
        preds: dict[Action, list[Action]] = {}
        for e in self.edges:
            preds.setdefault(e.dst, []).append(e.src)
        done: dict[Action, int] = {}
        heads = [0] * len(queues)
        remaining = sum(len(q) for q in queues)
        step = 0
        while remaining:
            ran = []
            for i, q in enumerate(queues):
                if heads[i] < len(q):
                    a = q[heads[i]]
                    if all(done.get(p, step) < step for p in preds.get(a, ())):
                        ran.append(i)
            if not ran:
                blocked = tuple(q[heads[i]] for i, q in enumerate(queues) if heads[i] < len(q))
                return DryRun(done, blocked)
            for i in ran:
                done[queues[i][heads[i]]] = step
                heads[i] += 1
            remaining -= len(ran)
            step += 1
        return DryRun(done, ())

    # -- text grid -----------------------------------------------------------------------
    def grid(self, mark: Action | None = None, streams: Sequence[str] | None = None,
             window: int | None = None, dry: DryRun | None = None) -> str:
        """Step x worker grid: row t holds what each worker (and the host) runs at dry-run step
        t. ``mark`` is shown as ``!!<action>!!`` with ``<-- here`` after its row; ``window``
        keeps that many rows either side of the mark; ``streams`` filters what is shown."""
        dry = dry or self.dry_run()
        cols = [f"w{w}" for w in range(self.workers)] + (["host"] if self.host else []) + (
            ["network"] if self.network else [])
        rows: dict[int, dict[str, list[str]]] = {}
        blocked_row = max(dry.steps.values(), default=-1) + 1
        for a in self.all_actions():
            if streams is not None and a.stream not in streams and a != mark:
                continue
            t = dry.steps.get(a)
            if t is None:
                if a not in dry.blocked and a != mark:
                    continue
                t = blocked_row
            text = f"!!{a.short()}!!" if a == mark else a.short()
            col = (a.stream if a.worker is None else f"w{a.worker}")
            rows.setdefault(t, {}).setdefault(col, []).append(text)
        steps = sorted(rows)
        mark_step = next((t for t in steps if any("!!" in c for v in rows[t].values() for c in v)), None)
        if window is not None and mark_step is not None:
            steps = [t for t in steps if abs(t - mark_step) <= window]
        cells = [["step", *cols]]
        for t in steps:
            label = "blocked" if t == blocked_row and dry.blocked else str(t)
            cells.append([label, *(" | ".join(rows[t].get(c, [])) for c in cols)])
        widths = [max(len(r[i]) for r in cells) for i in range(len(cols) + 1)]
        lines = []
        for r, t in zip(cells, [None, *steps]):
            line = "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            lines.append(line + ("   <-- here" if t is not None and t == mark_step else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        n = sum(len(lst) for lst in self.actions) + len(self.host) + len(self.network)
        lowered = ", ".join(self.passes) or "compute only"
        return (f"Schedule({self.kind}, {self.workers} workers, {self.microbatches} microbatches"
                f" x {self.rounds} rounds x {self.steps} steps, {n} actions, {len(self.edges)}"
                f" edges; {lowered})")


class ScheduleError(RPCompileError, ValueError):
    """A schedule broke an invariant; the message names the pass and shows the marked grid."""
