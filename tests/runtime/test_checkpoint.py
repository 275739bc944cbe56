"""Checkpoints: a round trip continues bit-identically (sync and async, RNG and extra
included); SIGKILL during a checkpoint write, between writes or at a random moment, then a
resume in a new process, trains to the same losses and masters bit for bit as an uninterrupted
run; a corrupt, truncated or mismatched checkpoint, and a bad state dict, are refused with the
key named and nothing changed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile.capture.core import capture
from rpcompile.capture.tracing import tracer_waiting
from rpcompile.options import TrainOptions
from rpcompile.runtime.checkpoint import CheckpointError, CheckpointManager, read_manifest
from tests.tiny_models import hf_model, token_batch

CHILD = Path(__file__).parents[1] / "checkpoint_child.py"


def make(mode="sync", layers=2):
    warnings.simplefilter("ignore")
    model = hf_model("qwen3", layers=layers)
    return rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6),
                             device="virtual", mode=mode,
                             optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                             train=TrainOptions(timeout_s=120))


def masters_of(compiled):
    return {k: v.clone() for k, v in compiled.trainer().masters().items()}


def assert_same_masters(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_continues_bit_identically(tmp_path, mode):
    first = make(mode)
    for k in range(2):
        first.step(token_batch(6, seed=k))
    torch.manual_seed(1234)
    path = first.save_checkpoint(tmp_path / "ckpt", extra={"loader": {"epoch": 0, "index": 12}})
    after_save = torch.rand(3)
    manifest = read_manifest(path)
    assert manifest["step"] == 2 and manifest["mode"] == mode and len(manifest["plan_id"]) == 64
    assert sorted(os.listdir(path)) == ["manifest.json", "state.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left aside
    losses = [first.step(token_batch(6, seed=k)) for k in (2, 3)]

    second = make(mode)
    second.step(token_batch(6, seed=99))  # state to be overwritten
    torch.manual_seed(0)
    extra = second.load_checkpoint(path)
    assert extra == {"loader": {"epoch": 0, "index": 12}}
    assert torch.equal(torch.rand(3), after_save)  # the RNG state came back
    assert second.trainer().steps_done == 2
    again = [second.step(token_batch(6, seed=k)) for k in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(losses, again))
    assert_same_masters(masters_of(first), masters_of(second))
    first.close()
    second.close()


def test_an_update_running_while_another_model_compiles_is_bit_identical(monkeypatch):
    """torch.export sets process-global flags (torch.compiler.is_compiling()) that torch.optim
    reads (AdamW's bias corrections are then fp32 tensor math, not Python floats), so an update
    running while another model compiles changes in the last bits unless the capture and the
    updates exclude each other (rpcompile/capture/tracing.py). Here that overlap is forced:
    updates run inside their step, as the schedule's OPT actions on the host queue, so the
    overlap is a step running on one thread while a model compiles on another."""
    data = [token_batch(6, seed=k) for k in range(2)]
    quiet = make("async")
    for batch in data:
        quiet.step(batch)
    expected = masters_of(quiet)
    quiet.close()

    busy = make("async")
    busy.step(data[0])  # its gradients stay pending: step 1's OPTs apply them (no flush here)
    groups = len(busy.trainer().driver.groups)
    original = torch.optim.AdamW.step
    calls, started, met = [], threading.Event(), []

    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first group of step 0's update, in step 1: hold it until
            started.set()    # the compile below traces, or waits to trace
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if torch.compiler.is_compiling() or tracer_waiting():
                    met.append(1)
                    break
                time.sleep(0.002)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    # The compile below must export, not reuse the suite's capture of the same model.
    monkeypatch.setattr("rpcompile.compiler.entry.capture_graph", capture)
    stepping = threading.Thread(target=busy.step, args=(data[1],))
    stepping.start()  # its update (an OPT of the step) runs on that thread
    assert started.wait(20)
    other = make()  # captures (torch.export) while the update is held
    stepping.join(60)
    assert not stepping.is_alive()
    assert met, "the update never overlapped the compile: the test proved nothing"
    assert len(calls) == groups  # update 0, in step 1 (update 1 is the flush below)
    assert_same_masters(expected, masters_of(busy))
    busy.close()
    other.close()


def test_corrupt_truncated_or_mismatched_checkpoints_are_refused(tmp_path):
    source = make()
    source.step(token_batch(6))
    good = source.save_checkpoint(tmp_path / "good")
    target = make()
    target.step(token_batch(6, seed=5))
    before = masters_of(target)
    opt_before = target.trainer().state_dict()["optimizer"]

    def refused(path, key_part, **kw):
        with pytest.raises(CheckpointError) as info:
            target.load_checkpoint(path, **kw)
        assert key_part in str(info.value) and key_part in (info.value.key or "")
        assert_same_masters(before, masters_of(target))
        opt_after = target.trainer().state_dict()["optimizer"]
        for i, entry in opt_before["state"].items():
            for name, value in entry.items():
                assert torch.equal(value, opt_after["state"][i][name])
        assert target.trainer().steps_done == 1

    import shutil

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(good, dst)
        return dst

    corrupt = copy("corrupt")
    data = bytearray((corrupt / "state.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / "state.safetensors").write_bytes(bytes(data))
    refused(corrupt, "state.safetensors")

    truncated = copy("truncated")
    data = (truncated / "state.safetensors").read_bytes()
    (truncated / "state.safetensors").write_bytes(data[: len(data) // 3])
    refused(truncated, "state.safetensors")

    half_manifest = copy("half_manifest")
    text = (half_manifest / "manifest.json").read_text()
    (half_manifest / "manifest.json").write_text(text[: len(text) // 2])
    refused(half_manifest, "manifest.json")

    no_manifest = copy("no_manifest")
    (no_manifest / "manifest.json").unlink()
    refused(no_manifest, "manifest.json")

    other = make(layers=3)  # another model: a layer more
    other.step(token_batch(6))
    mismatched = other.save_checkpoint(tmp_path / "other")
    refused(mismatched, "masters['model.layers.2.")
    other.close()

    async_run = make("async")
    async_run.step(token_batch(6))
    refused(async_run.save_checkpoint(tmp_path / "async"), "mode")
    async_run.close()
    source.close()
    target.close()


def _permuted(state: dict, order: list[int]) -> dict:
    """``state`` with its optimizer re-indexed: new index ``j`` is old index ``order[j]``
    (state entries, group members and ``param_names`` permuted together), a checkpoint as a
    differently ordered optimizer over the same parameters would write it."""
    new_of = {old: new for new, old in enumerate(order)}
    optim = state["optimizer"]
    out = dict(state)
    out["optimizer"] = {
        "state": {new_of[i]: entry for i, entry in optim["state"].items()},
        "param_groups": [{**g, "params": sorted(new_of[i] for i in g["params"])}
                         for g in optim["param_groups"]]}
    out["param_names"] = [state["param_names"][old] for old in order]
    return out


def test_optimizer_state_is_matched_by_parameter_name_not_position(tmp_path):
    """A checkpoint whose optimizer indexes the parameters in another order (here reversed:
    every layer's same-shape matrices trade places, so position alone would load another
    parameter's Adam moments without a shape error) resumes exactly as the uninterrupted
    run, which equals eager training; a state naming a parameter this model lacks, or a
    group of other parameters, is refused naming them."""
    from tests.tiny_models import eager_grads

    data = [token_batch(6, seed=k) for k in range(3)]
    run = make()
    for b in data[:2]:
        run.step(b)
    state = run.trainer().state_dict()
    run.step(data[2])
    uninterrupted = masters_of(run)
    run.close()
    # Eager: the same AdamW over the same token-mean loss and microbatches.
    model = hf_model("qwen3", layers=2)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    for b in data:
        _, grads = eager_grads(model, b, 3)
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        opt.step()
    for name, value in uninterrupted.items():
        assert float((value - model.get_parameter(name).detach()).abs().max()) < 1e-5, name

    n = len(state["param_names"])
    permuted = _permuted(state, list(reversed(range(n))))
    shapes = {name: tuple(v.shape) for name, v in state["masters"].items()}
    same_shape_moved = [j for j in range(n) if permuted["param_names"][j] != state[
        "param_names"][j] and shapes[permuted["param_names"][j]] == shapes[state["param_names"][j]]]
    assert same_shape_moved, "the permutation moves no same-shape parameter: proves nothing"
    target = make()
    target.trainer().load_state_dict(permuted)
    target.step(data[2])
    assert_same_masters(uninterrupted, masters_of(target))

    # Through the files as well: a permuted checkpoint written and read back.
    path = tmp_path / "permuted"
    fresh = make()
    fresh.trainer().load_state_dict(permuted)
    fresh.save_checkpoint(path)
    fresh.close()
    again = make()
    again.load_checkpoint(path)
    again.step(data[2])
    assert_same_masters(uninterrupted, masters_of(again))
    again.close()

    unknown = dict(permuted)
    unknown["param_names"] = ["model.nope.weight", *permuted["param_names"][1:]]
    before = masters_of(target)
    with pytest.raises(CheckpointError, match=r"model\.nope\.weight"):
        target.trainer().load_state_dict(unknown)
    moved = _permuted(state, list(range(n)))  # two groups where this optimizer has one
    groups = moved["optimizer"]["param_groups"]
    moved["optimizer"]["param_groups"] = [{**groups[0], "params": groups[0]["params"][:1]},
                                          {**groups[0], "params": groups[0]["params"][1:]}]
    with pytest.raises(CheckpointError, match="2 parameter groups"):
        target.trainer().load_state_dict(moved)
    assert_same_masters(before, masters_of(target))
    target.close()


def test_load_state_dict_validates_everything_first():
    trainer_owner = make()
    trainer_owner.step(token_batch(6))
    trainer = trainer_owner.trainer()
    state = trainer.state_dict()
    before = masters_of(trainer_owner)
    names = list(state["masters"])
    assert len(names) > 10

    def refused(bad, key_part, **kw):
        with pytest.raises(CheckpointError) as info:
            trainer.load_state_dict(bad, **kw)
        assert key_part in str(info.value), str(info.value)
        assert_same_masters(before, masters_of(trainer_owner))

    # One wrong-shaped tensor, last in order: nothing of the earlier ones is loaded.
    bad = {**state, "masters": {n: v + 1 for n, v in state["masters"].items()}}
    bad["masters"][names[-1]] = torch.zeros(3)
    refused(bad, names[-1])

    missing = {**state, "masters": dict(state["masters"])}
    del missing["masters"][names[0]]
    refused(missing, names[0])

    extra_param = {**state, "masters": {**state["masters"], "not.a.param": torch.zeros(2)}}
    refused(extra_param, "not.a.param")
    extra_key = {**state, "surprise": 1}
    refused(extra_key, "surprise")
    trainer.load_state_dict(extra_key, strict=False)  # explicitly allowed

    nan = {**state, "masters": dict(state["masters"])}
    nan["masters"][names[3]] = torch.full_like(state["masters"][names[3]], float("nan"))
    refused(nan, names[3])
    bad_opt = {**state, "optimizer": {**state["optimizer"],
                                      "state": {0: {**state["optimizer"]["state"][0]}}}}
    bad_opt["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    refused(bad_opt, "exp_avg")
    trainer.load_state_dict(nan, allow_nonfinite=True)
    assert torch.isnan(trainer.masters()[names[3]]).all()
    trainer_owner.close()


def test_a_partial_per_rank_load_checks_the_masters_of_the_files_it_skips(monkeypatch, tmp_path):
    """A sharded rank reads only the files holding its own parameters, but the masters every
    file lists are checked against the model first: a parameter this model lacks is refused
    (strict) and a trainable parameter no file holds always is, before any file is read."""
    from rpcompile.runtime.checkpoint import reading
    from rpcompile.runtime.memory import HostStore

    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (6, 2, 4))
    store = HostStore.build([[("a", a), ("b", b)], [("c", c)]])
    read: list = []
    monkeypatch.setattr(reading, "_read_tensors",
                        lambda folder, manifest, name: read.append(name) or {})

    def manifest(*lists):
        return {"rng": {}, "bounds": [[0, 6], [6, 12]],
                "shards": [{"rank": r, "file": f"shard-{r}", "masters": m, "optimizer": {}}
                           for r, m in enumerate(lists)]}

    with pytest.raises(CheckpointError, match=r"\(\['z'\]\): pass strict=False") as info:
        reading._rebuild_shards(tmp_path, manifest(["a"], ["b", "c", "z"]), store, {"a"})
    assert info.value.key == "masters" and read == []
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=r"lacks the masters of 1 .*\['c'\]"):
            reading._rebuild_shards(tmp_path, manifest(["a"], ["b"]), store, {"a"},
                                    strict=strict)
        assert read == []


def test_the_load_digest_the_ranks_agree_on_covers_the_whole_manifest(tmp_path):
    """Data-parallel ranks compare the digest of what they prepared before any applies: two
    checkpoints with the same files but another manifest (its extra: the data position,
    or its step) have different digests; a byte-for-byte copy has the same."""
    import shutil

    from rpcompile.runtime import checkpoint

    compiled = make()
    try:
        compiled.step(token_batch(6))
        good = compiled.save_checkpoint(tmp_path / "good", extra={"data": 3})
        trainer = compiled.trainer()
        digest = checkpoint.prepare(trainer, good).digest
        same = shutil.copytree(good, tmp_path / "same")
        assert checkpoint.prepare(trainer, same).digest == digest
        for key, value in (("extra", {"data": 4}), ("step", 2)):
            other = shutil.copytree(good, tmp_path / key)
            manifest = json.loads((other / "manifest.json").read_text())
            manifest[key] = value
            (other / "manifest.json").write_text(json.dumps(manifest))
            assert checkpoint.prepare(trainer, other).digest != digest, key
    finally:
        compiled.close()


def test_manager_keeps_the_last_k_and_finds_the_latest(tmp_path):
    compiled = make()
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=2)
    assert manager.latest() is None
    # A killed write's leftovers and an incomplete folder are neither latest nor kept.
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / ".step-00000009.tmp-1-abcd").mkdir()
    (tmp_path / "ckpts" / "step-00000099").mkdir()
    for step in range(1, 5):
        compiled.step(token_batch(6, seed=step))
        path = manager.save(compiled, step, extra={"next_step": step})
        assert path == tmp_path / "ckpts" / f"step-{step:08d}"
    assert [p.name for p in manager.checkpoints()] == ["step-00000003", "step-00000004"]
    assert manager.latest().name == "step-00000004"
    assert not (tmp_path / "ckpts" / ".step-00000009.tmp-1-abcd").exists()
    compiled.close()


def test_manager_names_what_it_skips_and_never_prunes_the_checkpoint_it_wrote(tmp_path):
    compiled = make()
    try:
        later = CheckpointManager(tmp_path / "ckpts", keep_last=1)
        compiled.step(token_batch(6, seed=1))
        later.save(compiled, 9)  # e.g. of another run: a higher step than the one written next
        assert later.save(compiled, 2).is_dir()
        manager = CheckpointManager(tmp_path / "cut", keep_last=3)
        for step in (1, 2):
            manager.save(compiled, step)
        manifest = manager.path_for(2) / "manifest.json"
        manifest.write_text(manifest.read_text()[:40])
        assert manager.latest() == manager.path_for(1)
        ((path, why),) = manager.skipped()
        assert path == manager.path_for(2)
        assert "manifest.json is unreadable or truncated" in why
    finally:
        compiled.close()


def test_a_write_the_file_system_refuses_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk mid-write (the tensor file half written, then ENOSPC): the error names the
    folder, the bytes it needs and those free, no temporary folder is left, and the previous
    checkpoint (and the one the failed write would have replaced) still load."""
    import errno

    import safetensors.torch

    compiled = make()
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=2)
    try:
        compiled.step(token_batch(6, seed=1))
        manager.save(compiled, 1)
        first = masters_of(compiled)
        compiled.save_checkpoint(tmp_path / "same")
        compiled.step(token_batch(6, seed=2))
        write = safetensors.torch.save_file

        def full_disk(tensors, filename, *args, **kwargs):
            write(tensors, filename, *args, **kwargs)
            with open(filename, "r+b") as fh:
                fh.truncate(100)
            raise OSError(errno.ENOSPC, "No space left on device", filename)

        monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
        for target in (manager.path_for(2), tmp_path / "same"):
            with pytest.raises(CheckpointError) as info:
                compiled.save_checkpoint(target)
            text = str(info.value)
            assert f"could not write the checkpoint {target}: No space left on device" in text
            assert "bytes on the file system of" in text and "bytes are free there" in text
            assert ("still holds the checkpoint it held before" in text) == (target.name ==
                                                                             "same")
        monkeypatch.undo()
        assert not [p for p in tmp_path.rglob(".*tmp-*")]
        assert not manager.path_for(2).exists()
        assert manager.latest() == manager.path_for(1)
        for saved in (manager.path_for(1), tmp_path / "same"):
            compiled.load_checkpoint(saved)
            assert_same_masters(masters_of(compiled), first)
    finally:
        compiled.close()


def _start_child(root: Path, *args: str) -> subprocess.Popen:
    """tests/checkpoint_child.py in the background on one thread, its stderr in
    ``root/stderr.txt``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root.mkdir(exist_ok=True)
    with (root / "stderr.txt").open("a") as err:
        return subprocess.Popen([sys.executable, str(CHILD), "--root", str(root), *args],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)


def _ended(root: Path, child: subprocess.Popen) -> tuple[int, str]:
    """The child's exit status once it ends (a hang fails the test), and its stderr's end."""
    try:
        child.wait(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail(f"the child in {root} did not end within 300 s (hang)")
    return child.returncode, (root / "stderr.txt").read_text()[-3000:]


def _losses(root: Path) -> dict[int, str]:
    out = {}
    for line in (root / "losses.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[int(parts[0])] = parts[1]  # a resumed run rewrites the steps it redoes
    return out


def _final(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "final.safetensors"))


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """Each run is its own process, as before; the independent ones run at once (each child
    is one thread: one at a time left a core idle)."""
    steps = ["--steps", "7", "--every", "2"]
    cases = {"in_write": ["--kill-in-write", "4"], "between": ["--kill-after", "2"],
             "random": []}
    clean = tmp_path / "clean"
    children = {name: _start_child(tmp_path / name, *steps, *kill)
                for name, kill in {"clean": [], **cases}.items()}
    root = tmp_path / "random"
    child = children["random"]
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and child.poll() is None:
        log = root / "losses.txt"
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.3))
    child.send_signal(signal.SIGKILL)
    child.wait()
    code, err = _ended(clean, children["clean"])
    assert code == 0, err
    for name in ("in_write", "between"):
        code, err = _ended(tmp_path / name, children[name])
        assert code == -signal.SIGKILL, err
    want_losses, want_masters = _losses(clean), _final(clean)
    assert sorted(want_losses) == list(range(7))

    root = tmp_path / "in_write"
    leftovers = [p.name for p in (root / "ckpts").iterdir() if p.name.startswith(".")]
    assert leftovers, "the kill was meant to land inside a write"
    latest = CheckpointManager(root / "ckpts").latest()
    assert latest is not None and latest.name == "step-00000002"
    resumed = {name: _start_child(tmp_path / name, *steps, "--resume") for name in cases}
    for name, child in resumed.items():
        root = tmp_path / name
        code, err = _ended(root, child)
        assert code == 0, (name, err)
        got = _losses(root)
        assert got == want_losses, name
        assert_same_masters(want_masters, _final(root))
        assert json.loads(
            (CheckpointManager(root / "ckpts").latest() / "manifest.json").read_text()
        )["extra"] == {"next_step": 6}
