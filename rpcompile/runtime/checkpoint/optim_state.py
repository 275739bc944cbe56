"""Optimizer state matched to an optimizer by parameter name.

**Optimizer state is matched by parameter name** (:func:`match_optimizer_state`) wherever
the state records ``param_names``, not by position; a state without names loads by position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.runtime.checkpoint.format import CheckpointError

if TYPE_CHECKING:
    from rpcompile.runtime.memory import HostStore

__all__ = [
    "match_optimizer_state",
    "optimizer_param_names",
]


def optimizer_param_names(store: HostStore, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of the parameter behind each of ``optimizer``'s indexes (group by group)."""
    by_id = {id(p): name for name, p in store.named_masters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def match_optimizer_state(store: HostStore, state: Mapping[str, Any],
                          optimizer: torch.optim.Optimizer, *, strict: bool = True,
                          require_names: bool = False, partial: bool = False) -> dict[str, Any]:
    """``state`` with its optimizer part indexed as ``optimizer`` indexes its parameters,
    matched by the parameter names the state records (``param_names``), not by position;
    only the parameters this store owns are kept (sharded: this rank's shard). Refused with
    a :class:`CheckpointError` naming the parameters: a group holding other parameters than
    this optimizer's group, a name recorded twice, a trainable parameter without masters,
    and (``strict``) a name that is not a trainable parameter here. A state without names
    (written before they were recorded) is returned as it is, matched by position, unless
    ``require_names``. ``partial``: the state holds only some ranks' shards (the files of a
    per-rank checkpoint that hold this store's parameters): only the parameters this store
    owns must have masters."""
    names = state.get("param_names")
    if names is None:
        if require_names:
            raise CheckpointError(
                "this checkpoint does not name its optimizer's parameters (written before "
                "sharded training existed): load it without shard_optimizer, save it again, "
                "then resume sharded", "param_names")
        return dict(state)
    optim = state.get("optimizer")
    if (not isinstance(optim, Mapping) or not isinstance(optim.get("param_groups"), (list, tuple))
            or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                       for g in optim["param_groups"])
            or not isinstance(optim.get("state"), Mapping)):
        return dict(state)  # validate_state names the malformed part
    theirs_groups = optim["param_groups"]
    count = sum(len(g["params"]) for g in theirs_groups)
    if (not isinstance(names, (list, tuple)) or len(names) != count
            or not all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"param_names must name each of the optimizer's {count} "
                              "parameters once", "param_names")
    ids = [i for g in theirs_groups for i in g["params"]]
    if sorted(ids, key=str) != sorted(range(count), key=str):
        raise CheckpointError("the checkpoint's optimizer groups do not index its parameters "
                              f"0..{count - 1} once each", "optimizer.param_groups")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CheckpointError(f"param_names names {twice[:3]} more than once", "param_names")
    trainable = {s.name for s in store.trainable_slots}
    masters = state.get("masters", {})
    required = {s.name for s in store.owned_slots} if partial else trainable
    missing = [n for n in sorted(required) if n not in masters]
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks the masters of {len(missing)} trainable parameters "
            f"({missing[:3]}): an incomplete set of shards, or another model", "masters")
    # Names with masters of their own are refused by validate_state, naming the master.
    unknown = sorted(set(names) - trainable - set(masters))
    if unknown and strict:
        raise CheckpointError(
            f"the checkpoint's optimizer holds state for {unknown[:3]}, which are not "
            "trainable parameters of this model (pass strict=False to ignore them)",
            "optimizer.param_names")
    owned = {s.name for s in store.owned_slots}
    ours_names = optimizer_param_names(store, optimizer)
    index_of = {name: i for i, name in enumerate(ours_names)}
    if len(theirs_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(theirs_groups)} parameter groups, this "
            f"one {len(optimizer.param_groups)}", "optimizer.param_groups")
    by_id = {id(p): name for name, p in store.named_masters()}
    groups = []
    for g, (theirs, ours) in enumerate(zip(theirs_groups, optimizer.param_groups)):
        wanted = {names[i] for i in theirs["params"]} & owned
        have = [by_id[id(p)] for p in ours["params"]]
        if set(have) != wanted:
            lack = sorted(set(have) - wanted)
            more = sorted(wanted - set(have))
            raise CheckpointError(
                f"optimizer group {g} holds other parameters than the checkpoint's group {g}"
                + (f": the checkpoint's lacks {lack[:3]}" if lack else "")
                + (f"{';' if lack else ':'} it has {more[:3]} in addition" if more else "")
                + " (build the optimizer's groups the same way)",
                f"optimizer.param_groups.{g}")
        groups.append({**{k: v for k, v in theirs.items() if k != "params"},
                       "params": [index_of[n] for n in have]})
    entries = {}
    for i, entry in optim["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(names):
            raise CheckpointError(f"optimizer state entry {i!r} has no parameter name",
                                  "optimizer.state")
        if names[i] in owned:
            entries[index_of[names[i]]] = entry
    out = dict(state)
    # Unknown names stay, for validate_state to refuse (strict) or ignore.
    out["masters"] = {n: v for n, v in masters.items() if n in owned or n not in trainable}
    out["optimizer"] = {"state": entries, "param_groups": groups}
    out["param_names"] = ours_names
    return out
