"""A trainer's state: this rank's masters and optimizer state, gathered or applied across data
parallel ranks, as state dicts and checkpoints."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

from rpcompile.errors import InvalidInput

if TYPE_CHECKING:
    import torch
from rpcompile.runtime.trainer.plan_shape import _comparable, plan_summary

__all__ = [
    "TrainerState",
]


class TrainerState:
    """The state methods of :class:`~rpcompile.runtime.trainer.core.Trainer` (its base):
    they read the attributes the trainer builds."""

    # -- checkpoints -------------------------------------------------------------------------
    def _local_state(self) -> dict[str, Any]:
        """This rank's state (sharded: its shard), copies, once every queued update has run."""
        from rpcompile.runtime.checkpoint import optimizer_param_names

        self._settle()
        state = copy.deepcopy(self.driver.state_dict())
        state["param_names"] = optimizer_param_names(self.store, self.optimizer)
        state["plan"] = plan_summary(self.compiled)
        state["executor_steps"] = self.executor.steps_run
        return state

    def state_dict(self) -> dict[str, Any]:
        """Masters, optimizer state, step counter, mode and a plan summary: a snapshot
        (copies), unlike ``torch.optim.Optimizer.state_dict`` whose tensors later steps
        would keep changing. ``param_names`` names the optimizer's parameters by index.
        Sharded: a collective (call it on every rank); rank 0 gets the whole state, as one
        process holds it (so it loads on any number of ranks), the other ranks None; a rank
        that fails makes every rank raise ``CheckpointFailed``."""
        if not self.sharded:
            return self._local_state()
        return self._state_across_ranks("the state_dict")

    def settle_across_ranks(self, what: str) -> None:
        """Data parallel: finish this rank's queued updates and agree that every rank did (a
        failure anywhere raises ``CheckpointFailed`` everywhere), before a collective that
        a rank with a failed update would skip (``save_pretrained``'s gather)."""
        self._state_across_ranks(what, gather=False, keep=False)

    def _state_across_ranks(self, what: str, gather: bool = True,
                            keep: bool = True) -> dict[str, Any] | None:
        """Data parallel: every rank's state taken and agreed (a failure anywhere raises
        ``CheckpointFailed`` everywhere), then, sharded, gathered to rank 0 (the others get
        None) and agreed again (rank 0's merge may refuse the set). ``keep=False``
        (replicated, a rank other than 0, whose state rank 0 writes): no copy is taken, only
        the queued updates are finished (what could fail), and None comes back. An
        interrupt in this rank's part is announced to the others (``DataParallel.
        interrupted``: they raise ``CheckpointFailed`` at once) and re-raised here."""
        from rpcompile.runtime.distributed import RankFailed

        dp = self.dp
        dp.check()
        state, error = None, None
        try:
            if keep:
                state = self._local_state()
            else:
                self._settle()
        except Exception as exc:  # every failure must reach the agreement
            error = exc
        except BaseException as exc:
            dp.interrupted(exc, what)
            raise
        dp.settle(error, what)
        if not self.sharded or not gather:
            return state
        whole, error = None, None
        try:
            whole = dp.gather_state(state, self.optimizer)
        except RankFailed:
            raise
        except Exception as exc:
            error = exc
        except BaseException as exc:
            dp.interrupted(exc, what)
            raise
        dp.settle(error, f"{what} (the gather of the shards to rank 0)")
        return whole

    def prepare_state(self, state: dict[str, Any], *, strict: bool = True,
                      allow_nonfinite: bool = False, partial: bool = False) -> dict[str, Any]:
        """``state`` checked against this trainer and made ready for :meth:`apply_state`,
        changing nothing: the optimizer state matched to this optimizer by the parameter
        names it records (sharded: cut to this rank's shard), then everything validated
        (:func:`~rpcompile.runtime.checkpoint.validate_state`). Raises ``CheckpointError``
        naming the key or the parameters. ``partial`` (sharded): ``state`` holds only some
        ranks' shards, those with this rank's parameters (a per-rank checkpoint's files)."""
        from rpcompile.runtime.checkpoint import match_optimizer_state, validate_state

        # After a failed step without the undo journal what it left (pending gradients) is
        # dropped, not applied: the state loaded replaces masters, optimizer state, shadows
        # and the pending buffer (apply_state).
        if not self._refused:
            self._settle()
        if partial and not self.sharded:
            raise InvalidInput("a partial state (some ranks' shards) loads only into a sharded "
                             "trainer, which needs no more than its own shard")
        if self.sharded:
            state = self.dp.shard_state(state, self.optimizer, strict=strict, partial=partial)
        elif isinstance(state, dict):
            state = match_optimizer_state(self.store, state, self.optimizer, strict=strict)
        validate_state(self, state, strict=strict, allow_nonfinite=allow_nonfinite)
        mine = plan_summary(self.compiled)
        theirs = state.get("plan")
        if theirs is not None and _comparable(theirs) != _comparable(mine):
            diff = [k for k in mine if _comparable(mine).get(k) != _comparable(theirs).get(k)]
            warnings.warn(
                f"loading a checkpoint saved under another plan (differs in {diff}); masters "
                "and optimizer state are per parameter, so they load, but the step will run "
                "under this trainer's plan",
                RuntimeWarning,
                stacklevel=3,
            )
        return state

    def apply_state(self, state: dict[str, Any]) -> None:
        """Apply a :meth:`prepare_state`-d state. Sharded: a collective (the shadows of every
        rank's shard are gathered)."""
        steps = int(state.get("executor_steps", state["step"]))
        before = self.store.shadow_version
        if self.executor.paired:  # the saved shadow is what the next step reads: its copy
            self.store.shadow_version = steps % 2
        try:
            self.driver.load_state_dict(state)
        except BaseException:
            self.store.shadow_version = before
            raise
        if self.sharded:  # every rank loaded its own shard's shadows: bring the others'
            self.dp.gather_shadows(None, in_step=False)
        self.executor.steps_run = steps
        self.executor.reset_scales()
        self._refused = ""  # masters, optimizer state and shadows are the saved ones

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        """Drive ``optimizer``, an earlier trainer's over the same model, instead of the one
        this trainer built (a new plan's trainer takes over the running one's): whatever
        holds that object, an lr scheduler, goes on driving the run. ``names``: the name of
        its parameter at each index, group by group (``state_dict()["param_names"]``). Each
        parameter becomes this store's master of that name and its state is emptied, since
        torch keys the state by the parameter tensor: load the state next
        (:meth:`load_state_dict`), which fills it and the groups' hyperparameters again."""
        masters = dict(self.store.named_masters())
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if type(optimizer) is not type(self.optimizer) or count != len(names) \
                or sorted(names) != sorted(masters):
            raise InvalidInput(
                f"adopt_optimizer: the {type(optimizer).__name__} given ({count} parameters) "
                f"is not an optimizer of this trainer's kind ({type(self.optimizer).__name__}) "
                f"over its {len(masters)} trainable masters, named as given")
        at = iter(names)
        for group in optimizer.param_groups:
            group["params"] = [masters[next(at)] for _ in group["params"]]
        optimizer.state.clear()
        self.driver.optimizer = optimizer

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True,
                        allow_nonfinite: bool = False) -> None:
        """Restore :meth:`state_dict` from a trainer over the same model. Everything is
        validated first (:meth:`prepare_state`: optimizer state matched by parameter name,
        names, shapes, finiteness, optimizer structure, mode); a bad state raises
        ``CheckpointError`` naming the key and changes nothing. ``strict=False`` ignores
        unknown keys and parameters; ``allow_nonfinite=True`` accepts inf/NaN masters and
        optimizer state. Data parallel: a collective (call it on every rank): the ranks agree
        that every rank's state validated before any changes anything, and a refusal on any
        rank is a ``CheckpointFailed`` on every rank."""
        if self.dp is not None:
            self.dp.check()
        prepared, error = None, None
        try:
            prepared = self.prepare_state(state, strict=strict, allow_nonfinite=allow_nonfinite)
            # torch's Optimizer.load_state_dict keeps the given tensors (same dtype and
            # device): copy them, or the caller's state dict would change with every update.
            prepared["optimizer"] = copy.deepcopy(prepared["optimizer"])
        except Exception as exc:  # every failure must reach the agreement
            if self.dp is None:
                raise
            error = exc
        except BaseException as exc:
            if self.dp is not None:  # the others must not wait for this rank's agreement
                self.dp.interrupted(exc, "loading a state dict")
            raise
        if self.dp is not None:
            self.dp.settle(error, "loading a state dict")
        self.apply_state(prepared)

    def save_checkpoint(self, path: Any, *, extra: dict[str, Any] | None = None,
                        per_rank: bool = False) -> Any:
        """Write a checkpoint folder atomically (:mod:`rpcompile.runtime.checkpoint`); returns
        its path. Data parallel: a collective (call it on every rank): every rank takes its
        state (sharded: the shards are gathered to rank 0), rank 0 alone writes one ordinary
        checkpoint (loadable on any number of ranks), and the ranks agree on the outcome at
        each phase, so a failure on any rank (rank 0's write included) raises
        ``CheckpointFailed`` on every rank, naming the rank and its error, and nothing was
        saved; the path comes back only once the checkpoint is on disk. ``per_rank=True``
        (sharded): every rank writes its own shard to its own file in the checkpoint folder,
        and rank 0 the manifest that lists them, so no rank holds more than its shard; the
        folder must be one every rank can write (a file system shared by the servers). It
        loads like any checkpoint, on any number of ranks."""
        from pathlib import Path

        from rpcompile.runtime import checkpoint

        if per_rank and not self.sharded:
            raise InvalidInput("per_rank=True writes one file per rank of a sharded state "
                             "(shard_optimizer=True on more than one rank); this state is "
                             "whole on every rank: save it with per_rank=False")
        if per_rank:
            return self._save_per_rank(Path(path), extra)
        if self.dp is None:
            return checkpoint.save(self, path, extra=extra)
        what = f"the checkpoint {Path(path)}"
        # Replicated, rank 0's state is every rank's: the others take no copy of theirs.
        state = self._state_across_ranks(what, keep=self.sharded or self.dp.rank == 0)
        error = None
        if self.dp.rank == 0:
            try:
                checkpoint.save(self, path, extra=extra, state=state)
            except Exception as exc:  # every failure must reach the agreement
                error = exc
            except BaseException as exc:
                self.dp.interrupted(exc, f"writing {what}")
                raise
        self.dp.settle(error, f"writing {what} (rank 0 writes)")
        return Path(path)

    def _save_per_rank(self, final: Any, extra: dict[str, Any] | None) -> Any:
        """``save_checkpoint(per_rank=True)``: each phase ends in an agreement, so a failure
        on any rank (a folder another rank cannot see included) fails every rank, and rank
        0 removes the temporary folder."""
        import shutil

        from rpcompile.runtime import checkpoint

        dp = self.dp
        what = f"the checkpoint {final}"
        state = self._state_across_ranks(what, gather=False)  # this rank's shard only
        tmp, error = None, None
        if dp.rank == 0:
            try:
                tmp = checkpoint.begin_folder(final)
            except Exception as exc:  # every failure must reach the agreement
                error = exc
            except BaseException as exc:
                dp.interrupted(exc, what)
                raise
        notes = dp.settle(error, f"{what} (rank 0 makes its folder)",
                          note="" if tmp is None else tmp.name)
        tmp = final.parent / notes[0]
        try:
            part, manifest, error = None, None, None
            try:
                part, manifest = checkpoint.write_shard(self, tmp, state, extra)
            except Exception as exc:
                error = exc
            except BaseException as exc:
                dp.interrupted(exc, f"writing {what}'s file on rank {dp.rank}")
                raise
            dp.settle(error, f"{what} (every rank writes its file into {tmp}, which needs a "
                      "folder every rank can write: a shared file system)")
            parts = dp.gather_to_first(part, f"the gather of {what}'s file list")
            error = None
            if dp.rank == 0:
                try:
                    checkpoint.finish_shards(tmp, final, manifest, parts, dp.bounds)
                except Exception as exc:
                    error = exc
                except BaseException as exc:
                    dp.interrupted(exc, f"writing {what}'s manifest")
                    raise
            dp.settle(error, f"writing {what}'s manifest (rank 0 writes it)")
        except BaseException:
            if dp.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def load_checkpoint(self, path: Any, *, strict: bool = True,
                        allow_nonfinite: bool = False) -> dict[str, Any]:
        """Restore a checkpoint folder; returns the ``extra`` dict it stored. Data parallel:
        a collective (call it on every rank): the ranks agree that every rank read and
        validated the same file before any changes anything."""
        from rpcompile.runtime import checkpoint

        if self.dp is not None:
            self.dp.check()
        return checkpoint.load(self, path, strict=strict, allow_nonfinite=allow_nonfinite)
