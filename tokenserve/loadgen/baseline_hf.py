"""The baseline: the same workload through transformers' ``generate``, static batches.

What a naive server does: take ``concurrency`` requests, left-pad them into one batch,
``generate`` until the longest output is done, then take the next ``concurrency``::

    batch 0: [pad pad p p p | o o o o]      every row waits for the slowest row;
             [p p p p p p p | o o o o]      the next batch starts when this one ends
    batch 1: ...

Same weights (the model directory the engine loads), same dtype, greedy. Every row
generates ``max(output_len)`` tokens of its batch (``min_new_tokens`` = ``max_new_tokens``,
so EOS does not end it early); a row's own output is its first ``output_len`` tokens.
A streamer records the wall time of every decoding step, which gives each row its TTFT
(step 1), ITLs and E2E (step ``output_len``), measured from the batch's start.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenserve.loadgen.metrics import RequestRecord
from tokenserve.loadgen.workload import BenchRequest

log = logging.getLogger("bench.hf")


class StepClock:
    """A ``generate`` streamer that only records when each new token step arrives
    (``put`` is called once with the prompt, then once per step with the batch's tokens)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfBaseline:
    """A transformers ``LlamaForCausalLM`` loaded from ``model_dir`` in ``dtype`` on
    ``device`` (``auto|cpu|cuda|npu``, resolved as the engine resolves it)."""

    def __init__(self, model_dir: str | Path, dtype: str, device: str = "cpu") -> None:
        import torch
        import transformers

        from tokenserve.config.resolve import select_device

        self.torch = torch
        self.dtype = dtype
        self.device = select_device(device)
        t0 = time.perf_counter()
        from tokenserve.models.loader import ensure_float_weights

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(ensure_float_weights(model_dir)), dtype=getattr(torch, dtype)).to(self.device).eval()
        cfg = self.model.config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else pad)
        log.info("transformers %s loaded %s as %s on %s in %.1f s", transformers.__version__,
                 model_dir, dtype, self.device, time.perf_counter() - t0)

    def _batch(self, reqs: Sequence[BenchRequest]) -> tuple[Any, Any]:
        """Left-padded ``input_ids`` and ``attention_mask`` [batch, max_len] int64."""
        torch = self.torch
        width = max(r.input_len for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):
            ids[row, width - r.input_len:] = torch.tensor(r.prompt_ids)
            mask[row, width - r.input_len:] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate_batch(self, reqs: Sequence[BenchRequest]) -> list[RequestRecord]:
        """Run one static batch; one record per request, timed from the batch's start."""
        ids, mask = self._batch(reqs)
        steps = max(r.output_len for r in reqs)
        clock = StepClock()
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=self.pad_id, streamer=clock)
        t_end = time.perf_counter()
        generated = out.shape[1] - ids.shape[1]
        records = []
        for r in reqs:
            n = min(r.output_len, generated, len(clock.times))
            times = [t - t0 for t in clock.times[:n]]
            rec = RequestRecord(r.index, r.input_len, r.output_len, ok=n > 0, start=t0,
                                ttft=times[0] if times else None,
                                e2e=times[-1] if times else t_end - t0,
                                itl=[b - a for a, b in itertools.pairwise(times)],
                                output_tokens=n, token_source="generate",
                                error=None if n > 0 else "generate returned no tokens")
            records.append(rec)
        return records

    def warmup(self, reqs: Sequence[BenchRequest]) -> None:
        if reqs:
            self.generate_batch(reqs)

    def run(self, reqs: Sequence[BenchRequest], concurrency: int, *,
            max_duration_s: float = float("inf"),
            progress: Callable[[int], None] | None = None) -> tuple[list[RequestRecord], float]:
        """All of ``reqs`` in static batches of ``concurrency``, in order; stops starting
        batches after ``max_duration_s``. Returns the records and the wall time (s)."""
        records: list[RequestRecord] = []
        t0 = time.perf_counter()
        for i in range(0, len(reqs), concurrency):
            if time.perf_counter() - t0 > max_duration_s:
                log.warning("hf baseline: stopped after %d of %d requests (max duration)",
                            len(records), len(reqs))
                break
            batch = reqs[i:i + concurrency]
            records.extend(self.generate_batch(batch))
            if progress is not None:
                progress(len(batch))
        return records, time.perf_counter() - t0
