"""What the engine tells the HTTP side about itself: fixed facts and limits
(:class:`EngineInfo`, built once) and a live snapshot (:class:`EngineStats`,
``engine.stats()``). The HTTP layer reads these two and nothing else of the engine's
internals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    """Model facts and serving limits (tokens unless said otherwise).

    Attributes:
        model_name: the id the APIs expect (``GET /v1/models``).
        model_path: where the weights came from (``--model``; ``""`` when unknown).
        vocab_size: token ids must be below this.
        max_model_len: prompt + output cap per request (``maxSeqLen``, capped by the model).
        max_input_len: longest accepted prompt (``maxInputTokenLen``, leaving room for one
            token, and no longer than the whole KV cache can hold).
        max_batch_size: most requests running at once (``maxBatchSize``).
        max_prefill_batch_size: most requests prefilling in one step.
        max_num_batched_tokens: token budget of one step (``maxPrefillTokens``).
        max_iter_times: most tokens one request may generate (``maxIterTimes``); 0: no
            cap but the context length.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache.
        kv_cache_bytes: the KV cache budget, bytes.
        device: ``cpu`` / ``cuda`` / ``npu``: where the model and its KV cache live.
        dtype: the dtype the weights are served in (``bfloat16``, ``float32``).
        weights_bytes: bytes of model weights the kernels read (packed or quantised copies,
            embedding table, norms); 0 when unknown.
        gemm: what each kind of layer computes on, e.g. ``bf16 → tokenserve.gemm
            avx512bf16 (invariant)`` (``tokenserve.ops.linear.describe_gemms``); "" when
            unknown.
        world_size: tensor-parallel ranks the model is split over (``worldSize``); a PD
            prefill and decode instance must agree (the KV hand-off is rank to rank).
    """

    model_name: str
    vocab_size: int
    max_model_len: int
    max_input_len: int
    max_batch_size: int = 200
    max_prefill_batch_size: int = 50
    max_num_batched_tokens: int = 8192
    max_iter_times: int = 0
    block_size: int = 128
    num_blocks: int = 0
    kv_cache_bytes: int = 0
    model_path: str = ""
    device: str = "cpu"
    dtype: str = "bfloat16"
    weights_bytes: int = 0
    gemm: str = ""
    world_size: int = 1


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and tests."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int
    finished_by_reason: dict[str, int]
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_swapped: int = 0
    #: speculative decoding: draft tokens verified, and of those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: structured output: ms spent on token masks (fill + apply), and the steps that
    #: had a constrained row
    mask_ms: float = 0.0
    mask_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up, in [0, 1]."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
