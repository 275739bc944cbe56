"""A compiled model's trained state in and out: state dicts, checkpoints, the trained weights
written back into the model and saved with Hugging Face."""

from __future__ import annotations

from typing import Any

import torch

from rpcompile.errors import InvalidInput

__all__ = [
    "CompiledState",
]


class CompiledState:
    """The state methods of :class:`~rpcompile.compiler.compiled.Compiled` (its base): they
    read the attributes and call the methods Compiled has."""

    def _finished_trainer(self) -> Any:
        # After close() the masters and optimizer state are still there to read.
        return self._trainer if self._closed and self._trainer is not None else self.trainer()

    def state_dict(self) -> dict[str, Any]:
        """Masters, optimizer state, step counter and a plan summary."""
        self._need_plan("state_dict()")
        return self._finished_trainer().state_dict()

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True,
                        allow_nonfinite: bool = False) -> None:
        """Restore :meth:`state_dict` (validated first: a bad state changes nothing). Before
        any plan, the plan is made for the shape the state was trained at."""
        self._plan_saved_shape(state.get("plan"))
        self.trainer().load_state_dict(state, strict=strict, allow_nonfinite=allow_nonfinite)

    def _plan_saved_shape(self, summary: dict[str, Any] | None) -> None:
        if self.plan is not None or self._closed:
            return
        if not summary or "microbatch_size" not in summary:
            self._need_plan("loading a state without a plan summary")
        self._plan_shape((int(summary["microbatch_size"]), int(summary["seq_len"])),
                         "the shape the loaded state was trained at")

    def save_checkpoint(self, path: Any, *, extra: dict[str, Any] | None = None,
                        per_rank: bool = False) -> Any:
        """Write masters, optimizer state, step counter, RNG states, loss-scale state, the
        plan's identity and ``extra`` (a JSON-serializable dict) to the folder ``path``
        atomically, in safetensors + a JSON manifest (:mod:`rpcompile.runtime.checkpoint`).
        Returns the folder's path. ``per_rank=True`` (sharded data parallel): one file per
        rank plus a manifest (``Trainer.save_checkpoint``)."""
        self._need_plan("save_checkpoint()")
        return self._finished_trainer().save_checkpoint(path, extra=extra, per_rank=per_rank)

    def load_checkpoint(self, path: Any, *, strict: bool = True,
                        allow_nonfinite: bool = False) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint`, after checking all of it
        (a corrupt, truncated or mismatched one is refused naming the key, changing nothing);
        returns the ``extra`` dict it stored ({} when none). Before any plan, the plan is
        made for the shape the checkpoint was trained at."""
        if self.plan is None and not self._closed:
            from rpcompile.runtime.checkpoint import read_manifest

            manifest = read_manifest(path)
            self._plan_saved_shape(manifest.get("plan"))
        return self.trainer().load_checkpoint(path, strict=strict,
                                              allow_nonfinite=allow_nonfinite)

    def sync_to_model(self) -> None:
        """Write the trained masters back into the original module (then save_pretrained).
        Before any plan nothing was trained: the module holds its own weights already."""
        if self.plan is None:
            return
        self._finished_trainer().sync_to_model()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The host optimizer over the fp32 masters (``trainer().optimizer``). Attach an LR
        scheduler to it as to any optimizer and call ``scheduler.step()`` after each
        :meth:`step`: step ``k``'s update uses the learning rate set when step ``k`` began,
        in both modes (the hyperparameters are read when the step begins). A new plan for a
        larger batch keeps this object, so the scheduler goes on driving it."""
        return self.trainer().optimizer
    def save_pretrained(self, directory: str | Any, *, merge: bool = False) -> None:
        """Write the trained weights into ``self.model`` and save it with Hugging Face's
        ``save_pretrained`` (safetensors). A PEFT model saves its adapter folder (loadable with
        ``PeftModel.from_pretrained``); ``merge=True`` saves the base model with the adapters
        merged in instead, from a copy, so this compiled model keeps training. Under
        ``shard_optimizer`` a collective (call it on every rank): the masters are gathered
        from every rank, rank 0 alone writes, and a failure on any rank (its queued updates,
        its copy of the gathered masters into the module, rank 0's write) raises
        ``CheckpointFailed`` on every rank."""
        trainer = self._finished_trainer()
        if trainer.sharded:
            from rpcompile.runtime.distributed import RankFailed

            what = f"writing the model to {directory}"
            # The queued updates first, agreed: a rank whose update fails must not skip the
            # gather the others are in.
            trainer.settle_across_ranks(f"{what} (the queued updates)")
            error = None
            try:
                trainer.sync_to_model()  # the gather (a collective), then this rank's copy
                if trainer.dp.rank == 0:
                    self._write_pretrained(directory, merge)
            except RankFailed:  # the gather failed: announced, out of step
                raise
            except Exception as exc:  # every rank must reach the agreement
                error = exc
            except BaseException as exc:  # announced: the others stop at once
                trainer.dp.interrupted(exc, what)
                raise
            trainer.dp.settle(error, f"{what} (rank 0 writes)")
            return
        self.sync_to_model()
        self._write_pretrained(directory, merge)

    def _write_pretrained(self, directory: Any, merge: bool) -> None:
        import copy

        model = self.model
        if merge:
            if not hasattr(model, "merge_and_unload"):
                raise InvalidInput("merge=True merges LoRA adapters; this model is not a PEFT model")
            model = copy.deepcopy(model).merge_and_unload()
        if not hasattr(model, "save_pretrained"):
            raise InvalidInput(
                f"{type(model).__name__} has no save_pretrained (not a Hugging Face model); "
                "save compiled.model.state_dict() after sync_to_model() instead"
            )
        model.save_pretrained(str(directory))
