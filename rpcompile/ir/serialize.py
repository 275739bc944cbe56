"""A schedule's written forms: CSV (one row per action), JSON (a Chrome trace that carries
the whole schedule), the step x worker grid as text, a PNG timeline, and the files they are
dumped to and loaded from. Each form loads back into an equal Schedule (except the grid and
the picture, which are for people)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rpcompile.errors import InvalidInput
from rpcompile.ir.actions import STREAMS, Action, Edge, Flow

if TYPE_CHECKING:
    from rpcompile.ir.schedule import Schedule

__all__ = [
    "ScheduleFormats",
]


class ScheduleFormats:
    """The CSV, JSON and file forms of a :class:`~rpcompile.ir.schedule.Schedule`, which
    inherits them; they read the schedule through its fields and views."""

    # -- CSV -----------------------------------------------------------------------------
    def to_csv(self) -> str:
        """Header lines ``# key: json`` with the metadata, then one row per action:
        ``worker,index,stream,action,waits`` where waits is ``kind=<action>`` joined by ``;``."""
        buf = io.StringIO()
        for key, val in self._meta().items():
            buf.write(f"# {key}: {json.dumps(val)}\n")
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["worker", "index", "stream", "action", "waits"])
        waits = self.waits()
        lists = [*((lst, str(w)) for w, lst in enumerate(self.actions)), (self.host, "host"),
                 (self.network, "host")]
        for lst, who in lists:
            for i, a in enumerate(lst):
                w = ";".join(f"{e.kind}={e.src}" for e in waits.get(a, ()))
                writer.writerow([who, i, a.stream, str(a), w])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        meta: dict = {}
        body = []
        for line in text.splitlines():
            if line.startswith("# "):
                key, _, val = line[2:].partition(": ")
                meta[key] = json.loads(val)
            elif line.strip():
                body.append(line)
        rows = list(csv.DictReader(body))
        per_worker: list[list[Action]] = [[] for _ in range(meta["workers"])]
        host: list[Action] = []
        network: list[Action] = []
        edges: list[Edge] = []
        for row in rows:
            a = Action.parse(row["action"])
            if row["worker"] != "host":
                per_worker[int(row["worker"])].append(a)
            else:
                (network if a.stream == "network" else host).append(a)
            for item in filter(None, row["waits"].split(";")):
                kind, _, src = item.partition("=")
                edges.append(Edge(Action.parse(src), a, kind))
        return cls._from_meta(meta, per_worker, host, edges, network)

    # -- JSON (Chrome trace) -------------------------------------------------------------
    def to_json(self, timeline: Mapping[Action, tuple[float, float]] | None = None) -> dict:
        """A Chrome trace (``traceEvents``; open in Perfetto or chrome://tracing): one process
        per worker (and the host), one thread per stream, one ``X`` event per action, one flow
        arrow per edge. Times come
        from ``timeline`` (action -> (start_ms, end_ms), e.g. from the simulator) or else from
        the dry run (1 step = 1 ms). The whole schedule rides along under ``rpcompile`` so the
        file loads back with :meth:`from_json`."""
        if timeline is None:
            dry = self.dry_run()
            timeline = {a: (float(t), float(t) + 1.0) for a, t in dry.steps.items()}
        events: list[dict] = []
        host_pid = self.workers
        for pid in range(self.workers + 1):
            name = "host" if pid == host_pid else f"worker {pid}"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            for tid, stream in enumerate(STREAMS):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": stream}})
        waits = self.waits()

        def lane(a: Action) -> dict:
            return {"pid": host_pid if a.worker is None else a.worker,
                    "tid": STREAMS.index(a.stream)}

        for a in self.all_actions():
            if a not in timeline:
                continue
            start, end = timeline[a]
            events.append({
                "ph": "X", "name": a.short(), "cat": a.kind, **lane(a),
                "ts": start * 1000.0, "dur": max(end - start, 0.0) * 1000.0,
                "args": {"action": str(a), "waits": [f"{e.kind}={e.src}" for e in waits.get(a, ())]},
            })
        # Edges as flow arrows (Perfetto draws them from the waited-on slice to the waiter).
        for n, e in enumerate(self.edges):
            if e.src in timeline and e.dst in timeline:
                events.append({"ph": "s", "id": n, "name": e.kind, "cat": "edge", **lane(e.src),
                               "ts": timeline[e.src][0] * 1000.0})
                events.append({"ph": "f", "bp": "e", "id": n, "name": e.kind, "cat": "edge",
                               **lane(e.dst), "ts": timeline[e.dst][0] * 1000.0})
        doc = {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "rpcompile": {
                **self._meta(),
                "actions": [[str(a) for a in lst] for lst in self.actions],
                "host": [str(a) for a in self.host],
                **({"network": [str(a) for a in self.network]} if self.network else {}),
                "edges": [[str(e.src), str(e.dst), e.kind] for e in self.edges],
            },
        }
        return doc

    @classmethod
    def from_json(cls, doc: dict | str) -> Schedule:
        if isinstance(doc, str):
            doc = json.loads(doc)
        if "rpcompile" not in doc:
            raise InvalidInput("this JSON trace holds no schedule (no 'rpcompile' key); only "
                             "traces written by Schedule.dump / to_json load back")
        body = doc["rpcompile"]
        per_worker = [[Action.parse(s) for s in lst] for lst in body["actions"]]
        host = [Action.parse(s) for s in body["host"]]
        edges = [Edge(Action.parse(s), Action.parse(d), k) for s, d, k in body["edges"]]
        network = [Action.parse(s) for s in body.get("network", ())]
        return cls._from_meta(body, per_worker, host, edges, network)

    # -- files ---------------------------------------------------------------------------
    def dump(self, path: str | os.PathLike,
             timeline: Mapping[Action, tuple[float, float]] | None = None) -> None:
        """Write by extension: ``.csv``, ``.json`` (Chrome trace), ``.txt`` (grid), ``.png``."""
        p = os.fspath(path)
        ext = os.path.splitext(p)[1].lower()
        if ext == ".csv":
            text = self.to_csv()
        elif ext == ".json":
            text = json.dumps(self.to_json(timeline))
        elif ext == ".txt":
            text = self.grid() + "\n"
        elif ext == ".png":
            from rpcompile._draw import draw_timeline

            draw_timeline(self, p, timeline, STREAMS)
            return
        else:
            raise InvalidInput(f"cannot dump a schedule to {p!r}: use .csv, .json, .txt or .png")
        with open(p, "w") as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Schedule:
        p = os.fspath(path)
        with open(p) as f:
            text = f.read()
        if p.lower().endswith(".csv"):
            return cls.from_csv(text)
        if p.lower().endswith(".json"):
            return cls.from_json(text)
        raise InvalidInput(f"cannot load a schedule from {p!r}: use .csv or .json")

    # -- helpers -------------------------------------------------------------------------
    def _meta(self) -> dict:
        return {
            "kind": self.kind, "workers": self.workers, "microbatches": self.microbatches,
            "rounds": self.rounds, "steps": self.steps, "optimizer": self.optimizer,
            "stage_names": list(self.stage_names),
            "stage_units": [list(u) for u in self.stage_units],
            "stage_workers": None if self.stage_workers is None else list(self.stage_workers),
            "passes": list(self.passes),
            "flows": [dataclasses.asdict(f) for f in self.flows],
            # Written only for data parallel, so one-process schedules read as before.
            **({"ranks": self.ranks} if self.ranks != 1 else {}),
            **({"sharded": True} if self.sharded else {}),
            **({"repeat_from": self.repeat_from} if self.repeat_from else {}),
            **({"repeat_until": self.repeat_until} if self.repeat_until else {}),
            **({"staging": [[str(a), slot] for a, slot in self.staging],
                "staging_bytes": list(self.staging_bytes)} if self.staging_bytes else {}),
        }

    @classmethod
    def _from_meta(cls, meta: dict, per_worker: list[list[Action]], host: list[Action],
                   edges: list[Edge], network: list[Action] = ()) -> Schedule:
        sw = meta.get("stage_workers")
        return cls(
            kind=meta["kind"], workers=meta["workers"], microbatches=meta["microbatches"],
            rounds=meta["rounds"], steps=meta["steps"], optimizer=meta["optimizer"],
            stage_names=tuple(meta["stage_names"]),
            stage_units=tuple(tuple(u) for u in meta["stage_units"]),
            flows=tuple(Flow(**f) for f in meta["flows"]),
            actions=tuple(tuple(lst) for lst in per_worker), host=tuple(host),
            edges=tuple(edges), stage_workers=None if sw is None else tuple(sw),
            passes=tuple(meta["passes"]), network=tuple(network),
            ranks=int(meta.get("ranks", 1)), sharded=bool(meta.get("sharded", False)),
            repeat_from=int(meta.get("repeat_from", 0)),
            repeat_until=int(meta.get("repeat_until", 0)),
            staging=tuple((Action.parse(a), int(slot)) for a, slot in meta.get("staging", ())),
            staging_bytes=tuple(int(n) for n in meta.get("staging_bytes", ())),
        )
