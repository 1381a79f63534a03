"""Management routes of spec/interfaces.md §7 beyond ``/health``: ``GET /health/timed[-N]``
(§7.1) and ``GET /v1/config`` (§7.3).

``/health/timed-N`` runs a one-token "virtual inference" (greedy, one prompt token) and
waits up to N seconds for it (N in [1, 600], at most 3 digits; 10 without a suffix)::

    engine unhealthy                    -> 503, empty body
    N not in [1, 600]                   -> 404 wrapper "Wait time should be in range of
                                           [1, 600], input is not valid"
    token generated, or engine busy     -> 200 {"status":"healthy"}
      (its waiting queue is full)
    engine error / no token in N s      -> 500 wrapper with the reason

The probe is not an API request: it is not counted in the metrics and cannot be stopped
with ``stopInfer``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tokenserve.api.engine_client import engine_healthy
from tokenserve.messages import EngineOverloadedError, FinishReason, GenerateRequest
from tokenserve.sampling_params import SamplingParams
from tokenserve.transport.errors import HttpError

if TYPE_CHECKING:
    from tokenserve.api.family_api import EngineClient
    from tokenserve.transport.cycle import HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

#: spec §7.1: default wait (seconds) and the accepted range.
DEFAULT_TIMED_WAIT_S = 10
TIMED_WAIT_RANGE = (1, 600)
INVALID_WAIT = "Wait time should be in range of [1, 600], input is not valid"
_WAIT = re.compile(r"[0-9]{1,3}")


def parse_wait(suffix: str | None) -> int:
    """The N of ``/health/timed-N`` in seconds (``None``: no suffix, the default).

    Raises:
        ValueError: not 1-3 digits or outside [1, 600] (spec §7.1).
    """
    if suffix is None:
        return DEFAULT_TIMED_WAIT_S
    if not _WAIT.fullmatch(suffix) or not (
            TIMED_WAIT_RANGE[0] <= int(suffix) <= TIMED_WAIT_RANGE[1]):
        raise ValueError(INVALID_WAIT)
    return int(suffix)


async def virtual_inference(engine: EngineClient, wait_s: float) -> None:
    """Generate one token within ``wait_s`` seconds; a full waiting queue counts as
    healthy (the engine is busy, spec §7.1).

    Raises:
        RuntimeError: the engine failed or did not answer in time (the message says why).
    """
    request = GenerateRequest(request_id=f"health-timed-{uuid.uuid4().hex}",
                              prompt_token_ids=(0,), params=SamplingParams(max_new_tokens=1),
                              timeout_s=wait_s)
    try:
        outputs = engine.generate(request)
    except EngineOverloadedError:
        return  # busy
    except Exception as exc:
        raise RuntimeError(f"Virtual inference failed: {exc}") from None
    try:
        async with asyncio.timeout(wait_s):
            async for out in outputs:
                if out.finished:
                    if out.finish_reason in (FinishReason.TIMEOUT, FinishReason.ERROR):
                        raise RuntimeError(f"Virtual inference failed: {out.error}")
                    return
        raise RuntimeError("Virtual inference failed: the engine gave no final output.")
    except TimeoutError:
        raise RuntimeError(f"Virtual inference did not finish within {wait_s:g} s.") from None
    finally:
        outputs.abort()  # a no-op once it ended


@dataclass(frozen=True)
class ServedConfig:
    """What ``GET /v1/config`` reports (spec §7.3), in MindIE's units: lengths in tokens,
    memory in GB (config.md ``npuMemSize`` / ``cpuMemSize``; [I] the KV cache size goes
    to the one that matches the device, the other keeps its "unset" value)."""

    modelName: str
    maxSeqLen: int
    npuMemSize: float
    cpuMemSize: float
    worldSize: int
    maxOutputLen: int
    cacheBlockSize: int

    @classmethod
    def build(cls, model_name: str, max_seq_len: int, kv_cache_bytes: int,
              accelerator: bool, max_iter_times: int, block_size: int,
              world_size: int = 1) -> ServedConfig:
        """``world_size``: the tensor-parallel ranks (``worldSize``)."""
        npu, cpu = kv_mem_sizes(kv_cache_bytes, accelerator)
        return cls(model_name, max_seq_len, npu, cpu, world_size, max_iter_times, block_size)


def kv_mem_sizes(kv_cache_bytes: int, accelerator: bool) -> tuple[float, float]:
    """(``npuMemSize``, ``cpuMemSize``) in GB as ``GET /v1/config`` and Triton's model
    config report them: the KV cache in the device's own field, the other "unset" (-1 for
    the NPU, 0 for the CPU); whole GB as an int, else rounded to 4 places."""
    gb = kv_cache_bytes / (1 << 30)
    size = int(gb) if gb == int(gb) else round(gb, 4)
    return (size, 0) if accelerator else (-1, size)


class ManagementApi:
    """``GET /health/timed``, ``/health/timed-{n}`` (spec §7.1) and ``GET /v1/config``
    (spec §7.3; 500 wrapper when ``served`` is None: no model configured)."""

    def __init__(self, engine: EngineClient, served: ServedConfig | None) -> None:
        self._engine = engine
        self._served = served

    async def timed(self, request: HttpRequest, response: HttpResponse) -> None:
        try:
            wait_s = parse_wait(request.path_params.get("n"))
        except ValueError as exc:
            raise HttpError(404, str(exc)) from None
        if not engine_healthy(self._engine):
            await response.send(503, b"", "application/json")
            return
        try:
            await virtual_inference(self._engine, wait_s)
        except RuntimeError as exc:
            raise HttpError(500, str(exc)) from None
        await response.send_json(200, {"status": "healthy"})

    async def config(self, request: HttpRequest, response: HttpResponse) -> None:
        if self._served is None:
            raise HttpError(500, "No model is configured.")
        await response.send_json(200, asdict(self._served))
