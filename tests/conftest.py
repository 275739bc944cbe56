"""The suite runs with every compile pass's invariants checked (RPCOMPILE_DEBUG=1), unless the
environment says otherwise.

Under pytest-xdist (README's test command runs the suite on 2 worker processes) each worker
computes on one intra-op thread, and so do the processes its tests start (OMP_NUM_THREADS=1,
unless set already): two workers of torch's default 2 threads each on the 2-core CI machine
spin against each other. Measured on the 2-core machine, tests/passes/test_recompute.py and
tests/passes/test_chunked_loss.py in one process took 103 s on 2 threads and 58 s on 1 (87 s and
53 s of user CPU). Every test that compares two runs makes both in the same process, or in
processes that share this environment, so no test compares runs on different thread counts."""

import os

import pytest

os.environ.setdefault("RPCOMPILE_DEBUG", "1")
# Every test searches its plans: a plan from the user's cache would skip what a test checks
# (tests of the cache name their own folder).
os.environ.setdefault("RPCOMPILE_PLAN_CACHE", "0")

# `datasets` gives its logger a handler on the sys.stderr of its first import. Imported first
# inside a test that captures output (capsys), that handler keeps the test's stream, which is
# closed afterwards, and a later test that makes `datasets` log an error gets a logging
# traceback in its output. Importing it here binds the handler to the session's stream.
try:
    import datasets  # noqa: F401
except ImportError:
    pass

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    torch.set_num_threads(1)


@pytest.fixture
def no_timeline_png(monkeypatch):
    """Schedule dumps write an empty ``.png`` instead of drawing the timeline. Drawing one bar
    per action costs seconds of CPU for a plan of a few hundred actions; a test of a command
    that dumps a schedule but never looks at the picture needs only the file.
    tests/ir/test_ir_schedule.py and tests/sim/test_sim.py check the drawing itself."""
    import rpcompile._draw

    def placeholder(sched, path, timeline, streams):
        with open(path, "wb"):
            pass

    monkeypatch.setattr(rpcompile._draw, "draw_timeline", placeholder)


@pytest.fixture(scope="session", autouse=True)
def _capture_cache():
    """compile() reuses the capture of a model an earlier test captured already, built the
    same way and given the same example batch (tests/capture_cache.py says what the key holds,
    and how to turn the cache off or check every hit against a fresh capture)."""
    import rpcompile.compiler.entry as entry
    from tests.capture_cache import cached

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(entry, "capture_graph", cached(entry.capture_graph))
        yield


# The files that take longest, longest first (each file's test times summed from
# `--durations=0` on the 2-core machine, from 206 s down to about 30 s). README's command runs
# whole files on 2 workers (`--dist loadfile`), each worker taking the next file as it frees;
# when a long file is dealt last, one worker runs it alone while the other idles. Dealt
# first, with the short files after them, the two workers end within seconds of each other.
# Add a file here, in its place, when it grows past about 30 s.
LONGEST_FIRST = (
    "runtime/test_distributed.py",
    "cli/test_cli.py",
    "planner/test_longest_host.py",
    "planner/test_golden.py",
    "passes/test_memory_paper_plans.py",
    "runtime/test_executor.py",
    "test_compile.py",
    "runtime/test_checkpoint.py",
    "passes/test_memory_agreement.py",
    "data/test_batches.py",
    "planner/test_search_bound.py",
    "finetune/test_finetune.py",
    "test_plan_shapes.py",
    "passes/test_memory_uneven.py",
    "runtime/test_staging.py",
    "planner/test_partition.py",
    "finetune/test_train_job.py",
    "runtime/test_trainer.py",
    "test_trl.py",
)


def pytest_collection_modifyitems(items):
    """Run the files of LONGEST_FIRST first, in that order, the others after in their own
    order (pyproject.toml turns off pytest-xdist's own reordering, which deals the files
    with the most tests first, whatever their length)."""
    def rank(item):
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: within a file, and among the rest, the collection order
