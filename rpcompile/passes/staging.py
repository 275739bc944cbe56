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
import itertools
from collections.abc import Mapping

from rpcompile.errors import InvalidInput
from rpcompile.ir import STAGING_FIT, STEPS_IN_FLIGHT, Action, Edge, Schedule

__all__ = ["download_frees", "lend", "slot_step", "staging_slot", "staging_slots", "step_key"]


# The last download_frees answer, by the identity of the action lists it read: the staging
# pass and the proof read the same lists (a schedule and its copy with slots share them).
_FREES: list = [None, None, None]


def download_frees(sched: Schedule) -> dict[Action, tuple[Action, ...]]:
    """Each download -> the actions after all of which its host buffer is free: a job's
    gradients, the ``ACC`` of that job; a value, every ``H2D`` reading it. A download no
    action reads (none in a lowered schedule) is free once it has landed: itself."""
    actions, host, got = _FREES
    if actions is sched.actions and host is sched.host:
        return got
    out = _download_frees(sched)
    _FREES[:] = [sched.actions, sched.host, out]
    return out


def _download_frees(sched: Schedule) -> dict[Action, tuple[Action, ...]]:
    acc = {(a.stage, a.round, a.step): a for a in sched.host if a.kind == "ACC"}
    reads: dict[tuple, list[Action]] = {}
    downloads: list[Action] = []
    for lst in sched.actions:
        for a in lst:
            kind = a.kind
            if kind == "H2D":
                reads.setdefault((a.value, a.microbatch, a.round, a.step), []).append(a)
            elif kind == "D2H":
                downloads.append(a)
    out: dict[Action, tuple[Action, ...]] = {}
    for a in downloads:
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


def _phase_step(sched: Schedule, step: int) -> int:
    """The step naming a slot of its own for run step ``step``'s download: a download whose
    copy one cycle on may still be on the host when that copy lands (a cycle of one step,
    steps overlapping) has a slot per cycle phase, the phases :data:`STEPS_IN_FLIGHT`
    or more steps apart (so the steps' commit order keeps a slot's holders apart); phase
    ``p`` is named at :func:`slot_step` plus ``p`` cycles."""
    k = slot_step(sched, step)
    first = max(0, sched.repeat_from - 1)
    if not sched.repeat_until or step < first:
        return k
    period = sched.run_steps - sched.repeat_from
    phases = -(-STEPS_IN_FLIGHT // period)
    return k + ((step - first) // period) % phases * period


def staging_slot(sched: Schedule, slot_of: Mapping[tuple, int], a: Action,
                 step: int) -> int | None:
    """The staging slot download ``a`` of run step ``step`` takes, from ``slot_of`` (the
    :func:`step_key` of each ``Schedule.staging`` entry -> its slot): its phase's own slot
    where it has one, else its key's at :func:`slot_step`; None: none (a download of no
    bytes)."""
    phase = _phase_step(sched, step)
    k = slot_step(sched, step)
    if phase != k:
        got = slot_of.get(step_key(a, phase))
        if got is not None:
            return got
    return slot_of.get(step_key(a, k))


def step_key(a: Action, step: int | None = None) -> tuple:
    """``a`` as a plain tuple with its step replaced by ``step`` (default: its own): what
    names a download, or the action freeing one, across the copies a run repeats."""
    return (a.worker, a.kind, a.stage, a.microbatch, a.round, a.what, a.value,
            a.step if step is None else step)


class _Clash(Exception):
    """A download's cycle copy found its slot still lent in the replay."""

    def __init__(self, key: tuple) -> None:
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
    slot_of, sizes, _, pairs = lend(sched, timeline, frees)
    edges = [Edge(f, y, "reuse") for f, y in pairs]
    # The slot of each key, named by the download of the key's own step.
    named = {a: slot_of[step_key(a)] for a in frees if step_key(a) in slot_of}
    staging = tuple(sorted(named.items(), key=lambda kv: (kv[1], str(kv[0]))))
    return sched.replace(edges=(*sched.edges, *edges), staging=staging,
                         staging_bytes=tuple(sizes))


def lend(sched: Schedule, timeline: Mapping[Action, tuple[float, float]],
         frees: Mapping[Action, tuple[Action, ...]] | None = None
         ) -> tuple[dict[tuple, int], list[int], list[list[Action]], list[tuple[Action, Action]]]:
    """The slots of ``sched``'s downloads as the replay ``timeline`` lends them: (key
    (:func:`step_key` at :func:`slot_step`) -> slot, each slot's size, each slot's holders
    in the order they took it, the (freeing action, next holder) pairs the ``reuse`` edges
    join). A download keeps its buffer from its start until the last
    of :func:`download_frees` ends, and takes the smallest free slot that holds it and is
    at most ``STAGING_FIT`` times its size, else a new one of its size; a download whose
    key has a slot takes that one. A key is given a slot no other key shares where sharing
    would leave two holders unordered by any edge the slots may add: its cycle copy finds
    the slot still lent, a holder of a later step comes before one of an earlier step, or
    the waits into a repeated step would differ from those into its copy one cycle on."""
    frees = download_frees(sched) if frees is None else frees
    stays = []  # (start, freed at, bytes, download, its key, its phase's key)
    for a, by in frees.items():
        start = timeline[a][0]
        end = max(timeline[f][1] for f in by)
        stays.append((start, max(start, end), a.bytes, a, step_key(a, slot_step(sched, a.step)),
                      step_key(a, _phase_step(sched, a.step))))
    own: set[tuple] = set()  # keys with a slot per phase, shared by no other key
    while True:
        keyed = [(s0, s1, n, a, phased if key in own else key)
                 for s0, s1, n, a, key, phased in stays]
        private = {phased for _, _, _, _, key, phased in stays if key in own}
        try:
            slot_of, sizes, holders = _assign(keyed, private)
        except _Clash as clash:
            if clash.key in private:
                raise InvalidInput(
                    f"the staging slot of the download {clash.key} is still lent in the "
                    "replay when its copy two or more steps later downloads: the schedule "
                    "does not make a step wait for the commit of the step two before it "
                    "(in_flight edges)") from None
            own.add(clash.key)
            continue
        pairs = _reuse_pairs(holders, frees)
        bad = _unordered(sched, holders, pairs) - own
        if not bad:
            return slot_of, sizes, holders, pairs
        own |= bad


def _reuse_pairs(holders: list[list[Action]], frees: Mapping[Action, tuple[Action, ...]]
                 ) -> list[tuple[Action, Action]]:
    """(an action freeing a slot's holder, the slot's next holder), for holders of the same
    or consecutive steps (further apart, the steps' commit order keeps them apart)."""
    pairs: list[tuple[Action, Action]] = []
    for chain in holders:
        for x, y in itertools.pairwise(chain):
            if 0 <= y.step - x.step < STEPS_IN_FLIGHT:
                pairs.extend((f, y) for f in frees[x] if f != y)
    return list(dict.fromkeys(pairs))


def _unordered(sched: Schedule, holders: list[list[Action]],
               pairs: list[tuple[Action, Action]]) -> set[tuple]:
    """The keys whose sharing a slot no reuse edge can order: a holder after one of a later
    step (an edge would run back in steps), and, in a schedule that repeats steps, the
    holders whose waits into a repeated step differ from those into its copy one cycle on
    (the run repeats the first)."""
    bad: set[tuple] = set()
    for chain in holders:
        for x, y in itertools.pairwise(chain):
            if y.step < x.step:
                bad.add(step_key(y, slot_step(sched, y.step)))
    if not sched.repeat_until or bad:
        return bad
    period = sched.run_steps - sched.repeat_from
    into_repeated: dict[tuple, Action] = {}
    into_copies: dict[tuple, Action] = {}
    for f, y in pairs:
        if sched.repeat_from <= y.step < sched.run_steps and y.step + period < sched.steps:
            into_repeated[(step_key(f, f.step + period), step_key(y, y.step + period))] = y
        elif y.step >= sched.run_steps:
            into_copies[(step_key(f), step_key(y))] = y
    for pair in into_repeated.keys() ^ into_copies.keys():
        y = into_repeated.get(pair) or into_copies[pair]
        bad.add(step_key(y, slot_step(sched, y.step)))
    return bad


def _assign(stays, own: set[tuple]):
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

