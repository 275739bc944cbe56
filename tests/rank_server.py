"""Preloaded by the forkserver that starts tests/runtime/test_distributed.py's ranks (forked from it,
not spawned): the imports (torch, transformers, rpcompile, the test module) and the first
compile in a process (several times the cost of a later one: torch.export's shape and
dispatch caches fill) are paid once for the session, not once per rank. The compile is of
the ranks' tiny Qwen3 on a batch of one rank's shape, from weights no test uses, and it is
closed (every thread it started is joined) before the server
forks: a forked rank starts with one thread and a fresh process group of its own, as a
spawned one does; what its cases compute is the same (a rank's later cases already compile
after an earlier one in the same process)."""

from __future__ import annotations

import os
import threading
import time
import warnings

import torch

import rpcompile
import tests.runtime.test_distributed  # noqa: F401  (the ranks' targets, unpickled by reference)
from tests.tiny_models import hf_model, sft_batch

# Started by test_distributed._fork_server: one OpenMP thread in every thread, so no OpenMP
# thread pool exists to be forked (set_num_threads alone covers only the calling thread).
assert os.environ.get("OMP_NUM_THREADS") == "1", "start the server with _fork_server()"
torch.set_num_threads(1)  # as every rank sets
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _compiled = rpcompile.compile(hf_model("qwen3", seed=123), gpus=2, microbatches=2,
                                  example_inputs=sft_batch(3, 12, seed=1), device="virtual")
    _compiled.step(sft_batch(3, 12, seed=2))
    _compiled.close()
del _compiled
# A fork copies only the forking thread: a thread still running here could leave a lock held
# in every rank. The compile above must have joined all of its threads, and the server forks
# only once the system has ended them too: a joined Python thread still runs its native
# thread-exit code for a moment (MKL frees its buffers there under a spin lock, which a rank
# forked then inherits held, and its first matrix multiply spins forever).
assert threading.active_count() == 1, threading.enumerate()
_deadline = time.monotonic() + 30.0
while len(os.listdir("/proc/self/task")) > 1:
    if time.monotonic() > _deadline:
        raise RuntimeError("the rank server still runs native threads "
                           f"{os.listdir('/proc/self/task')} 30 s after its warm-up compile")
    time.sleep(0.001)
