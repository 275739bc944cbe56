"""One state, as one process would hold it, from every rank's shard of a sharded
data-parallel trainer (a per-rank checkpoint's files, or the shards gathered to rank 0)."""

from __future__ import annotations

from typing import Any

import torch

from rpcompile.runtime.checkpoint.format import CheckpointError

__all__ = [
    "merge_shards",
]


def merge_shards(store: Any, parts: list[dict[str, Any]], *,
                 complete: bool = True, strict: bool = True) -> dict[str, Any]:
    """One state, as one process would hold it, from every rank's shard (``gather_state``).
    Optimizer parameters are indexed group by group, each group's parameters in the store's
    order (what one process's optimizer over the same factory indexes). Raises
    ``CheckpointError`` on a set of shards that is empty, incomplete, overlaps, or
    disagrees, and (``strict``) on a parameter that is not trainable in ``store``'s model;
    ``strict=False`` leaves such parameters out (masters and optimizer state).
    ``complete=False``: some ranks' shards only (a per-rank checkpoint's files that a rank
    needs); the state then holds their parameters alone."""
    if not parts:
        raise CheckpointError("no shards to merge (no file of the checkpoint was read)",
                              "shards")
    order = {s.name: s.master_offset for s in store.trainable_slots}
    named = {n for p in parts for n in [*p["state"]["masters"], *p["names"].values()]}
    unknown = sorted(named - set(order))
    if unknown and strict:
        raise CheckpointError(
            f"the shards hold {len(unknown)} parameters that are not trainable parameters of "
            f"this model ({unknown[:3]}): pass strict=False to ignore them", "shards")
    world = parts[0]["world"]
    ranks = sorted(p["rank"] for p in parts)
    if (ranks != list(range(world)) if complete else len(set(ranks)) != len(ranks)) or any(
            p["world"] != world or p["bounds"] != parts[0]["bounds"] for p in parts):
        raise CheckpointError("the shards gathered for the checkpoint are not one set (ranks "
                              f"{sorted(p['rank'] for p in parts)} of {world}, or their bounds "
                              "differ)", "shards")
    masters: dict[str, torch.Tensor] = {}
    for p in parts:
        for name, value in p["state"]["masters"].items():
            if name in masters:
                raise CheckpointError(f"parameter {name!r} is in two shards", "shards")
            if name in order:
                masters[name] = value
    missing = [n for n in order if n not in masters]
    if missing and complete:
        raise CheckpointError(f"the shards lack {len(missing)} trainable parameters "
                              f"({missing[:3]})", "shards")
    first = parts[0]["state"]
    ngroups = len(first["optimizer"]["param_groups"])
    if any(len(p["state"]["optimizer"]["param_groups"]) != ngroups for p in parts):
        raise CheckpointError("the ranks' optimizers have different numbers of parameter "
                              "groups", "optimizer.param_groups")
    members: list[list[str]] = [[] for _ in range(ngroups)]
    entries: dict[str, Any] = {}
    for p in parts:
        optim = p["state"]["optimizer"]
        for g, group in enumerate(optim["param_groups"]):
            members[g].extend(p["names"][i] for i in group["params"]
                              if p["names"][i] in order)
        for i, entry in optim["state"].items():
            if p["names"][i] in order:
                entries[p["names"][i]] = entry
    names: list[str] = []
    groups = []
    for g, group in enumerate(first["optimizer"]["param_groups"]):
        ordered = sorted(members[g], key=order.__getitem__)
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(len(names), len(names) + len(ordered)))})
        names.extend(ordered)
    state = dict(first)
    state["masters"] = {n: masters[n] for n in sorted(masters, key=order.__getitem__)}
    state["optimizer"] = {"state": {i: entries[n] for i, n in enumerate(names) if n in entries},
                          "param_groups": groups}
    state["param_names"] = names
    return state
