"""The grouped public API: option groups, the flat keywords kept for scripts, one check each."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile import CaptureOptions, PlanOptions, TrainOptions
from rpcompile.options import FLAT
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model, token_batch

ROOT = Path(__file__).resolve().parent.parent
# Every keyword the README and docs showed for compile() before the groups existed.
DOCUMENTED = ("gpus", "microbatches", "rounds", "hardware", "example_inputs", "loss_fn",
              "optimizer", "device", "mode", "chaos", "capacity_bytes", "kernels",
              "skip_nonfinite", "loss_scale")


def test_every_documented_keyword_is_still_a_keyword_of_compile():
    params = inspect.signature(rpcompile.compile).parameters
    missing = [k for k in DOCUMENTED if k not in params]
    assert not missing, missing
    # ... and every option of every group is one too, so nothing needs the groups.
    assert set(FLAT) <= set(params)


def test_everything_the_trainer_takes_is_reachable_from_compile():
    params = set(inspect.signature(rpcompile.compile).parameters)
    trainer = set(inspect.signature(Trainer).parameters) - {"compiled", "options", "train"}
    trainer |= {f.name for f in fields(TrainOptions)}
    assert trainer <= params, trainer - params


def test_groups_and_flat_keywords_make_the_same_compile():
    model = hf_model("qwen3", layers=2)
    flat = rpcompile.compile(model, gpus=2, microbatches=3, rounds=2, mode="async",
                             device="virtual", max_grad_norm=1.0, chunk_bytes=1 << 16,
                             example_inputs=token_batch(6))
    grouped = rpcompile.compile(
        model, example_inputs=token_batch(6),
        plan_options=PlanOptions(gpus=2, microbatches=3, rounds=2, mode="async",
                                 chunk_bytes=1 << 16),
        train_options=TrainOptions(device="virtual", max_grad_norm=1.0))
    assert flat.options == grouped.options
    assert flat.schedule == grouped.schedule
    assert [s.units for s in flat.plan.stages] == [s.units for s in grouped.plan.stages]
    # Groups and keywords mix when each option is given once.
    mixed = rpcompile.compile(model, example_inputs=token_batch(6), rounds=2, mode="async",
                              plan_options=PlanOptions(gpus=2, microbatches=3,
                                                       chunk_bytes=1 << 16),
                              device="virtual", max_grad_norm=1.0)
    assert mixed.options == flat.options


def test_plan_options_reach_the_runtime_schedule():
    """chunk_bytes is a plan option: the schedule the trainer runs cuts bulk transfers by it."""
    model = hf_model("qwen3", layers=2)
    small = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                              device="virtual", chunk_bytes=4096)
    big = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                            device="virtual")

    def pieces(c):
        return sum(a.chunks for a in c.trainer().schedule.all_actions())

    try:
        assert pieces(small) > pieces(big)
    finally:
        small.close()
        big.close()


def test_an_option_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"mode.*both.*plan_options"):
        rpcompile.compile(hf_model("qwen3", layers=1), mode="sync",
                          plan_options=PlanOptions(gpus=2, mode="async"))
    with pytest.raises(ValueError, match=r"train_options.*TrainOptions"):
        rpcompile.compile(hf_model("qwen3", layers=1), train_options={"device": "virtual"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(gpus=2.5), "gpus must be a positive integer"),
        (dict(rounds=0), "rounds must be a positive integer"),
        (dict(mode="eventually"), "mode must be one of 'sync', 'async'"),
        (dict(device="tpu"), "device must be one of"),
        (dict(kernels="cuda"), "kernels must be one of"),
        (dict(max_grad_norm=-1.0), "max_grad_norm must be a positive number"),
        (dict(max_grad_norm=math.inf), "max_grad_norm must be a positive number"),
        (dict(timeout_s=0), "timeout_s must be positive"),
        (dict(loss_chunk_tokens=0), "loss_chunk_tokens must be a positive number"),
        (dict(units="model.layers"), "units must be a list of module names"),
        (dict(chunk_bytes=0), "chunk_bytes must be a positive integer"),
        (dict(hardware=3), "hardware must be a profile name"),
        (dict(loss_scale=True, mode="async", updates="deferred"),
         "'deferred' is a sync-mode order"),
        (dict(compute_dtype="bf16"), "compute_dtype must be a torch.dtype"),
    ],
)
def test_bad_options_fail_before_any_capture(monkeypatch, kwargs, match):
    def no_capture(*a, **k):
        raise AssertionError("captured before the options were checked")

    monkeypatch.setattr("rpcompile.compiler.capture", no_capture)
    with pytest.raises(ValueError, match=match):
        rpcompile.compile(hf_model("qwen3", layers=1), **kwargs)


def test_trainer_keywords_are_checked_by_the_same_options():
    compiled = rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual")
    with pytest.raises(ValueError, match="kernels must be one of"):
        Trainer(compiled, kernels="cuda")
    with pytest.raises(ValueError, match="either as options=TrainOptions"):
        Trainer(compiled, options=TrainOptions(), device="virtual")


def test_errors_the_docs_name_are_exported():
    text = (ROOT / "README.md").read_text() + "".join(
        p.read_text() for p in (ROOT / "docs").glob("*.md"))
    named = set(re.findall(
        r"\b([A-Z][A-Za-z]+(?:Error|Failed|Timeout|Aborted|OutOfMemory|Model))\b", text))
    ours = {n for n in named if any(
        isinstance(c := getattr(m, n, None), type) and issubclass(c, BaseException)
        for m in _modules())}
    assert ours, "no error classes found in the docs"
    missing = sorted(n for n in ours if n not in rpcompile.__all__)
    assert not missing, f"documented errors not in rpcompile.__all__: {missing}"


def _modules():
    # Every module of the package, so an error class defined anywhere is found: importlib,
    # since the attribute ``rpcompile.capture`` is the capture() function.
    import importlib
    import pkgutil

    return tuple(importlib.import_module(m.name) for m in pkgutil.walk_packages(
        rpcompile.__path__, "rpcompile.") if not m.name.endswith("__main__"))


def test_options_are_frozen_and_compiled_keeps_them():
    opts = PlanOptions(gpus=2)
    with pytest.raises(AttributeError):
        opts.gpus = 3  # type: ignore[misc]
    c = rpcompile.compile(hf_model("qwen3", layers=1), example_inputs=token_batch(4),
                          plan_options=PlanOptions(gpus=2, microbatches=2),
                          capture_options=CaptureOptions(compute_dtype=torch.float32))
    assert c.options.plan.gpus == 2 and c.workers == 2
    assert c.options.capture.compute_dtype is torch.float32


# -- each option checked once: one rule, one message, wherever a bad value is refused ---------

def _said(call) -> str:
    """The message of the ValueError ``call()`` raises."""
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def _rule(option: str, bad: str, name: str | None = None) -> str:
    """The option's one message (rpcompile.choices.check_option) for ``bad``."""
    from rpcompile.choices import check_option

    return _said(lambda: check_option(option, bad, name=name))


@pytest.mark.parametrize(("option", "bad"), [
    ("mode", "eventually"), ("updates", "later"), ("recompute", "never"),
    ("device", "tpu"), ("kernels", "cuda"), ("host_memory", "swap"),
])
def test_a_bad_choice_reads_the_same_from_compile_and_the_trainer(monkeypatch, option, bad):
    """compile() and a Trainer built by hand refuse a bad value with the option's one message:
    its name, every choice, what they mean."""
    rule = _rule(option, bad)
    assert f"{option} must be one of" in rule and repr(bad) in rule
    with monkeypatch.context() as m:
        m.setattr("rpcompile.compiler.capture", lambda *a, **k: pytest.fail("captured"))
        assert _said(lambda: rpcompile.compile(hf_model("qwen3", layers=1),
                                               **{option: bad})) == rule
    if option == "recompute":  # a plan option the Trainer does not override
        return
    compiled = _tiny()
    assert _said(lambda: Trainer(compiled, **{option: bad})) == rule


def test_public_lower_layers_refuse_with_the_options_rule():
    """The lower layers users and benchmarks call with a plain string route it through the
    options' own rule (no second copy): the same words, under the layer's own name."""
    from rpcompile.hardware import get_hardware
    from rpcompile.passes.lower import runtime_schedule
    from rpcompile.planner.longest import longest_sequence
    from rpcompile.planner.partition import partition
    from rpcompile.runtime import kernels
    from rpcompile.runtime.executor import Executor
    from rpcompile.runtime.memory import pin_host_memory
    from rpcompile.runtime.workers import make_workers

    compiled = _tiny()
    profiles = compiled.profiles
    assert _said(lambda: partition(profiles, "cpu", 2, 2, optimizer="eventually")) == \
        _rule("mode", "eventually", name="optimizer")
    assert _said(lambda: partition(profiles, "cpu", 2, 2, recompute="never")) == \
        _rule("recompute", "never")
    assert _said(lambda: partition(profiles, "cpu", 2, 2, updates="later")) == \
        _rule("updates", "later")
    assert _said(lambda: longest_sequence(lambda s: profiles, "cpu", 2, 2,
                                          optimizer="eventually")) == \
        _rule("mode", "eventually", name="optimizer")
    assert _said(lambda: runtime_schedule(compiled.plan, 2, 2, 1, "eventually")) == \
        _rule("mode", "eventually")
    assert _said(lambda: make_workers(2, "tpu")) == _rule("device", "tpu")
    assert _said(lambda: pin_host_memory("swap", "cuda")) == _rule("host_memory", "swap")
    assert _said(lambda: get_hardware("cpu").with_host_memory("swap")) == \
        _rule("host_memory", "swap")
    assert _said(lambda: kernels.resolve_backend("cuda", torch.device("cpu"))) == \
        _rule("kernels", "cuda", name="backend")
    assert _said(lambda: Executor(compiled, [], compiled.schedule, None, None,
                                  kernels="cuda")) == _rule("kernels", "cuda")


@pytest.mark.parametrize(("flag", "option", "bad"), [
    ("--optimizer", "mode", "eventually"), ("--recompute", "recompute", "never"),
    ("--host-memory", "host_memory", "swap"),
])
def test_a_bad_plan_flag_reads_the_options_rule(capsys, flag, option, bad):
    """``rpcompile plan``'s choice flags are checked by the same rule (after the flag's
    name), and list the same choices in --help."""
    from rpcompile.choices import CHOICES
    from rpcompile.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "qwen3-1.7b", flag, bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {_rule(option, bad)}" in err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert f"{flag} {{{','.join(CHOICES[option][0])}}}" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "bad"), [("--device", "tpu"), ("--kernels", "cuda"),
                                           ("--host-memory", "swap")])
def test_a_bad_train_flag_names_the_flag_and_its_choices(capsys, flag, bad):
    from rpcompile.choices import CHOICES
    from rpcompile.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", flag, bad])
    assert info.value.code == 2
    err = capsys.readouterr().err
    choices = CHOICES[flag[2:].replace("-", "_")][0]
    assert f"argument {flag}" in err and repr(bad) in err
    assert all(repr(c) in err for c in choices)


def _tiny():
    return rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, microbatches=2,
                             example_inputs=token_batch(4), device="virtual")


# -- the lower layers read the groups compile() resolved ---------------------------------------

def test_group_values_reach_the_trainer_and_its_executor():
    """timeout_s, chunk_bytes and schedule_steps set in the groups passed to compile() are
    what the trainer, its schedule and its executor run with; the executor reads the
    compile's TrainOptions themselves."""
    c = rpcompile.compile(
        hf_model("qwen3", layers=2), example_inputs=token_batch(4),
        plan_options=PlanOptions(gpus=2, microbatches=2, chunk_bytes=4096, schedule_steps=3),
        train_options=TrainOptions(device="virtual", timeout_s=123.0, kernels="torch"))
    default = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                example_inputs=token_batch(4), device="virtual")
    try:
        trainer = c.trainer()
        assert trainer.timeout_s == 123.0 and trainer.executor.timeout_s == 123.0
        assert trainer.schedule is c.schedule and c.schedule.steps == 3
        assert trainer.executor.options is c.options.train
        assert trainer.executor.kernels == "torch"
        pieces = sum(a.chunks for a in trainer.schedule.all_actions() if a.step == 0)
        assert pieces > sum(a.chunks for a in default.schedule.all_actions() if a.step == 0)
    finally:
        c.close()
        default.close()


def test_runtime_schedule_reads_the_plan_options():
    """runtime_schedule given the compile's PlanOptions lowers the very schedule compile()
    kept; the loose form builds the same options (and refuses to mix the two)."""
    from rpcompile.passes.lower import runtime_schedule

    c = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=3, rounds=2,
                          example_inputs=token_batch(6), device="virtual", chunk_bytes=8192)
    assert runtime_schedule(c.plan, c.options.plan) == c.schedule
    assert runtime_schedule(c.plan, 2, 3, 2, "sync", 8192) == c.schedule
    with pytest.raises(TypeError, match="not both: mode"):
        runtime_schedule(c.plan, c.options.plan, mode="async")


# -- the planner's entries take the plan group; every other door checks by the same rule -----

def _group_compile():
    """A sync compile whose clipping needs the deferred update order: the plan group it hands
    the partitioner carries that order."""
    return rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=3,
                             example_inputs=token_batch(3), device="virtual", max_grad_norm=1.0,
                             recompute="stage", max_simulations=5)


def test_compile_hands_the_partitioner_its_plan_group(monkeypatch):
    """compile() passes partition() the run's PlanOptions (the update order its training
    options need), no loose plan keyword; partition given that group plans as the loose
    keywords of the same values do."""
    from dataclasses import replace

    from rpcompile.planner.partition import partition

    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return partition(*args, **kwargs)

    monkeypatch.setattr("rpcompile.compiler.partition", recording)
    c = _group_compile()
    ((args, kwargs),) = calls
    assert len(args) == 2  # the profiles and the planning hardware; the rest by name
    assert kwargs["options"] == replace(c.options.plan, updates="deferred")
    loose = {"workers", "microbatches", "rounds", "optimizer", "recompute", "updates",
             "max_simulations"}
    assert not loose & set(kwargs)
    grouped = partition(*args, **kwargs)
    assert grouped.updates == "deferred" and grouped.grad_check_passes > 0
    same = partition(c.profiles, c.hardware, 2, 3, c.plan.microbatch_size, c.plan.seq_len,
                     1, kwargs["costing"], optimizer="sync", recompute="stage",
                     max_simulations=5, updates="deferred",
                     grad_check_passes=kwargs["grad_check_passes"])
    assert same == grouped


def test_partition_checks_its_loose_keywords_by_the_plan_group():
    """The loose keywords build a PlanOptions: each is checked once, by the group's rule, its
    message under partition's own name for it; a group given beside loose keywords is
    refused; a bad update order in a group reads as compile() says it."""
    from rpcompile.planner.partition import partition

    profiles = _group_compile().profiles
    assert _said(lambda: partition(profiles, "cpu", 0, 2)) == \
        _said(lambda: PlanOptions(gpus=0)).replace("gpus", "workers", 1)
    assert _said(lambda: partition(profiles, "cpu", 2, 0)) == \
        _said(lambda: PlanOptions(microbatches=0))
    assert _said(lambda: partition(profiles, "cpu", 2, 2, rounds=0)) == \
        _said(lambda: PlanOptions(rounds=0))
    assert _said(lambda: partition(profiles, "cpu", 2, 2, max_simulations=0)) == \
        _said(lambda: PlanOptions(max_simulations=0))
    for option, bad in (("mode", "eventually"), ("recompute", "never"), ("updates", "later")):
        assert _said(lambda: PlanOptions(**{option: bad})) == _rule(option, bad)  # noqa: B023
    async_deferred = dict(mode="async", updates="deferred")
    with pytest.MonkeyPatch.context() as m:
        m.setattr("rpcompile.compiler.capture", lambda *a, **k: pytest.fail("captured"))
        said = _said(lambda: rpcompile.compile(hf_model("qwen3", layers=1), **async_deferred))
    assert _said(lambda: partition(profiles, "cpu", options=PlanOptions(
        gpus=2, **async_deferred))) == said
    with pytest.raises(TypeError, match=r"not both: optimizer, workers given beside "
                                        r"options=; set them in the PlanOptions \(optimizer "
                                        r"is mode, workers is gpus\)"):
        partition(profiles, "cpu", 2, optimizer="sync", options=PlanOptions(gpus=2))
    with pytest.raises(TypeError, match="needs workers and microbatches"):
        partition(profiles, "cpu")


def test_longest_sequence_takes_the_plan_group():
    """rpcompile.planner.longest.longest_sequence reads the plan group too (what `rpcompile
    plan` passes: its compile's); the loose keywords build the same group."""
    from rpcompile.planner.longest import longest_sequence

    profiles = _group_compile().profiles
    search = dict(start=64, step=64, limit=256)
    grouped = longest_sequence(lambda s: profiles, "cpu", options=PlanOptions(
        gpus=2, microbatches=3, mode="sync"), **search)
    loose = longest_sequence(lambda s: profiles, "cpu", 2, 3, optimizer="sync", **search)
    assert grouped == loose and grouped.seq_len == 256
    with pytest.raises(TypeError, match="not both: rounds given beside options="):
        longest_sequence(lambda s: profiles, "cpu", rounds=2, options=PlanOptions(gpus=2))


@pytest.mark.parametrize(("option", "bad"), [
    ("mode", "eventually"), ("recompute", "never"), ("device", "tpu"), ("kernels", "cuda"),
    ("host_memory", "swap"),
])
def test_a_bad_choice_in_a_train_config_reads_as_from_compile(monkeypatch, capsys, tmp_path,
                                                               option, bad):
    """A bad value in `rpcompile train --config run.yaml`, or as the flag, is refused with
    compile()'s message (the option's one rule), in the command line's words."""
    from rpcompile.cli import main

    rule = _rule(option, bad)
    with monkeypatch.context() as m:
        m.setattr("rpcompile.compiler.capture", lambda *a, **k: pytest.fail("captured"))
        assert _said(lambda: rpcompile.compile(hf_model("qwen3", layers=1),
                                               **{option: bad})) == rule
    flag = "--" + option.replace("_", "-")
    config = tmp_path / "run.yaml"
    config.write_text(f"{option}: {bad}\n")
    assert main(["train", "--config", str(config)]) == 2
    assert f"error: {config}: {flag}{rule[len(option):]}\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", flag, bad])
    assert f"argument {flag}: {rule}\n" in capsys.readouterr().err


def test_cost_figures_check_a_resolved_recompute_by_the_rule():
    """recompute_working_bytes and recompute_ms (public) take a stage's resolved
    granularity, checked by the choices' one rule: an unresolved "auto" is refused, not
    costed as one granularity or the other."""
    from rpcompile.choices import RECOMPUTE_GRANULARITIES, check_choice
    from rpcompile.passes.cost import RECOMPUTE, recompute_ms, recompute_working_bytes

    assert RECOMPUTE == RECOMPUTE_GRANULARITIES == ("stage", "layer")
    profiles = _group_compile().profiles
    rule = _said(lambda: check_choice("recompute", "auto", RECOMPUTE))
    assert rule.startswith("recompute must be one of 'stage', 'layer', got 'auto' (")
    assert _said(lambda: recompute_working_bytes(profiles, (1, 2), "auto")) == rule
    assert _said(lambda: recompute_ms(profiles, (1, 2), "auto")) == rule
