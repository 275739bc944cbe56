"""A ``Trainer.state_dict()``-shaped state checked against a trainer before anything
changes: keys, mode, step, masters, shadows and the optimizer state's structure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.runtime.checkpoint.format import CheckpointError

if TYPE_CHECKING:
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "validate_state",
]


_STATE_KEYS = {"masters", "optimizer", "step", "mode", "plan", "executor_steps", "shadow",
               "param_names"}
# Optimizers whose state tensors (other than 0-d ones such as Adam's step) have the shape of
# their parameter; others (Adafactor's factored moments) are not shape-checked.
_SHAPED_STATE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                 "RAdam", "RMSprop", "Rprop")


def validate_state(trainer: Trainer, state: Any, *, strict: bool = True,
                   allow_nonfinite: bool = False) -> None:
    """Check a ``Trainer.state_dict()``-shaped ``state`` against ``trainer`` without changing
    anything: keys, mode, step, every master's name, shape and finiteness, the shadows (async),
    the optimizer state's structure. Raises :class:`CheckpointError` naming the first bad key.
    ``strict=False`` ignores unknown keys and masters; ``allow_nonfinite=True`` accepts inf/NaN."""

    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"state {key}: {why}; nothing was loaded", key)

    if not isinstance(state, Mapping):
        raise CheckpointError(f"a state dict must be a dict, got {type(state).__name__}")
    for key in ("masters", "optimizer", "step", "mode"):
        if key not in state:
            raise bad(repr(key), "missing")
    unknown = sorted(set(state) - _STATE_KEYS)
    if unknown and strict:
        raise bad(repr(unknown[0]), f"unknown key (unknown: {unknown}); pass strict=False to "
                  "ignore unknown keys")
    if state["mode"] != trainer.mode:
        raise bad("'mode'", f"saved in {state['mode']!r} mode, this trainer runs {trainer.mode!r}")
    for key in ("step", "executor_steps"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(repr(key), f"must be a non-negative integer, got {value!r}")

    store = trainer.store
    slots = {s.name: s for s in store.owned_slots}  # sharded: the state was cut to the shard

    def check_tensors(section: str, tensors: Any, required: bool) -> None:
        if not isinstance(tensors, Mapping):
            raise bad(repr(section), f"must be a dict of tensors, got {type(tensors).__name__}")
        missing = [n for n in slots if n not in tensors]
        if missing and required:
            raise bad(f"{section}[{missing[0]!r}]", f"missing ({len(missing)} trainable "
                      f"parameters missing: {missing[:3]}...)")
        for name, value in tensors.items():
            key = f"{section}[{name!r}]"
            if name not in slots:
                if strict:
                    raise bad(key, "not a trainable parameter of this model (pass strict=False "
                              "to ignore unknown parameters)")
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise bad(key, f"must be a floating-point tensor, got {_describe(value)}")
            if tuple(value.shape) != tuple(slots[name].shape):
                raise bad(key, f"shape {tuple(value.shape)} != the parameter's "
                          f"{tuple(slots[name].shape)}")
            if not allow_nonfinite and not bool(torch.isfinite(value).all()):
                raise bad(key, "holds inf or NaN (pass allow_nonfinite=True to load it anyway)")

    check_tensors("masters", state["masters"], required=True)
    if trainer.mode == "async":
        if "shadow" not in state:
            raise bad("'shadow'", "missing (an async checkpoint holds the shadows the next step "
                      "computes with)")
        check_tensors("shadow", state["shadow"], required=True)

    optim = state["optimizer"]
    if not isinstance(optim, Mapping) or "state" not in optim or "param_groups" not in optim:
        raise bad("'optimizer'", "must be an optimizer state_dict (with 'state' and "
                  "'param_groups')")
    mine = trainer.optimizer.param_groups
    groups = optim["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(mine):
        raise bad("optimizer['param_groups']", f"{len(groups)} groups, this optimizer has "
                  f"{len(mine)}")
    params: dict[int, torch.Tensor] = {}
    for g, (theirs, ours) in enumerate(zip(groups, mine)):
        ids = theirs.get("params") if isinstance(theirs, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(ours["params"]):
            raise bad(f"optimizer['param_groups'][{g}]['params']",
                      f"{'not a list' if not isinstance(ids, (list, tuple)) else len(ids)} "
                      f"parameters, this optimizer's group has {len(ours['params'])}")
        for i, p in zip(ids, ours["params"]):
            params[i] = p
    shaped = type(trainer.optimizer).__name__ in _SHAPED_STATE
    entries = optim["state"]
    if not isinstance(entries, Mapping):
        raise bad("optimizer['state']", "must be a dict")
    for index, entry in entries.items():
        key = f"optimizer['state'][{index!r}]"
        if index not in params:
            raise bad(key, f"no parameter {index!r} in the optimizer's groups")
        if not isinstance(entry, Mapping):
            raise bad(key, "must be a dict")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if shaped and value.dim() > 0 and tuple(value.shape) != tuple(params[index].shape):
                raise bad(f"{key}[{name!r}]", f"shape {tuple(value.shape)} != its parameter's "
                          f"{tuple(params[index].shape)}")
            if (not allow_nonfinite and value.is_floating_point()
                    and not bool(torch.isfinite(value).all())):
                raise bad(f"{key}[{name!r}]", "holds inf or NaN (pass allow_nonfinite=True to "
                          "load it anyway)")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__
