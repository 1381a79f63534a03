"""KV-cache hand-off between a prefill (P) and a decode (D) instance over the Mooncake
Transfer Engine (spec/pd_disaggregation.md §8; D *pulls*, as MindIE's ``pull_blocks``).

Each instance registers its whole KV cache, once, with its own Mooncake engine
(``P2PHANDSHAKE`` metadata: peers exchange segment descriptors directly, no etcd). P puts
a :class:`KvRegion` (where its cache is and how it is laid out) and the request's block ids
in the decode request; D allocates blocks and calls :meth:`KvTransfer.pull`, which reads
P's blocks into its own for every layer, K and V, in ONE batched Mooncake read (per
:data:`MAX_SEGMENTS_PER_CALL` segments).

The cache is one contiguous tensor (``CausalLM.allocate_kv_cache``)::

    kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, R]   (model dtype, R = head_dim;
                                                                   int8: R = head_dim + 4)

    byte offset of (layer l, kv k, block b) = ((l * 2 + k) * num_blocks + b) * block_bytes
    block_bytes = num_kv_heads * block_size * head_dim * element_size

    plane (l=0,K)          plane (l=0,V)          plane (l=1,K)
    [ b0 | b1 | b2 | .. ]  [ b0 | b1 | b2 | .. ]  [ b0 | .. ]  ...   2 * num_layers planes

P and D run the same model (same ``num_layers``, ``block_bytes``) but hold different
``num_blocks``, so the same block sits at different offsets on each side. A run of
consecutive ids on both sides (P 7,8,9 -> D 3,4,5) is one segment per plane; segments
that touch on both sides merge further (all blocks of equal-sized caches: one segment).
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import operator
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenserve.config import env

log = logging.getLogger("tokenserve.pd")

#: Mooncake settings applied (where the environment leaves them unset) while mooncake.engine
#: is first imported (it reads MC_LOG_LEVEL then: at INFO it logs every connection) and
#: while an engine starts (its TCP transport fails a whole batch when more than its per-peer
#: queue, 1024 requests by default, are in flight to one peer; a pull of scattered blocks
#: is ``2 * num_layers`` requests per run of blocks)
_IMPORT_ENV = {"MC_LOG_LEVEL": "WARNING"}
_ENGINE_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535"}
#: segments per Mooncake call: a bigger pull is several calls, one after the other, so a
#: few concurrent pulls from one P stay under the per-peer queue above
MAX_SEGMENTS_PER_CALL = 8192
_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one engine creation at a time
_MIN_TIMEOUT_S = 5  # Mooncake clamps MC_TRANSFER_TIMEOUT to at least 5 s
_DEFAULT_TIMEOUT_S = 30  # Mooncake's default when MC_TRANSFER_TIMEOUT is unset


class KvTransferError(RuntimeError):
    """A KV hand-off failed (engine start, registration, layout, block ids, or the read).

    Attributes:
        timed_out: the read ran to Mooncake's deadline while the peer was still connected
            (a stalled P). Its data may STILL land in the destination blocks later (seen
            with a P resumed after SIGSTOP): the caller must not give those blocks to
            another request. False for every fast failure (peer gone, refused, bad ids):
            the blocks may hold part of the data, but nothing more will arrive.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class KvLayout:
    """Shape of a KV region in transfer terms.

    Attributes:
        num_layers: decoder layers.
        num_blocks: KV blocks in this instance's cache (differs between P and D).
        block_bytes: bytes of one block of one layer's K (or V):
            ``num_kv_heads * block_size * head_dim * element_size``.
    """

    num_layers: int
    num_blocks: int
    block_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_bytes"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"KvLayout.{name} must be a positive int, got {v!r}")

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> KvLayout:
        """Layout of ``kv`` [num_layers, 2, num_blocks, Hkv, block_size, head_dim], contiguous.

        Raises:
            ValueError: another rank, a middle dim other than 2, or a non-contiguous tensor.
        """
        if kv.dim() != 6 or kv.shape[1] != 2 or not kv.is_contiguous():
            raise ValueError("the KV region must be one contiguous tensor [num_layers, 2, "
                             f"num_blocks, Hkv, block_size, head_dim], got shape "
                             f"{tuple(kv.shape)} contiguous={kv.is_contiguous()}")
        return cls(kv.shape[0], kv.shape[2], math.prod(kv.shape[3:]) * kv.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region."""
        return self.num_layers * 2 * self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class KvRegion:
    """What P advertises to D (JSON, inside the P -> D decode request).

    Attributes:
        session_id: ``host:rpc_port`` of P's Mooncake engine (the host P was started
            with: an address D can reach).
        base_addr: address of P's registered region (``kv.data_ptr()``), in P's process.
        layout: P's layout.
    """

    session_id: str
    base_addr: int
    layout: KvLayout

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "base_addr": self.base_addr,
                "num_layers": self.layout.num_layers, "num_blocks": self.layout.num_blocks,
                "block_bytes": self.layout.block_bytes}

    @classmethod
    def from_dict(cls, d: Any) -> KvRegion:
        """Inverse of :meth:`to_dict`. Raises ValueError on anything malformed."""
        if not isinstance(d, dict):
            raise ValueError(  # noqa: TRY004 - one error type for any malformed body
                f"a KV region must be a JSON object, got {type(d).__name__}")
        try:
            sid, addr = d["session_id"], d["base_addr"]
            layout = KvLayout(d["num_layers"], d["num_blocks"], d["block_bytes"])
        except KeyError as exc:
            raise ValueError(f"a KV region lacks {exc.args[0]!r}") from None
        if not isinstance(sid, str) or not sid.rpartition(":")[0]:
            raise ValueError(f"KV region session_id must be 'host:port', got {sid!r}")
        if type(addr) is not int or addr <= 0:
            raise ValueError(f"KV region base_addr must be a positive int, got {addr!r}")
        return cls(sid, addr, layout)


def merge_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int],
               ) -> list[tuple[int, int, int]]:
    """Pair ``src_blocks[i] -> dst_blocks[i]``, merging runs consecutive on BOTH sides.

    Returns:
        ``(src_start, dst_start, count)`` per run, in input order: src 4,5,6,9 -> dst
        0,1,2,3 gives ``[(4, 0, 3), (9, 3, 1)]``.
    """
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def plan_segments(src: KvLayout, dst: KvLayout, src_blocks: Sequence[int],
                  dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Byte segments that copy ``src_blocks`` of ``src`` to ``dst_blocks`` of ``dst`` in
    every layer, K and V.

    Returns:
        ``(src_offset, dst_offset, length)`` in bytes from each region's base; segments
        contiguous on both sides are merged. Empty when no blocks are given.

    Raises:
        KvTransferError: layouts of another model, lists of unequal length, an id that is
            not an int or out of ``[0, num_blocks)``, or a destination block listed twice.
    """
    if (src.num_layers, src.block_bytes) != (dst.num_layers, dst.block_bytes):
        raise KvTransferError(
            f"KV layouts differ (another model or dtype?): source {src.num_layers} layers "
            f"x {src.block_bytes} B/block, destination {dst.num_layers} x {dst.block_bytes}")
    if len(src_blocks) != len(dst_blocks):
        raise KvTransferError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} "
                              "destination blocks")
    src_ids, dst_ids = _check_ids(src_blocks, src, "source"), _check_ids(dst_blocks, dst,
                                                                         "destination")
    if len(set(dst_ids)) != len(dst_ids):
        raise KvTransferError(f"a destination block is listed twice: {dst_ids}")
    runs = merge_runs(src_ids, dst_ids)
    bb, segs = src.block_bytes, []
    for plane in range(2 * src.num_layers):  # plane = layer * 2 + (0: K, 1: V)
        for s, d, n in runs:
            so, do = (plane * src.num_blocks + s) * bb, (plane * dst.num_blocks + d) * bb
            if segs and segs[-1][0] + segs[-1][2] == so and segs[-1][1] + segs[-1][2] == do:
                segs[-1][2] += n * bb
            else:
                segs.append([so, do, n * bb])
    return [(s, d, n) for s, d, n in segs]


def _check_ids(ids: Sequence[int], layout: KvLayout, side: str) -> list[int]:
    try:
        out = [operator.index(b) for b in ids]
    except TypeError:
        raise KvTransferError(f"{side} block ids must be ints, got {list(ids)!r}") from None
    bad = [b for b in out if not 0 <= b < layout.num_blocks]
    if bad:
        raise KvTransferError(f"{side} block ids {bad} out of range [0, {layout.num_blocks})")
    return out


def pull_blocks_ref(src_tensor: torch.Tensor, dst_tensor: torch.Tensor,
                    src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """Pure-torch reference of :meth:`KvTransfer.pull` (in place, on ``dst_tensor``).

    Args:
        src_tensor: [num_layers, 2, Ns, Hkv, block_size, head_dim], P's cache.
        dst_tensor: [num_layers, 2, Nd, Hkv, block_size, head_dim], D's cache, same dtype.
        src_blocks, dst_blocks: equal-length block ids; ``dst[:, :, dst_blocks[i]] =
            src[:, :, src_blocks[i]]``.
    """
    if not len(src_blocks):
        return
    dst_tensor[:, :, list(dst_blocks)] = src_tensor[:, :, list(src_blocks)]


class _ScopedEnv:
    """Set environment variables for a block (``setdefault`` for ``defaults``), then restore
    them: Mooncake reads its settings with getenv()."""

    def __init__(self, defaults: dict[str, str], force: dict[str, str] | None = None) -> None:
        self.defaults, self.force = defaults, force or {}

    def __enter__(self) -> None:
        _ENV_LOCK.acquire()
        self.saved = {k: os.environ.get(k) for k in (*self.defaults, *self.force)}
        for k, v in self.defaults.items():
            os.environ.setdefault(k, v)
        os.environ.update(self.force)

    def __exit__(self, *exc: object) -> None:
        try:
            for k, v in self.saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        finally:
            _ENV_LOCK.release()


def load_mooncake(port_range: tuple[int, int] | None = None) -> type:
    """``mooncake.engine.TransferEngine``, imported with this module's log level default
    and, where given, the listeners' port range (``MC_MIN_RPC_PORT`` /
    ``MC_MAX_RPC_PORT``: Mooncake reads them when its library loads, so they only take
    effect on the process's first import).

    Raises:
        KvTransferError: Mooncake is not installed (or its library does not load).
    """
    ports = {} if port_range is None else {"MC_MIN_RPC_PORT": str(port_range[0]),
                                           "MC_MAX_RPC_PORT": str(port_range[1])}
    with _ScopedEnv(_IMPORT_ENV, ports):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise KvTransferError(
                "PD needs the Mooncake Transfer Engine: pip install 'tokenserve[pd]' (its "
                "CPU wheel links Debian's libibverbs1 and libnuma1: apt-get install -y "
                f"libibverbs1 libnuma1; on CUDA use mooncake-transfer-engine) ({exc})"
            ) from exc
    return TransferEngine


def _session_id(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 as Mooncake writes it


def _non_cuda_wheel() -> bool:
    try:
        importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class KvTransfer:
    """This instance's Mooncake engine with its KV cache registered (P and D alike).

    Lifetime: one per process, created once the KV cache exists and closed at shutdown,
    after the last pull. P's region must stay registered while any D may read it (the
    object keeps ``kv`` alive). Thread-safe: pulls may run concurrently from worker
    threads; :meth:`close` must not race them.

    Args:
        host: the address other hosts reach this instance at (IP or name; never assume
            loopback). Mooncake's two listeners (handshake RPC and TCP data) bind every
            interface on random ports in ``port_range``.
        kv: the KV region, one contiguous [num_layers, 2, num_blocks, Hkv, block_size,
            head_dim] tensor (CPU with the ``-non-cuda`` wheel).
        protocol: Mooncake transport: ``tcp``, or ``rdma`` where the hardware has it.
        device_name: RDMA device(s), e.g. ``mlx5_0`` (comma-separated); ``""`` for tcp.
        timeout_s: bound of one stalled pull (``kv_trans_timeout``), passed to Mooncake as
            ``MC_TRANSFER_TIMEOUT`` (it clamps to >= 5 s and adds 1 ns per byte); None:
            the environment's ``MC_TRANSFER_TIMEOUT``, else Mooncake's 30 s.
        port_range: (lowest, highest) port of those listeners, passed to Mooncake as
            ``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT``, which it reads once, when it is
            first imported in the process (this constructor imports it); None: the
            environment's, else 15000-17000.

    Raises:
        KvTransferError: Mooncake missing, a bad ``kv``, the engine cannot start or
            register the memory, or its listener is outside ``port_range`` (Mooncake was
            imported earlier in the process, with other settings).
    """

    def __init__(self, host: str, kv: torch.Tensor, *, protocol: str = "tcp",
                 device_name: str = "", timeout_s: float | None = None,
                 port_range: tuple[int, int] | None = None) -> None:
        engine_cls = load_mooncake(port_range)
        try:
            self.layout = KvLayout.from_tensor(kv)
        except ValueError as exc:
            raise KvTransferError(str(exc)) from None
        if kv.device.type != "cpu" and _non_cuda_wheel():
            raise KvTransferError(f"the KV cache is on {kv.device}, but the installed "
                                  "Mooncake wheel (-non-cuda) reads host memory only")
        self._kv = kv  # keeps the registered memory alive
        self._base = kv.data_ptr()
        self.timeout_s = _effective_timeout(timeout_s)
        # Mooncake reads MC_TRANSFER_TIMEOUT in the constructor, MC_TCP_* in initialize()
        with _ScopedEnv(_ENGINE_ENV, {"MC_TRANSFER_TIMEOUT": str(self.timeout_s)}):
            self._engine = engine_cls()
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        try:
            if rc != 0:
                raise KvTransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, "
                                      f"{protocol!r}, {device_name!r}) failed (rc={rc}; its "
                                      "log says why)")
            port = self._engine.get_rpc_port()
            self.session_id = _session_id(host, port)
            if port_range is not None and not port_range[0] <= port <= port_range[1]:
                raise KvTransferError(
                    f"Mooncake listens on port {port}, outside {port_range[0]}-"
                    f"{port_range[1]}: it was imported earlier in this process, before the "
                    "port range was set")
            rc = self._engine.register_memory(self._base, self.layout.nbytes)
            if rc != 0:
                raise KvTransferError(f"Mooncake register_memory of the {self.layout.nbytes} "
                                      f"B KV region failed (rc={rc})")
        except BaseException:
            del self._engine  # stop its listeners now, not at garbage collection
            raise
        self._closed = False
        log.info("KV transfer: Mooncake %s engine %s, %d B registered (%d layers x %d "
                 "blocks x %d B x K/V)", protocol, self.session_id, self.layout.nbytes,
                 self.layout.num_layers, self.layout.num_blocks, self.layout.block_bytes)

    def descriptor(self) -> KvRegion:
        """What P puts in the decode request for D to :meth:`pull` from."""
        return KvRegion(self.session_id, self._base, self.layout)

    def pull(self, src: KvRegion, src_blocks: Sequence[int], dst_blocks: Sequence[int],
             ) -> None:
        """Read P's ``src_blocks`` into this instance's ``dst_blocks``, all layers, K and V.

        BLOCKING: run it in a worker thread, never on the event loop. Mooncake releases
        the GIL but busy-polls one core until the read ends. Over TCP on a loaded 2-core
        box: ~10 ms for 7 MiB in 60 segments, plus ~40-100 us per further segment (each
        run of blocks costs ``2 * num_layers`` segments). Bounded: up to ``timeout_s``
        when P stalls, and up to Mooncake's 60 s handshake read timeout on the FIRST pull
        from a P that accepts connections but never answers. Empty lists are a no-op.

        Args:
            src: P's :meth:`descriptor`.
            src_blocks: P's block ids; ``dst_blocks[i]`` receives ``src_blocks[i]``.
            dst_blocks: this instance's block ids, no duplicates.

        Raises:
            KvTransferError: mismatched layouts, bad ids, a closed engine, or the read
                failed (P gone or unreachable: at once; P stalled: after ``timeout_s``,
                with ``timed_out`` set; see :class:`KvTransferError`).
        """
        segs = plan_segments(src.layout, self.layout, src_blocks, dst_blocks)
        if not segs:
            return
        if self._closed:
            raise KvTransferError("the KV transfer engine is closed")
        nbytes = sum(n for _, _, n in segs)
        t0 = time.perf_counter()
        for i in range(0, len(segs), MAX_SEGMENTS_PER_CALL):
            self._read(src, segs[i:i + MAX_SEGMENTS_PER_CALL],
                       f"KV pull of {len(src_blocks)} blocks ({nbytes} B, {len(segs)} "
                       f"segments) from {src.session_id}")
        dt = time.perf_counter() - t0
        log.debug("KV pull %d blocks %d B %d segments from %s: %.2f ms, %.0f MB/s",
                  len(src_blocks), nbytes, len(segs), src.session_id, dt * 1e3,
                  nbytes / max(dt, 1e-9) / 1e6)

    def _read(self, src: KvRegion, segs: list[tuple[int, int, int]], what: str) -> None:
        """One ``batch_transfer_sync_read`` of ``segs`` (src_offset, dst_offset, length)."""
        nbytes = sum(n for _, _, n in segs)
        t0 = time.perf_counter()
        try:
            rc = self._engine.batch_transfer_sync_read(
                src.session_id, [self._base + d for _, d, _ in segs],
                [src.base_addr + s for s, _, _ in segs], [n for _, _, n in segs])
        except Exception as exc:  # the binding's own errors (TypeError, ...) are ours too
            raise KvTransferError(f"{what}: Mooncake raised {type(exc).__name__}: "
                                  f"{exc}") from exc
        dt = time.perf_counter() - t0
        if rc != 0:
            # Mooncake gives up on a read after MC_TRANSFER_TIMEOUT s + 1 ns per byte
            timed_out = dt >= self.timeout_s + nbytes * 1e-9 - 0.05
            raise KvTransferError(
                f"{what} failed after {dt * 1e3:.0f} ms (rc={rc}): "
                + ("P stalled past the transfer timeout" if timed_out else
                   "P is gone, unreachable, or rejected the read"), timed_out=timed_out)

    def close(self) -> None:
        """Unregister the region and stop the engine (its listeners close). Idempotent;
        call after the last pull has returned."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        rc = self._engine.unregister_memory(self._base)
        if rc != 0:
            log.warning("Mooncake unregister_memory failed (rc=%d)", rc)
        del self._engine

    def __enter__(self) -> KvTransfer:  # noqa: PYI034 - typing.Self is 3.11+
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _effective_timeout(timeout_s: float | None) -> int:
    """Whole seconds Mooncake will wait for a stalled read, as it computes them."""
    if timeout_s is None:
        given = env.mc_transfer_timeout()
        try:
            timeout_s = int(given) if given else _DEFAULT_TIMEOUT_S
        except ValueError:
            timeout_s = 0  # Mooncake's atoi() gives 0, clamped below
    return max(_MIN_TIMEOUT_S, math.ceil(timeout_s))
