"""Engine configuration (frozen dataclasses).

Names follow MindIE's config.json (``shared/spec/config.md``);
``tokenserve/mindie_config.py`` reads a config.json into these and the CLI's flags
override it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: dtype names (``torch.<name>``); torch itself is imported only when needed, so the CLI
#: answers ``--help`` and start-up errors without loading it.
DTYPES = ("bfloat16", "float32", "float16")
#: weight quantisation choices (``tokenserve.models.loader.resolve_quantization``)
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding without a draft model, configured as vLLM's
    ``--speculative-config '{"method": "ngram", ...}'``.

    Attributes:
        num_speculative_tokens: k, draft tokens verified per step (>= 1).
        prompt_lookup_max: longest n-gram matched (tokens, >= prompt_lookup_min).
        prompt_lookup_min: shortest n-gram matched (tokens, >= 1).
        max_draft_rows: drafts only in steps with at most this many decode rows: a wider
            batch is already compute-bound on a CPU, where the extra positions cost as much
            as they save (published n-gram drafting loses under load).
        min_acceptance: a request whose running acceptance rate (accepted / drafted, an
            exponential average) falls below this stops drafting for ``backoff_steps``
            decode steps, then tries again.
        backoff_steps: see ``min_acceptance``.
    """

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_draft_rows: int = 4
    min_acceptance: float = 0.2
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative config: num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if self.max_draft_rows < 1:
            raise ValueError("speculative config: max_draft_rows must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("speculative config: min_acceptance must be in [0, 1]")
        if self.backoff_steps < 0:
            raise ValueError("speculative config: backoff_steps must be >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> SpecConfig:
        """From vLLM's speculative-config object (``method`` must be ``ngram``).

        Raises:
            ValueError: another method, an unknown key, or a bad value.
        """
        d = dict(d)
        method = d.pop("method", "ngram")
        if method not in ("ngram", "prompt_lookup"):
            raise ValueError(f"speculative config: method {method!r} is not supported "
                             "(only 'ngram': drafts from the request's own tokens)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}")
        for k, v in d.items():
            want = float if k == "min_acceptance" else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    want is int and not float(v).is_integer()):
                raise ValueError(f"speculative config: {k} must be a number, got {v!r}")
            d[k] = want(v)
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an :class:`~tokenserve.engine.engine.AsyncEngine`.

    Attributes:
        model: HF directory, ``.gguf`` file, or None for the default SmolLM2-135M-Instruct.
        dtype: weights and KV cache dtype name (``bfloat16`` default; ``float32``).
        device: ``auto`` (NPU if ``torch_npu`` imports, else CUDA, else CPU), ``cpu``,
            ``cuda`` or ``npu``.
        block_size: tokens per KV block (MindIE ``cacheBlockSize``).
        kv_cache_bytes: memory for the KV cache, bytes; sets the number of blocks.
        max_batch_size: most running requests (``maxBatchSize``).
        max_num_batched_tokens: token budget per step (``maxPrefillTokens``).
        max_seq_len: prompt + output cap, tokens (``maxSeqLen``); None = the model's
            context length.
        max_iter_times: global cap on generated tokens per request (``maxIterTimes``).
        token_timeout_s: max seconds between two tokens of a request (``tokenTimeout``).
        e2e_timeout_s: max seconds a request may live (``e2eTimeout``).
        max_prefill_batch_size: most requests prefilling in one step
            (``maxPrefillBatchSize``).
        max_input_len: prompt cap, tokens (``maxInputTokenLen``); None = max_seq_len - 1.
        max_queue_size: most requests waiting for a batch slot; one more is refused at
            once (HTTP 503) instead of queueing without bound.
        enable_prefix_caching: share KV blocks of common prompt prefixes.
        enable_chunked_prefill: split long prompts across steps so decodes keep flowing.
        long_prefill_token_threshold: a prefill with more tokens than this left is long
            (``longPrefillTokenThreshold``): it is guaranteed this many per step, and
            shorter prompts may start ahead of it; 0 = a quarter of
            max_num_batched_tokens. See ``engine/scheduler.py``.
        max_long_partial_prefills: most long prefills (same or higher priority) in
            progress at once (``maxLongPartialPrefills``).
        served_model_name: the name APIs report (MindIE ``modelName``); None = the
            model's own name.
        quantization: ``gguf`` computes with a GGUF model's own Q4_0/Q4_1/Q8_0 blocks
            (3x fewer weight bytes than bf16), ``none`` with ``dtype`` weights, ``auto``
            (default) ``gguf`` for a GGUF model at ``bfloat16`` with ``max_batch_size`` <= 8
            (where it is faster) and ``none`` otherwise; ``int8``: weight-only int8 per
            output channel from any model (config.json: ``ModelConfig[0].quantization``).
        kv_trans_timeout_s: PD prefill: seconds a request's KV blocks are held for the
            decode instance to pull (MindIE ``kv_trans_timeout``, spec
            pd_disaggregation.md §8.2).
        speculative_config: speculative decoding by prompt lookup
            (:class:`~tokenserve.engine.ngram.SpecConfig`, vLLM's ``--speculative-config``
            object), or None (off, the default).
    """

    model: str | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 128
    kv_cache_bytes: int = 1 << 30
    max_batch_size: int = 200
    max_num_batched_tokens: int = 8192
    max_seq_len: int | None = None
    max_iter_times: int = 512
    token_timeout_s: float = 600.0
    e2e_timeout_s: float = 600.0
    max_prefill_batch_size: int = 50
    max_input_len: int | None = None
    max_queue_size: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    served_model_name: str | None = None
    quantization: str = "auto"
    kv_trans_timeout_s: float = 10.0
    speculative_config: SpecConfig | None = None

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda", "npu"):
            raise ValueError(f"device must be auto, cpu, cuda or npu, got {self.device!r}")
        for name in ("block_size", "kv_cache_bytes", "max_batch_size",
                     "max_num_batched_tokens", "max_iter_times", "max_prefill_batch_size",
                     "max_queue_size", "max_long_partial_prefills"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_seq_len", "max_input_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.token_timeout_s <= 0 or self.e2e_timeout_s <= 0 or self.kv_trans_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


def select_device(name: str) -> torch.device:
    """Resolve ``auto|cpu|cuda|npu`` to a torch device.

    Raises:
        ValueError: the requested accelerator is not available.
    """
    import torch

    if name == "auto":
        try:
            import torch_npu

            return torch.device("npu")
        except ImportError:
            pass
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise ValueError("--device npu needs the optional torch_npu package") from exc
    return torch.device(name)


def check_model_path(path: str | None) -> None:
    """Check a model argument before anything is loaded (start-up errors in one line).

    ``None`` (the default model) passes; otherwise ``path`` must be a ``.gguf`` file or a
    Hugging Face directory: ``config.json`` naming a supported ``model_type`` and at
    least one ``*.safetensors`` file (``tokenserve.models.loader`` then checks that the
    ``model_type`` is one it serves).

    Raises:
        ValueError: the path is missing, empty, or not a model (the message says why).
    """
    import json
    from pathlib import Path

    if path is None:
        return
    if not path.strip():
        raise ValueError("model path is empty")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {p} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model path {p} is a file but not a .gguf file")
        return
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model path {p} is not a model directory: it has no config.json")
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"model path {p}: config.json is not a JSON object") from None
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model path {p} is not a model directory: its config.json has "
                         "no model_type")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model path {p} has no *.safetensors weights")


#: PD roles (spec/pd_disaggregation.md §1).
ROLES = ("prefill", "decode", "flex")


@dataclass(frozen=True)
class PdConfig:
    """PD settings (config.md ``ServerConfig.inferMode``, ``interCommPort``; ModelConfig
    ``kv_trans_timeout``, ``kv_link_timeout``).

    Attributes:
        infer_mode: ``standard`` (mixed) or ``dmi`` (PD).
        role: ``prefill``, ``decode`` or ``flex``; None: wait for ``POST /v1/role``.
        ip_address: the address peers and the coordinator reach this instance at (its
            ``d-target`` / ``pNodeAddr``; never assume loopback across hosts).
        p_percentage: flex only: share of work taken as a prefill instance, [0, 100].
        kv_protocol: Mooncake transport, ``tcp`` (CPU) or ``rdma``.
        kv_device: RDMA device name(s) for Mooncake; ``""`` for tcp.
        kv_trans_timeout_s: seconds P holds a request's blocks for D; seconds D waits
            for a hand-off call.
        kv_port_range: (lowest, highest) TCP port Mooncake's listeners (handshake RPC
            and TCP data) may bind, for firewalls (Mooncake's ``MC_MIN_RPC_PORT`` /
            ``MC_MAX_RPC_PORT``); None: the environment's, else Mooncake's 15000-17000.
    """

    infer_mode: str = "standard"
    role: str | None = None
    ip_address: str = "127.0.0.1"
    p_percentage: int = 50
    kv_protocol: str = "tcp"
    kv_device: str = ""
    kv_trans_timeout_s: float = 10.0
    kv_port_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kv_port_range is not None:
            lo, hi = self.kv_port_range
            if not 1024 <= lo <= hi <= 65535 or hi - lo < 1:
                raise ValueError(f"kv port range must be MIN-MAX with 1024 <= MIN < MAX <= "
                                 f"65535 (two listeners), got {lo}-{hi}")
        if self.infer_mode not in ("standard", "dmi"):
            raise ValueError(f"inferMode must be standard or dmi, got {self.infer_mode!r}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.p_percentage <= 100:
            raise ValueError("p_percentage must be in [0, 100]")

    @property
    def pd(self) -> bool:
        return self.infer_mode == "dmi"
