"""The scheduler core (scheduler, block pool, request, messages, sampling params, finish
rules) and its actor shell import no torch: the model thread owns every tensor and
generator (``SeqStart`` tells it how to start a request's). Proved in a fresh interpreter
where ``import torch`` raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    from importlib.abc import MetaPathFinder

    class NoTorch(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, NoTorch())

    from tokenserve.engine.block_pool import BlockPool
    from tokenserve.engine.finish import StopStringMatcher, after_token, expiry
    from tokenserve.engine.request import Request, RequestStatus
    from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
    from tokenserve.engine.scheduler_actor import SchedulerActor  # its async shell too
    from tokenserve.messages import FinishReason, StepPlan, StepResult
    from tokenserve.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_seq_len=64,
                                      eos_token_ids=frozenset({2})), BlockPool(16, 4))
    for i, n in enumerate((5, 11)):
        sched.add(Request(f"r{i}", list(range(10, 10 + n)), n,
                          SamplingParams(max_new_tokens=3, do_sample=True, seed=i), 5, 0.0, i))
    step, started, dropped = 0, set(), []
    while sched.has_work():
        seqs = sched.schedule()
        for s in seqs:  # the model thread is told once how to start each request
            assert (s.start is not None) == (s.request_id not in started)
            started.add(s.request_id)
        plan = StepPlan(step, tuple(seqs), sched.take_dropped())
        dropped += plan.drop
        result = StepResult(step, {s.request_id: 7 for s in plan.seqs if s.sample}, 0.0)
        sched.update(list(plan.seqs), dict(result.sampled), now=float(step))
        step += 1
    assert sched.pool.all_free()
    dropped += sched.take_dropped()  # ends since the last plan
    assert sorted(dropped) == ["r0", "r1"]
    assert "torch" not in sys.modules
    print("ok", step)
""")


def test_scheduler_core_runs_without_torch() -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=False,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok ")
