"""Host staging slots: the host buffer each download of a RoundPipe schedule is lent, and the
waits that keep two downloads of one buffer apart.

A download (``D2H``) lands in a host buffer that stays lent until the actions that read it
are done: the ``ACC`` that adds a job's gradients into the host accumulator, or every
``H2D`` that uploads a value again (:func:`download_frees`). The runtime keeps its buffers
and lends them again (rpcompile.runtime.memory.HostStaging). Which download takes which
buffer is fixed here, from one replay of the schedule (:func:`staging_slots`): each download
gets a *slot* (a buffer of a fixed size), the first free one that holds it and is at most
``STAGING_FIT`` times its size, else a new one. Then every download waits (``reuse`` edges)
for the actions that free its slot's previous holder. Each such wait is met in the replay
the slots came from (the holder was given back before the next took the slot), so the
replay and its step time do not change; and since the waits are edges, every order of the
schedule keeps two holders of a slot apart. The host staging is then the sum of the slot
sizes, whatever the timing (the proof: rpcompile.passes.memory.staging_problem).

A run longer than the schedule cycles through its repeated steps (``Schedule.step_of``); a
download of a run step takes the slot of the same download in the schedule step
:func:`slot_step` names. From the step before the repeated ones on, slots are periodic (a
download and its copy one cycle later share a slot), so the edges into a repeated step say
the same in every cycle. Holders further apart than one step need no edge: a step starts
only after the step two before it has committed (``in_flight``; data parallel: ``barrier``),
and by then that step's buffers are back.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Mapping

from rpcompile.errors import InvalidInput
from rpcompile.ir import STAGING_FIT, STEPS_IN_FLIGHT, Action, Edge, Schedule

__all__ = ["download_frees", "lend", "slot_step", "staging_slots"]


def download_frees(sched: Schedule) -> dict[Action, tuple[Action, ...]]:
    """Each download -> the actions after all of which its host buffer is free: a job's
    gradients, the ``ACC`` of that job; a value, every ``H2D`` reading it. A download no
    action reads (none in a lowered schedule) is free once it has landed: itself."""
    acc: dict[tuple, Action] = {}
    reads: dict[tuple, list[Action]] = {}
    for a in sched.host:
        if a.kind == "ACC":
            acc[(a.stage, a.round, a.step)] = a
    for lst in sched.actions:
        for a in lst:
            if a.kind == "H2D":
                reads.setdefault((a.value, a.microbatch, a.round, a.step), []).append(a)
    out: dict[Action, tuple[Action, ...]] = {}
    for lst in sched.actions:
        for a in lst:
            if a.kind != "D2H":
                continue
            if a.what == "grad":
                got = acc.get((a.stage, a.round, a.step))
                out[a] = (got,) if got is not None else (a,)
            else:
                out[a] = tuple(reads.get((a.value, a.microbatch, a.round, a.step), ())) or (a,)
    return out


def slot_step(sched: Schedule, step: int) -> int:
    """The schedule step whose downloads' slots the downloads of run step ``step`` (or of
    schedule step ``step``) take. A schedule that repeats no step (``repeat_until`` 0)
    drains at its end: step ``step mod steps``. Else from the step before the repeated ones
    (``repeat_from - 1``) on, one slot per download and cycle position: that step plus
    ``step``'s place in the cycle of ``run_steps - repeat_from`` steps."""
    if not sched.repeat_until:
        return step % sched.steps
    first = max(0, sched.repeat_from - 1)
    if step < first:
        return step
    return first + (step - first) % (sched.run_steps - sched.repeat_from)


def _key(a: Action, step: int) -> Action:
    return a if a.step == step else dataclasses.replace(a, step=step)


class _Clash(Exception):
    """A download's cycle copy found its slot still lent in the replay."""

    def __init__(self, key: Action) -> None:
        super().__init__(str(key))
        self.key = key


def staging_slots(sched: Schedule, timeline: Mapping[Action, tuple[float, float]]
                  ) -> Schedule:
    """``sched`` with a staging slot for each download (``Schedule.staging``: the download of
    :func:`slot_step`'s step -> slot; ``Schedule.staging_bytes``: each slot's size) and the
    ``reuse`` edges that order a slot's holders, assigned from ``timeline`` (a replay of
    ``sched``: every action's start and end) by :func:`lend`. A baseline schedule
    (``stage_workers`` set) has no pool: returned as it is."""
    if sched.stage_workers is not None:
        return sched
    frees = download_frees(sched)
    slot_of, sizes, holders = lend(sched, timeline, frees)
    edges = _reuse_edges(holders, frees)
    staging = tuple(sorted(slot_of.items(), key=lambda kv: (kv[1], str(kv[0]))))
    return sched.replace(edges=(*sched.edges, *edges), staging=staging,
                         staging_bytes=tuple(sizes))


def lend(sched: Schedule, timeline: Mapping[Action, tuple[float, float]],
         frees: Mapping[Action, tuple[Action, ...]] | None = None
         ) -> tuple[dict[Action, int], list[int], list[list[Action]]]:
    """The slots of ``sched``'s downloads as the replay ``timeline`` lends them: (key ->
    slot, each slot's size, each slot's holders in the order they took it). A download keeps
    its buffer from its start until the last of :func:`download_frees` ends, and takes the
    smallest free slot that holds it and is at most ``STAGING_FIT`` times its size, else a
    new one of its size; a download whose key (:func:`slot_step`) has a slot takes that one.
    A key is given a slot no other key shares where sharing would leave two holders
    unordered by any edge the slots may add: its cycle copy finds the slot still lent, a
    holder of a later step comes before one of an earlier step, or the waits into a repeated
    step would differ from those into its copy one cycle later."""
    frees = download_frees(sched) if frees is None else frees
    stays = []  # (start, freed at, bytes, download, its key)
    for a, by in frees.items():
        start = timeline[a][0]
        end = max(timeline[f][1] for f in by)
        stays.append((start, max(start, end), a.bytes, a, _key(a, slot_step(sched, a.step))))
    own: set[Action] = set()
    while True:
        try:
            slot_of, sizes, holders = _assign(stays, own)
        except _Clash as clash:
            if clash.key in own:
                raise InvalidInput(
                    f"the staging slot of {clash.key} is still lent in the replay when its "
                    "copy one cycle later downloads: the schedule's cycle does not order a "
                    "download after its copy's readers") from None
            own.add(clash.key)
            continue
        bad = _unordered(sched, holders, frees) - own
        if not bad:
            return slot_of, sizes, holders
        own |= bad


def _reuse_edges(holders: list[list[Action]], frees: Mapping[Action, tuple[Action, ...]]
                 ) -> list[Edge]:
    """A ``reuse`` edge from each action freeing a slot's holder to the slot's next holder,
    for holders of the same or consecutive steps (further apart, the steps' commit order
    keeps them apart)."""
    edges: list[Edge] = []
    seen: set[tuple[Action, Action]] = set()
    for chain in holders:
        for x, y in itertools.pairwise(chain):
            if not 0 <= y.step - x.step < STEPS_IN_FLIGHT:
                continue
            for f in frees[x]:
                if f != y and (f, y) not in seen:
                    seen.add((f, y))
                    edges.append(Edge(f, y, "reuse"))
    return edges


def _unordered(sched: Schedule, holders: list[list[Action]],
               frees: Mapping[Action, tuple[Action, ...]]) -> set[Action]:
    """The keys whose sharing a slot no reuse edge can order: a holder after one of a later
    step (an edge would run back in steps), and, in a schedule that repeats steps, the
    holders whose waits into a repeated step differ from those into its copy one cycle on
    (the run repeats the first)."""
    bad: set[Action] = set()
    for chain in holders:
        for x, y in itertools.pairwise(chain):
            if y.step < x.step:
                bad.add(_key(y, slot_step(sched, y.step)))
    if not sched.repeat_until or bad:
        return bad
    period = sched.run_steps - sched.repeat_from
    into_repeated: dict[tuple[Action, Action], Action] = {}
    into_copies: dict[tuple[Action, Action], Action] = {}
    for e in _reuse_edges(holders, frees):
        if sched.repeat_from <= e.dst.step < sched.run_steps and e.dst.step + period < sched.steps:
            into_repeated[(_shift(e.src, period), _shift(e.dst, period))] = e.dst
        elif e.dst.step >= sched.run_steps:
            into_copies[(e.src, e.dst)] = e.dst
    for pair in into_repeated.keys() ^ into_copies.keys():
        dst = into_repeated.get(pair) or into_copies[pair]
        bad.add(_key(dst, slot_step(sched, dst.step)))
    return bad


def _shift(a: Action, steps: int) -> Action:
    return dataclasses.replace(a, step=a.step + steps)


def _assign(stays, own: set[Action]):
    """The replay's lending with slots fixed per key: (key -> slot, slot sizes, each slot's
    holders in the order they took it). Raises :class:`_Clash` naming a key whose slot is
    still lent when another of its downloads starts."""
    # (time, order, index): at equal times buffers come back (0) before they are taken (1),
    # except a download's own return when it stays no time at all (2: after its take).
    events = sorted([(s[0], 1, i) for i, s in enumerate(stays)]
                    + [(s[1], 0 if s[1] > s[0] else 2, i) for i, s in enumerate(stays)])
    slot_of: dict[Action, int] = {}
    sizes: list[int] = []
    holders: list[list[Action]] = []
    shared: list[tuple[int, int]] = []  # free slots any download may take: (size, slot), sorted
    idle: set[int] = set()  # every free slot
    held: dict[int, int] = {}  # download index -> its slot
    private: set[int] = set()  # the slots of the keys in ``own``
    for _, order, i in events:
        _, _, nbytes, a, key = stays[i]
        if nbytes <= 0:
            continue
        if order != 1:
            slot = held.pop(i)
            idle.add(slot)
            if slot not in private:
                bisect.insort(shared, (sizes[slot], slot))
            continue
        slot = slot_of.get(key)
        if slot is not None:
            if slot not in idle:
                raise _Clash(key)
            j = bisect.bisect_left(shared, (sizes[slot], slot))
            if j < len(shared) and shared[j][1] == slot:
                shared.pop(j)
        elif key not in own:
            j = bisect.bisect_left(shared, (nbytes, -1))
            if j < len(shared) and shared[j][0] <= STAGING_FIT * nbytes:
                slot = shared.pop(j)[1]
        if slot is None:
            slot = len(sizes)
            sizes.append(nbytes)
            holders.append([])
            if key in own:
                private.add(slot)
        else:
            idle.discard(slot)
        slot_of[key] = slot
        held[i] = slot
        holders[slot].append(a)
    return slot_of, sizes, holders

