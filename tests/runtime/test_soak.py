"""A bounded chaos soak (tests/chaos_soak.py): random architectures, 1-8 workers, sync and
async, chaos delays and injected faults; every run's masters equal the reference over the
batches whose updates were applied. benchmarks/soak.py runs a longer one."""

from tests.chaos_soak import soak


def test_bounded_chaos_soak():
    result = soak(runs=5, steps=4, seed=2026)
    assert result.runs == 5
    assert result.faults_fired >= 3  # the soak does meet faults
    # Each fired fault ends its step with StepFailed (two at once may end one step together).
    assert result.faults_fired // 2 <= result.faults_survived <= result.faults_fired
    assert not result.divergences, result.divergences
