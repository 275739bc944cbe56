"""The output folder of ``rpcompile train``: one folder holds one run.

Sections, in reading order:

1. identity: ``run.json`` marks a folder as a run's and records what the run is: the model
   (its folder's config and tokenizer files by content, its weight files by name and size),
   the data files by content (sha256) and the compute dtype. The run's options are in
   ``config.yaml`` beside it; :data:`MAY_CHANGE` lists those a resume may change, every other
   one is part of the run's trajectory.
2. claiming a folder for a new run: an empty or new folder is taken; one that holds another
   run is refused unless ``--overwrite`` (which deletes that run's files first); a folder
   with files rpcompile did not write is refused either way. A run that fails before its
   first step removes what it created, so no empty folder is left behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpcompile.errors import InvalidInput

__all__ = ["MAY_CHANGE", "RUN_FILE", "RunFolder", "file_sha256", "model_fingerprint",
           "read_identity"]

RUN_FILE = "run.json"
FORMAT = "rpcompile-run"
VERSION = 1
# What rpcompile writes into a run folder: a folder holding only these is a run's (with
# ``.final.*``, final/ being replaced).
_RUN_ENTRIES = {RUN_FILE, "config.yaml", "checkpoints", "final", "base", "metrics.jsonl",
                "tensorboard", "wandb", "mlflow.db", "loss.png", "summary.json", "schedule.csv",
                "schedule.json", "schedule.png"}


def _ours(name: str) -> bool:
    return name in _RUN_ENTRIES or name.startswith(".final.")

# Options a resumed run may change: how long it runs, what it logs and saves, and where it
# computes (a plan for other workers trains the same masters on the same batches, split the
# same way: --microbatches is the run's). Every other option is part of the trajectory.
MAY_CHANGE = ("steps", "epochs", "eval_every", "save_every", "keep_last", "workers", "device",
              "kernels", "chaos", "recompute", "host_memory", "undo_journal", "shard_optimizer",
              "checkpoint_per_rank", "report_to", "merge", "search_effort", "plan_cache",
              "quiet")


# ---------------------------------------------------------------------------------------------
# 1. identity
# ---------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


_MODEL_TEXT = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "adapter_config.json")
_WEIGHTS = ("*.safetensors", "*.bin")


def model_fingerprint(folder: str | Path) -> str:
    """sha256 over a model folder's config and tokenizer files and its weight files' names
    and sizes (the weights are not read: a changed config, tokenizer or set of weight files
    is what tells another model apart without reading gigabytes)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in _MODEL_TEXT:
        if (folder / name).is_file():
            digest.update(f"{name}\0".encode() + (folder / name).read_bytes() + b"\0")
    for pattern in _WEIGHTS:
        for file in sorted(folder.glob(pattern)):
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
    return digest.hexdigest()


def read_identity(folder: Path) -> dict[str, Any] | None:
    """The identity ``run.json`` records in ``folder`` (None: no run.json); raises
    ``ValueError`` for one that is not readable."""
    path = folder / RUN_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidInput(f"{path} is unreadable ({err}): it records which run {folder} "
                         "holds; restore it, or start the run again in a new --out") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidInput(f"{path} is not an rpcompile run record")
    return data


# ---------------------------------------------------------------------------------------------
# 2. claiming a folder
# ---------------------------------------------------------------------------------------------


@dataclass
class RunFolder:
    """The run folder ``path`` and what this process created in it (so that a run that fails
    before its first step removes it)."""

    path: Path
    created: Path | None = None  # the outermost folder this run created, if any
    resumed: bool = False

    @classmethod
    def start(cls, path: Path, *, overwrite: bool, lead: bool = True) -> RunFolder:
        """Claim ``path`` for a new run (see the module doc) and mark it with ``run.json``.
        ``lead`` False (a data-parallel rank other than 0): nothing is written."""
        if not lead:
            return cls(path)
        if path.exists() and not path.is_dir():
            raise InvalidInput(f"--out {path} is a file, not a folder: give a folder for the run")
        held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        if held:
            foreign = [n for n in held if not _ours(n)]
            if foreign:
                raise InvalidInput(
                    f"--out {path} holds files that are not an rpcompile run's "
                    f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}): give an "
                    "empty or new folder (--overwrite deletes only a run's files)")
            if not overwrite:
                raise InvalidInput(
                    f"--out {path} already holds a run ({', '.join(held[:4])}"
                    f"{', ...' if len(held) > 4 else ''}); a folder holds one "
                    f"run: give a new --out, continue that run with --resume {path}, or pass "
                    "--overwrite to delete its files and start over")
            for name in held:
                child = path / name
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        created = None
        if not path.exists():
            created = path
            while not created.parent.exists():
                created = created.parent
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / RUN_FILE).write_text(json.dumps({"format": FORMAT, "version": VERSION}))
        except OSError as err:
            raise InvalidInput(f"cannot write to --out {path}: {err.strerror or err}; give a "
                             "folder this process can write") from None
        return cls(path, created)

    @classmethod
    def resume(cls, path: Path) -> RunFolder:
        return cls(path, resumed=True)

    def record(self, identity: dict[str, Any]) -> None:
        """Write the run's identity into ``run.json`` (see the module doc)."""
        (self.path / RUN_FILE).write_text(json.dumps(
            {"format": FORMAT, "version": VERSION, **identity}, indent=1, sort_keys=True))

    def abandon(self) -> None:
        """A new run failed before its first step: remove what it created (the folder, or its
        contents when the folder was there before)."""
        if self.resumed:
            return
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        if self.path.is_dir():
            for child in self.path.iterdir():
                if _ours(child.name):
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
