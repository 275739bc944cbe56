"""Plans that follow the data, and plans remembered on disk.

``compile(model, gpus=N)`` without an example batch plans at the first batch, for its shape,
and again for a larger one; the training is checked against eager Hugging Face training of the
same batches, which shares nothing with the planning. The plan cache is checked by what it
skips (the partition search) and by what it must never do (serve a corrupt or foreign entry).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import rpcompile
import rpcompile.compiler.search as search_module
from rpcompile.options import PlanOptions, TrainOptions
from rpcompile.planner import cache as cache_module
from tests.data.test_batches import _eager_training
from tests.option_groups import grouped
from tests.tiny_models import hf_model, sft_batch


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _eager(model, batches):
    losses = _eager_training(model, batches, _sgd)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _assert_trained_alike(losses, masters, want_losses, want, tol):
    """The same losses step by step and the same trained weights, within ``tol``."""
    assert losses == pytest.approx(want_losses, abs=tol)
    assert max(float((masters[n] - want[n]).abs().max()) for n in masters) < tol


def test_plans_follow_the_batches_and_train_like_eager(capsys):
    model = hf_model("qwen3", seed=3)
    reference = copy.deepcopy(model)
    # Three shapes: the second is longer than the first (a new plan), the third shorter and
    # with fewer sequences (fits the second plan), the fourth has more sequences (a new plan,
    # for the longer of the two lengths).
    batches = [sft_batch(6, 10, seed=1), sft_batch(6, 16, left=True, seed=2),
               sft_batch(4, 8, seed=3), sft_batch(9, 12, seed=4)]
    compiled = rpcompile.compile(model, gpus=3, device="virtual", microbatches=3, optimizer=_sgd,
                                 plan=PlanOptions(progress=True), train=TrainOptions(chaos=5))
    try:
        assert not compiled.planned
        assert "not planned yet" in compiled.explain()
        losses = [float(compiled.step(b)) for b in batches]
        masters = compiled.trainer().masters()
    finally:
        compiled.close()
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("rpcompile: planned for")]
    # The phases say what they do: the capture once, a search per plan made.
    assert err.count("rpcompile: capturing Qwen3ForCausalLM") == 1
    assert err.count("rpcompile: searching stage cuts") == 3
    assert compiled.plans_made == [(2, 10), (2, 16), (3, 16)]
    assert len(notices) == len(compiled.plans_made)
    assert "the first batch" in notices[0] and "larger than the plan's 2 x 10" in notices[1]
    assert (compiled.plan.microbatch_size, compiled.plan.seq_len) == (3, 16)
    eager_losses, eager = _eager(reference, batches)
    _assert_trained_alike(losses, masters, eager_losses, eager, 1e-5)


def test_a_fixed_shape_refuses_a_larger_batch(capsys):
    model = hf_model("qwen3", seed=3)
    compiled = rpcompile.compile(model, gpus=2, device="virtual", microbatches=2, optimizer=_sgd,
                                 plan=PlanOptions(dynamic=False, progress=False))
    try:
        compiled.step(sft_batch(4, 10, seed=1))
        assert "rpcompile:" not in capsys.readouterr().err  # progress=False: silent
        compiled.step(sft_batch(4, 8, seed=2))  # smaller: runs on the plan
        with pytest.raises(ValueError, match="larger than the plan's shape"):
            compiled.step(sft_batch(4, 12, seed=3))
        assert compiled.plans_made == [(2, 10)]
    finally:
        compiled.close()


def test_an_unplanned_model_names_what_to_do_and_loads_a_checkpoint_at_its_shape(tmp_path):
    batch = sft_batch(4, 10, seed=1)
    trained = rpcompile.compile(hf_model("qwen3", seed=3), gpus=2, device="virtual",
                                microbatches=2, optimizer=_sgd)
    fresh = rpcompile.compile(hf_model("qwen3", seed=4), gpus=2, device="virtual",
                              microbatches=2, optimizer=_sgd)
    try:
        with pytest.raises(RuntimeError, match="step\\(batch\\) or plan_for"):
            trained.save_checkpoint(tmp_path / "nothing")
        trained.step(batch)
        saved = trained.save_checkpoint(tmp_path / "ckpt")
        fresh.load_checkpoint(saved)  # plans for the checkpoint's shape, then loads
        assert fresh.plans_made == [(2, 10)]
        ref, got = trained.trainer().masters(), fresh.trainer().masters()
        assert all(torch.equal(ref[n], got[n]) for n in ref)
    finally:
        trained.close()
        fresh.close()


def _compile_planned(tmp_path, **options):
    # One decoder layer: the cache's checks need a searched plan, not a deep one.
    return rpcompile.compile(hf_model("qwen3", seed=3, layers=1), gpus=2, microbatches=2,
                             example_inputs=sft_batch(4, 10, seed=1),
                             **grouped(plan_cache=tmp_path, progress=True, **options))


def test_a_cached_plan_skips_the_search_and_a_bad_entry_is_never_used(tmp_path, monkeypatch,
                                                                      capsys):
    searches = []
    search = search_module.partition

    def counted(*args, **kwargs):
        searches.append(1)
        return search(*args, **kwargs)

    monkeypatch.setattr(search_module, "partition", counted)
    first = _compile_planned(tmp_path)
    assert len(searches) == 1
    entries = list(tmp_path.glob("*.json"))
    assert len(entries) == 1
    capsys.readouterr()

    second = _compile_planned(tmp_path)
    assert len(searches) == 1  # the search was skipped
    assert "plan from the cache" in capsys.readouterr().err
    assert second.plan == first.plan

    # Another option that changes the plan is another entry.
    _compile_planned(tmp_path, mode="async")
    assert len(searches) == 2 and len(list(tmp_path.glob("*.json"))) == 2

    # A corrupt entry is ignored with a warning and searched again (and rewritten).
    entries[0].write_text(entries[0].read_text()[:100])
    with pytest.warns(RuntimeWarning, match="ignoring the cached plan"):
        third = _compile_planned(tmp_path)
    assert len(searches) == 3 and third.plan == first.plan
    # An entry whose plan is not the search's (edited by hand, or for other units) too.
    doc = json.loads(entries[0].read_text())
    doc["plan"]["units"] = doc["plan"]["units"][:-1]
    entries[0].write_text(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match="ignoring the cached plan"):
        _compile_planned(tmp_path)
    assert len(searches) == 4

    # Changed search code makes every entry stale.
    monkeypatch.setattr(cache_module, "_source_digest", lambda: "other source")
    _compile_planned(tmp_path)
    assert len(searches) == 5

    # plan_cache=False: no cache at all.
    rpcompile.compile(hf_model("qwen3", seed=3, layers=1), gpus=2, microbatches=2,
                      example_inputs=sft_batch(4, 10, seed=1), plan=PlanOptions(plan_cache=False))
    assert len(searches) == 6


def test_the_plan_round_trips_through_its_json_form():
    compiled = rpcompile.compile(hf_model("qwen3_tied", seed=3), gpus=3, microbatches=3,
                                 example_inputs=sft_batch(6, 10, seed=1),
                                 plan=PlanOptions(plan_cache=False))
    data = json.loads(json.dumps(cache_module.plan_to_dict(compiled.plan)))
    assert cache_module.plan_from_dict(data) == compiled.plan


def test_an_unwritable_cache_warns_and_the_plan_is_still_made(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="could not write the plan cache"):
        compiled = rpcompile.compile(hf_model("qwen3", seed=3), gpus=2, microbatches=2,
                                     example_inputs=sft_batch(4, 10, seed=1),
                                     plan=PlanOptions(plan_cache=blocked))
    assert compiled.planned


def test_fit_plans_at_its_first_batch_and_trains_like_eager():
    model = hf_model("qwen3", seed=3)
    reference = copy.deepcopy(model)
    batches = [sft_batch(6, 10, seed=s) for s in range(4)]
    compiled = rpcompile.compile(model, gpus=3, device="virtual", microbatches=3, optimizer=_sgd,
                                 train=TrainOptions(chaos=5))
    try:
        losses = [float(r.loss) for r in compiled.fit(batches)]
        assert compiled.plans_made == [(2, 10)]
        masters = compiled.trainer().masters()
    finally:
        compiled.close()
    eager_losses, eager = _eager(reference, batches)
    _assert_trained_alike(losses, masters, eager_losses, eager, 1e-5)


def _eager_scheduled(model, batches, lr_lambda, stale):
    """Eager HF training with SGD stepped by a LambdaLR after each step; ``stale``: the async
    rule, update k applies step k's gradient computed at the weights before update k-1."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    behind = copy.deepcopy(model)  # the weights step k's gradient is computed at (async)
    losses = []
    for batch in batches:
        at = behind if stale else model
        at.zero_grad(set_to_none=True)
        loss = at(**batch, use_cache=False).loss
        loss.backward()
        losses.append(float(loss))
        if stale:
            behind.load_state_dict(model.state_dict())
            for p, q in zip(model.parameters(), at.parameters()):
                p.grad = q.grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("mode", "fail_once"), [("sync", True), ("async", False)])
def test_fit_plans_anew_for_a_larger_batch_with_its_scheduler_like_eager(
        mode, fail_once, capsys, monkeypatch, tmp_path):
    # A stream of three shapes: the second longer than the first (a new plan, made while two
    # steps of the first are in flight), the third smaller than the second (runs on it). The
    # scheduler, bound to the optimizer before the stream, drives every step's lr.
    import rpcompile.runtime.trainer.core as trainer_core

    model = hf_model("qwen3", seed=3)
    reference = copy.deepcopy(model)
    batches = [sft_batch(6, 10, seed=1), sft_batch(6, 10, seed=2),
               sft_batch(6, 16, left=True, seed=3), sft_batch(6, 16, seed=4),
               sft_batch(4, 8, seed=5)]

    def lr_lambda(k):
        return 1.0 / (k + 1)

    compiled = rpcompile.compile(model, gpus=3, device="virtual", microbatches=3, optimizer=_sgd,
                                 plan=PlanOptions(progress=True, mode=mode),
                                 train=TrainOptions(chaos=5))
    saved = None
    try:
        compiled.plan_for(batches[0])
        first = compiled.trainer()
        optimizer = compiled.optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        stream = compiled.fit(batches, scheduler=scheduler)
        results = []
        if fail_once:
            # The new plan's workers fail to start: the re-plan raises, the previous plan
            # and the two committed steps stay, and the stream goes on from there.
            make_workers = trainer_core.make_workers
            failed = []

            def failing(*args, **kwargs):
                if not failed:
                    failed.append(1)
                    raise RuntimeError("planted: no workers")
                return make_workers(*args, **kwargs)

            monkeypatch.setattr(trainer_core, "make_workers", failing)
            results += [next(stream), next(stream)]
            with pytest.raises(RuntimeError, match="planted: no workers"):
                next(stream)
            assert failed and compiled.plans_made == [(2, 10)]
            assert compiled.trainer().steps_done == 2 and scheduler.last_epoch == 2
        results += list(stream)
        assert [r.step for r in results] == list(range(len(batches)))
        assert compiled.optimizer is optimizer and scheduler.last_epoch == len(batches)
        with pytest.raises(RuntimeError, match=r"retired .* compiled\.save_checkpoint"):
            first.masters()  # the first plan's trainer: its state moved on
        losses = [float(r.loss) for r in results]
        masters = compiled.trainer().masters()
        saved = compiled.save_checkpoint(tmp_path / "ckpt")
    finally:
        compiled.close()
    notices = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith("rpcompile: planned for")]
    assert compiled.plans_made == [(2, 10), (2, 16)]
    assert len(notices) == len(compiled.plans_made)
    assert "larger than the plan's 2 x 10" in notices[1]
    eager_losses, eager = _eager_scheduled(reference, batches, lr_lambda, stale=mode == "async")
    _assert_trained_alike(losses, masters, eager_losses, eager, 1e-5)

    # A checkpoint saved after the new plan resumes at the new plan's shape.
    fresh = rpcompile.compile(hf_model("qwen3", seed=4), gpus=3, device="virtual",
                              microbatches=3, optimizer=_sgd, plan=PlanOptions(mode=mode))
    try:
        fresh.load_checkpoint(saved)
        assert fresh.plans_made == [(2, 16)]
        got = fresh.trainer().masters()
        assert all(torch.equal(got[n], masters[n]) for n in masters)
    finally:
        fresh.close()


def test_fit_with_a_fixed_shape_refuses_a_larger_batch_after_the_steps_before_it():
    compiled = rpcompile.compile(hf_model("qwen3", seed=3), gpus=2, device="virtual",
                                 microbatches=2, optimizer=_sgd,
                                 plan=PlanOptions(dynamic=False, progress=False))
    try:
        stream = compiled.fit([sft_batch(4, 10, seed=1), sft_batch(4, 8, seed=2),
                               sft_batch(4, 12, seed=3)])
        with pytest.raises(ValueError, match="larger than the plan's shape"):
            list(stream)
        assert compiled.plans_made == [(2, 10)]
        compiled.trainer().flush()  # the steps before it commit
        assert compiled.trainer().steps_done == 2
    finally:
        compiled.close()


def test_a_new_plan_in_a_fit_stream_draws_the_same_dropout_masks():
    # Dropout on: a stream that plans anew at its third batch trains as a model planned for
    # the largest shape from the start. Masks are drawn per sequence from the step's seed, so
    # this holds only if the new plan goes on with the same seed stream at the same steps.
    from tests.capture.test_dropout import _tiny

    batches = [sft_batch(6, 10, seed=1), sft_batch(6, 10, seed=2),
               sft_batch(6, 16, seed=3), sft_batch(4, 8, seed=4)]

    def run(example):
        compiled = rpcompile.compile(_tiny("sdpa"), gpus=2, device="virtual", microbatches=3,
                                     optimizer=_sgd, example_inputs=example,
                                     plan=PlanOptions(progress=False))
        try:
            losses = [float(r.loss) for r in compiled.fit(batches)]
            return losses, compiled.trainer().masters(), compiled.plans_made
        finally:
            compiled.close()

    losses, masters, plans = run(None)
    want_losses, want, want_plans = run(batches[2])
    assert plans == [(2, 10), (2, 16)] and want_plans == [(2, 16)]
    _assert_trained_alike(losses, masters, want_losses, want, 1e-6)


def test_a_step_that_fails_while_a_larger_batch_waits_runs_again_before_the_new_plan(
        monkeypatch):
    # Step 2 fails while the larger batch 3 waits for the steps in flight: the discarded
    # steps run again on the old plan, then the new plan is made and batch 3 runs on it. The
    # loss scale doubles at every committed step (growth_interval=1) and a failed step leaves
    # it as it was, so it tells whether the new plan went on from the scale the run reached.
    from rpcompile.options import LossScaleConfig
    from rpcompile.runtime.executor import Executor, StepFailed

    model = hf_model("qwen3", seed=3)
    reference = copy.deepcopy(model)
    batches = [sft_batch(6, 10, seed=s) for s in (1, 2, 3)] + [sft_batch(6, 16, seed=4)]
    original, fired = Executor._do_B, []

    def failing(self, run, action):
        if run.k == 2 and not fired:
            fired.append(run.k)
            raise RuntimeError("planted: a backward job")
        return original(self, run, action)

    monkeypatch.setattr(Executor, "_do_B", failing)
    compiled = rpcompile.compile(model, gpus=3, device="virtual", microbatches=3, optimizer=_sgd,
                                 plan=PlanOptions(progress=False),
                                 train=TrainOptions(chaos=3, loss_scale=LossScaleConfig(
                                     init_scale=16.0, growth_interval=1)))
    try:
        stream = compiled.fit(batches)
        results = []
        with pytest.raises(StepFailed):
            while True:
                results.append(next(stream))
        assert fired == [2] and len(results) == 2 and compiled.plans_made == [(2, 10)]
        assert stream.in_flight == 2  # batch 2 to run again, batch 3 held
        results += list(stream)
        assert [r.step for r in results] == [0, 1, 2, 3]
        assert compiled.plans_made == [(2, 10), (2, 16)]
        assert compiled.trainer().loss_scaler.scale == 16.0 * 2 ** len(batches)
        losses = [float(r.loss) for r in results]
        masters = compiled.trainer().masters()
    finally:
        compiled.close()
    eager_losses, eager = _eager(reference, batches)
    _assert_trained_alike(losses, masters, eager_losses, eager, 1e-5)
