"""Where ``rpcompile train`` reports its metrics: TensorBoard, Weights & Biases, MLflow and
Trackio, each through its own library, imported only when named in ``--report-to``.

Every reporter takes the same calls: ``log(metrics, step)`` once per step (and per eval), then
``summary(metrics)`` once at the end, then ``close()``. Where each writes:

- ``tensorboard``: event files in ``OUT/tensorboard`` (``torch.utils.tensorboard``).
- ``wandb``: a run in ``OUT/wandb``, offline unless ``WANDB_MODE`` says otherwise
  (``wandb sync OUT/wandb/offline-run-*`` uploads it).
- ``mlflow``: a run of the experiment ``rpcompile`` at ``MLFLOW_TRACKING_URI``, or in a local
  SQLite store ``OUT/mlflow.db`` when that is unset
  (``mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db``).
- ``trackio``: a run of the project ``rpcompile`` in Trackio's local database (``TRACKIO_DIR``,
  default under the Hugging Face cache; ``trackio show`` opens it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rpcompile.errors import InvalidInput

__all__ = ["REPORTERS", "Reporter", "open_reporters", "parse_report_to", "require"]

REPORTERS = ("tensorboard", "wandb", "mlflow", "trackio")
PROJECT = "rpcompile"


def parse_report_to(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ``("tensorboard", "wandb")``; ``"none"`` -> ``()``. Unknown
    names are refused, naming the known ones."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == ["none"] or not names:
        return ()
    unknown = [n for n in names if n not in REPORTERS]
    if unknown or "none" in names:
        raise InvalidInput(f"--report-to {','.join(names)}: unknown {unknown or ['none']}; give "
                         f"a comma-separated list of {', '.join(REPORTERS)}, or none")
    return tuple(dict.fromkeys(names))


def require(names: Sequence[str]) -> None:
    """Refuse a reporter whose library is not installed, naming the extra that installs it."""
    import importlib.util

    for name in names:
        # Each reporter's package has the reporter's name, and so has the extra installing it
        # (tensorboard is a dependency of rpcompile itself).
        if importlib.util.find_spec(name) is None:
            install = "tensorboard" if name == "tensorboard" else f"'rpcompile[{name}]'"
            raise InvalidInput(f"--report-to {name} needs the {name} package: pip install "
                             f"{install} (or leave {name} out of --report-to)")


class Reporter:
    """One destination of the metrics (see the module doc)."""

    name = ""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def summary(self, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard(Reporter):
    name = "tensorboard"

    def __init__(self, out: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run drops the events of steps after its checkpoint.
        self.writer = SummaryWriter(str(out / "tensorboard"),
                                    purge_step=start + 1 if start else None)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in _numbers(metrics).items():
            group = "eval" if key.startswith("eval") else "train"
            self.writer.add_scalar(f"{group}/{key}", value, step)

    def summary(self, metrics: Mapping[str, float]) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(f"summary/{key}", value, 0)

    def close(self) -> None:
        self.writer.close()


class _WandB(Reporter):
    name = "wandb"

    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        import wandb

        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=PROJECT, name=out.name, dir=str(out),
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              config=dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def summary(self, metrics: Mapping[str, float]) -> None:
        for key, value in _numbers(metrics).items():
            self.run.summary[key] = value

    def close(self) -> None:
        self.run.finish()


class _MLflow(Reporter):
    name = "mlflow"

    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(PROJECT))
        self.run_id = self.client.create_run(experiment_id, run_name=out.name).info.run_id
        for key, value in config.items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, value, now, step) for key, value in _numbers(metrics).items()])

    def summary(self, metrics: Mapping[str, float]) -> None:
        for key, value in _numbers(metrics).items():
            self.client.set_tag(self.run_id, f"summary.{key}", repr(value))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio(Reporter):
    name = "trackio"

    def __init__(self, out: Path, config: Mapping[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=PROJECT, name=out.name, config=dict(config),
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def summary(self, metrics: Mapping[str, float]) -> None:
        self.run.log({f"summary/{k}": v for k, v in _numbers(metrics).items()})

    def close(self) -> None:
        self.run.finish()


def open_reporters(names: Sequence[str], out: Path, config: Mapping[str, Any],
                   start: int = 0) -> list[Reporter]:
    """The reporters ``names`` (from :func:`parse_report_to`) for the run in ``out``; every
    library is checked before any is opened, so a missing one stops the run before it trains."""
    require(names)
    made: list[Reporter] = []
    for name in names:
        if name == "tensorboard":
            made.append(_TensorBoard(out, start))
        elif name == "wandb":
            made.append(_WandB(out, config))
        elif name == "mlflow":
            made.append(_MLflow(out, config))
        else:
            made.append(_Trackio(out, config))
    return made
