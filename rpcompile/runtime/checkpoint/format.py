"""The checkpoint format: what a checkpoint folder holds, how a trainer's state maps to
tensors and JSON, and the errors a refused checkpoint raises.

**Format.** A checkpoint is a folder with two files. ``state.safetensors`` holds every tensor:
``master/<name>`` (fp32 masters), ``shadow/<name>`` (async mode: the trainable shadows the next
step computes with), ``optim/<param index>/<key>`` (optimizer state tensors),
``optim_group/<group>/<key>`` (tensor hyperparameters), ``rng/torch`` and ``rng/cuda/<i>``
(generator states). ``manifest.json`` holds the rest: format and version, step counter, mode,
the executor's schedule-step counter, the plan's summary and its sha256 (the plan identity),
the dropout base seed, the optimizer's class and its non-tensor state and hyperparameters, the
name of the parameter behind each optimizer index (``optimizer.param_names``), how many ranks
wrote it and whether they were sharded (``ranks``, ``sharded``), the loss scaler's state, the
caller's ``extra`` dict, and the size and sha256 of the tensor file. No pickle anywhere:
loading runs no code from the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.runtime.errors import RuntimeFault

if TYPE_CHECKING:
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TENSORS",
    "VERSION",
    "CheckpointError",
    "CheckpointFailed",
    "plan_identity",
]


FORMAT = "rpcompile-checkpoint"
VERSION = 1
TENSORS = "state.safetensors"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeFault, ValueError):
    """A checkpoint is refused (or cannot be written); ``key`` names what is wrong."""

    def __init__(self, message: str, key: str | None = None) -> None:
        self.key = key
        super().__init__(message)


class CheckpointFailed(CheckpointError):
    """Data parallel: a save or load failed on one or more ranks, so it failed on every rank
    (nothing was saved, or nothing was loaded, anywhere, unless ``restart``: below). ``failures`` maps each rank that
    failed to what it raised; a rank that failed itself has its own error as the cause.
    ``restart``: a rank could not take part in the agreement (its data-parallel state was
    already broken by a failed step, or it was interrupted) and announced it instead, so
    the ranks' collectives are out of step and every rank must be restarted; then the
    outcome is not the same everywhere: rank 0's write of a save may have been committed
    (a complete checkpoint of the target name may exist), and a load may have been applied
    on some ranks and not others. Resume from the latest checkpoint on disk."""

    def __init__(self, what: str, failures: Mapping[int, str], world: int, *,
                 restart: bool = False) -> None:
        self.failures = dict(failures)
        self.world = world
        self.restart = restart
        listed = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        end = ("the ranks' collectives are now out of step: restart every rank (torchrun "
               "restarts them) and resume from the last checkpoint" if restart else
               "every rank stopped at the same point, nothing changed")
        super().__init__(f"{what} failed on {len(self.failures)} of {world} ranks ({listed}); "
                         + end, "ranks")


def _encode(value: Any, key: str) -> Any:
    """A JSON value for a hyperparameter or state entry (tuples are tagged to come back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{key}.{k}") for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {key!r}: a {type(value).__name__} is neither a tensor nor a JSON value "
        "(checkpoints hold no pickle)", key)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def plan_identity(summary: Mapping[str, Any]) -> str:
    """sha256 of the plan summary's canonical JSON."""
    text = json.dumps(_encode(dict(summary), "plan"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _split_state(trainer: Trainer, extra: Mapping[str, Any] | None,
                 state: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, manifest) of ``state`` (default: the trainer's current state)."""
    if state is None:
        state = trainer.state_dict()  # copies, once every queued update has run
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state["masters"].items():
        tensors[f"master/{name}"] = value
    for name, value in state.get("shadow", {}).items():
        tensors[f"shadow/{name}"] = value
    optim = state["optimizer"]
    optim_state: dict[str, dict[str, Any]] = {}
    for index, entry in optim["state"].items():
        plain: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                plain[key] = _encode(value, f"optimizer.state.{index}.{key}")
        optim_state[str(index)] = plain
    groups = []
    for g, group in enumerate(optim["param_groups"]):
        plain = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim_group/{g}/{key}"] = value
            else:
                plain[key] = _encode(value, f"optimizer.param_groups.{g}.{key}")
        groups.append(plain)
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, rng in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = rng
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}", "extra")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"extra is not JSON-serializable: {exc}", "extra") from None
    scaler = trainer.loss_scaler
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(state["step"]),
        "mode": state["mode"],
        "executor_steps": int(state["executor_steps"]),
        "plan": _encode(state["plan"], "plan"),
        "plan_id": plan_identity(state["plan"]),
        "dropout_seed": int(getattr(trainer.compiled.capture, "dropout_seed", 0)),
        "optimizer": {"class": type(trainer.optimizer).__name__, "state": optim_state,
                      "param_groups": groups, "param_names": list(state["param_names"])},
        "ranks": 1 if getattr(trainer, "dp", None) is None else int(trainer.dp.world),
        "sharded": bool(getattr(trainer, "sharded", False)),
        "loss_scale": None if scaler is None else _encode(scaler.state_dict(), "loss_scale"),
        "extra": dict(extra) if extra is not None else None,
        "torch_version": torch.__version__,
    }
    # safetensors stores each tensor on its own storage, contiguous, on the CPU.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return tensors, manifest
