"""Data parallel across processes (torch.distributed, gloo, localhost): each rank trains on its
share of the global batch over its own virtual workers. Every check is against a run that
shares nothing with the cross-rank code: one process training the whole global batch, and
eager Hugging Face on the whole global batch."""

from __future__ import annotations

import copy
import datetime
import faulthandler
import functools
import os
import signal
import socket
import time
from multiprocessing import forkserver

import pytest
import torch
import torch.multiprocessing as mp

import rpcompile
from rpcompile.options import PlanOptions
from tests.option_groups import grouped
from tests.tiny_models import SkipNet, hf_model, sft_batch, skipnet_batch

GLOBAL = 6  # sequences per global batch (divides by 2 and 3 ranks)
STEPS = 3

# What each rank trains, in order, in one process group (one spawn: start-up costs once).
# (name, model, compile options); "skipnet" is a loss_fn model (a mean per microbatch).
def _sgd(params):
    # No per-element normalisation (unlike Adam): summation-order differences stay ~1e-8.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    # Per-element state (two moments and a step count): what sharding must keep right. Adam
    # normalises each element's step to about lr whatever its gradient, so the summation-order
    # differences of data parallel (not of sharding) move elements by a fraction of lr:
    # measured at lr 1e-4 on 3 ranks with clipping, replicated data parallel is 1.003e-6 from
    # one process and the sharded run 7.5e-9 from the replicated one (at lr 1e-3 on 2 ranks:
    # 2.4e-6, and sharded = replicated bit for bit). lr 5e-5 keeps them under the 1e-6 bound.
    return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01)


# What each rank trains, in order, in one process group (one spawn: start-up costs once).
# (name, model, compile options); "skipnet" is a loss_fn model (a mean per microbatch); the
# "zero1" cases shard the masters and optimizer state (and checkpoint after step 2).
CASES = {
    2: [("sync", "qwen3", {}), ("async", "qwen3", {"mode": "async"}),
        ("loss_fn", "skipnet", {}),
        ("zero1", "qwen3", {"shard_optimizer": True, "optimizer": _adamw}),
        # Tied embedding and LM head: one parameter in three stages, updated at the last of
        # its two gradient stages, after an earlier stage's SHADOW has already run.
        ("zero1_tied", "qwen3_tied", {"shard_optimizer": True, "optimizer": _adamw}),
        # No example batch: the ranks agree on the first step's shape and plan for it.
        ("lazy", "qwen3", {"lazy": True})],
    3: [("clip", "qwen3", {"max_grad_norm": 0.5}),
        ("zero1_clip", "qwen3", {"shard_optimizer": True, "optimizer": _adamw,
                                 "max_grad_norm": 0.5})],
}


def _batches(model: str = "qwen3"):
    if model == "skipnet":
        return [skipnet_batch(2 * GLOBAL, seed=40 + k) for k in range(STEPS)]
    return [sft_batch(GLOBAL, 12, left=k % 2 == 1, seed=40 + k) for k in range(STEPS)]


def _model(model: str, seed: int):
    if model == "skipnet":
        torch.manual_seed(seed)
        return SkipNet()
    return hf_model(model, seed=seed)


def _compile(model_name: str, seed: int, example, parts: int = 2, **options):
    if options.pop("lazy", False):
        example = None  # planned at the first step
    extra = {"loss_fn": torch.nn.functional.cross_entropy} if model_name == "skipnet" else {}
    options.setdefault("optimizer", _sgd)
    return rpcompile.compile(_model(model_name, seed), gpus=2, microbatches=parts,
                             example_inputs=example, device="virtual",
                             **grouped(**extra, **options))


def _share(batch, rank, world):
    if isinstance(batch, tuple):
        return tuple(v.tensor_split(world)[rank] for v in batch)
    return {k: v.tensor_split(world)[rank] for k, v in batch.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, scenario: str, options: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict = {}
    searches = [0]  # the partition searches this rank ran (rank 0 searches for every rank)
    partition = rpcompile.compiler.search.partition

    def counted(*args, **kwargs):
        searches[0] += 1
        return partition(*args, **kwargs)

    rpcompile.compiler.search.partition = counted
    try:
        if scenario == "train":
            for name, model_name, case_options in CASES[world]:
                # Rank 0's weights are the run's: the other ranks start elsewhere on purpose,
                # and the trainer's broadcast must bring them to rank 0's.
                batches = [_share(b, rank, world) for b in _batches(model_name)]
                searches[0] = 0
                compiled = _compile(model_name, rank, batches[0], chaos=rank + 1,
                                    **case_options)
                sharded = case_options.get("shard_optimizer", False)
                losses, norms = [], []
                for k, b in enumerate(batches):
                    losses.append(float(compiled.step(b)))
                    trainer = compiled.trainer()
                    norms.append(trainer.last.grad_norm)
                    if sharded and k == STEPS - 2:  # every rank saves; rank 0 writes
                        saved = trainer.save_checkpoint(os.path.join(out, f"{name}-step2"))
                        per_rank = trainer.save_checkpoint(  # one file per rank
                            os.path.join(out, f"{name}-step2-per-rank"), per_rank=True)
                result[name] = {
                    "losses": losses, "norms": norms, "reductions": trainer.dp.reductions,
                    "searches": searches[0], "plans_made": list(compiled.plans_made),
                    "masters": trainer.gather_masters(), "shadow": trainer.store.shadow.clone()}
                if sharded:
                    result[name]["saved"] = str(saved)
                    result[name]["per_rank"] = str(per_rank)
                    result[name]["memory"] = _held_bytes(trainer)
                    with pytest.raises(RuntimeError, match="owned_masters"):
                        trainer.masters()  # a rank's own masters are not all of them
                    if world == 3:
                        # Resume the sharded checkpoint on the same ranks, sharded again.
                        again = _compile(model_name, rank + 7, batches[0], **case_options)
                        again.load_checkpoint(saved)
                        again.step(batches[-1])
                        result[name]["resumed"] = again.trainer().gather_masters()
                        with _files_read() as read:  # and from the per-rank files
                            again.load_checkpoint(per_rank)
                        result[name]["read"] = read
                        again.step(batches[-1])
                        result[name]["resumed_per_rank"] = again.trainer().gather_masters()
                        again.close()
                        # On 2 of the 3 ranks (another cut of the shards): each reads the
                        # files that hold its parameters, and step 3 is the same.
                        pair = dist.new_group([0, 1], backend="gloo")
                        if rank < 2:
                            two = [_share(b, rank, 2) for b in _batches(model_name)]
                            fewer = _compile(model_name, rank + 9, two[0], process_group=pair,
                                             **case_options)
                            with _files_read() as read:
                                fewer.load_checkpoint(per_rank)
                            fewer.step(two[-1])
                            result[name]["two_ranks"] = fewer.trainer().gather_masters()
                            result[name]["two_ranks_read"] = read
                            result[name]["two_ranks_owned"] = sorted(
                                s.name for s in fewer.trainer().store.owned_slots)
                            fewer.close()
                if name == "sync":  # every rank saves; rank 0 alone writes
                    from rpcompile.runtime.checkpoint import CheckpointManager

                    manager = CheckpointManager(os.path.join(out, "ckpts"), keep_last=1)
                    for step in (STEPS - 1, STEPS):
                        result[name]["saved"] = str(manager.save(compiled, step))
                compiled.close()
        else:
            model = hf_model("qwen3", seed=rank)
            batches = [_share(b, rank, world) for b in _batches()]
            compiled = rpcompile.compile(model, gpus=2, microbatches=2,
                                         example_inputs=batches[0], optimizer=_sgd,
                                         device="virtual", **grouped(chaos=rank + 1, **options))
            trainer = compiled.trainer()
            compiled.step(batches[0])
            result["before"] = {k: v.clone() for k, v in trainer.masters().items()}
            if rank == 1:
                _fail_in_backward(trainer, scenario)
            start = time.monotonic()
            try:
                compiled.step(batches[1])
                result["error"] = None
            except Exception as exc:  # what the surviving rank saw, and when
                result["error"] = type(exc).__name__
                result["message"] = str(exc)
            result["elapsed"] = time.monotonic() - start
            result["after"] = {k: v.clone() for k, v in trainer.masters().items()}
            if rank == 1 and scenario == "raise":
                # Alive until rank 0 is done, so that it learns of the failure from the
                # announcement, not from closed connections.
                limit = time.monotonic() + 30.0
                while not os.path.exists(os.path.join(out, "rank0.pt")) and \
                        time.monotonic() < limit:
                    time.sleep(0.1)
            compiled.close()
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        rpcompile.compiler.search.partition = partition
        if scenario == "train":
            dist.destroy_process_group()


class _files_read:
    """The per-rank checkpoint files read (and checked) inside the block, by file name."""

    def __enter__(self) -> list:
        from rpcompile.runtime.checkpoint import reading

        self.original = reading._read_tensors
        self.names: list = []

        def recorded(folder, manifest, name=reading.TENSORS):
            self.names.append(name)
            return self.original(folder, manifest, name)

        reading._read_tensors = recorded
        return self.names

    def __exit__(self, *exc) -> None:
        from rpcompile.runtime.checkpoint import reading

        reading._read_tensors = self.original


def _held_bytes(trainer) -> dict:
    """Host bytes per trainable parameter this rank holds, measured from the tensors
    themselves (the master buffer, every optimizer state tensor, the shadow and gradient
    buffers), not from the memory report."""
    store = trainer.store
    params = sum(s.numel for s in store.trainable_slots)
    state = {}
    for entry in trainer.optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                state[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    report = trainer.memory_report()
    return {
        "sharded": (store.master.untyped_storage().nbytes() + sum(state.values())) / params,
        "whole": (store.shadow.untyped_storage().nbytes()
                  + store.grad.untyped_storage().nbytes()) / params,
        "reported": (report.master_bytes + report.optimizer_state_bytes)
        / report.trainable_params,
        "largest": max(s.numel for s in store.trainable_slots) / params,
    }


def _fail_in_backward(trainer, scenario: str) -> None:
    """Make this rank die (``kill``) or raise and stay alive (``raise``) in its first
    backward job of the next step."""
    executor = trainer.executor
    original = executor._do_B

    def failing(run, a):
        if scenario == "kill":
            os._exit(17)
        raise RuntimeError("injected failure on rank 1")

    executor._do_B = failing
    del original


def _spawn(target, world: int, tmp_path, *args, timeout: float = 240.0) -> list[dict | None]:
    """Run ``target(rank, world, port, out, *args)`` in ``world`` new processes (one gloo
    group on localhost); each writes ``out/rank<r>.pt``. Returns what every rank wrote (None
    for a rank that wrote nothing); a rank still running after ``timeout`` fails the test as
    a hang."""
    return _join(*_start(target, world, tmp_path, *args, timeout=timeout))


def _fork_server():
    """The forkserver context of the ranks, its server started (once per process) with
    ``OMP_NUM_THREADS=1``. ``torch.set_num_threads(1)`` covers only the calling thread: under
    OpenMP's default a virtual worker's thread runs MKL's parallel regions on two threads,
    and every thread that ran one keeps an idle helper thread. With one OpenMP thread per
    thread none exists, so the server can wait until it runs a single native thread before
    it forks (tests/rank_server.py). This process's own environment is left as it was."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.rank_server"])
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in one}
    os.environ.update(one)
    try:
        forkserver.ensure_running()  # a no-op once the server runs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def _start(target, world: int, tmp_path, *args, timeout: float = 240.0):
    """Start the ranks of :func:`_spawn` (the caller may work meanwhile); :func:`_join` them.
    The ranks are forked from a server started once for the session (tests/rank_server.py:
    the imports and a first compile done there), each a new process with its own process
    group, as a spawned one would be."""
    ctx = _fork_server()
    port = _free_port()
    procs = [ctx.Process(target=_watched, args=(target, r, world, port, str(tmp_path), *args))
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, tmp_path, timeout, time.monotonic() + timeout


def _watched(target, *args) -> None:
    """A rank's process: ``target(*args)``, and on SIGUSR1 (what :func:`_join` sends a rank
    that outlives its time) the stack of every thread on standard error, which the test's
    captured output shows."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    target(*args)


def _join(procs: list, tmp_path, timeout: float, deadline: float) -> list[dict | None]:
    world = len(procs)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    if hung:
        for r in hung:  # where each one is stuck, before it goes
            os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(2.0)
        for p in procs:
            p.kill()
            p.join()
        pytest.fail(f"rank(s) {hung} did not finish within {timeout} s (hang); their threads' "
                    "stacks are in the captured standard error")
    out = []
    for r in range(world):
        path = tmp_path / f"rank{r}.pt"
        out.append(torch.load(path) if path.exists() else None)
    return out


def _single_process(model_name: str, options: dict, parts: int = 2, memory: list | None = None):
    batches = _batches(model_name)
    compiled = _compile(model_name, 0, batches[0], parts=parts, **options)
    try:
        losses = [float(compiled.step(b)) for b in batches]
        if memory is not None:
            memory.append(_held_bytes(compiled.trainer()))
        return losses, {k: v.clone() for k, v in compiled.trainer().masters().items()}
    finally:
        compiled.close()


def _eager(max_norm: float | None = None, optimizer=_sgd):
    model = hf_model("qwen3", seed=0)
    opt = optimizer(list(model.parameters()))
    losses = []
    for b in _batches():
        opt.zero_grad(set_to_none=True)
        loss = model(**b, use_cache=False).loss
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_like_one_process_and_eager_on_the_global_batch(tmp_path, world):
    started = _start(_rank_main, world, tmp_path, "train", {})
    # The references, while the ranks train (they share nothing with the ranks' run).
    references = {}
    try:
        for name, model_name, options in CASES[world]:
            # One process on the whole global batch: a loss_fn model's loss is the mean over
            # microbatches, so it gets as many microbatches as all ranks together.
            parts = 2 * world if model_name == "skipnet" else 2
            memory: list = []  # one process with shard_optimizer: one shard, all of it
            single = _single_process(model_name, options, parts, memory)
            eager = None
            if model_name == "qwen3" and name != "async":  # eager HF (async is stale)
                eager = _eager(options.get("max_grad_norm"), options.get("optimizer", _sgd))
            references[name] = single, memory, eager
    except BaseException:
        for p in started[0]:
            p.kill()
        raise
    ranks = _join(*started)
    assert all(r is not None for r in ranks), "a rank failed (see its output)"
    for name, model_name, options in CASES[world]:
        first = ranks[0][name]
        # Every rank ends every step with the same masters, bit for bit, and reports the same
        # (global) loss and gradient norm.
        for r in ranks[1:]:
            assert _max_diff(r[name]["masters"], first["masters"]) == 0.0, name
            assert r[name]["losses"] == first["losses"], name
            assert r[name]["norms"] == first["norms"], name
            # ... and uploads the same weights next step: the shadows match too.
            assert torch.equal(r[name]["shadow"], first["shadow"]), name
        assert first["reductions"] >= 2, name  # one per gradient stage at least, not one at the end
        # Rank 0 alone searched; every rank runs the plan it sent.
        assert first["searches"] >= 1 and all(r[name]["searches"] == 0 for r in ranks[1:]), name
        assert all(r[name]["plans_made"] == first["plans_made"] for r in ranks), name
        (single_losses, single), memory, eager = references[name]
        assert first["losses"] == pytest.approx(single_losses, abs=1e-6), name
        assert _max_diff(first["masters"], single) < 1e-6, name
        if eager is not None:
            eager_losses, eager = eager
            assert first["losses"] == pytest.approx(eager_losses, abs=1e-6), name
            assert _max_diff(first["masters"], {n: eager[n] for n in single}) < 1e-6, name
        if name == "sync":
            # One checkpoint, written once, resumes in one process with the same masters.
            from rpcompile.runtime.checkpoint import CheckpointManager

            saved = CheckpointManager(tmp_path / "ckpts").checkpoints()
            assert [p.name for p in saved] == [f"step-{STEPS:08d}"]
            assert all(r[name]["saved"] == str(saved[0]) for r in ranks)
            resumed = _compile(model_name, 1, _batches()[0])
            try:
                with pytest.warns(RuntimeWarning, match="another plan"):
                    resumed.load_checkpoint(saved[0])
                assert _max_diff(resumed.trainer().masters(), first["masters"]) == 0.0
            finally:
                resumed.close()
        if "clip" in name:
            # The clip fired on the global norm (every rank's norm is the same).
            assert first["norms"][0] > options["max_grad_norm"]
        if options.get("shard_optimizer"):
            _check_sharded(name, model_name, options, ranks, world, memory[0])


def _check_sharded(name: str, model_name: str, options: dict, ranks: list, world: int,
                   one: dict) -> None:
    # Host bytes per trainable parameter held for masters + optimizer state fall as 1/N:
    # every parameter's state is on exactly one rank (the ranks' figures add up to one
    # process's), and each rank holds its 1/N share give or take half the largest parameter
    # (shards hold whole parameters). Shadows and gradients stay whole on every rank.
    held = [r[name]["memory"] for r in ranks]
    assert sum(h["sharded"] for h in held) == pytest.approx(one["sharded"], rel=1e-12)
    for h in held:
        assert abs(h["sharded"] / one["sharded"] - 1 / world) <= h["largest"]
        assert h["whole"] == one["whole"]
        assert h["reported"] == pytest.approx(h["sharded"], rel=1e-12)
    # The sharded checkpoint of step 2, written once (by rank 0) for every rank, resumes in
    # one process (unsharded) and its step 3 equals the uninterrupted run's, optimizer state
    # included (Adam's third update reads both moments and the step count).
    # The same for the checkpoint of one file per rank.
    for key in ("saved", "per_rank"):
        saved = ranks[0][name][key]
        assert all(r[name][key] == saved for r in ranks)
        unsharded = {k: v for k, v in options.items() if k != "shard_optimizer"}
        single = _compile(model_name, 5, _batches(model_name)[0], **unsharded)
        try:
            single.load_checkpoint(saved)
            single.step(_batches(model_name)[-1])
            assert _max_diff(single.trainer().masters(), ranks[0][name]["masters"]) < 1e-6, key
        finally:
            single.close()
    if world == 3:  # and on the same 3 ranks, sharded again: exactly the uninterrupted run
        from rpcompile.runtime.checkpoint import read_manifest

        for rank, r in enumerate(ranks):
            assert _max_diff(r[name]["resumed"], ranks[0][name]["masters"]) == 0.0
            assert _max_diff(r[name]["resumed_per_rank"], ranks[0][name]["masters"]) == 0.0
            # Each rank read its own file, not every rank's.
            assert r[name]["read"] == [f"shard-{rank:05d}-of-00003.safetensors"], r[name]["read"]
        # On 2 ranks: each read exactly the files whose masters it owns (from the manifest's
        # list of each file's masters), fewer than all three, and step 3 equals the run's.
        shards = read_manifest(ranks[0][name]["per_rank"])["shards"]
        for r in ranks[:2]:
            owned = set(r[name]["two_ranks_owned"])
            assert r[name]["two_ranks_read"] == [s["file"] for s in shards
                                                 if owned & set(s["masters"])]
            assert len(r[name]["two_ranks_read"]) < 3
            assert _max_diff(r[name]["two_ranks"], ranks[0][name]["masters"]) < 1e-6


def test_sharded_checkpoints_refuse_an_incomplete_or_mismatched_set():
    from rpcompile.runtime.checkpoint import CheckpointError
    from rpcompile.runtime.distributed import merge_shards
    from rpcompile.runtime.memory import HostStore, shard_bounds

    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (6, 2, 4))
    store = HostStore.build([[("a", a), ("b", b)], [("c", c)]])
    bounds = shard_bounds(store.trainable_slots, 2)
    assert bounds == [(0, 6), (6, 12)]  # whole parameters, the cut nearest half of 12
    # A large first parameter (a tied embedding) must not leave a rank with nothing to own.
    big = HostStore.build([[("e", torch.nn.Parameter(torch.randn(155)))]]
                          + [[(f"l{i}", torch.nn.Parameter(torch.randn(15)))] for i in range(29)])
    cuts = shard_bounds(big.trainable_slots, 8)
    assert all(b0 < b1 for b0, b1 in cuts) and cuts[0] == (0, 155) and cuts[-1][1] == 590

    def part(rank, names, world=2, cut=bounds):
        masters = {n: torch.zeros(store.slot(n).shape) for n in names}
        return {"rank": rank, "world": world, "bounds": cut, "names": dict(enumerate(names)),
                "state": {"masters": masters, "step": 1, "mode": "sync", "optimizer": {
                    "state": {}, "param_groups": [{"lr": 0.1, "params": list(range(len(names)))}]}}}

    whole = merge_shards(store, [part(0, ["a"]), part(1, ["b", "c"])])
    assert whole["param_names"] == ["a", "b", "c"]
    assert whole["optimizer"]["param_groups"][0]["params"] == [0, 1, 2]
    with pytest.raises(CheckpointError, match="not one set"):
        merge_shards(store, [part(0, ["a"]), part(0, ["b", "c"])])
    with pytest.raises(CheckpointError, match="bounds differ"):
        merge_shards(store, [part(0, ["a"]), part(1, ["b", "c"], cut=[(0, 8), (8, 12)])])
    with pytest.raises(CheckpointError, match="lack 1 trainable"):
        merge_shards(store, [part(0, ["a"]), part(1, ["b"])])
    with pytest.raises(CheckpointError, match="in two shards"):
        merge_shards(store, [part(0, ["a", "b"]), part(1, ["b", "c"])])
    with pytest.raises(CheckpointError, match="no shards to merge"):
        merge_shards(store, [])
    # A parameter this model lacks ("z", with optimizer state): named, or left out (strict=False).
    other = part(1, ["b", "c"])
    other["names"][2] = "z"
    other["state"]["masters"]["z"] = torch.zeros(3)
    other["state"]["optimizer"]["param_groups"][0]["params"].append(2)
    other["state"]["optimizer"]["state"] = {0: {"m": torch.ones(2)}, 2: {"m": torch.ones(3)}}
    with pytest.raises(CheckpointError, match=r"\(\['z'\]\): pass strict=False"):
        merge_shards(store, [part(0, ["a"]), other])
    lenient = merge_shards(store, [part(0, ["a"]), other], strict=False)
    assert lenient["param_names"] == ["a", "b", "c"] and list(lenient["masters"]) == ["a", "b", "c"]
    assert lenient["optimizer"]["param_groups"][0]["params"] == [0, 1, 2]
    assert list(lenient["optimizer"]["state"]) == [1]  # b's entry; z's is gone
    assert torch.equal(lenient["optimizer"]["state"][1]["m"], torch.ones(2))


# -- checkpoints across ranks: one outcome on every rank --------------------------------------

GROUP_TIMEOUT_S = 60.0  # the process group's timeout in these tests: a wait that long is a hang


def _outcome(call, *args) -> dict:
    """What ``call(*args)`` raised on this rank (None: it returned), its message, the ranks its
    ``CheckpointFailed`` names, and how long it took."""
    start = time.monotonic()
    out = {"error": None, "message": "", "failures": None}
    try:
        call(*args)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc),
                   failures=sorted(getattr(exc, "failures", {}) or {}))
    out["elapsed"] = time.monotonic() - start
    return out


def _checkpoint_rank(rank: int, world: int, port: int, out: str) -> None:
    from pathlib import Path

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        batches = [_share(b, rank, world) for b in _batches()]
        result = {name: _checkpoint_case(name, options, rank, Path(out), batches)
                  for name, options in (("sharded", {"shard_optimizer": True,
                                                     "optimizer": _adamw}),
                                        ("replicated", {}))}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _checkpoint_case(name: str, options: dict, rank: int, root, batches) -> dict:
    import shutil

    import torch.distributed as dist

    from rpcompile.runtime.checkpoint import reading, writing

    compiled = _compile("qwen3", rank, batches[0], **options)
    trainer = compiled.trainer()
    compiled.step(batches[0])
    r: dict = {}

    def owned():
        return {k: v.clone() for k, v in trainer.owned_masters().items()}

    step1 = owned()
    # Rank 0's write fails (after every rank's state was taken and, sharded, gathered).
    original = writing._fsync_and_hash
    if rank == 0:
        def full_disk(path):
            raise OSError(28, "injected: no space left on device")
        writing._fsync_and_hash = full_disk
    r["write"] = _outcome(trainer.save_checkpoint, root / f"{name}-failed")
    writing._fsync_and_hash = original
    good = trainer.save_checkpoint(root / f"{name}-good")
    per_rank = root / f"{name}-per-rank"
    if trainer.sharded:
        # One file per rank: a failure in rank 1's write fails every rank, leaves nothing.
        if rank == 1:
            def full_disk_on_one(path):
                raise OSError(28, "injected: no space left on rank 1's disk")
            writing._fsync_and_hash = full_disk_on_one
        r["per_rank_write"] = _outcome(functools.partial(
            trainer.save_checkpoint, root / f"{name}-per-rank-failed", per_rank=True))
        writing._fsync_and_hash = original
        trainer.save_checkpoint(per_rank, per_rank=True)
        r["step1_all"] = trainer.gather_masters()
    else:
        r["per_rank_write"] = _outcome(functools.partial(
            trainer.save_checkpoint, per_rank, per_rank=True))
    compiled.step(batches[1])
    later = trainer.save_checkpoint(root / f"{name}-later")
    step2 = owned()
    corrupt = root / f"{name}-corrupt"
    if rank == 0:  # a copy of the good checkpoint with one byte flipped
        shutil.copytree(good, corrupt)
        data = bytearray((corrupt / "state.safetensors").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (corrupt / "state.safetensors").write_bytes(bytes(data))
    dist.barrier()
    # Rank 1 reads the corrupt copy (a CheckpointError there), rank 0 the good one.
    r["corrupt"] = _outcome(trainer.load_checkpoint, good if rank == 0 else corrupt)
    # Rank 0 fails with an error that is not a ValueError, before any agreement.
    original_read = reading.read_manifest
    if rank == 0:
        def unreadable(path):
            raise PermissionError(13, "injected: permission denied", str(path))
        reading.read_manifest = unreadable
    r["unreadable"] = _outcome(trainer.load_checkpoint, good)
    reading.read_manifest = original_read
    # Two valid checkpoints, one on each rank: the digests differ.
    r["different"] = _outcome(trainer.load_checkpoint, good if rank == 0 else later)
    r["unchanged"] = _max_diff(owned(), step2)
    trainer.load_checkpoint(good)  # the same file on every rank: loads
    r["loaded"] = _max_diff(owned(), step1)
    if trainer.sharded:  # the per-rank checkpoint of step 1 loads on the same ranks
        compiled.step(batches[1])
        trainer.load_checkpoint(per_rank)
        r["per_rank_loaded"] = _max_diff(owned(), step1)
    compiled.close()
    return r


def test_a_checkpoint_save_or_load_ends_the_same_way_on_every_rank(tmp_path):
    """A failure on one rank inside a save or a load (rank 0's write, a corrupt file on rank
    1, an OSError on rank 0 before any agreement, ranks reading different checkpoints) makes
    every rank raise ``CheckpointFailed`` naming the failed rank and its error, at once (far
    inside the process group's timeout); nothing is saved and nothing is loaded anywhere; a
    good checkpoint then loads on every rank. Sharded and replicated."""
    ranks = _spawn(_checkpoint_rank, 2, tmp_path, timeout=300.0)
    assert all(r is not None for r in ranks), "a rank failed (see its output)"
    for name in ("sharded", "replicated"):
        assert not (tmp_path / f"{name}-failed").exists(), name  # nothing claims to be saved
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{name}-failed")]
        for rank, r in enumerate(ranks):
            case = r[name]
            for what, failed, says in (("write", 0, "injected: no space left"),
                                       ("corrupt", 1, "sha256"),
                                       ("unreadable", 0, "PermissionError"),
                                       ("different", None, "sha256")):
                got = case[what]
                assert got["error"] == "CheckpointFailed", (name, rank, what, got)
                if failed is not None:
                    assert got["failures"] == [failed], (name, rank, what, got)
                    assert f"rank {failed}: " in got["message"]
                assert says in got["message"], (name, rank, what, got["message"])
                assert got["elapsed"] < GROUP_TIMEOUT_S / 3, (name, rank, what, got)
            assert case["unchanged"] == 0.0 and case["loaded"] == 0.0, (name, rank)
            got = case["per_rank_write"]
            if name == "sharded":
                assert got["error"] == "CheckpointFailed" and got["failures"] == [1], got
                assert "rank 1: OSError" in got["message"] and "shared file" in got["message"]
                assert case["per_rank_loaded"] == 0.0
            else:
                assert got["error"] == "InvalidInput" and "per_rank=True" in got["message"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".sharded-per-rank")]
    assert not (tmp_path / "sharded-per-rank-failed").exists()
    # One file per rank and a manifest; it loads in one process as the gathered checkpoint
    # of the same step does: the same masters and optimizer state, tensor for tensor.
    from rpcompile.runtime.checkpoint import read_manifest

    per_rank = tmp_path / "sharded-per-rank"
    assert sorted(p.name for p in per_rank.iterdir()) == [
        "manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert read_manifest(per_rank)["sharded"]
    states = []
    for path in (per_rank, tmp_path / "sharded-good"):
        single = _compile("qwen3", 5, _batches()[0], optimizer=_adamw)
        try:
            single.load_checkpoint(path)
            assert _max_diff(single.trainer().masters(), ranks[0]["sharded"]["step1_all"]) == 0
            states.append(single.trainer().state_dict())
        finally:
            single.close()
    a, b = (s["optimizer"] for s in states)
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


# -- no hang across ranks: a rank that cannot take part announces it ---------------------------

ANNOUNCED_S = 10.0  # far under GROUP_TIMEOUT_S and the step deadline: the others stopped at once


def _announce_rank(rank: int, world: int, port: int, out: str) -> None:
    """Five failures on rank 1 that must not leave rank 0 waiting for the group's timeout (or
    the step's deadline), each on its own process group (a failure leaves a group's
    collectives out of step): rank 1's data-parallel state broken by a failed step before a
    save; a KeyboardInterrupt in rank 1's load and in its per-rank write; rank 1's REDUCE
    (the network lane's thread) raising mid-step; rank 1's batch refused before the step. Before them, on the first group, a
    replicated save in which rank 1 may take no copy of its state."""
    from pathlib import Path

    import torch.distributed as dist

    from rpcompile.runtime import checkpoint
    from rpcompile.runtime.checkpoint import reading

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    root = Path(out)
    groups = [dist.new_group(backend="gloo") for _ in range(5)]
    batches = [_share(b, rank, world) for b in _batches()]
    result: dict = {}

    def caught(call, *args, **kwargs) -> dict:
        try:
            return _outcome(functools.partial(call, *args, **kwargs))
        except KeyboardInterrupt:
            return {"error": "KeyboardInterrupt"}

    # 1. replicated: rank 1 saves without a copy of its state; then its step fails after
    # every collective (rank 0's step completes) and its state is broken before the next save.
    compiled = _compile("qwen3", rank, batches[0], process_group=groups[0], timeout_s=60)
    trainer = compiled.trainer()
    compiled.step(batches[0])
    if rank == 1:
        def no_copy():
            raise AssertionError("rank 1 took a copy of its state to agree on rank 0's save")
        trainer.driver.state_dict = no_copy
    result["no_copy"] = _outcome(trainer.save_checkpoint, root / "replicated")
    result["masters"] = {k: v.clone() for k, v in trainer.masters().items()}
    if rank == 1:
        commit = trainer.driver.commit_step

        def failing_commit():
            trainer.driver.commit_step = commit
            raise RuntimeError("injected: rank 1's commit failed")
        trainer.driver.commit_step = failing_commit
    result["step"] = _outcome(compiled.step, batches[1])
    result["broken_save"] = _outcome(trainer.save_checkpoint, root / "broken")
    compiled.close()
    # 2. replicated: a KeyboardInterrupt in rank 1's reading of a checkpoint.
    compiled = _compile("qwen3", rank, batches[0], process_group=groups[1], timeout_s=60)
    prepare = reading.prepare
    if rank == 1:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        reading.prepare = interrupted
    result["interrupted_load"] = caught(compiled.load_checkpoint, root / "replicated")
    reading.prepare = prepare
    compiled.close()
    # 3. sharded: a KeyboardInterrupt in rank 1's write of its own file.
    compiled = _compile("qwen3", rank, batches[0], process_group=groups[2], timeout_s=60,
                        shard_optimizer=True, optimizer=_adamw)
    compiled.step(batches[0])
    write_shard = checkpoint.write_shard
    if rank == 1:
        def interrupted_write(*args, **kwargs):
            raise KeyboardInterrupt
        checkpoint.write_shard = interrupted_write
    result["interrupted_write"] = caught(compiled.trainer().save_checkpoint,
                                         root / "per-rank", per_rank=True)
    checkpoint.write_shard = write_shard
    compiled.close()
    # 4. a REDUCE (on the executor's network-lane thread) raises on rank 1 mid-step.
    compiled = _compile("qwen3", rank, batches[0], process_group=groups[3], timeout_s=60)
    compiled.step(batches[0])
    if rank == 1:
        def failing_reduce(stage):
            raise RuntimeError("injected: rank 1's REDUCE failed")
        compiled.trainer().dp.stage_done = failing_reduce
    result["reduce"] = _outcome(compiled.step, batches[1])
    compiled.close()
    # 5. rank 1's batch is refused before the step starts (longer than the plan's shape, which
    # dynamic=False keeps: by default the ranks would agree on a new plan for it).
    compiled = _compile("qwen3", rank, batches[0], process_group=groups[4], timeout_s=60,
                        dynamic=False)
    compiled.step(batches[0])
    bad = {k: torch.cat([v, v], dim=1) for k, v in batches[1].items()} if rank == 1 else \
        batches[1]
    result["refused_batch"] = _outcome(compiled.step, bad)
    compiled.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if rank == 1:
        # Alive until rank 0 is done, so that it learns of the refusal from the announcement,
        # not from closed connections (a rank that exits at once can beat rank 0's next poll).
        limit = time.monotonic() + 30.0
        while not os.path.exists(os.path.join(out, "rank0.pt")) and time.monotonic() < limit:
            time.sleep(0.1)
    dist.destroy_process_group()


def test_a_rank_that_cannot_take_part_makes_the_others_fail_at_once(tmp_path):
    """No rank waits for the group's timeout or the step's deadline on a rank that failed
    and stays alive: a rank whose data-parallel state is broken, or that is interrupted in
    a checkpoint's local phase, or whose network lane fails mid-step, announces it, and the
    others raise the named error (``CheckpointFailed`` in a checkpoint, ``RankFailed`` in a
    step) within seconds, naming the rank and what it announced."""
    ranks = _spawn(_announce_rank, 2, tmp_path, timeout=300.0)
    assert all(r is not None for r in ranks), "a rank failed (see its output)"
    first, second = ranks
    # Replicated: rank 1 agreed on rank 0's save without a copy of its state (it would have
    # raised); the checkpoint holds rank 0's masters, which are every rank's.
    for r in ranks:
        assert r["no_copy"]["error"] is None, r["no_copy"]
    resumed = _compile("qwen3", 3, _batches()[0])
    try:
        with pytest.warns(RuntimeWarning, match="another plan"):
            resumed.load_checkpoint(tmp_path / "replicated")
        assert _max_diff(resumed.trainer().masters(), first["masters"]) == 0.0
        assert _max_diff(first["masters"], second["masters"]) == 0.0
    finally:
        resumed.close()
    assert first["step"]["error"] is None and second["step"]["error"] == "StepFailed"
    assert second["broken_save"]["error"] == "StateError"  # a RuntimeError
    assert "out of step" in second["broken_save"]["message"]
    assert second["interrupted_load"]["error"] == "KeyboardInterrupt"
    assert second["interrupted_write"]["error"] == "KeyboardInterrupt"
    for what, says in (("broken_save", "step 1 failed"),
                       ("interrupted_load", "KeyboardInterrupt on rank 1 in loading"),
                       ("interrupted_write", "KeyboardInterrupt on rank 1 in writing")):
        got = first[what]
        assert got["error"] == "CheckpointFailed", (what, got)
        assert got["failures"] == [1], (what, got)
        assert "rank 1: " in got["message"] and says in got["message"], (what, got)
        assert "restart every rank" in got["message"], (what, got)
        assert got["elapsed"] < ANNOUNCED_S, (what, got)
    assert not (tmp_path / "broken").exists() and not (tmp_path / "per-rank").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    got = first["reduce"]
    assert got["error"] == "RankFailed" and "rank 1 announced" in got["message"], got
    assert got["elapsed"] < ANNOUNCED_S, got  # the step's deadline is 60 s
    assert second["reduce"]["error"] == "StepFailed"
    assert "injected: rank 1's REDUCE failed" in second["reduce"]["message"]
    got = first["refused_batch"]
    assert got["error"] == "RankFailed" and "refused its batch on rank 1" in got["message"], got
    assert got["elapsed"] < ANNOUNCED_S, got  # it waited for the 60 s group timeout before
    assert second["refused_batch"]["error"] == "InvalidInput"  # a ValueError


class _Work:
    """A collective's handle whose first, timed wait gives up (``Operation timed out!``) as
    it completes, then ends with ``error`` (None: a success) when waited for again."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.done = False

    def wait(self, timeout=None):
        if not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done


def _bare_dp(rank: int = 0, world: int = 2):
    """A DataParallel with no group or store, for its waits alone."""
    import types

    from rpcompile.runtime.distributed import DataParallel

    dp = DataParallel.__new__(DataParallel)
    dp.rank, dp.world, dp._store, dp._key = rank, world, None, ""
    dp._broken, dp._works, dp._pending = "", [], []
    dp.store = types.SimpleNamespace(trainable_slots=[])
    return dp


def test_a_collective_done_between_the_polls_timed_wait_and_its_check_is_a_success():
    from rpcompile.runtime.distributed import RankFailed

    dp = _bare_dp()
    dp._wait("the test's all-reduce", _Work(), None)  # no RankFailed: it completed
    assert dp._broken == ""
    dp.check()  # and the next step may run
    # One that failed as it completed raises its own error, not the poll's timeout.
    with pytest.raises(RankFailed, match="the test's all-reduce") as info:
        dp._wait("the test's all-reduce", _Work(RuntimeError("Connection closed by peer")),
                 None)
    assert "Connection closed by peer" in str(info.value.__cause__)
    assert dp._broken == "the test's all-reduce"


def test_the_end_of_a_step_waits_for_its_reductions_within_one_deadline(monkeypatch):
    """finish() gives its reductions the time left of the step's deadline together, not the
    whole deadline each: two reductions done 0.5 s and 1.0 s after it begins miss a 0.6 s
    deadline (on a simulated clock that the waits advance)."""
    import types

    from rpcompile.runtime import distributed
    from rpcompile.runtime.distributed import RankFailed

    clock = [0.0]

    class Late:
        def __init__(self, done_at: float) -> None:
            self.done_at = done_at

        def wait(self, timeout=None):
            step = float("inf") if timeout is None else timeout.total_seconds()
            if clock[0] + step >= self.done_at:
                clock[0] = max(clock[0], self.done_at)
                return True
            clock[0] += step
            raise RuntimeError("Operation timed out!")

        def is_completed(self) -> bool:
            return clock[0] >= self.done_at

    monkeypatch.setattr(distributed, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(distributed, "dist", types.SimpleNamespace(
        all_reduce=lambda tensor, group, async_op: Late(0.0)))
    dp = _bare_dp()
    dp.shard, dp.mean_loss, dp.group = False, False, None
    dp._works = [("the first reduction", Late(0.5)), ("the second reduction", Late(1.0))]
    with pytest.raises(RankFailed, match="the second reduction") as info:
        dp.finish(torch.tensor(1.0), False, 0.6)
    assert "deadline" in str(info.value.__cause__)
    assert clock[0] == pytest.approx(0.6)
    # Within the deadline: the step's loss comes back.
    clock[0] = 0.0
    dp._broken = ""
    dp._works = [("the first reduction", Late(0.5)), ("the second reduction", Late(1.0))]
    loss, nonfinite, _ = dp.finish(torch.tensor(1.0), False, 1.5)
    assert float(loss) == 1.0 and not nonfinite


class _Group:
    """One rank's handle on a process group of ``size`` ranks simulated in this process:
    ranks build their trainers one after another, sharing the group's store (a real
    in-memory ``HashStore``) and its broadcasts (rank 0's n-th reaches every rank's n-th)."""

    def __init__(self, hub: dict, name: str, rank: int, size: int) -> None:
        import torch.distributed as dist

        self.name, self.rank, self.size = name, rank, size
        self.shared = hub.setdefault(name, {"store": dist.HashStore(), "sent": []})
        self.received = 0


def _fake_dist():
    import types

    def broadcast(tensor, src, group, async_op):
        assert src == 0 and async_op
        if group.rank == 0:
            group.shared["sent"].append(tensor.clone())
        else:
            tensor.copy_(group.shared["sent"][group.received])
            group.received += 1
        return types.SimpleNamespace(wait=lambda timeout=None: True, is_completed=lambda: True)

    return types.SimpleNamespace(
        get_rank=lambda g: g.rank, get_world_size=lambda g: g.size,
        get_backend=lambda g: "gloo", get_global_rank=lambda g, r: r, broadcast=broadcast)


def test_every_trainer_of_a_group_has_the_same_store_keys_on_every_rank(monkeypatch):
    """A trainer's store keys are agreed by its group: after a trainer on a subgroup (ranks
    0 and 1 of 3), all 3 ranks of the next trainer read the same keys (rank 1's announced
    failure reaches ranks 0 and 2), and a fresh trainer reads no failure announced to an
    earlier one."""
    import types

    from rpcompile.runtime import distributed

    monkeypatch.setattr(distributed, "dist", _fake_dist())
    monkeypatch.setattr(distributed, "_group_store", lambda g: g.shared["store"])
    hub: dict = {}
    store = types.SimpleNamespace(trainable_slots=[])
    world = [_Group(hub, "world", r, 3) for r in range(3)]
    pair = [_Group(hub, "pair", r, 2) for r in range(2)]
    for g in pair:
        distributed.DataParallel(g, store, mean_loss=False)
    first = [distributed.DataParallel(g, store, mean_loss=False) for g in world]
    first[1].abandon("step 4 failed")
    assert [first[r].failed_peers() for r in range(3)] == \
        [{1: "step 4 failed"}, {}, {1: "step 4 failed"}]
    second = [distributed.DataParallel(g, store, mean_loss=False) for g in world]
    assert len({dp._key for dp in second}) == 1 and second[0]._key != first[0]._key
    assert [dp.failed_peers() for dp in second] == [{}, {}, {}]


def test_a_sharded_save_pretrained_agrees_on_a_failed_copy_of_the_gathered_masters(tmp_path):
    """Sharded save_pretrained: a rank whose copy of the gathered masters into its module
    fails reaches the agreement (the others raise CheckpointFailed at once instead of
    waiting there for the group's timeout), after an agreement on the queued updates."""
    from rpcompile.compiler import Compiled
    from rpcompile.runtime.checkpoint import CheckpointFailed

    calls: list = []

    class Ranks:
        rank = 1

        def settle(self, error, what):
            calls.append(("settle", what, None if error is None else str(error)))
            if error is not None:
                raise CheckpointFailed(what, {1: str(error)}, 2) from error

        def interrupted(self, exc, what):
            calls.append(("interrupted", what))

    class Trainer:
        sharded = True
        dp = Ranks()

        def settle_across_ranks(self, what):
            calls.append(("updates", what))

        def sync_to_model(self):
            raise RuntimeError("injected: the copy into the module failed")

    compiled = Compiled.__new__(Compiled)
    compiled._finished_trainer = Trainer
    compiled._write_pretrained = lambda directory, merge: calls.append(("write",))
    with pytest.raises(CheckpointFailed, match="injected: the copy"):
        compiled.save_pretrained(tmp_path / "final")
    where = f"writing the model to {tmp_path / 'final'}"
    assert calls == [("updates", f"{where} (the queued updates)"),
                     ("settle", f"{where} (rank 0 writes)",
                      "injected: the copy into the module failed")]


def test_shard_optimizer_refuses_async_updates():
    from rpcompile.options import Options, PlanOptions, TrainOptions

    with pytest.raises(ValueError, match="shard_optimizer needs mode='sync'"):
        Options(plan=PlanOptions(mode="async", shard_optimizer=True), train=TrainOptions())
    with pytest.raises(ValueError, match="shard_optimizer must be True or False"):
        PlanOptions(shard_optimizer="yes")


@pytest.mark.parametrize("scenario", ["kill", "raise"])
def test_a_failing_rank_makes_the_other_fail_with_a_named_error_in_time(tmp_path, scenario):
    timeout_s = 6.0
    ranks = _spawn(_rank_main, 2, tmp_path, scenario, {"timeout_s": timeout_s}, timeout=180.0)
    survivor = ranks[0]
    assert survivor is not None
    assert survivor["error"] == "RankFailed", survivor.get("message")
    assert "rank 0 of 2" in survivor["message"] and "restart every rank" in survivor["message"]
    # At once, far inside the watchdog's bound: a peer that died closed its connections, a
    # peer that raised and lives announced its failure (the survivor's waits poll for it).
    assert survivor["elapsed"] < timeout_s / 2, survivor
    if scenario == "raise":
        assert "rank 1 announced: step 1 failed" in survivor["message"]
    # The failed step changed nothing.
    assert _max_diff(survivor["after"], survivor["before"]) == 0.0
    if scenario == "raise":
        assert ranks[1]["error"] == "StepFailed"


def test_one_process_without_a_group_is_not_data_parallel():
    model = hf_model("qwen3")
    compiled = rpcompile.compile(copy.deepcopy(model), gpus=2, microbatches=2,
                                 example_inputs=_batches()[0], device="virtual")
    try:
        assert compiled.trainer().dp is None
    finally:
        compiled.close()


def _run_cli(cmd: list[str], env: dict, cwd) -> None:
    import subprocess

    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]


def _train_args(tmp_path, lr: str = "3e-3") -> tuple[list[str], dict]:
    """``rpcompile train`` arguments over a tiny checkpoint and prompt/completion data, and
    the environment to run them in."""
    import json
    from pathlib import Path

    from tests.finetune.test_finetune import WORDS, _tiny_checkpoint

    root = Path(__file__).resolve().parents[2]
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    data = tmp_path / "pairs.jsonl"
    with data.open("w") as f:
        for i in range(40):
            w, k = WORDS[i % len(WORDS)], 1 + (i // len(WORDS)) % 4
            f.write(json.dumps({"prompt": f"{w} x{k}:", "completion": f" {w}" * k}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    args = ["train", "--model", str(ckpt), "--data", str(data), "--steps", "4", "--workers",
            "2", "--microbatches", "2", "--batch", "8", "--lr", lr, "--eval-every", "0",
            "--save-every", "2", "--keep-last", "2", "--report-to", "none"]
    return args, env


def _one_process(args: list[str]) -> int:
    """``rpcompile train`` in this process (the CLI's own ``main``, no process group), on one
    thread as the ranks and the CLI's subprocesses run (OMP_NUM_THREADS=1): the reference
    runs without a new process's start-up and first compile. Returns the exit status."""
    from rpcompile.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


def _torchrun(args: list[str], out, env: dict, cwd, ranks: int = 2) -> None:
    import sys

    _run_cli([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
              "--nproc-per-node", str(ranks), "--master-port", str(_free_port()), "-m",
              "rpcompile", *args, "--out", str(out)], env, cwd)


def _records(out) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_under_torchrun_equals_one_process_and_resumes_on_one_rank(tmp_path):
    args, env = _train_args(tmp_path)
    two, one, resumed = tmp_path / "two", tmp_path / "one", tmp_path / "resumed"
    _torchrun(args, two, env, tmp_path)
    assert _one_process([*args, "--out", str(one)]) == 0
    got, want = _records(two), _records(one)
    # Rank 0 alone wrote: one line per step and eval, one final/, its checkpoints.
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3, 4, 4]
    assert (two / "final" / "config.json").is_file()
    # The cpu profile has no inter-server link to time REDUCE on: the schedule is written,
    # its simulated timeline is left out (the run itself is not affected).
    assert (two / "schedule.csv").is_file() and not (two / "schedule.json").exists()
    assert (one / "schedule.json").is_file()
    assert sorted(p.name for p in (two / "checkpoints").iterdir()
                  if p.name.startswith("step-")) == ["step-00000002", "step-00000004"]
    for a, b in zip(got, want):
        for key in ("loss", "eval_loss", "tokens", "target_tokens"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a, b)
    # The two-rank checkpoint of step 2 resumes on one rank and continues as both runs did.
    assert _one_process(["train", "--resume", str(two / "checkpoints" / "step-00000002"),
                         "--out", str(resumed)]) == 0
    after = {r["step"]: r["loss"] for r in _records(resumed) if "loss" in r}
    assert sorted(after) == [3, 4]
    for step in (3, 4):
        assert after[step] == pytest.approx(next(r["loss"] for r in want if r["step"] == step
                                                 and "loss" in r), abs=1e-5)


def test_train_shard_optimizer_under_torchrun_equals_one_process(tmp_path, capsys):
    """``rpcompile train --shard-optimizer --checkpoint-per-rank`` on 2 ranks: every rank
    takes part in the evaluations, the checkpoints (each rank writes its shard's file, rank 0
    the manifest) and final/ (the masters gathered, rank 0 writes); the eval losses and
    final/'s weights equal one process training the same global batches, and the step-2
    checkpoint resumes on 3 ranks (another cut of the shards) to the one-process losses.
    (A sharded checkpoint that rank 0 writes whole is checked in
    test_ranks_train_like_one_process_and_eager_on_the_global_batch's zero1 cases.)"""

    from safetensors.torch import load_file

    # A small lr keeps AdamW's amplification of data parallel's summation order under 1e-6.
    args, env = _train_args(tmp_path, lr="5e-5")
    args[args.index("--eval-every") + 1] = "2"
    two, one = tmp_path / "two", tmp_path / "one"
    _torchrun([*args, "--shard-optimizer", "--checkpoint-per-rank"], two, env, tmp_path)
    assert _one_process([*args, "--out", str(one)]) == 0
    got, want = _records(two), _records(one)
    evals = [r["eval_loss"] for r in want if "eval_loss" in r]
    assert len(evals) == 3 and [r.get("eval_loss") for r in got if "eval_loss" in r] == \
        pytest.approx(evals, abs=1e-6)
    for a, b in zip(got, want):
        if "loss" in b:
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()
                  if p.name.startswith("step-")) == ["step-00000002", "step-00000004"]
    from rpcompile.runtime.checkpoint import read_manifest

    for step in ("step-00000002", "step-00000004"):
        folder = two / "checkpoints" / step
        assert sorted(p.name for p in folder.iterdir()) == [
            "manifest.json", "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors"]
        manifest = read_manifest(folder)
        assert manifest["sharded"] and manifest["ranks"] == 2
    sharded = load_file(str(two / "final" / "model.safetensors"))
    single = load_file(str(one / "final" / "model.safetensors"))
    assert sharded.keys() == single.keys()
    moved = max(float((single[k] - load_file(str(tmp_path / "ckpt" / "model.safetensors"))[k])
                      .abs().max()) for k in single)
    assert moved > 1e-5  # the weights trained: the comparison below is not of untouched ones
    assert max(float((sharded[k] - single[k]).abs().max()) for k in single) < 1e-6
    resumed = tmp_path / "resumed-3"
    _torchrun(["train", "--resume", str(two / "checkpoints" / "step-00000002")],
              resumed, env, tmp_path, ranks=3)
    after = {r["step"]: r["loss"] for r in _records(resumed) if "loss" in r}
    assert sorted(after) == [3, 4]
    for b in want:
        if b["step"] > 2 and "loss" in b:
            assert after[b["step"]] == pytest.approx(b["loss"], abs=1e-6)
    # Without --shard-optimizer the CLI refuses --checkpoint-per-rank (exit status 2, the
    # error on stderr) before it starts anything: an argument check of the CLI's own main,
    # with no process group (the subprocess it ran in proved nothing more).
    capsys.readouterr()
    assert _one_process([*args, "--checkpoint-per-rank", "--out", str(tmp_path / "refused")]) == 2
    assert "needs --shard-optimizer" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


# -- planning at scale (no processes) -----------------------------------------------------------


def test_link_presets_and_the_ring_all_reduce_time():
    from rpcompile.hardware import get_link, list_links

    assert list_links() == ["eth100", "eth25"]
    eth25 = get_link("eth25")
    # 1 GB over 4 servers: each sends 2 * 3/4 GB at 25 Gbit/s * 0.9, plus 6 latencies.
    expected_ms = 1.5e9 * 8 / (25e9 * 0.9) * 1e3 + 6 * eth25.latency_us * 1e-3
    assert eth25.allreduce_ms(1e9, 4) == pytest.approx(expected_ms, rel=1e-12)
    assert eth25.allreduce_ms(1e9, 1) == 0.0
    assert get_link("eth100").allreduce_ms(1e9, 4) < expected_ms / 3.9
    with pytest.raises(ValueError, match="known: eth100, eth25"):
        get_link("infiniband")


@pytest.fixture(scope="module")
def small_plan():
    from rpcompile.hardware import get_hardware
    from rpcompile.planner.partition import partition
    from rpcompile.workloads.paper import MODELS

    hw = get_hardware("rtx4090x8").with_gpus(4)
    units = MODELS["qwen3-1.7b"].units(2, 1024)[:6] + MODELS["qwen3-1.7b"].units(2, 1024)[-1:]
    return partition(units, hw, PlanOptions(gpus=4, microbatches=5, rounds=1, mode="async"),
                     microbatch_size=2, seq_len=1024), hw, 10 * 1024


def test_simulated_nodes_replay_the_schedule_lowered_for_n_ranks(small_plan):
    from rpcompile.hardware import get_link
    from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps
    from rpcompile.sim.scaling import simulate_nodes

    plan, hw, tokens = small_plan
    steps = steady_steps(plan)
    run = simulate_roundpipe(plan, hw, steps=steps, optimizer="async")
    one = simulate_nodes(plan, hw, 1, "eth100", tokens_per_step=tokens, one_server=run)
    assert one.efficiency == 1.0 and one.added_ms == 0.0 and one.reductions == 0
    assert one.step_ms == pytest.approx(steady_step_ms(run))
    grads = 4 * sum(u.trainable_params for u in plan.units)  # these units share nothing
    by_link = {}
    for link in ("eth25", "eth100"):
        for n in (2, 4):
            s = simulate_nodes(plan, hw, n, link, tokens_per_step=tokens, one_server=run)
            # One per gradient stage.
            assert s.gradient_bytes == grads and s.reductions == sum(
                1 for st in plan.stages if st.kind != "forward" and st.grad_bytes)
            # Each REDUCE takes at least its ring all-reduce time, computed here on its own.
            lk = get_link(link)
            ring = 2 * (n - 1) / n * grads / (lk.gbit_per_s * lk.efficiency / 8 * 1e6)
            assert s.link_busy_ms >= ring + 2 * 2 * (n - 1) * lk.latency_us * 1e-3 - 1e-6
            again = simulate_roundpipe(plan, hw.with_link(link), steps=steps, ranks=n)
            assert s.step_ms == pytest.approx(steady_step_ms(again))
            assert s.added_ms == pytest.approx(s.step_ms - one.step_ms)
            assert s.tokens_per_s == pytest.approx(n * tokens * 1e3 / s.step_ms)
            by_link[link, n] = s.efficiency
    assert by_link["eth25", 2] < by_link["eth100", 2] <= 1.0
    assert by_link["eth25", 4] <= by_link["eth25", 2]


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_nodes_prints_scaling(capsys, tmp_path):
    import json

    from rpcompile.cli import main

    out = tmp_path / "plan"
    assert main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "256", "--batch",
                 "18", "--microbatches", "9", "--gpus", "4", "--nodes", "2", "--link", "eth25",
                 "--no-fit-search", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 servers over eth25" in text and "scaling efficiency" in text
    nodes = json.loads((out / "summary.json").read_text())["nodes"]
    assert nodes["nodes"] == 2 and 0 < nodes["efficiency"] <= 1.0
    assert nodes["tokens_per_step"] == 2 * 18 * 256
    # Sharded: the same plan's scaling, its REDUCEs to the owners and the shadows broadcast.
    sharded = tmp_path / "sharded"
    assert main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "256", "--batch",
                 "18", "--microbatches", "9", "--gpus", "4", "--nodes", "2", "--link", "eth25",
                 "--optimizer", "sync", "--shard-optimizer", "--no-fit-search",
                 "--out", str(sharded)]) == 0
    assert "shadows broadcast (sharded)" in capsys.readouterr().out
    nodes = json.loads((sharded / "summary.json").read_text())["nodes"]
    assert nodes["sharded"] and nodes["shadow_bytes"] > 0
    assert main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--nodes", "2",
                 "--optimizer", "async", "--shard-optimizer", "--no-fit-search"]) == 2
    assert "shard_optimizer needs mode='sync'" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--optimizer", "sync",
                 "--shard-optimizer", "--no-fit-search"]) == 2  # one server: nothing to shard
    assert "changes nothing on one: add --nodes N" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3-1.7b", "--nodes", "2", "--link", "ib"]) == 2
    assert "unknown link 'ib'; known: eth100, eth25" in capsys.readouterr().err
    assert main(["hardware"]) == 0
    assert "eth25       link between servers" in capsys.readouterr().out
