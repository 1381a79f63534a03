"""The coordinator's configuration: instance addresses, limits and timeouts
(spec/pd_disaggregation.md §3.2 defaults; plan "Instance addresses"), and its request ids
(§3.3).

An instance is given as ``HOST:PORT[@MGMT]``: ``PORT`` is its business port (inference
routes, ``/dresult``, ``stopInfer``, ``/v1/models``), ``MGMT`` the port its management
routes (``/v1/status``) answer on, the business port when absent. IPv6 hosts are written
in brackets: ``[::1]:1025@1026``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

MAX_U64 = 2**64 - 1


@dataclass(frozen=True)
class InstanceAddr:
    """One P or D instance as the coordinator reaches it (plan "Instance addresses")."""

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


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``tokenserve coordinator`` needs. Times are seconds; defaults are
    MindIE Motor's (§3.2) where it has one.

    Attributes:
        prefill: the P instances (flex instances may be listed in both lists).
        decode: the D instances.
        host, port: the coordinator's listener (``port=0``: any free port).
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
        block_size_hint: tokens per KV block, to cost a request in D blocks.
        max_body_bytes: request body limit (§3.2 ``body_limit``: 1 MB).
        drain_timeout_s: on SIGTERM/SIGINT, how long running requests get to finish.
    """

    prefill: tuple[InstanceAddr, ...]
    decode: tuple[InstanceAddr, ...]
    host: str = "127.0.0.1"
    port: int = 1025
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
    block_size_hint: int = 128
    max_body_bytes: int = 2**20
    drain_timeout_s: float = 25.0

    def __post_init__(self) -> None:
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


class ReqIdGenerator:
    """Unique request ids: unsigned 64-bit decimal strings (§3.3).

    ``id_n = (base + n * step) mod 2**64`` with a random base and a random odd step is a
    bijection of the counter ``n``, so ids never repeat within 2**64 requests of one
    coordinator and differ between coordinators (and restarts) with high probability.
    """

    def __init__(self) -> None:
        self._base = secrets.randbits(64)
        self._step = secrets.randbits(64) | 1
        self._n = 0

    def next(self) -> str:
        """The next id, e.g. ``"11528317054338029012"``."""
        self._n += 1
        return str((self._base + self._n * self._step) & MAX_U64)
