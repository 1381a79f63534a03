"""Every environment variable the program reads, in one table (:data:`VARS`: name, type,
value when unset, meaning, reader), and one function per variable that reads it. Each
function looks the variable up when it is called, never at import, so a test's
``monkeypatch.setenv`` takes effect at once; what a value means past that (a path's
default, an unknown GEMM name) stays with the caller named in the table.

``TOKENSERVE_SAMPLING_PORTABLE`` is read by the C++ kernels (``csrc/sampling.cpp``, once,
with ``getenv``) and is in the table for completeness. Written, not read: ``pd.kv_transfer``
sets Mooncake's own ``MC_LOG_LEVEL``, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and
``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT`` (where unset) while Mooncake loads, and
restores them after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    Attributes:
        name: the variable.
        type: what its value is.
        unset: what the program does or uses when it is unset (or empty).
        meaning: what it sets.
        read_by: the module that uses it.
    """

    name: str
    type: str
    unset: str
    meaning: str
    read_by: str

    def raw(self) -> str | None:
        """The value now; None when unset."""
        return os.environ.get(self.name)


MIES_CONFIG_JSON_PATH = EnvVar(
    "MIES_CONFIG_JSON_PATH", "path", "no config.json (unless MINDIE_LLM_HOME_PATH)",
    "the MindIE config.json `tokenserve serve` reads when --config is not given "
    "(spec config.md)", "config.mindie_json")
MINDIE_LLM_HOME_PATH = EnvVar(
    "MINDIE_LLM_HOME_PATH", "directory", "no config.json",
    "else $MINDIE_LLM_HOME_PATH/conf/config.json, if that file exists", "config.mindie_json")
TOKENSERVE_CACHE = EnvVar(
    "TOKENSERVE_CACHE", "directory", "~/.cache/tokenserve",
    "where GGUF models are converted to (Hugging Face layout)", "models.loader")
TOKENSERVE_GEMM = EnvVar(
    "TOKENSERVE_GEMM", "c | c-fma | amx-bf16 | onednn | torch", "the backend is chosen per layer",
    "force one GEMM backend (another value: ValueError)", "ops.linear")
TOKENSERVE_DISABLE_C = EnvVar(
    "TOKENSERVE_DISABLE_C", "flag: set and not 0", "off",
    "run the pure torch reference instead of the tokenserve._C kernels", "ops.dispatch")
TOKENSERVE_KERNELS_SO = EnvVar(
    "TOKENSERVE_KERNELS_SO", "path to a .so", "the installed tokenserve._C",
    "load the kernels from this file (a tools/dev_kernels.py build)", "ops.dispatch")
TOKENSERVE_FUSED_DECODER = EnvVar(
    "TOKENSERVE_FUSED_DECODER", "flag: 0 turns it off", "on",
    "0: the Python layer loop instead of _C.Decoder (profiling per kernel)", "models.decoder")
MC_TRANSFER_TIMEOUT = EnvVar(
    "MC_TRANSFER_TIMEOUT", "integer seconds (Mooncake's own)", "Mooncake's 30 s",
    "how long Mooncake waits for a stalled KV read, as pd.kv_transfer reports and bounds it "
    "(not a number: 0, as Mooncake's atoi; at least 5)", "pd.kv_transfer")
TOKENSERVE_SAMPLING_PORTABLE = EnvVar(
    "TOKENSERVE_SAMPLING_PORTABLE", "flag: set and not 0", "off",
    "the portable sampling loop on an AVX2 CPU (tests of that path)",
    "csrc/sampling.cpp (C++, once)")

#: every environment variable the program reads, by name
VARS: dict[str, EnvVar] = {v.name: v for v in (
    MIES_CONFIG_JSON_PATH, MINDIE_LLM_HOME_PATH, TOKENSERVE_CACHE, TOKENSERVE_GEMM,
    TOKENSERVE_DISABLE_C, TOKENSERVE_KERNELS_SO, TOKENSERVE_FUSED_DECODER,
    MC_TRANSFER_TIMEOUT, TOKENSERVE_SAMPLING_PORTABLE)}


def mies_config_json_path() -> str | None:
    """``$MIES_CONFIG_JSON_PATH``; None when unset or empty."""
    return MIES_CONFIG_JSON_PATH.raw() or None


def mindie_llm_home_path() -> str | None:
    """``$MINDIE_LLM_HOME_PATH``; None when unset or empty."""
    return MINDIE_LLM_HOME_PATH.raw() or None


def cache_dir() -> str | None:
    """``$TOKENSERVE_CACHE``; None when unset or empty (the caller's default applies)."""
    return TOKENSERVE_CACHE.raw() or None


def gemm() -> str:
    """``$TOKENSERVE_GEMM`` as given, ``""`` when unset (``ops.linear.forced_backend``
    checks the value)."""
    return TOKENSERVE_GEMM.raw() or ""


def disable_c() -> bool:
    """``$TOKENSERVE_DISABLE_C`` is set to anything but ``""`` or ``0``."""
    return (TOKENSERVE_DISABLE_C.raw() or "") not in ("", "0")


def kernels_so() -> str | None:
    """``$TOKENSERVE_KERNELS_SO``; None when unset or empty."""
    return TOKENSERVE_KERNELS_SO.raw() or None


def fused_decoder() -> bool:
    """False only when ``$TOKENSERVE_FUSED_DECODER`` is ``0``."""
    return TOKENSERVE_FUSED_DECODER.raw() != "0"


def mc_transfer_timeout() -> str | None:
    """``$MC_TRANSFER_TIMEOUT`` as given; None when unset or empty."""
    return MC_TRANSFER_TIMEOUT.raw() or None
