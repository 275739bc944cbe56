"""CheckpointManager: one checkpoint folder per step under a root, the last K kept."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpcompile.errors import InvalidInput
from rpcompile.runtime.checkpoint.format import CheckpointError
from rpcompile.runtime.checkpoint.reading import read_manifest

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "CheckpointManager",
]


_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointManager:
    """Checkpoints ``root/step-NNNNNNNN``, keeping the last ``keep_last`` complete ones.

    ``save(compiled, step, extra=None)`` writes the step's folder atomically and only then
    prunes older ones (never the one just written; and temporary folders left by a killed
    write), so a kill at any moment leaves the previous checkpoints readable. ``latest()`` is
    the newest complete one; ``skipped()`` names the step folders passed over as unreadable,
    each with the reason."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidInput(f"keep_last must be a positive integer, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{int(step):08d}"

    def save(self, compiled: Compiled | Trainer, step: int,
             extra: Mapping[str, Any] | None = None, *, per_rank: bool = False) -> Path:
        path = compiled.save_checkpoint(self.path_for(step), extra=extra,
                                        **({"per_rank": True} if per_rank else {}))
        dp = getattr(getattr(compiled, "_trainer", compiled), "dp", None)
        if dp is None or dp.rank == 0:  # data parallel: rank 0 alone writes and prunes
            self._prune(Path(path))
        return Path(path)

    def _scan(self) -> tuple[list[Path], list[tuple[Path, str]]]:
        """(complete checkpoints oldest first, [(step folder, why it is unreadable)])."""
        if not self.root.is_dir():
            return [], []
        found, skipped = [], []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match is None or not child.is_dir():
                continue
            try:
                read_manifest(child)
            except CheckpointError as exc:
                skipped.append((child, str(exc)))
                continue
            found.append((int(match.group(1)), child))
        return [p for _, p in sorted(found)], sorted(skipped)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (a readable manifest), oldest first."""
        return self._scan()[0]

    def skipped(self) -> list[tuple[Path, str]]:
        """Step folders that are not complete checkpoints, with the reason (an unreadable or
        truncated manifest, say); :meth:`latest` passes over them."""
        return self._scan()[1]

    def latest(self) -> Path | None:
        done = self.checkpoints()
        return done[-1] if done else None

    def _prune(self, keep: Path) -> None:
        done = [p for p in self.checkpoints() if p != keep]
        for old in done[:max(0, len(done) + 1 - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
        mine = f"-{os.getpid()}-"
        for child in self.root.iterdir():
            # Temporary folders of killed writes (this process writes one at a time).
            if child.name.startswith(".step-") and ".tmp-" in child.name and mine not in child.name:
                shutil.rmtree(child, ignore_errors=True)
