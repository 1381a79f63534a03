"""Read a MindIE Service ``config.json`` into our configuration.

Schema and ranges: ``shared/spec/config.md`` (ServerConfig §1, BackendConfig §2,
ModelDeployConfig §3, ModelConfig §4, ScheduleConfig §5). Unknown keys are ignored, as
MindIE does; a known key with a wrong type or an out-of-range value is a start-up
error naming the key (ValueError). Keys MindIE requires but that have no meaning for
this server (NPU ids, backend names, ...) are accepted and ignored.

HTTPS (config.md §1 ``httpsEnabled``, spec interfaces.md §0.2): each plane's certificate,
key, CA files and CRL files (``tlsCert`` ..., ``managementTls*``, ``metricsTls*``) become
a :class:`~tokenserve.config.tree.TlsSettings` that requires client certificates (mutual TLS,
as MindIE does). [I] Relative paths are relative to the config file's directory (MindIE:
its install directory); a plane with none of its own keys uses the business plane's
material; the CRL and key-password files are used only when their keys are given.
``allowAllZeroIpListening`` false refuses ``0.0.0.0`` / ``::`` addresses.

KV cache size [I]: ``npuMemSize`` GB on an accelerator, ``cpuMemSize`` GB on the CPU
(MindIE's ``cpuMemSize`` is swap space; on a CPU-only server the host memory *is* the
KV cache); a value of -1 / 0 leaves the default (``EngineConfig.kv_cache_bytes``).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenserve.config import env
from tokenserve.config.tree import ALL_INTERFACES, ServeConfig, SpecConfig, TlsSettings

GB = 1 << 30


def _get(obj: dict, key: str, kind: type | tuple[type, ...], where: str,
         lo: float | None = None, hi: float | None = None, default: Any = None) -> Any:
    """``obj[key]`` checked for type and range; ``default`` when absent."""
    if key not in obj:
        return default
    v = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ValueError(f"config {where}.{key}: expected {names}, got {v!r}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise ValueError(f"config {where}.{key}: {v} is outside [{lo}, {hi}]")
    return v


def _section(obj: dict, key: str, where: str) -> dict:
    v = obj.get(key, {})
    if not isinstance(v, dict):
        raise ValueError(f"config {where}.{key}: expected an object")
    return v


def config_path_from_env() -> Path | None:
    """``$MIES_CONFIG_JSON_PATH``, else ``$MINDIE_LLM_HOME_PATH/conf/config.json`` if it
    exists (spec config.md "General rules"), else None."""
    if p := env.mies_config_json_path():
        return Path(p)
    if home := env.mindie_llm_home_path():
        p = Path(home) / "conf" / "config.json"
        return p if p.exists() else None
    return None


def load_mindie_config(path: str | Path, base: ServeConfig | None = None,
                       accelerator: bool = False) -> ServeConfig:
    """Parse ``path`` over ``base`` (defaults); CLI flags are applied by the caller after.

    Raises:
        ValueError: unreadable JSON, a wrong type or an out-of-range value (the message
            names the key), or a setting this server cannot honour (``httpsEnabled``).
        FileNotFoundError: ``path`` does not exist.
    """
    p = Path(path)
    size = p.stat().st_size
    if not 0 < size <= 10 * 2**20:
        raise ValueError(f"config {p}: size must be in (0, 10 MiB], got {size} bytes")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {p}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"config {p}: the top level must be an object")
    base = base or ServeConfig()
    eng, srv = base.engine, base.server

    sc = _section(doc, "ServerConfig", "")
    w = "ServerConfig"
    tls = {"business_tls": srv.business_tls, "management_tls": srv.management_tls,
           "metrics_tls": srv.metrics_tls}
    if _get(sc, "httpsEnabled", bool, w, default=False):
        tls = _tls_settings(sc, p.parent)
    host = _get(sc, "ipAddress", str, w, default=srv.host)
    port = _get(sc, "port", int, w, 1024, 65535, srv.port)
    mgmt_host = _get(sc, "managementIpAddress", str, w, default=srv.management_host)
    if not _get(sc, "allowAllZeroIpListening", bool, w, default=False):
        for key, value in (("ipAddress", host), ("managementIpAddress", mgmt_host)):
            if value in ALL_INTERFACES:
                raise ValueError(f"config {w}.{key}: {value} listens on every interface; "
                                 "set allowAllZeroIpListening to true to allow it")
    mgmt_port = _get(sc, "managementPort", int, w, 1024, 65535, srv.management_port)
    metrics_port = _get(sc, "metricsPort", int, w, 1024, 65535, srv.metrics_port)
    srv = replace(
        srv, host=host, port=port, management_host=mgmt_host, management_port=mgmt_port,
        metrics_port=metrics_port, **tls,
        max_connections=_get(sc, "maxLinkNum", int, w, 1, 4096, srv.max_connections),
        max_body_bytes=_get(sc, "maxRequestLength", int, w, 1, 100,
                            srv.max_body_bytes >> 20) << 20,
        max_json_depth=_get(sc, "maxJsonDepth", int, w, 10, 100, srv.max_json_depth))
    eng = replace(
        eng,
        token_timeout_s=float(_get(sc, "tokenTimeout", int, w, 1, 3600, eng.token_timeout_s)),
        e2e_timeout_s=float(_get(sc, "e2eTimeout", int, w, 1, 65535, eng.e2e_timeout_s)))

    bc = _section(doc, "BackendConfig", "")
    md = _section(bc, "ModelDeployConfig", "BackendConfig")
    w = "BackendConfig.ModelDeployConfig"
    max_seq_len = _get(md, "maxSeqLen", int, w, 1, None, eng.max_seq_len)
    max_input = _get(md, "maxInputTokenLen", int, w, 1, 4194304, eng.max_input_len)
    models = md.get("ModelConfig", [])
    if not isinstance(models, list) or len(models) > 1:
        raise ValueError(f"config {w}.ModelConfig: expected a list of at most one model")
    model, name, kv_bytes = eng.model, eng.served_model_name, eng.kv_cache_bytes
    quantization = eng.quantization
    spec = eng.speculative_config
    mc_kv_timeout = None
    parallel = eng.parallel
    if models:
        mc, w2 = models[0], f"{w}.ModelConfig[0]"
        if not isinstance(mc, dict):
            raise ValueError(f"config {w2}: expected an object")
        name = _get(mc, "modelName", str, w2, default=name)
        mc_kv_timeout = _get(mc, "kv_trans_timeout", int, w2, default=None)
        if mc_kv_timeout is not None and mc_kv_timeout <= 0:
            mc_kv_timeout = 1  # spec pd §8.1: values <= 0 become 1
        if name is not None and not _valid_model_name(name):
            raise ValueError(f"config {w2}.modelName: {name!r} must match "
                             "^[A-Za-z0-9_.-]{1,256}$ and start/end alphanumeric")
        model = _get(mc, "modelWeightPath", str, w2, default=model)
        if model is not None and not model.strip():
            raise ValueError(f"config {w2}.modelWeightPath: must name a model directory, "
                             "got an empty string")
        # ours (MindIE reads it from the weights): none | gguf | auto, see EngineConfig
        quantization = _get(mc, "quantization", str, w2, default=quantization)
        # ours: vLLM's speculative-config object (SpecConfig)
        spec_cfg = _get(mc, "speculative_config", dict, w2, default=None)
        if spec_cfg is not None:
            try:
                spec = SpecConfig.from_dict(spec_cfg)
            except ValueError as exc:
                raise ValueError(f"config {w2}.speculative_config: {exc}") from None
        npu_gb = _get(mc, "npuMemSize", int, w2, -1, 2**31 - 1, -1)
        cpu_gb = _get(mc, "cpuMemSize", int, w2, 0, None, 0)
        if npu_gb == 0:
            raise ValueError(f"config {w2}.npuMemSize: must be -1 (auto) or > 0")
        gb = npu_gb if accelerator else cpu_gb
        if gb > 0:
            kv_bytes = gb * GB
        # tensor parallelism (issue 41): worldSize ranks; npuDeviceIds, when it lists one
        # instance's devices, must name as many (spec config.md §3, §4)
        world = _get(mc, "worldSize", int, w2, 1, 1024, eng.parallel.tensor_parallel_size)
        ids = bc.get("npuDeviceIds")
        if (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list)
                and len(ids[0]) != world):
            raise ValueError(f"config {w2}.worldSize: {world} ranks, but "
                             f"BackendConfig.npuDeviceIds lists {len(ids[0])} devices")
        parallel = replace(eng.parallel, tensor_parallel_size=world)

    sch = _section(bc, "ScheduleConfig", "BackendConfig")
    w = "BackendConfig.ScheduleConfig"
    max_batch = _get(sch, "maxBatchSize", int, w, 1, 819200, eng.max_batch_size)
    prefill_batch = _get(sch, "maxPrefillBatchSize", int, w, 0, max_batch,
                         eng.max_prefill_batch_size) or max_batch
    eng = replace(
        eng, model=model, served_model_name=name, kv_cache_bytes=kv_bytes,
        quantization=quantization, speculative_config=spec, parallel=parallel,
        max_seq_len=max_seq_len, max_input_len=max_input,
        block_size=_get(sch, "cacheBlockSize", int, w, 1, 128, eng.block_size),
        max_batch_size=max_batch, max_prefill_batch_size=prefill_batch,
        max_num_batched_tokens=_get(sch, "maxPrefillTokens", int, w, 1, 4194304,
                                    eng.max_num_batched_tokens),
        max_iter_times=_get(sch, "maxIterTimes", int, w, 1, max_seq_len, eng.max_iter_times),
        enable_prefix_caching=_get(sch, "enablePrefixCache", bool, w,
                                   default=eng.enable_prefix_caching),
        long_prefill_token_threshold=_get(sch, "longPrefillTokenThreshold", int, w, 1, 8192,
                                          eng.long_prefill_token_threshold),
        max_long_partial_prefills=_get(
            sch, "maxLongPartialPrefills", int, w, 1,
            _get(sch, "maxNumPartialPrefills", int, w, 1, 64, 64),
            eng.max_long_partial_prefills))
    pd = replace(base.pd, infer_mode=_get(sc, "inferMode", str, w, default=base.pd.infer_mode),
                 ip_address=host if host not in ("0.0.0.0", "::") else base.pd.ip_address)
    if mc_kv_timeout is not None:  # ServeConfig copies it into the engine's
        pd = replace(pd, kv_trans_timeout_s=float(mc_kv_timeout))
    return ServeConfig(engine=eng, server=srv, pd=pd)


def _valid_model_name(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,254}[A-Za-z0-9])?", name))


#: config.md §1 TLS keys per plane: (CA files, certificate, key, key password, CRL
#: directory, CRL files) and the defaults of the certificate, key and CA files.
_TLS_KEYS = {
    "business_tls": (("tlsCaFile", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath",
                      "tlsCrlFiles"),
                     (["ca.pem"], "security/certs/server.pem",
                      "security/keys/server.key.pem")),
    "management_tls": (("managementTlsCaFile", "managementTlsCert", "managementTlsPk",
                        "managementTlsPkPwd", "managementTlsCrlPath",
                        "managementTlsCrlFiles"), None),
    "metrics_tls": (("metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk",
                     "metricsTlsPkPwd", "metricsTlsCrlPath", "metricsTlsCrlFiles"), None),
}


def _str_list(obj: dict, key: str, where: str, default: list[str]) -> list[str]:
    v = obj.get(key, default)
    if not isinstance(v, list) or not 0 < len(v) <= 3 or not all(
            isinstance(x, str) and x for x in v):
        raise ValueError(f"config {where}.{key}: expected a list of 1 to 3 file names")
    return v


def _tls_settings(sc: dict, base: Path) -> dict[str, TlsSettings]:
    """Each plane's :class:`TlsSettings` from ``ServerConfig`` (``httpsEnabled``):
    mutual TLS with the plane's CA files (spec §0.2)."""
    w = "ServerConfig"

    def path(p: str, key: str) -> str:
        full = base / p
        if not full.is_file():
            raise ValueError(f"config {w}.{key}: {full} does not exist (httpsEnabled is "
                             "true; relative paths are relative to the config file)")
        return str(full)

    ca_dir = _get(sc, "tlsCaPath", str, w, default="security/ca/")
    out: dict[str, TlsSettings] = {}
    for field_name, ((ca, cert, pk, pwd, crl_dir, crls), defaults) in _TLS_KEYS.items():
        keys = (ca, cert, pk, pwd, crl_dir, crls)
        if defaults is None and not any(k in sc for k in keys):
            out[field_name] = out["business_tls"]  # [I] no keys of its own
            continue
        dflt = defaults or (None, None, None)
        for k, d in ((cert, dflt[1]), (pk, dflt[2])):
            if k not in sc and d is None:
                raise ValueError(f"config {w}.{k}: required when httpsEnabled is true")
        ca_files = _str_list(sc, ca, w, dflt[0]) if ca in sc or dflt[0] else None
        if ca_files is None:
            raise ValueError(f"config {w}.{ca}: required when httpsEnabled is true")
        crl_files: list[str] = []
        if crls in sc:
            crl_base = _get(sc, crl_dir, str, w, default="security/certs/")
            crl_files = [str(Path(crl_base) / f) for f in _str_list(sc, crls, w, [])]
        password = _get(sc, pwd, str, w, default=None)
        out[field_name] = TlsSettings(
            certfile=path(_get(sc, cert, str, w, default=dflt[1]), cert),
            keyfile=path(_get(sc, pk, str, w, default=dflt[2]), pk),
            password_file=path(password, pwd) if password else None,
            ca_files=tuple(path(str(Path(ca_dir) / f), ca) for f in ca_files),
            crl_files=tuple(path(f, crls) for f in crl_files),
            cert_reqs=2)
    return out
