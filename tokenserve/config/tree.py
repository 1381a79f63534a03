"""The configuration tree: every setting of ``tokenserve serve`` and ``tokenserve
coordinator``, defined once, with its unit in its name (``_s`` seconds, ``_bytes`` bytes;
lengths and budgets are tokens) or its docstring. Frozen dataclasses::

    ServeConfig                 tokenserve serve
      engine: EngineConfig      the engine (model, KV cache, scheduling limits)
        speculative_config: SpecConfig | None
      server: ServerConfig      listeners, HTTP limits, drain
        business_tls / management_tls / metrics_tls: TlsSettings | None
      pd: PdConfig              PD role, addresses, KV hand-off
    CoordinatorConfig           tokenserve coordinator
      prefill / decode: tuple[InstanceAddr, ...]

Names follow MindIE's config.json (``shared/spec/config.md``). The sources map onto the
tree in one module each: :mod:`tokenserve.config.mindie_json` (config.json),
:mod:`tokenserve.config.flags` (the command lines), :mod:`tokenserve.config.env` (the
environment). This module imports no other part of tokenserve (pyproject.toml contract),
and no torch: the CLI answers ``--help`` and start-up errors, and the coordinator runs,
without loading it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: dtype names (``torch.<name>``, ``EngineConfig.torch_dtype``), and ``auto``
#: (``tokenserve.models.loader.resolve_dtype``: an f32 / f16 / bf16 GGUF at its own
#: precision, everything else bfloat16).
DTYPES = ("auto", "bfloat16", "float32", "float16")
#: ``EngineConfig.device`` choices (:func:`tokenserve.config.resolve.select_device`).
DEVICES = ("auto", "cpu", "cuda", "npu")
#: weight quantisation choices (``tokenserve.models.loader.resolve_quantization``)
QUANTIZATIONS = ("auto", "none", "gguf", "int8")
#: KV cache element types (``tokenserve.models.decoder.CausalLM.kv_cache_dtype``)
KV_CACHE_DTYPES = ("auto", "int8", "model")
#: PD roles (spec/pd_disaggregation.md §1).
ROLES = ("prefill", "decode", "flex")
#: ``PdConfig.infer_mode``: mixed or PD (config.md ``inferMode``).
INFER_MODES = ("standard", "dmi")
#: ``PdConfig.kv_protocol``: Mooncake transports.
KV_PROTOCOLS = ("tcp", "rdma")
#: addresses that listen on every interface (config.md ``allowAllZeroIpListening``).
ALL_INTERFACES = ("0.0.0.0", "::", "")
#: uvicorn's ``--ssl-cert-reqs`` values (``ssl.VerifyMode``): 0 none, 1 optional, 2 required.
CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}

#: default listen address of both programs.
LOOPBACK = "127.0.0.1"
#: default business port of both programs (MindIE's ``port``).
MINDIE_PORT = 1025
#: [I] seconds running requests get to finish on SIGTERM/SIGINT, both programs: under
#: Kubernetes' 30 s grace period.
DRAIN_TIMEOUT_S = 25.0


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
            for a hand-off call (MindIE ``kv_trans_timeout``, spec pd_disaggregation.md
            §8.2). The one definition: ``EngineConfig.kv_trans_timeout_s`` is a copy.
        kv_port_range: (lowest, highest) TCP port Mooncake's listeners (handshake RPC
            and TCP data) may bind, for firewalls (Mooncake's ``MC_MIN_RPC_PORT`` /
            ``MC_MAX_RPC_PORT``); None: the environment's, else Mooncake's 15000-17000.
        dresult_orphan_timeout_s: (D) seconds its requests outlive the last ``/dresult``
            consumer (a coordinator that died): after this with none connected, every
            request still running is aborted and its KV blocks freed ([I], issue 22; a
            re-linking coordinator reconnects within ``relink_backoff_max_s``).
    """

    infer_mode: str = "standard"
    role: str | None = None
    ip_address: str = LOOPBACK
    p_percentage: int = 50
    kv_protocol: str = "tcp"
    kv_device: str = ""
    kv_trans_timeout_s: float = 10.0
    kv_port_range: tuple[int, int] | None = None
    dresult_orphan_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.dresult_orphan_timeout_s <= 0:
            raise ValueError("dresult orphan timeout must be > 0, got "
                             f"{self.dresult_orphan_timeout_s}")
        if self.kv_port_range is not None:
            lo, hi = self.kv_port_range
            if not 1024 <= lo <= hi <= 65535 or hi - lo < 1:
                raise ValueError(f"kv port range must be MIN-MAX with 1024 <= MIN < MAX <= "
                                 f"65535 (two listeners), got {lo}-{hi}")
        if self.infer_mode not in INFER_MODES:
            raise ValueError(f"inferMode must be standard or dmi, got {self.infer_mode!r}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.p_percentage <= 100:
            raise ValueError("p_percentage must be in [0, 100]")

    @property
    def pd(self) -> bool:
        return self.infer_mode == "dmi"


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one model split across processes (issue 41).

    Attributes:
        tensor_parallel_size: ranks the model is split over (``--tensor-parallel-size``,
            MindIE ``worldSize``); 1 = one process, no communication.
        nnodes: hosts the ranks run on (``--nnodes``); each runs ``tensor_parallel_size //
            nnodes`` of them.
        node_rank: this host's index (``--node-rank``); node 0 owns HTTP, the scheduler and
            the KV-block allocator (global rank 0), the others only compute.
        dist_init_addr: ``HOST:PORT`` of node 0's rendezvous (``--dist-init-addr``; the
            torch.distributed TCP store there, and node 0's step channel on PORT + 1);
            None: 127.0.0.1 and a free port (one host only).
        cpu_binding: ``auto`` (each local rank on its own share of this process's CPUs,
            NUMA nodes first), ``none``, or a list of CPU sets, one per local rank,
            ``"0-7;8-15"``.
    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    cpu_binding: str = "auto"

    def __post_init__(self) -> None:
        n, m = self.tensor_parallel_size, self.nnodes
        if n < 1 or m < 1:
            raise ValueError(f"tensor_parallel_size and nnodes must be >= 1, got {n} and {m}")
        if n % m:
            raise ValueError(f"tensor_parallel_size {n} is not a multiple of nnodes {m}")
        if not 0 <= self.node_rank < m:
            raise ValueError(f"node_rank must be in [0, {m}), got {self.node_rank}")
        if m > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")

    @property
    def local_ranks(self) -> range:
        """The global ranks this host runs."""
        per = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an :class:`~tokenserve.engine.engine.AsyncEngine`.

    Attributes:
        model: HF directory, ``.gguf`` file, or None for the default SmolLM2-135M-Instruct.
        dtype: weights and KV cache dtype name: ``auto`` (default: a GGUF stored at f32 / f16
            runs at float32, one at bf16 at bfloat16, anything else at bfloat16),
            ``bfloat16``, ``float32``, ``float16``.
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
            (default) ``gguf`` for a GGUF model at ``bfloat16`` on an AVX-512 VNNI or AMX
            CPU, on an AVX2 one with ``max_batch_size`` <= 8 (where it is faster), and
            ``none`` otherwise (``models/loader.py`` resolve_quantization); ``int8``: weight-only int8 per
            output channel from any model (config.json: ``ModelConfig[0].quantization``).
        kv_cache_dtype: ``int8``: each (token, kv head) row of the KV cache as int8 with
            one fp32 scale (half a bf16 cache's bytes, which a decode step reads); ``model``:
            rows of ``dtype``; ``auto`` (default): int8 on a CPU with the C++ kernels at
            bfloat16, else ``model``. PD: a prefill and a decode instance must agree.
        kv_trans_timeout_s: PD prefill: seconds a parked request keeps its KV blocks for
            the decode instance to pull: the engine's copy of
            :attr:`PdConfig.kv_trans_timeout_s` (its default), which
            :class:`ServeConfig` copies in, so a server has one value.
        speculative_config: speculative decoding by prompt lookup
            (:class:`SpecConfig`, vLLM's ``--speculative-config`` object), or None (off,
            the default).
        grammar_compile_timeout_s: structured output: seconds one constraint may take to
            compile before the request is answered 400 (``tokenserve/grammar``).
        grammar_cache_size: structured output: compiled constraints kept (LRU).
        grammar_max_bytes: structured output: the largest constraint text (schema,
            regex, grammar), UTF-8 bytes; larger is a 400.
        parallel: tensor parallelism (:class:`ParallelConfig`); the default is one process.
    """

    model: str | None = None
    dtype: str = "auto"
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
    kv_cache_dtype: str = "auto"
    kv_trans_timeout_s: float = PdConfig.kv_trans_timeout_s
    speculative_config: SpecConfig | None = None
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    grammar_max_bytes: int = 1 << 20
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be auto, cpu, cuda or npu, got {self.device!r}")
        for name in ("block_size", "kv_cache_bytes", "max_batch_size",
                     "max_num_batched_tokens", "max_iter_times", "max_prefill_batch_size",
                     "max_queue_size", "max_long_partial_prefills", "grammar_cache_size",
                     "grammar_max_bytes", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_seq_len", "max_input_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.token_timeout_s <= 0 or self.e2e_timeout_s <= 0 or self.kv_trans_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`dtype`; ``auto`` is resolved against the model first
        (``AsyncEngine.build``): asking before that is a bug."""
        import torch

        assert self.dtype != "auto", "dtype auto is resolved against the model first"
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class TlsSettings:
    """One listener's TLS material (spec/interfaces.md §0.2: HTTPS when ``httpsEnabled``,
    mutual TLS with the configured CA; config.md §1 ``tlsCert`` / ``tlsPk`` /
    ``tlsCaFile`` / ``tlsCrlFiles`` per plane), and the :mod:`ssl` server context it makes
    (``loop.create_server(ssl=context)`` wraps each connection, so the h11 protocol sees
    plain bytes; a plain-HTTP client fails the handshake, a client without a certificate
    is refused by a listener that requires one).

    Attributes:
        certfile: server certificate chain, PEM.
        keyfile: its private key, PEM.
        password_file: a file holding the key's passphrase in plain text, or None
            ([I] MindIE's ``tlsPkPwd`` is KMC-encrypted; we read it as plain text).
        ca_files: CA certificates that client certificates are verified against, PEM.
        crl_files: certificate revocation lists, PEM (checked for the client's cert).
        cert_reqs: 0 no client certificate asked, 1 optional, 2 required (mutual TLS).
    """

    certfile: str
    keyfile: str
    password_file: str | None = None
    ca_files: tuple[str, ...] = ()
    crl_files: tuple[str, ...] = ()
    cert_reqs: int = 0

    def __post_init__(self) -> None:
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"ssl cert_reqs must be 0, 1 or 2, got {self.cert_reqs}")
        if self.cert_reqs and not self.ca_files:
            raise ValueError("asking for client certificates (ssl cert_reqs 1 or 2) needs "
                             "a CA file to verify them (--ssl-ca-certs / tlsCaFile)")

    @property
    def mutual(self) -> bool:
        """Client certificates are required."""
        return self.cert_reqs == 2

    def context(self) -> ssl.SSLContext:
        """A server context (TLS 1.2 or newer, ALPN ``http/1.1``).

        Raises:
            ValueError: a file is missing or unreadable, or the key does not match the
                certificate (the message names the file).
        """
        for f in (self.certfile, self.keyfile, *self.ca_files, *self.crl_files):
            if not Path(f).is_file():
                raise ValueError(f"TLS file {f} does not exist")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        password = None
        if self.password_file is not None:
            password = Path(self.password_file).read_text(encoding="utf-8").strip()
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile, password)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"TLS certificate {self.certfile} / key {self.keyfile}: "
                             f"{exc}") from None
        for f in (*self.ca_files, *self.crl_files):
            try:
                ctx.load_verify_locations(cafile=f)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"TLS file {f}: {exc}") from None
        if self.crl_files:
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        ctx.verify_mode = CERT_REQS[self.cert_reqs]
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listeners and limits of ``tokenserve serve`` (spec interfaces.md §0.1,
    config.md §1 ``ServerConfig``).

    Attributes:
        host, port: the business plane's address and port (``ipAddress``, ``port``).
        management_host: management and metrics planes' address
            (``managementIpAddress``); None: ``host``.
        management_port: management plane port (``managementPort``); None: ``port`` (one
            listener).
        metrics_port: metrics plane port (``metricsPort``); None: the management port.
        max_body_bytes: request body limit, bytes (``maxRequestLength``, MiB there).
        max_json_depth: deepest JSON nesting of a request body (``maxJsonDepth``).
        max_connections: open connections per business listener (``maxLinkNum``).
        business_tls, management_tls, metrics_tls: each plane's TLS, None: plain HTTP.
        drain_timeout_s: on SIGTERM/SIGINT, seconds running requests get to finish.
    """

    host: str = LOOPBACK
    port: int = MINDIE_PORT
    management_host: str | None = None
    management_port: int | None = None
    metrics_port: int | None = None
    max_body_bytes: int = 40 << 20
    max_json_depth: int = 10
    max_connections: int = 1000
    business_tls: TlsSettings | None = None
    management_tls: TlsSettings | None = None
    metrics_tls: TlsSettings | None = None
    drain_timeout_s: float = DRAIN_TIMEOUT_S


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``tokenserve serve`` needs.

    ``engine.kv_trans_timeout_s`` is set from ``pd.kv_trans_timeout_s`` (the one
    definition of MindIE's ``kv_trans_timeout``): the sources set only the PD one.

    Raises:
        ValueError: PD over tensor-parallel ranks on several hosts (a rank's Mooncake
            engine registers at ``pd.ip_address``, node 0's), or a ``kv_port_range`` with
            fewer than two ports per rank (each rank opens its own Mooncake engine).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    pd: PdConfig = field(default_factory=PdConfig)

    def __post_init__(self) -> None:
        par = self.engine.parallel
        if self.pd.pd and par.nnodes > 1:  # PD over TP on one host works (issue 41)
            raise ValueError("PD (inferMode dmi) with tensor parallelism runs every rank on "
                             "one host (--nnodes 1): each rank's Mooncake engine registers "
                             "at --advertise-ip, which names node 0 only")
        ports = self.pd.kv_port_range
        if (self.pd.pd and ports is not None
                and ports[1] - ports[0] + 1 < 2 * par.tensor_parallel_size):
            raise ValueError(f"kv port range {ports[0]}-{ports[1]} is too small for "
                             f"{par.tensor_parallel_size} ranks: each rank's Mooncake engine "
                             "binds two ports")
        if self.engine.kv_trans_timeout_s != self.pd.kv_trans_timeout_s:
            object.__setattr__(self, "engine", replace(
                self.engine, kv_trans_timeout_s=self.pd.kv_trans_timeout_s))


@dataclass(frozen=True)
class InstanceAddr:
    """One P or D instance as the coordinator reaches it (plan "Instance addresses").

    Written ``HOST:PORT[@MGMT]``: ``PORT`` is its business port (inference routes,
    ``/dresult``, ``stopInfer``, ``/v1/models``), ``MGMT`` the port its management routes
    (``/v1/status``) answer on, the business port when absent. IPv6 hosts are written in
    brackets: ``[::1]:1025@1026``.
    """

    host: str
    port: int
    mgmt_port: int | None = None

    @property
    def name(self) -> str:
        """``host:port`` (the business address), how logs and selection name it."""
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the business plane."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def mgmt_url(self) -> str:
        """``http://host:mgmt`` of the management plane (the business port when no
        ``@MGMT`` was given)."""
        return f"http://{_url_host(self.host)}:{self.mgmt_port or self.port}"

    @classmethod
    def parse(cls, text: str) -> InstanceAddr:
        """Parse ``HOST:PORT[@MGMT]``.

        Raises:
            ValueError: no host, or a port that is not an integer in 1..65535.
        """
        addr, _, mgmt = text.strip().partition("@")
        host, sep, port = addr.rpartition(":")
        host = host.strip("[]")
        if not sep or not host:
            raise ValueError(f"instance address {text!r} is not HOST:PORT[@MGMT]")
        return cls(host, _port(port, text), _port(mgmt, text) if mgmt else None)


def _port(text: str, whole: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"bad port {text!r} in instance address {whole!r}")
    return port


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``tokenserve coordinator`` needs. Times are seconds; defaults are
    MindIE Motor's (§3.2) where it has one.

    Attributes:
        prefill: the P instances (flex instances may be listed in both lists).
        decode: the D instances.
        host, port: the coordinator's listener (``port=0``: any free port).
        management_port: a second listener for the management plane (spec §9.4
            ``manage_port`` and status routes); None: the main port serves them.
        schedule_timeout_s: a request that cannot be placed on a P and a D for this long
            (on a resubmission, when none is usable) ends with 408.
        first_token_timeout_s: P's answer must arrive this long after arrival, else 408.
        infer_timeout_s: the whole response must be done this long after arrival, else 408.
        tokenizer_timeout_s: bound on a forwarded ``/v1/tokenizer`` request.
        max_requests: in-flight requests; one more gets 429 ``Too many requests``.
        max_retry: resubmissions of one request (``retry:``, a lost D, P errors while
            retrying), and /dresult re-links before a D is marked down.
        p_connect_tries: P instances tried per submission before 500 ``Connect to p
            instance failed`` (§10: 4).
        retry_delay_s: wait before re-sending to a P that answered an error while the
            request was being retried (§7.3: 1 s).
        status_interval_s: how often each instance's ``GET /v1/status`` is polled.
        status_timeout_s: bound on one status poll.
        connect_timeout_s: TCP connect bound for every upstream request.
        dresult_idle_timeout_s: a /dresult stream silent this long is dead (D writes a
            heartbeat after 5 s idle, §6.2).
        relink_backoff_s, relink_backoff_max_s: first and largest pause between
            /dresult re-links (doubling).
        chars_per_token: text prompts are costed as ``len(text) / chars_per_token``
            tokens (MindIE ``string_token_rate``).
        block_size_hint: tokens per KV block, to cost a request in D blocks (default:
            the instances' default, ``EngineConfig.block_size``).
        max_body_bytes: request body limit (§3.2 ``body_limit``: 1 MB).
        drain_timeout_s: on SIGTERM/SIGINT, how long running requests get to finish.
        p_policy: how a P is chosen: ``load`` (DIGS load balance, spec §3.4) or
            ``affinity`` (same prompt prefix, same P while its load stays in bound;
            :mod:`tokenserve.coordinator.policy`).
        affinity_prefix_chars: the prompt characters affinity hashes.
        affinity_load_bound, affinity_slack_tokens: affinity leaves its P only when that
            P's prefill load (estimated prompt tokens) is above both this many times the
            least loaded P's and the least plus this many tokens.
    """

    prefill: tuple[InstanceAddr, ...]
    decode: tuple[InstanceAddr, ...]
    host: str = LOOPBACK
    port: int = MINDIE_PORT
    management_port: int | None = None
    schedule_timeout_s: float = 600.0
    first_token_timeout_s: float = 600.0
    infer_timeout_s: float = 600.0
    tokenizer_timeout_s: float = 300.0
    max_requests: int = 10000
    max_retry: int = 5
    p_connect_tries: int = 4
    retry_delay_s: float = 1.0
    status_interval_s: float = 1.0
    status_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    dresult_idle_timeout_s: float = 20.0
    relink_backoff_s: float = 0.2
    relink_backoff_max_s: float = 5.0
    chars_per_token: float = 4.0
    block_size_hint: int = EngineConfig.block_size
    max_body_bytes: int = 2**20
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    p_policy: str = "load"
    affinity_prefix_chars: int = 512
    affinity_load_bound: float = 2.0
    affinity_slack_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.p_policy not in ("load", "affinity"):
            raise ValueError(f"p_policy must be load or affinity, got {self.p_policy!r}")
        if (self.affinity_prefix_chars < 1 or self.affinity_load_bound < 1
                or self.affinity_slack_tokens < 0):
            raise ValueError("affinity_prefix_chars must be >= 1, affinity_load_bound >= 1 "
                             "and affinity_slack_tokens >= 0")
        if not self.prefill or not self.decode:
            raise ValueError("the coordinator needs at least one prefill and one decode "
                             "instance")
        for name in ("schedule_timeout_s", "first_token_timeout_s", "infer_timeout_s",
                     "tokenizer_timeout_s", "status_interval_s", "chars_per_token"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_requests", "p_connect_tries", "block_size_hint", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retry < 0:
            raise ValueError(f"max_retry must be >= 0, got {self.max_retry}")
