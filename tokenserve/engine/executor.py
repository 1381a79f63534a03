"""ExecutorActor: runs ModelRunner.step() on a worker thread, one step in flight.

The forward pass never runs on the event loop: torch releases the GIL inside its ops,
so HTTP stays responsive while a step computes.

The worker thread (the *model thread*) should also load the model (:meth:`start`): it is
then the process's only OpenMP master. Every thread that enters an OpenMP parallel region
gets a team of its own, and once libgomp manages more threads than there are CPUs it
stops spinning and puts idle workers to sleep after each region; with ~300 short parallel
regions per decode step the wake-ups cost more than the kernels (measured on 2 cores: a
batch-1 step 15 ms with one master, 23-27 ms once a second thread had used OpenMP).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import StepPlan, StepResult

log = logging.getLogger("tokenserve.engine")


class ExecutorActor:
    """Owns the ModelRunner and its single worker thread."""

    def __init__(self, runner: ModelRunner, thread: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self._thread = thread or ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="tokenserve-executor")

    @classmethod
    def start(cls, load: Callable[[], ModelRunner]) -> ExecutorActor:
        """Run ``load`` (blocking) on a new model thread and keep that thread for the steps.

        Raises:
            whatever ``load`` raises (the thread is shut down first).
        """
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenserve-executor")
        try:
            runner = thread.submit(load).result()
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(runner, thread)

    async def run(self, plan: StepPlan) -> StepResult:
        """Execute ``plan``; a failure comes back as ``StepResult.error``, never raises."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, self.runner.step, plan)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            return StepResult(plan.step_id, {}, 0.0, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._thread.shutdown(wait=True)
