"""The stream of steps a training loop iterates: :class:`StepStream` (``Trainer.fit``).

It keeps the executor fed: before it hands back step k's result, step k+1 runs and step k+2
is submitted (at most ``Executor.in_flight_limit`` steps uncommitted), its batch taken from
the source and bound meanwhile, so the workers go from one step's backward drain into the
next step's forward fill without waiting for the loop's own work.

A failure discards every step not yet committed (rpcompile.runtime.executor); their batches
are kept, in order, and the next ``next()`` runs them again before taking more from the
source: the same batches at the same run steps, so the retry is bit for bit what the steps
would have been.

A stream given a ``planner`` (``Compiled.fit``) follows the data's shapes: a batch larger than
the running plan's shape is held back while the steps in flight drain and commit (no step
follows them on the old plan), then the planner makes a plan for it and hands over the trainer
that runs it, with the trained state, the optimizer object and the step counter moved over, and
the held batch runs first on the new plan. A failed re-plan puts the batch back first in
line: the next ``next()`` tries again, from the last committed state.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from rpcompile.errors import InvalidInput, StateError
from rpcompile.runtime.results import StepResult

if TYPE_CHECKING:
    from rpcompile.runtime.trainer import Trainer

__all__ = ["Planner", "StepStream"]


class Planner(Protocol):
    """How a stream re-plans for a larger batch (``Compiled.fit`` gives one)."""

    def outgrows(self, bound: dict[str, Any]) -> bool:
        """Whether ``bound``, a batch as the running trainer binds it, needs a new plan
        (larger than the running plan's shape)."""

    def replan(self, batch: Any) -> None:
        """Plan for ``batch`` and move the trained state to the new plan's trainer; called
        with no step in flight. On failure it raises, the last committed state kept."""

    def trainer(self) -> Trainer:
        """The trainer that runs the current plan."""


class StepStream(Iterator[StepResult]):
    """An iterator of the :class:`StepResult` of each committed step, over the batches of
    ``batches`` (at most ``steps`` of them; see ``Trainer.fit``). ``committed``: the steps it
    has committed, which equals the batches it has taken from ``batches`` once no step is in
    flight (after a ``flush()``, a checkpoint, or the end). ``in_flight``: the batches taken
    and not yet committed (run again first after a failure), a batch held for a new plan
    included."""

    def __init__(self, trainer: Trainer, batches: Iterable[Any], steps: int | None,
                 scheduler: Any = None, planner: Planner | None = None) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 0):
            raise InvalidInput(f"steps must be a whole number >= 0 or None, got {steps!r}")
        self._trainer = trainer
        self._planner = planner
        # A batch that needs a new plan, waiting for the steps in flight to commit.
        self._held: Any = None
        self._after_commit = None if scheduler is None else scheduler.step
        self._source = iter(batches)
        self._left = steps  # batches still to take from the source (None: all)
        # (run step, batch) of each step submitted and not yet handed back, in order
        self._ahead: collections.deque[tuple[int, Any]] = collections.deque()
        self._retry: collections.deque[Any] = collections.deque()  # discarded, to run again
        self._ended = False
        self.committed = 0

    @property
    def in_flight(self) -> int:
        return len(self._ahead) + len(self._retry) + (self._held is not None)

    def end(self) -> None:
        """Take no more batches from the source: the steps in flight (and a discarded step's
        batch, run again, or one held for a new plan) still commit, and ``next()`` hands
        their results back, then ends.
        A training loop that must stop (a signal) ends its stream this way, with every step
        it drew committed."""
        self._left = 0

    def __iter__(self) -> StepStream:
        return self

    def __next__(self) -> StepResult:
        if self._trainer._refused:
            raise StateError(self._trainer._refused)
        self._requeue()
        if self._trainer.executor.failure_held:  # it came as the steps before it committed
            try:
                self._trainer.executor.finish()
            except BaseException as exc:
                self._trainer._failed(exc)
                raise
        self._fill(replan=True)
        trainer = self._trainer  # a new plan's, when the fill re-planned
        executor = trainer.executor
        if not self._ahead:
            raise StopIteration
        if not self._retry and (self._held is not None or self._ended or self._left == 0):
            # The source is done, or the next batch waits for a new plan: no step follows
            # the ones in flight on this plan.
            executor.end_steps()
        try:
            result = executor.finish()
        except BaseException as exc:
            self._requeue()  # every step not yet committed was discarded: they run again
            trainer._failed(exc)
            raise
        k, _batch = self._ahead.popleft()
        if k != result.step:
            raise StateError(f"the stream expected step {k}'s result, got step "
                               f"{result.step}'s: another caller ran steps on this trainer")
        self.committed += 1
        trainer._committed(result)
        try:
            self._fill()  # the next steps run while the caller works on this one
        except Exception:  # raised again by the next next(), which fills first
            pass
        return result

    def _requeue(self) -> None:
        """Steps submitted but neither committed nor in flight were discarded by a failure
        (here, or in a flush or checkpoint that let them commit): their batches, in order,
        run again before any other."""
        next_step = self._trainer.executor.next_step
        while self._ahead and self._ahead[-1][0] >= next_step:
            self._retry.appendleft(self._ahead.pop()[1])

    def _fill(self, replan: bool = False) -> None:
        """Submit steps until the executor holds as many in flight as it runs at once. A
        batch that cannot be bound or submitted, or planned for, goes back first in line,
        and the error is raised. A batch that needs a new plan is held; with no step in
        flight and ``replan``, the plan is made for it here and the stream goes on with the
        new plan's trainer (``replan`` is off in the fill after a result, so that a re-plan,
        its notice and its failure come from ``next()`` itself)."""
        executor = self._trainer.executor
        while executor.in_flight < executor.in_flight_limit and not executor.failure_held:
            batch = self._take()
            if batch is None:
                return
            try:
                k = executor.next_step
                planner = self._planner
                bound = self._trainer._bind(batch, k, check_shape=planner is None)
                if planner is not None and planner.outgrows(bound):
                    if self._ahead or not replan:
                        self._held = batch  # until the steps in flight have committed
                        return
                    self._replan(batch)
                    executor = self._trainer.executor
                    k = executor.next_step
                    bound = self._trainer._bind(batch, k)  # against the new plan
                executor.start(bound, self._after_commit)
            except BaseException:
                self._retry.appendleft(batch)
                raise
            self._ahead.append((k, batch))

    def _replan(self, batch: Any) -> None:
        """Plan for ``batch`` (nothing in flight) and go on with the new plan's trainer; after
        a failure, with the trainer that holds the last committed state."""
        try:
            self._planner.replan(batch)
        except BaseException:
            try:
                self._trainer = self._planner.trainer()
            except Exception:  # none to go on with: the re-plan's own error is raised
                pass
            raise
        self._trainer = self._planner.trainer()

    def _take(self) -> Any:
        """The next batch: a discarded one first, then one held for a new plan, then the
        source's (None at the end)."""
        if self._retry:
            return self._retry.popleft()
        if self._held is not None:
            batch, self._held = self._held, None
            return batch
        if self._ended or self._left == 0:
            return None
        try:
            batch = next(self._source)
        except StopIteration:
            self._ended = True
            return None
        if self._left is not None:
            self._left -= 1
        return batch
