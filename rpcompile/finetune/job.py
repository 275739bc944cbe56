"""One ``rpcompile train`` run (:class:`_Job`): the run folder it owns (rpcompile.run_folder; a
resume is checked against the run's identity), data (rpcompile.data), the model in training
mode, ``rpcompile.compile``, an LR scheduler on ``compiled.optimizer`` (:func:`lr_lambda`), the
step loop with eval, checkpoints and logs, then ``OUT/final/`` (written whole, then moved into
place). SIGINT and SIGTERM stop it at a step boundary with a checkpoint (rpcompile.interrupts)."""

from __future__ import annotations

import math
import shutil
import sys
import time
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpcompile.errors import InvalidInput
from rpcompile.finetune.config import (
    OPTIONS,
    _dump_yaml,
    _load_yaml,
    plan_cache_option,
)
from rpcompile.finetune.data import _check_rows
from rpcompile.finetune.metrics import _evaluate, _Log, _predicted_step_seconds, _write_report
from rpcompile.finetune.model import _dtype_name, _torch_dtype, add_lora, load_model, model_folder
from rpcompile.options import PlanOptions, TrainOptions

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled


def lr_lambda(kind: str, warmup: int, total: int):
    """The multiplier of the peak learning rate at scheduler step ``k`` (the update of step
    ``k + 1``): linear warmup over ``warmup`` steps, then cosine or linear decay to 0 at
    ``total``, or constant."""

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class _Job:
    """One ``rpcompile train``: set up (the run folder, model, data, compile, resume), train,
    then write ``final/`` and the report; a signal ends it with a checkpoint (:meth:`_stop`).
    A new run that fails or is stopped before its first step leaves no folder behind."""

    def __init__(self, opts: dict[str, Any], checkpoint: Path | None, rank: int, world: int,
                 origin: Any, stop: Any) -> None:
        self.opts, self.checkpoint, self.rank, self.world = opts, checkpoint, rank, world
        self.lead = rank == 0  # only rank 0 writes: metrics, checkpoints, final/, the report
        self.origin, self.stop = origin, stop
        self.out = Path(opts["out"])
        # The run resumed: its folder, which the job goes on in unless --out branches it.
        self.source = checkpoint.parent.parent if checkpoint is not None else self.out
        self.branch = self.source.resolve() != self.out.resolve()
        self.compiled: Compiled | None = None
        self.log: _Log | None = None
        self.manager: Any = None
        self.folder: Any = None
        self.committed = 0  # the last step the trainer and the job's bookkeeping both hold
        self.writing: Path | None = None  # the output being written, for a refused write

    def run(self) -> int:
        from rpcompile.run_folder import RunFolder

        resuming = self.checkpoint is not None
        self.folder = (RunFolder.resume(self.out) if resuming and not self.branch else
                       RunFolder.start(self.out, overwrite=self.opts["overwrite"],
                                       lead=self.lead))
        try:
            try:
                self._setup()
            except KeyboardInterrupt:
                if self.lead:
                    self.folder.abandon()
                    print(f"train: {self.stop.name} before the first step: stopped, nothing "
                          "saved" + (f"; the run can still be resumed from {self.checkpoint}"
                                     if resuming else ""), file=sys.stderr)
                return self.stop.status
            except BaseException:
                if self.lead:
                    self.folder.abandon()
                raise
            try:
                return self._train()
            except KeyboardInterrupt:  # again, while the checkpoint of a stop was written
                latest = self._checkpoints().latest() if self.lead else None
                print(f"train: {self.stop.name} while saving: the latest checkpoint is "
                      f"{latest}" + (f"; go on with: rpcompile train --resume {self.out}"
                                     if latest is not None else ""), file=sys.stderr)
                return self.stop.status
        finally:
            if self.log is not None:
                self.log.close()
            if self.compiled is not None:
                self.compiled.close()

    # -- set up ---------------------------------------------------------------------------
    def _setup(self) -> None:
        import torch

        import rpcompile
        from rpcompile import data as rpdata
        from rpcompile.capture.batch import masks_documents

        opts, out, lead, world = self.opts, self.out, self.lead, self.world
        device = opts["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "virtual"
            if device == "virtual" and lead:
                print("train: no CUDA device; running on virtual CPU workers", file=sys.stderr)
        workers = opts["workers"] or (torch.cuda.device_count() if device == "cuda" else 4)
        dtype = _torch_dtype(opts["dtype"], device)
        seed = opts["seed"]
        opts["data"] = opts["data"] or str(rpdata.shipped_corpus())
        dtype_name = _dtype_name(opts["dtype"], device)
        identity = None
        if lead and self.checkpoint is not None:  # refused before anything is loaded
            identity = self._identity(dtype_name, self.source)
            self._check_same_run(identity)
            base = self.source / "base"
            if self.branch and model_folder(opts["model"], self.source) == base:
                shutil.copytree(base, out / "base")  # a shipped config's built weights
        model, tokenizer = self._load_model(dtype, seed)
        if lead and identity is None:  # a shipped config's folder is there now
            identity = self._identity(dtype_name, out)
        self.tokenizer = tokenizer
        data_path = opts["data"]
        prepared = rpdata.prepare(
            data_path, tokenizer, completion_only=opts["completion_only"],
            eval_split=0.0 if opts["eval_data"] else opts["eval_split"],
            eval_path=opts["eval_data"], seed=seed,
        )
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        seq = opts["seq"] = opts["seq"] or min(2048, limit, -(-prepared.longest() // 64) * 64)
        packed = opts["packing"] == "on" or (opts["packing"] == "auto"
                                             and prepared.format == "text")
        pad_id = tokenizer.pad_token_id
        dropped = 0
        if packed:
            rows, truncated, dropped = rpdata.pack(prepared.train, seq, pad_id, seed)
            note = f"packed into {len(rows.rows)} rows of {seq}, attention per document"
        else:
            rows, truncated, dropped = rpdata.pad_rows(prepared.train, seq, pad_id)
            note = f"one per row, padded to {rpdata.bucket_lengths(seq, opts['buckets'])}"
        if rows.split:
            note += f"; {rows.split} long texts split into pieces of {seq} tokens"
        if truncated:
            note += f"; {truncated} truncated to {seq} tokens"
        if dropped:
            note += f"; {dropped} dropped (nothing left to predict after truncation)"
        micro = opts["microbatches"] = opts["microbatches"] or workers + 1
        batch_size = opts["batch"] = opts["batch"] or micro * opts["rounds"] * world
        if batch_size < micro * opts["rounds"] * world:
            # An uneven split is fine (the loss is the global token mean either way); an
            # empty microbatch is not.
            raise InvalidInput(f"--batch {batch_size} is smaller than microbatches x rounds"
                             + (" x ranks" if world > 1 else "")
                             + f" = {micro} x {opts['rounds']}"
                             + (f" x {world}" if world > 1 else "")
                             + ": every microbatch needs a sequence")
        _check_rows(rows, batch_size, prepared, dropped, packed, opts, data_path)
        self.iterator = rpdata.BatchIterator(rows, batch_size, seed, buckets=opts["buckets"])
        self.total = opts["steps"] or max(
            1, math.ceil(opts["epochs"] * self.iterator.batches_per_epoch))
        # Every rank draws the same global batches (same seed) and trains on its share of
        # each; the plan is for the largest share, and rank 0 alone evaluates, in batches of
        # that size.
        share = -(-batch_size // world)
        self.eval_sets = rpdata.eval_batches(prepared.eval, seq, pad_id, share)
        if lead:
            print(f"train: {data_path}: {len(prepared.train)} {prepared.format} examples "
                  f"({note}), {len(prepared.eval)} eval; {self.total} steps of {batch_size} x "
                  f"{seq} tokens, {self.iterator.batches_per_epoch} per epoch"
                  + (f", each of {world} ranks training on its share" if world > 1 else ""),
                  file=sys.stderr)

        if opts["lora"]:
            model = add_lora(model, opts["lora"], opts["lora_alpha"], opts["lora_dropout"],
                             seed)
        # from_pretrained returns the model in eval mode: train it as its config says (dropout
        # on, replayed exactly in recompute).
        model.train()
        lr = opts["lr"] or (2e-4 if opts["lora"] else 2e-5)
        example = {"input_ids": torch.zeros(share, seq, dtype=torch.long)}
        example["labels"] = example["input_ids"].clone()
        if packed:
            example["position_ids"] = torch.arange(seq).expand(share, seq).clone()
        if lead:
            sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
            print(f"train: compiling {type(model).__name__} ({sum(n for n, _ in sizes):,} "
                  f"parameters, {sum(n for n, t in sizes if t):,} trainable) for {workers} "
                  f"{device} workers, a step of {share} x {seq} tokens in {micro} "
                  f"microbatches x {opts['rounds']} rounds (capture, cost model, partition "
                  "search)", file=sys.stderr)
        began = time.perf_counter()
        self.compiled = compiled = rpcompile.compile(
            model, example, gpus=workers, microbatches=micro, rounds=opts["rounds"],
            device=device, mode=opts["mode"], search_effort=opts["search_effort"],
            optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=opts["weight_decay"],
                                                  fused=True),
            max_grad_norm=opts["max_grad_norm"] or None,
            plan=PlanOptions(recompute=opts["recompute"], shard_optimizer=opts["shard_optimizer"],
                             undo_journal=opts["undo_journal"], host_memory=opts["host_memory"],
                             plan_cache=plan_cache_option(opts["plan_cache"]),
                             progress=False if opts["quiet"] else None),
            train=TrainOptions(chaos=opts["chaos"], kernels=opts["kernels"],
                               loss_scale=True if dtype == torch.float16 else None),
        )
        if packed and not masks_documents(compiled.capture):
            compiled.close()
            raise InvalidInput(
                f"--packing on needs attention confined to each document, and "
                f"{type(model).__name__}'s captured graph builds no attention mask from "
                "position_ids (its attention ignores where a packed document starts), so a token "
                "would attend to the earlier documents of its row: train it with --packing off"
            )
        self.sharded = compiled.trainer().sharded
        self.predicted = _predicted_step_seconds(compiled)
        # The cost model's FLOPs of one step (forward and backward of every unit, recompute
        # not counted) over the whole global batch: the numerator of the MFU.
        self.flops_per_step = batch_size * sum(sum(u.flops_at(1, seq))
                                               for u in compiled.unit_costs)
        if lead:
            print(f"train: compiled in {time.perf_counter() - began:.1f}s", file=sys.stderr)
            print(compiled.plan, file=sys.stderr)
            print(f"train: transfers: "
                  f"{compiled.hardware.describe_host_memory('--host-memory pageable')}",
                  file=sys.stderr)
        warmup = opts["warmup_steps"] if opts["warmup_steps"] is not None \
            else round(0.03 * self.total)
        self.factor = lr_lambda(opts["schedule"], warmup, self.total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(compiled.optimizer, self.factor)
        self.start = 0
        if opts["save_every"]:
            self.manager = self._checkpoints()
        if self.checkpoint is not None:
            self._resume()
        self.committed = self.start
        if lead:
            (out / "config.yaml").write_text(_dump_yaml(opts))
            self.folder.record(identity)
            self.log = _Log(out, self.start, opts["report_to"], opts)

    def _checkpoints(self) -> Any:
        from rpcompile.runtime.checkpoint import CheckpointManager

        # Data parallel: a checkpoint save is a collective (every rank takes part, rank 0
        # writes).
        return CheckpointManager(self.out / "checkpoints", keep_last=self.opts["keep_last"])

    def _load_model(self, dtype: Any, seed: int) -> tuple[Any, Any]:
        spec = self.opts["model"]
        if self.world > 1:
            import torch.distributed as dist

            if not self.lead:
                dist.barrier()  # rank 0 writes a shipped model's folder first; the others read
                from rpcompile.workloads.models import list_models

                if spec in list_models() and not Path(spec).is_dir():
                    spec = str(self.out / "base")
            model, tokenizer, _ = load_model(spec, self.out, dtype, seed,
                                             self.opts["quantize"])
            if self.lead:
                dist.barrier()
            return model, tokenizer
        model, tokenizer, _ = load_model(spec, self.out, dtype, seed, self.opts["quantize"])
        return model, tokenizer

    # -- the run's identity (rpcompile.run_folder) ---------------------------------------------
    def _identity(self, dtype: str, root: Path) -> dict[str, Any] | None:
        """What run.json records: the model's fingerprint, the data files' sha256 and the
        compute dtype. A new run of a shipped config has no model folder yet (it is built
        into OUT/base): its fingerprint is taken once it is written (:meth:`_resume` never
        sees that case)."""
        from rpcompile.run_folder import file_sha256, model_fingerprint

        opts = self.opts
        files = {}
        for key in ("data", "eval_data"):
            path = opts[key]
            if path is None:
                files[key] = None
            elif not Path(path).is_file():
                raise InvalidInput(f"data file {path} does not exist")
            else:
                files[key] = {"path": str(path), "sha256": file_sha256(path)}
        folder = model_folder(opts["model"], root)
        return {"model": {"name": opts["model"],
                          "fingerprint": None if folder is None else model_fingerprint(folder)},
                **files, "dtype": dtype}

    def _check_same_run(self, identity: dict[str, Any]) -> None:
        """A resume goes on only with the run's model, data and trajectory options; each
        refusal names the option, where its value came from and the run's own value."""
        from rpcompile.run_folder import MAY_CHANGE, RUN_FILE, read_identity

        run_dir = self.source
        config = run_dir / "config.yaml"
        saved = _load_yaml(config, run=True) if config.is_file() else {}

        def given(name: str) -> str:
            source = self.origin(name)
            return source if source.startswith("--") else f"{name} (from {source})"

        for option in OPTIONS:
            name = option.name
            if name in MAY_CHANGE or name in ("model", "data", "eval_data", "out") \
                    or name not in saved or self.opts[name] == saved[name]:
                continue
            raise InvalidInput(
                f"{given(name)} is {self.opts[name]!r}, but the run in {run_dir} trained with "
                f"{saved[name]!r} ({config}): it changes the training, so a resumed run keeps "
                f"the run's value. Leave it out to go on with {saved[name]!r}, or start a new "
                "run with it (a new --out, or --overwrite)")
        recorded = read_identity(run_dir)
        if recorded is None or "model" not in recorded:
            print(f"train: {run_dir} has no {RUN_FILE} with the run's model and data: they "
                  "are not checked against the run's", file=sys.stderr)
            return
        for key in ("data", "eval_data"):
            theirs, ours = recorded.get(key), identity[key]
            if (theirs is None) != (ours is None) or (theirs and theirs["sha256"] !=
                                                      ours["sha256"]):
                flag = "--" + key.replace("_", "-")
                was = "none" if theirs is None else f"{theirs['path']} (sha256 " \
                    f"{theirs['sha256'][:12]}...)"
                now = "none" if ours is None else f"{ours['path']} (sha256 " \
                    f"{ours['sha256'][:12]}...)"
                raise InvalidInput(
                    f"{given(key)}: the run in {run_dir} trained on {was}, this resume would "
                    f"train on {now}: a resumed run goes on with the same data. Give {flag} "
                    "the run's file (moved files are found by content), or start a new run "
                    "(a new --out, or --overwrite)")
        theirs, ours = recorded["model"], identity["model"]
        if ours["fingerprint"] is None:
            raise InvalidInput(
                f"the model of the run in {run_dir} ({theirs['name']}) is not there "
                + (f"(its {run_dir}/base/ is missing)" if theirs["name"] == ours["name"] and
                   not Path(ours["name"]).is_dir() else "(moved or deleted?)")
                + ": give --model the folder it moved to")
        if ours["fingerprint"] != theirs["fingerprint"]:
            raise InvalidInput(
                f"{given('model')}: {ours['name']} is not the model the run in {run_dir} "
                f"started from ({theirs['name']}: another config, tokenizer or set of weight "
                "files); give --model that model's folder, or start a new run (a new --out, "
                "or --overwrite)")
        if identity["dtype"] != recorded["dtype"]:
            raise InvalidInput(
                f"the run in {run_dir} computed in {recorded['dtype']}; --dtype "
                f"{self.opts['dtype']} on {self.opts['device']} workers computes in "
                f"{identity['dtype']}, which changes the training: pass --dtype "
                f"{recorded['dtype']}")

    def _resume(self) -> None:
        from rpcompile.runtime.checkpoint import CheckpointManager

        if self.lead:
            for path, why in CheckpointManager(self.source / "checkpoints").skipped():
                print(f"train: skipped {path}: {why}", file=sys.stderr)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", RuntimeWarning)
            extra = self.compiled.load_checkpoint(self.checkpoint) or {}
        for warning in said:  # e.g. saved under another plan (other --workers): one line
            if self.lead:
                print(f"train: {warning.message}", file=sys.stderr)
        self.start = int(extra["step"])
        self.iterator.load_state(extra["data"])
        self.scheduler.load_state_dict(extra["scheduler"])
        # The learning rate of the next update is the schedule's at the step reached, for
        # this run's total: the saved rate itself when the total is the run's, the schedule
        # of a run of the new total when --steps extends it (never the 0 a finished cosine
        # or linear schedule ends at).
        for group, base in zip(self.compiled.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.factor(self.scheduler.last_epoch)
        if self.lead:
            print(f"train: resumed from {self.checkpoint} at step {self.start}",
                  file=sys.stderr)

    # -- training ---------------------------------------------------------------------------
    def _train(self) -> int:
        from safetensors import SafetensorError
        from tqdm import tqdm

        opts, lead, compiled = self.opts, self.lead, self.compiled
        self.began = time.perf_counter()
        self.tokens, self.seconds = 0, 0.0
        self.stop.graceful = True
        try:
            if self.start == 0:
                self._evaluate(0)
            with tqdm(total=self.total, initial=self.start, desc="train", unit="step",
                      disable=not lead) as bar:
                self.bar = bar
                while self.committed < self.total and not self.stop.requested:
                    self._steps(self._next_stop(self.committed))
                    if self.stop.requested:
                        break
                    step = self.committed
                    if opts["eval_every"] and step % opts["eval_every"] == 0 \
                            and step != self.total:
                        self._evaluate(step)
                    if self.manager is not None and (step % opts["save_every"] == 0
                                                     or step == self.total):
                        self._save(step)
            if self.stop.requested:
                return self._stop()
            # Every step is done: a signal now stops at once (with a checkpoint of the last
            # step, from which a resume writes final/).
            self.stop.graceful = False
            self._evaluate(self.total)
            self._write_final()
            if lead:
                summary = _write_report(self.out, self.log.records, opts,
                                        time.perf_counter() - self.began,
                                        self.tokens / max(self.seconds, 1e-9), compiled,
                                        compiled.trainer().schedule, self._mfu())
                self.log.summary(summary)
        except KeyboardInterrupt:
            return self._stop()
        except (OSError, SafetensorError) as err:
            # safetensors reports a refused write (a full disk) as its own error, without
            # the file's name.
            what = getattr(err, "filename", None) or self.writing or "a file"
            raise InvalidInput(self._failed(f"cannot write {what}: "
                                          f"{getattr(err, 'strerror', None) or err}")) from None
        return 0

    def _next_stop(self, step: int) -> int:
        """The first step after ``step`` at which the loop evaluates or saves, or the last."""
        ends = [self.total]
        for every in (self.opts["eval_every"], self.opts["save_every"] if self.manager else 0):
            if every:
                ends.append((step // every + 1) * every)
        return min(ends)

    def _mfu(self) -> dict[str, float | None]:
        """Model FLOPs utilization of the training steps: the cost model's FLOPs per step times
        the steps, over their measured seconds and the peak of every worker of every rank."""
        hardware = self.compiled.hardware
        steps = self.committed - self.start
        peak = hardware.matmul_tflops * 1e12 * self.compiled.workers * self.world
        achieved = self.flops_per_step * steps / self.seconds if self.seconds > 0 else None
        return {"flops_per_step": float(self.flops_per_step),
                "peak_flops_per_s": peak,
                "mfu": None if achieved is None else achieved / peak}

    def _steps(self, until: int) -> None:
        """Train steps ``committed + 1 .. until`` as one stream (``Compiled.fit``): each batch
        is drawn and bound while the steps before it run, the learning-rate scheduler steps as
        each step commits, and the loop books each result as it comes. The stream ends drained
        at ``until`` (the loop evaluates or saves there). A first signal stops the drawing: the
        steps in flight commit and are booked, and the loop stops. A second one discards them
        (``KeyboardInterrupt``): the job then holds the steps that committed, and the data
        position is rewound to the batch of the first step not committed."""
        first = self.committed + 1
        # Per step from ``first``, made as its batch is drawn: the data position before its
        # batch, then its tokens and target tokens over the whole global batch and the epoch
        # the data is in once it is drawn. Its learning rate: noted as the step before it
        # committed.
        drawn: dict[int, list[Any]] = {}
        rates = {first: self.compiled.optimizer.param_groups[0]["lr"]}
        hooked = [first - 1]  # the steps the scheduler has stepped for (on the host queue)

        def batches() -> Any:
            step = first
            while True:
                drawn[step] = [self.iterator.state()]
                batch = next(self.iterator)
                drawn[step] += [batch["input_ids"].numel(),
                                int((batch["labels"][:, 1:] != -100).sum()),
                                self.iterator.epoch]
                step += 1
                yield batch if self.world == 1 else {
                    k: v.tensor_split(self.world)[self.rank] for k, v in batch.items()}

        def stepped() -> None:  # on the host queue, as each step commits
            self.scheduler.step()
            hooked[0] += 1
            rates[hooked[0] + 1] = self.compiled.optimizer.param_groups[0]["lr"]

        stream = self.compiled.fit(batches(), steps=until - self.committed,
                                   scheduler=types.SimpleNamespace(step=stepped))
        try:
            for result in stream:
                self._book(result, self.committed + 1, drawn, rates)
                if self.stop.requested:
                    stream.end()  # no batch drawn after this; the steps in flight go on
        except KeyboardInterrupt:
            done = hooked[0]  # committed, booked or not
            if done > self.committed:
                print(f"train: steps {self.committed + 1}..{done} committed as the run was "
                      "interrupted; their losses are not logged", file=sys.stderr)
                self.committed = done
            if done + 1 in drawn:  # the discarded steps' batches are drawn again on resume
                self.iterator.load_state(drawn[done + 1][0])
            raise

    def _book(self, result: Any, step: int, drawn: dict[int, Any],
              rates: dict[int, float]) -> None:
        """Log step ``step``'s result (its loss is the global batch's on every rank)."""
        with self.stop.deferred():
            _position, tokens, target, epoch = drawn.pop(step)
            step_lr = rates.pop(step)
            loss = float(result.loss)
            self.committed = step
            self.seconds += result.seconds
            self.tokens += tokens
            rate = self.tokens / self.seconds  # training steps only, not eval or saving
            norm = None if result.grad_norm is None else float(result.grad_norm)
            # The fraction of the target tokens (those the loss averages over) whose argmax
            # logit is their label, counted where the tail computes the loss.
            correct = result.correct_tokens
            accuracy = None if correct is None or not target else correct / target
            record = {"step": step, "loss": loss, "lr": step_lr, "grad_norm": norm,
                      "token_accuracy": accuracy, "tokens": tokens, "target_tokens": target,
                      "tokens_per_s": rate, "epoch": epoch,
                      "step_seconds": result.seconds,
                      "predicted_step_seconds": self.predicted}
            if self.log is not None:
                self.log.write(record)
            shown = {"loss": f"{loss:.3f}", "tok_s": f"{rate:,.0f}", "lr": f"{step_lr:.2e}"}
            if norm is not None:
                shown["gnorm"] = f"{norm:.2f}"
            if accuracy is not None:
                shown["acc"] = f"{accuracy:.3f}"
            self.bar.set_postfix(shown)
            self.bar.update()

    def _evaluate(self, step: int) -> None:
        from tqdm import tqdm

        if not self.eval_sets:
            return
        # Sharded: every rank takes part in gathering the masters; rank 0 evaluates.
        masters = self.compiled.trainer().gather_masters() if self.sharded else None
        if self.lead:
            value = _evaluate(self.compiled, self.eval_sets, masters)
            self.log.write({"step": step, "eval_loss": value})
            tqdm.write(f"step {step}: eval loss {value:.4f}", file=sys.stderr)

    def _save(self, step: int) -> Path:
        from rpcompile.runtime.checkpoint import CheckpointError

        if self.manager is None:
            self.manager = self._checkpoints()
        try:
            return self.manager.save(self.compiled, step, extra={
                "step": step, "data": self.iterator.state(),
                "scheduler": self.scheduler.state_dict(), "epoch": self.iterator.epoch,
            }, per_rank=self.sharded and self.opts["checkpoint_per_rank"])
        except CheckpointError as err:
            raise InvalidInput(self._failed(str(err))) from None

    def _failed(self, what: str) -> str:
        """The message of a run stopped by a failed write: what failed, the checkpoint a
        resume goes on from, and the command."""
        latest = self._checkpoints().latest() if self.lead else None
        where = (f"the latest checkpoint is {latest}: make room (or make {self.out} "
                 f"writable) and go on with: rpcompile train --resume {self.out}"
                 if latest is not None else "no checkpoint of it was written")
        return f"{what}. The run stopped after step {self.committed}; {where}"

    def _stop(self) -> int:
        """A signal stopped the loop: checkpoint the last committed step (one process) and say
        how to go on."""
        step, out = self.committed, self.out
        if self.world > 1:
            print(f"train: {self.stop.name} after step {step}: every rank stops; go on from "
                  f"the latest checkpoint with: rpcompile train --resume {out}",
                  file=sys.stderr)
            return self.stop.status
        if step == 0:
            self.folder.abandon()
            print(f"train: {self.stop.name} before the first step ended: stopped, nothing "
                  "saved", file=sys.stderr)
            return self.stop.status
        existing = self._checkpoints().latest()
        if existing is not None and existing.name == self._checkpoints().path_for(step).name:
            saved = existing
        else:
            saved = self._save(step)
        print(f"train: {self.stop.name}: stopped after step {step} of {self.total}, saved "
              f"{saved}; go on with: rpcompile train --resume {out}", file=sys.stderr)
        return self.stop.status

    def _write_final(self) -> None:
        """``final/``, written whole into a fresh folder and then moved into place, so that
        it never holds files of an earlier write (an adapter beside full weights)."""
        from rpcompile.runtime.checkpoint import replace_folder

        partial = self.out / ".final.partial"
        self.writing = self.out / "final"
        if self.lead:
            shutil.rmtree(partial, ignore_errors=True)
        try:
            if self.lead or self.sharded:  # sharded: a collective (the masters gathered)
                self.compiled.save_pretrained(partial, merge=self.opts["merge"])
            if self.lead:
                self.tokenizer.save_pretrained(partial)
                replace_folder(partial, self.out / "final")
        except BaseException:
            if self.lead:  # a final/ written in part is no model: leave none behind
                shutil.rmtree(partial, ignore_errors=True)
            raise
        self.writing = None
