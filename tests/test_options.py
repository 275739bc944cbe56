"""The public API's one option form: three groups, a few shortcuts at compile(), one check each."""

from __future__ import annotations

import ast
import inspect
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile import CaptureOptions, PlanOptions, TrainOptions
from rpcompile.compiler import SHORTCUTS
from rpcompile.options import FLAT
from rpcompile.runtime.trainer import Trainer
from tests.schedules import without_staging
from tests.tiny_models import hf_model, token_batch

ROOT = Path(__file__).resolve().parent.parent
_GROUP_CLASSES = {"capture": CaptureOptions, "plan": PlanOptions, "train": TrainOptions}


def _compile_with(model, **options):
    """compile(model, ...) with each option as its shortcut, else in its group."""
    groups: dict[str, dict] = {}
    for name, value in options.items():
        if name not in SHORTCUTS:
            groups.setdefault(FLAT[name], {})[name] = value
    return rpcompile.compile(model, **{k: v for k, v in options.items() if k in SHORTCUTS},
                             **{g: _GROUP_CLASSES[g](**kw) for g, kw in groups.items()})


def _documented_compile_calls() -> list[tuple[str, ast.Call]]:
    """Every ``compile(...)`` call README.md and docs/ show, parsed (``...`` stands for
    arguments a page leaves out)."""
    calls = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"compile\(", page.read_text()):
            text = page.read_text()[match.start():]
            depth, end = 0, None
            for i, ch in enumerate(text):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0 and ch == ")":
                    end = i + 1
                    break
            try:
                call = ast.parse(text[:end].replace("...", "_")).body[0].value
            except (SyntaxError, TypeError):
                continue  # prose, not a call
            calls.append((page.name, call))
    return calls


def test_every_keyword_the_docs_show_is_a_keyword_of_compile():
    """Each compile() call in README.md and docs/ uses keywords compile() takes: the groups,
    ``example_inputs`` and the shortcuts, each shortcut the same field of its group."""
    params = inspect.signature(rpcompile.compile).parameters
    calls = _documented_compile_calls()
    assert any(page == "README.md" for page, _ in calls), "no compile() call in README.md"
    shown = {(page, k.arg) for page, call in calls for k in call.keywords if k.arg}
    assert shown
    bad = sorted((page, k) for page, k in shown
                 if k not in params or (params[k].kind is not inspect.Parameter.KEYWORD_ONLY
                                        and k != "example_inputs"))
    assert not bad, bad
    # One form: compile() takes the groups, example_inputs and the shortcuts, nothing more
    # by name; each shortcut is a field of the group it goes to.
    named = {k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert named == {"model", "example_inputs", "capture", "plan", "train", *SHORTCUTS}
    assert all(FLAT[k] == g for k, g in SHORTCUTS.items())


def test_the_readme_compile_lands_each_shortcut_in_its_group():
    """README's compile(model, gpus=4, device="virtual") of a causal LM (captured now, planned
    at its first batch) keeps each shortcut as its group's field."""
    calls = [call for page, call in _documented_compile_calls() if page == "README.md"]
    model = hf_model("qwen3", layers=1)
    for call in calls:
        keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords
                    if k.arg in SHORTCUTS and isinstance(k.value, ast.Constant)}
        c = rpcompile.compile(model, **keywords)
        try:
            for name, value in keywords.items():
                assert getattr(getattr(c.options, SHORTCUTS[name]), name) == value
        finally:
            c.close()


def test_everything_the_trainer_takes_is_reachable_from_compile():
    params = set(inspect.signature(rpcompile.compile).parameters)
    trainer = set(inspect.signature(Trainer).parameters) - {"compiled"}
    assert trainer == {"plan", "train"} and trainer <= params


def test_shortcuts_and_groups_make_the_same_compile():
    model = hf_model("qwen3", layers=2)
    flat = rpcompile.compile(model, token_batch(6), gpus=2, microbatches=3, rounds=2,
                             mode="async", device="virtual", max_grad_norm=1.0,
                             plan=PlanOptions(chunk_bytes=1 << 16))
    grouped = rpcompile.compile(model, example_inputs=token_batch(6),
                                plan=PlanOptions(gpus=2, microbatches=3, rounds=2, mode="async",
                                                 chunk_bytes=1 << 16),
                                train=TrainOptions(device="virtual", max_grad_norm=1.0))
    assert flat.options == grouped.options
    assert flat.schedule == grouped.schedule
    assert [s.units for s in flat.plan.stages] == [s.units for s in grouped.plan.stages]


def test_plan_options_reach_the_runtime_schedule():
    """chunk_bytes is a plan option: the schedule the trainer runs cuts bulk transfers by it."""
    model = hf_model("qwen3", layers=2)
    small = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                              device="virtual", plan=PlanOptions(chunk_bytes=4096))
    big = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                            device="virtual")

    def pieces(c):
        return sum(a.chunks for a in c.trainer().schedule.all_actions())

    try:
        assert pieces(small) > pieces(big)
    finally:
        small.close()
        big.close()


def test_a_shortcut_and_its_field_in_the_group_are_refused(monkeypatch):
    monkeypatch.setattr("rpcompile.compiler.entry.capture_graph",
                        lambda *a, **k: pytest.fail("captured"))
    model = hf_model("qwen3", layers=1)
    with pytest.raises(rpcompile.InvalidInput,
                       match=r"mode='sync' given both .* plan=PlanOptions\(mode='async'\)"):
        rpcompile.compile(model, mode="sync", plan=PlanOptions(gpus=2, mode="async"))
    with pytest.raises(rpcompile.InvalidInput, match=r"device='cuda'.*train=TrainOptions"):
        rpcompile.compile(model, device="cuda", train=TrainOptions(device="virtual"))
    # An option compile() has no shortcut for is refused with the group that holds it.
    with pytest.raises(TypeError, match=r"capacity_bytes in its group: plan=PlanOptions"):
        rpcompile.compile(model, capacity_bytes=1 << 30)
    with pytest.raises(TypeError, match=r"unknown keyword 'gpu'"):
        rpcompile.compile(model, gpu=2)
    with pytest.raises(TypeError, match=r"train must be an rpcompile.TrainOptions"):
        rpcompile.compile(model, train={"device": "virtual"})


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

    monkeypatch.setattr("rpcompile.compiler.entry.capture_graph", no_capture)
    with pytest.raises(ValueError, match=match):
        _compile_with(hf_model("qwen3", layers=1), **kwargs)


def test_the_trainer_takes_the_groups_only():
    compiled = rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual")
    with pytest.raises(ValueError, match="kernels must be one of"):
        Trainer(compiled, train=replace(compiled.options.train, kernels="cuda"))
    with pytest.raises(TypeError, match=r"Trainer's train must be an rpcompile\.TrainOptions"):
        Trainer(compiled, train={"device": "virtual"})
    with pytest.raises(TypeError):
        Trainer(compiled, device="virtual")


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
                          capture=CaptureOptions(compute_dtype=torch.float32),
                          plan=PlanOptions(gpus=2, microbatches=2))
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
        m.setattr("rpcompile.compiler.entry.capture_graph", lambda *a, **k: pytest.fail("captured"))
        assert _said(lambda: _compile_with(hf_model("qwen3", layers=1),
                                           **{option: bad})) == rule
    compiled = _tiny()
    group = FLAT[option]
    assert _said(lambda: Trainer(compiled, **{group: replace(
        getattr(compiled.options, group), **{option: bad})})) == rule


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
    # The planner's entries and the lowering take the group only, checked when it was built.
    for entry in (lambda: partition(profiles, "cpu", 2), lambda: runtime_schedule(
            compiled.plan, 2), lambda: longest_sequence(lambda s: profiles, "cpu", 2)):
        with pytest.raises(TypeError, match=r"must be an rpcompile\.PlanOptions, got int"):
            entry()
    assert _said(lambda: make_workers(2, "tpu")) == _rule("device", "tpu")
    assert _said(lambda: pin_host_memory("swap", "cuda")) == _rule("host_memory", "swap")
    assert _said(lambda: get_hardware("cpu").with_host_memory("swap")) == \
        _rule("host_memory", "swap")
    assert _said(lambda: kernels.resolve_backend("cuda", torch.device("cpu"))) == \
        _rule("kernels", "cuda", name="backend")
    with pytest.raises(TypeError):
        Executor(compiled, [], compiled.schedule, None, None, kernels="cuda")


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
    c = rpcompile.compile(hf_model("qwen3", layers=2), example_inputs=token_batch(4),
                          plan=PlanOptions(gpus=2, microbatches=2, chunk_bytes=4096,
                                           schedule_steps=3),
                          train=TrainOptions(device="virtual", timeout_s=123.0, kernels="torch"))
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
    kept (before the staging pass gives its downloads their host slots), and so does an equal
    group built by hand."""
    from rpcompile.passes.lower import runtime_schedule
    from rpcompile.sim.engine import with_staging

    c = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=3, rounds=2,
                          example_inputs=token_batch(6), device="virtual",
                          plan=PlanOptions(chunk_bytes=8192))
    for options in (c.options.plan, PlanOptions(gpus=2, microbatches=3, rounds=2, mode="sync",
                                                chunk_bytes=8192)):
        lowered = runtime_schedule(c.plan, options)
        assert lowered == without_staging(c.schedule)
        assert with_staging(lowered, c.plan, c.hardware) == c.schedule


# -- the planner's entries take the plan group; every other door checks by the same rule -----

def _group_compile():
    """A sync compile whose clipping needs the deferred update order: the plan group it hands
    the partitioner carries that order."""
    return rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=3,
                             example_inputs=token_batch(3), device="virtual", max_grad_norm=1.0,
                             plan=PlanOptions(recompute="stage", max_simulations=5))


@pytest.fixture(scope="module")
def group_profiles():
    """The unit profiles of _group_compile(), built once for the tests that read only them."""
    return _group_compile().profiles


def test_compile_hands_the_partitioner_its_plan_group(monkeypatch):
    """compile() passes partition() the run's PlanOptions (the update order its training
    options need); partition given that group plans as an equal group built by hand does."""
    from dataclasses import replace

    from rpcompile.planner.partition import partition

    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return partition(*args, **kwargs)

    monkeypatch.setattr("rpcompile.compiler.search.partition", recording)
    c = _group_compile()
    ((args, kwargs),) = calls
    assert len(args) == 2  # the profiles and the planning hardware; the rest by name
    assert kwargs["options"] == replace(c.options.plan, updates="deferred")
    grouped = partition(*args, **kwargs)
    assert grouped.updates == "deferred" and grouped.grad_check_passes > 0
    same = partition(c.profiles, c.hardware, PlanOptions(gpus=2, microbatches=3, rounds=1,
                                                         mode="sync", recompute="stage",
                                                         updates="deferred", max_simulations=5),
                     microbatch_size=c.plan.microbatch_size, seq_len=c.plan.seq_len,
                     costing=kwargs["costing"], grad_check_passes=kwargs["grad_check_passes"])
    assert same == grouped


def test_partition_refuses_a_bad_update_order_as_compile_does(group_profiles):
    """A group whose update order compile() refuses reads the same from partition()."""
    from rpcompile.planner.partition import partition

    profiles = group_profiles
    async_deferred = dict(mode="async", updates="deferred")
    with pytest.MonkeyPatch.context() as m:
        m.setattr("rpcompile.compiler.entry.capture_graph", lambda *a, **k: pytest.fail("captured"))
        said = _said(lambda: rpcompile.compile(hf_model("qwen3", layers=1),
                                               plan=PlanOptions(**async_deferred)))
    assert said == _said(lambda: partition(profiles, "cpu", PlanOptions(gpus=2,
                                                                        **async_deferred)))
    # A group's own check does not see the training options: partition() decides the order
    # from the gradient check it is told of, by the same rule.
    with pytest.raises(rpcompile.InvalidInput, match="'overlap' update order"):
        partition(profiles, "cpu", PlanOptions(gpus=2, microbatches=3, mode="sync",
                                               updates="overlap"), grad_check_passes=3)


def test_longest_sequence_takes_the_plan_group(group_profiles):
    """rpcompile.planner.longest.longest_sequence reads the plan group (what `rpcompile
    plan` passes: its compile's)."""
    from rpcompile.planner.longest import longest_sequence

    profiles = group_profiles
    search = dict(start=64, step=64, limit=256)
    found = longest_sequence(lambda s: profiles, "cpu", PlanOptions(
        gpus=2, microbatches=3, mode="sync"), **search)
    assert found.seq_len == 256


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
        m.setattr("rpcompile.compiler.entry.capture_graph", lambda *a, **k: pytest.fail("captured"))
        assert _said(lambda: _compile_with(hf_model("qwen3", layers=1),
                                           **{option: bad})) == rule
    flag = "--" + option.replace("_", "-")
    config = tmp_path / "run.yaml"
    config.write_text(f"{option}: {bad}\n")
    assert main(["train", "--config", str(config)]) == 2
    assert f"error: {config}: {flag}{rule[len(option):]}\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", flag, bad])
    assert f"argument {flag}: {rule}\n" in capsys.readouterr().err


def test_cost_figures_check_a_resolved_recompute_by_the_rule(group_profiles):
    """recompute_working_bytes and recompute_ms (public) take a stage's resolved
    granularity, checked by the choices' one rule: an unresolved "auto" is refused, not
    costed as one granularity or the other."""
    from rpcompile.choices import RECOMPUTE_GRANULARITIES, check_choice
    from rpcompile.passes.cost import RECOMPUTE, recompute_ms, recompute_working_bytes

    assert RECOMPUTE == RECOMPUTE_GRANULARITIES == ("stage", "layer")
    profiles = group_profiles
    rule = _said(lambda: check_choice("recompute", "auto", RECOMPUTE))
    assert rule.startswith("recompute must be one of 'stage', 'layer', got 'auto' (")
    assert _said(lambda: recompute_working_bytes(profiles, (1, 2), "auto")) == rule
    assert _said(lambda: recompute_ms(profiles, (1, 2), "auto")) == rule
