"""ExecutorActor: runs ModelRunner.step() on a worker thread, one step in flight.

The forward pass never runs on the event loop: torch releases the GIL inside its ops,
so HTTP stays responsive while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import StepPlan, StepResult

log = logging.getLogger("tokenserve.engine")


class ExecutorActor:
    """Owns the ModelRunner and its single worker thread."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenserve-executor")

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
