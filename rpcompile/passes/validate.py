"""Schedule validation: structure, every read after its write, and a dry run proving progress.

Checks, in order (the first failure raises :class:`ScheduleError` with the pass name, the
problem and the step x worker grid with the offending cell marked ``!!...!!``):

  1. structure - actions sit on their worker's list, none twice; every wait names an action
                 that is in the schedule (an event that is recorded)
  2. coverage  - every (compute kind, stage, microbatch, round, step) runs exactly once, and
                 on its bound worker in a baseline
  3. ordering  - every read happens after the write it needs: by order on an ordered stream
                 (compute, host), or by an edge from the writer (or a later action on its
                 stream, if ordered) to the reader (or an earlier action on its stream, if
                 ordered); what is read depends on the passes applied
  4. progress  - a unit-time dry run of the in-order streams and edges finishes (no deadlock)
"""

from __future__ import annotations

import bisect
from collections import Counter

from rpcompile.ir import ORDERED_STREAMS, Action, Schedule, ScheduleError

__all__ = ["ScheduleError", "validate"]

_GRID_ROWS = 12  # rows either side of the marked cell shown in an error


class _Order:
    """Answers 'does w finish before a starts?' for the one-hop rule above (O(log n) between
    ordered streams, O(edges of the action) when a transfer lane is involved). Streams and
    actions are numbered once, so the answers hash ints, not actions."""

    def __init__(self, sched: Schedule) -> None:
        queues = list(sched.queues().items())
        self.ordered = [q[1] in ORDERED_STREAMS for q, _ in queues]
        self.streams = len(queues)
        # action -> (stream, place in it, number)
        self.pos: dict[Action, tuple[int, int, int]] = {}
        for q, (_key, lst) in enumerate(queues):
            for i, a in enumerate(lst):
                self.pos[a] = (q, i, len(self.pos))
        self.count = len(self.pos)
        self.edges: set[int] = set()  # src number * count + dst number
        self.succ: dict[int, list[tuple[int, int]]] = {}  # number -> (stream, place) of dsts
        self.pred: dict[int, list[tuple[int, int]]] = {}  # number -> (stream, place) of srcs
        pairs: dict[int, list[tuple[int, int]]] = {}
        pos, count, streams = self.pos, self.count, self.streams
        for e in sched.edges:
            src, dst = pos.get(e.src), pos.get(e.dst)
            if src is None or dst is None:  # not in the schedule: no order to give
                continue
            (qs, i, ns), (qd, j, nd) = src, dst
            self.edges.add(ns * count + nd)
            self.succ.setdefault(ns, []).append((qd, j))
            self.pred.setdefault(nd, []).append((qs, i))
            pairs.setdefault(qs * streams + qd, []).append((j, i))
        # per stream pair: destination indices ascending and the running max source index
        self.table: dict[int, tuple[list[int], list[int]]] = {}
        for key, items in pairs.items():
            items.sort()
            dst, best, m = [], [], -1
            for j, i in items:
                m = max(m, i)
                dst.append(j)
                best.append(m)
            self.table[key] = (dst, best)

    def before(self, w: Action, a: Action) -> bool:
        (qw, i, nw), (qa, j, na) = self.pos[w], self.pos[a]
        w_ordered, a_ordered = self.ordered[qw], self.ordered[qa]
        if qw == qa and w_ordered:
            return i < j
        if not w_ordered or not a_ordered:
            # A transfer lane gives no order: the edge must leave w itself or reach a itself;
            # or, from an ordered stream, an edge into a from w's stream at or after w, or
            # from w into a's ordered stream at or before a.
            return nw * self.count + na in self.edges or (
                w_ordered and any(q == qw and k >= i for q, k in self.pred.get(na, ()))) or (
                a_ordered and any(q == qa and k <= j for q, k in self.succ.get(nw, ())))
        entry = self.table.get(qw * self.streams + qa)
        if entry is None:
            return False
        dst, best = entry
        n = bisect.bisect_right(dst, j)
        return n > 0 and best[n - 1] >= i


def _fail(sched: Schedule, pass_name: str, problem: str, mark: Action | None) -> ScheduleError:
    dry = sched.dry_run()
    if mark is not None and mark not in dry.steps and mark not in dry.blocked:
        mark = None  # an action missing from the lists cannot be drawn
    grid = sched.grid(mark=mark, window=_GRID_ROWS, dry=dry)
    return ScheduleError(f"after pass {pass_name!r}: {problem}\n{grid}")


def validate(sched: Schedule, pass_name: str = "?") -> None:
    """Raise :class:`ScheduleError` unless ``sched`` is well formed, ordered and deadlock free."""
    _check_structure(sched, pass_name)
    _check_coverage(sched, pass_name)
    _check_ordering(sched, pass_name)
    dry = sched.dry_run()
    if not dry.ok:
        heads = ", ".join(str(a) for a in dry.blocked[:6])
        raise _fail(sched, pass_name, f"deadlock: no stream can move; blocked heads: {heads}",
                    dry.blocked[0])


# --------------------------------------------------------------------------------------------
# 1-2. structure and coverage
# --------------------------------------------------------------------------------------------


def _check_structure(sched: Schedule, pass_name: str) -> None:
    if len(sched.actions) != sched.workers:
        raise ScheduleError(f"after pass {pass_name!r}: {len(sched.actions)} worker lists for "
                            f"{sched.workers} workers")
    seen: set[Action] = set()
    lists = [*((w, lst, None) for w, lst in enumerate(sched.actions)),
             (None, sched.host, "host"), (None, sched.network, "network")]
    for w, lst, lane in lists:
        for a in lst:
            if a.worker != w or (lane is not None and a.stream != lane):
                where = f"worker {w}" if w is not None else f"the host's {lane} lane"
                raise _fail(sched, pass_name, f"{a} is on the list of {where}", a)
            if a in seen:
                raise _fail(sched, pass_name, f"{a} appears twice", a)
            if not 0 <= a.stage < len(sched.stage_names):
                raise _fail(sched, pass_name, f"{a} names stage {a.stage} of "
                            f"{len(sched.stage_names)}", a)
            seen.add(a)
    for e in sched.edges:
        if e.src not in seen:
            raise _fail(sched, pass_name, f"{e.dst} waits ({e.kind}) for {e.src}, which is not "
                        "in the schedule: a wait without a matching record", e.dst)
        if e.dst not in seen:
            raise _fail(sched, pass_name, f"edge {e.kind} from {e.src} to {e.dst}, which is "
                        "not in the schedule", e.src)


def _check_coverage(sched: Schedule, pass_name: str) -> None:
    kinds = {(f.dst_kind, f.dst_stage) for f in sched.flows}
    kinds |= {(f.src_kind, f.src_stage) for f in sched.flows if not f.from_host}
    count = Counter((a.kind, a.stage, a.microbatch, a.round, a.step)
                    for lst in sched.actions for a in lst if a.is_compute)
    for key, n in count.items():
        if n > 1:
            raise _fail(sched, pass_name, f"compute {key} runs {n} times", None)
        if (key[0], key[1]) not in kinds:
            raise _fail(sched, pass_name, f"compute {key} is not in the dataflow", None)
    for ck, s in sorted(kinds):
        for k in range(sched.steps):
            for r in range(sched.rounds):
                for m in range(sched.microbatches):
                    if (ck, s, m, r, k) not in count:
                        raise _fail(sched, pass_name, f"{ck} of stage {s} microbatch {m} round "
                                    f"{r} step {k} never runs", None)
    if sched.stage_workers is not None:
        for w, lst in enumerate(sched.actions):
            for a in lst:
                if a.is_compute and sched.stage_workers[a.stage] != w:
                    raise _fail(sched, pass_name, f"{a}: stage {a.stage} is bound to worker "
                                f"{sched.stage_workers[a.stage]}", a)


# --------------------------------------------------------------------------------------------
# 3. ordering
# --------------------------------------------------------------------------------------------


def _check_ordering(sched: Schedule, pass_name: str) -> None:
    order = _Order(sched)
    applied = set(sched.passes)
    index: dict[tuple, Action] = {}
    for a in sched.all_actions():
        key = (a.worker, a.kind, a.what, a.stage, a.microbatch, a.round, a.step, a.value)
        index[key] = a
    compute: dict[tuple, Action] = {
        (a.kind, a.stage, a.microbatch, a.round, a.step): a
        for lst in sched.actions for a in lst if a.is_compute
    }

    def need(writer: Action | None, reader: Action, what: str) -> None:
        if writer is None:
            raise _fail(sched, pass_name, f"{reader} reads {what}, which nothing writes", reader)
        if not order.before(writer, reader):
            raise _fail(sched, pass_name, f"{reader} reads {what} written by {writer} without "
                        "waiting for it (no edge from the writer's stream)", reader)

    flows_into: dict[tuple[str, int], list] = {}
    for f in sched.flows:
        flows_into.setdefault((f.dst_kind, f.dst_stage), []).append(f)
    jobs: dict[tuple, list[Action]] = {}
    job_worker: dict[tuple, int | None] = {}
    for c in compute.values():
        jobs.setdefault((c.worker, c.stage, c.round, c.step), []).append(c)
        job_worker[(c.stage, c.round, c.step)] = c.worker

    for c in compute.values():
        m, r, k = c.microbatch, c.round, c.step
        for f in flows_into.get((c.kind, c.stage), ()):
            h2d = index.get((c.worker, "H2D", f.what, c.stage, m, r, k, f.value))
            if f.from_host:
                if "transfers" in applied:
                    need(h2d, c, f"host value {f.value}")
                continue
            p = compute[(f.src_kind, f.src_stage, m, r, k)]
            if p.worker == c.worker or "transfers" not in applied:
                need(p, c, f"{f.value} from {p}")
                continue
            need(h2d, c, f"{f.value} brought in by H2D")
            down = next((index[key] for key in [(p.worker, "D2H", w, p.stage, m, r, k, f.value)
                                                for w in ("act", "save", "igrad")]
                         if key in index), None)
            need(down, h2d, f"{f.value} on the host")
            need(p, down, f"{f.value} from {p}")

    if "upload" in applied:
        for w, lst in enumerate(sched.actions):
            ups = [a for a in lst if a.kind == "UP"]
            for n, up in enumerate(ups):
                key = (w, up.stage, up.round, up.step)
                evict = index.get((w, "EVICT", None, up.stage, None, up.round, up.step, None))
                for c in jobs.get(key, ()):
                    need(up, c, f"the weights of stage {up.stage}")
                    if evict is None or not order.before(c, evict):
                        raise _fail(sched, pass_name, f"{c} runs after its weights are evicted"
                                    f" ({evict})", c)
                if n >= 2:
                    old = ups[n - 2]
                    need(index.get((w, "EVICT", None, old.stage, None, old.round, old.step,
                                    None)), up, "a free weight slot (at most two resident)")
    if "grads" in applied:
        for a in sched.all_actions():
            if a.kind == "D2H" and a.what == "grad":
                for c in jobs.get((a.worker, a.stage, a.round, a.step), ()):
                    need(c, a, f"the gradients of {c}")
            elif a.kind == "ACC":
                w = job_worker.get((a.stage, a.round, a.step))
                down = index.get((w, "D2H", "grad", a.stage, None, a.round, a.step, None))
                need(down, a, f"the gradients of stage {a.stage} round {a.round}")
    if "reduce" in applied:
        # Every REDUCE of a step follows its stage's last ACC, and the step's first OPT (the
        # gradient check, which reads every gradient) waits for all of them.
        last = sched.rounds - 1
        first_opt: dict[int, Action] = {}
        for a in sched.host:
            if a.kind == "OPT":
                first_opt.setdefault(a.step, a)
        for red in sched.network:
            acc = index.get((None, "ACC", None, red.stage, None, last, red.step, None))
            need(acc, red, f"the last round's gradients of stage {red.stage}")
            # Async: step k+1's OPTs apply step k's gradients.
            opt = first_opt.get(red.step + (sched.optimizer == "async"))
            if opt is not None:
                need(red, opt, f"the reduced gradients of stage {red.stage}")
    if "optimizer" in applied:
        lag = 1  # UP(x, k) reads what SHADOW(x, k-1) wrote, in both modes (lower.add_optimizer)
        # Sync: OPT(s, k) applies step k's gradients of s; async: step k-1's, pending on the
        # host (nothing in a schedule's first step).
        behind = 0 if sched.optimizer == "sync" else 1
        for a in sched.host:
            if a.kind == "OPT" and a.step - behind >= 0:
                for r in range(sched.rounds):
                    acc = index.get((None, "ACC", None, a.stage, None, r, a.step - behind,
                                     None))
                    need(acc, a, f"round {r}'s accumulated gradients")
        opts = {(a.stage, a.step): a for a in sched.host if a.kind == "OPT"}
        shadows = {(a.stage, a.step): a for a in sched.host if a.kind == "SHADOW"}
        by_step: dict[int, list[Action]] = {}
        for (_, k), sh in shadows.items():
            by_step.setdefault(k, []).append(sh)
        opts_of_step: dict[int, list[tuple[int, Action]]] = {}
        for (y, ky), opt in opts.items():
            opts_of_step.setdefault(ky, []).append((y, opt))
        for (x, k), sh in shadows.items():
            for y, opt in opts_of_step.get(k, ()):
                if _overlap(sched.stage_units[x], sched.stage_units[y]):
                    need(opt, sh, f"the updated masters of stage {y}")
        for a in sched.all_actions():
            if a.kind != "UP":
                continue
            src = shadows.get((a.stage, a.step - lag))
            if src is not None:
                need(src, a, f"the shadow of stage {a.stage} from step {a.step - lag}")
            # Sync: a stage's own SHADOW of step k rewrites what its uploads of step k read.
            # Async (two copies of the shadow): the SHADOW of step k+1 of every stage
            # overlapping its units rewrites the copy step k read (the schedule does not
            # know ties; the lowering does).
            later = ([sh for sh in by_step.get(a.step + 1, [])
                      if _overlap(sched.stage_units[sh.stage], sched.stage_units[a.stage])]
                     if sched.optimizer == "async" else
                     [sh for sh in (shadows.get((a.stage, a.step)),) if sh is not None])
            for nxt in later:
                if not order.before(a, nxt):
                    raise _fail(sched, pass_name, f"{nxt} overwrites the shadow that {a} "
                                "reads without waiting for it", a)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]
