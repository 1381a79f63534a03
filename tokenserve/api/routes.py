"""The one table of every route (spec/interfaces.md §0.1, §2-§7; spec/pd_disaggregation.md
§3.1, §9.4): method, path, family, plane, what serves it on an instance and on the
coordinator, and, for inference routes, how a client asks for a stream and which body field
holds the prompt.

Every program reads it: the server binds each row's ``handler`` to the family object that
owns it (:func:`tokenserve.server.app.build_router`), the listeners split it by plane
(:func:`plane_of`), the prefill gate and the recompute path ask :func:`match` whether a
request is an inference call and where its prompt is, the coordinator serves the rows it
relays, forwards or answers itself (:attr:`Route.coordinator`), and the bench client takes
its paths from it by name. A new route is one row here plus its handler.

``POST /generate`` belongs to two families (spec §3.1): the body decides, once, in
:func:`generate_family`; :meth:`Route.resolve` gives the family, stream flag and prompt field
of a concrete body for every inference route.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenserve.transport.planes import Plane
from tokenserve.transport.router import compile_pattern


class Family(str, enum.Enum):
    """Who defines a route: one of the five API families, or the server itself."""

    MINDIE = "mindie"
    TGI = "tgi"
    VLLM = "vllm"
    OPENAI = "openai"
    TRITON = "triton"
    #: ``POST /generate``: vLLM or TGI by the body (:func:`generate_family`)
    GENERATE = "generate"
    #: health, metrics, management and PD routes of MindIE Server
    SERVER = "server"
    #: routes only the PD coordinator serves (MindIE Motor, spec/pd_disaggregation.md §9.4)
    COORDINATOR = "coordinator"


class Stream(str, enum.Enum):
    """How a client asks an inference route for a stream (spec §3.1 of the PD spec)."""

    NEVER = "never"
    ALWAYS = "always"
    #: the body's ``stream`` is ``true`` (absent: false)
    BODY = "body"


class Coord(str, enum.Enum):
    """What the PD coordinator does with a route (spec/pd_disaggregation.md §3, §9.4)."""

    NONE = "none"  # 404 on the coordinator
    RELAY = "relay"  # through a P and a D
    PROBE = "probe"  # 200 while a P and a D are usable, else 503
    FORWARD = "forward"  # to the least loaded P, answer unchanged
    STOP = "stop"  # stopInfer: to the instances holding the request (else a P)
    MANAGE = "manage"  # the coordinator's own (management port, metrics)
    #: [I] every usable decode instance is asked; numeric fields of their 200 answers
    #: are summed (a cluster's slots are its decode instances': coordinator/capacity.py),
    #: else the first non-200 answer is relayed
    SUM = "sum"
    #: [I] TGI ``/info``: a P's answer with ``max_concurrent_requests`` = the cluster's
    #: slots, the ``total_slots`` that :attr:`SUM` gives for getSlotCount (one number)
    INFO = "info"


@dataclass(frozen=True)
class Route:
    """One row of the table.

    Attributes:
        method: ``GET`` or ``POST``.
        path: the pattern; ``{name}`` matches one segment (``[\\w\\-.]+``, spec §0.1).
        name: unique, ``family.what`` (the bench client and tests look routes up by it).
        family: who defines it.
        plane: the listener that serves it (spec §0.1).
        handler: ``owner.attribute`` the server binds (owners: see
            :func:`tokenserve.server.app.build_router`); None for a route an instance does
            not serve (classified for the planes only, or coordinator-only).
        stream: inference routes: how a stream is asked for.
        prompt: inference routes: the body field with the prompt (recompute, spec §7.2
            of the PD spec; ``/generate``: by family, see :meth:`resolve`).
        coordinator: what the coordinator does with it.
    """

    method: str
    path: str
    name: str
    family: Family
    plane: Plane
    handler: str | None
    stream: Stream | None = None
    prompt: str | None = None
    coordinator: Coord = Coord.NONE

    @property
    def inference(self) -> bool:
        """Whether this is an inference call (it runs the engine: spec §3.1 of the PD spec)."""
        return self.stream is not None

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return compile_pattern(self.path)

    def resolve(self, body: dict[str, Any]) -> Resolved:
        """The family, stream flag and prompt field of this inference route for ``body``.

        Raises:
            ValueError: not an inference route, or a ``/generate`` body with neither
                ``prompt`` nor ``inputs`` (spec §3.1).
        """
        if not self.inference:
            raise ValueError(f"{self.path} is not an inference route")
        if self.family is Family.GENERATE:
            family = generate_family(body)
            if family is Family.VLLM:
                return Resolved(family, body.get("stream") is True, "prompt")
            return Resolved(family, False, "inputs")
        stream = self.stream is Stream.ALWAYS or (
            self.stream is Stream.BODY and body.get("stream") is True)
        assert self.prompt is not None, self.name
        return Resolved(self.family, stream, self.prompt)


@dataclass(frozen=True)
class Resolved:
    """An inference route applied to one body: the family that serves it, whether the
    client gets a stream, and the body field holding the prompt."""

    family: Family
    stream: bool
    prompt: str


def generate_family(body: dict[str, Any]) -> Family:
    """spec §3.1: ``POST /generate`` is vLLM when ``prompt`` is non-null (it wins), else TGI
    when ``inputs`` is non-null.

    Raises:
        ValueError: neither is (the server answers 422 with ``GENERATE_ROUTING_ERROR``).
    """
    if body.get("prompt") is not None:
        return Family.VLLM
    if body.get("inputs") is not None:
        return Family.TGI
    raise ValueError("/generate needs `prompt` (vLLM) or `inputs` (TGI)")


_B, _MG, _MT = Plane.BUSINESS, Plane.MANAGEMENT, Plane.METRICS
_F = Family
_M = "/v2/models/{model}"


def _r(method: str, path: str, name: str, family: Family, plane: Plane, handler: str | None,
       stream: Stream | None = None, prompt: str | None = None,
       coordinator: Coord = Coord.NONE) -> Route:
    return Route(method, path, name, family, plane, handler, stream, prompt, coordinator)


#: Every route, in registration order. Columns: method, path, name, family, plane,
#: instance handler, stream rule, prompt field, coordinator.
ROUTES: tuple[Route, ...] = (
    # --- inference (spec §2.1, §3, §4.1, §5, §6; PD spec §3.1) ---------------------------
    _r("POST", "/infer", "mindie.infer", _F.MINDIE, _B, "mindie.infer",
       Stream.BODY, "inputs", Coord.RELAY),
    _r("POST", "/infer_token", "mindie.infer_token", _F.MINDIE, _B, "mindie.infer",
       Stream.BODY, "inputs", Coord.RELAY),
    _r("POST", "/generate", "generate", _F.GENERATE, _B, "server.generate",
       Stream.BODY, None, Coord.RELAY),
    _r("POST", "/generate_stream", "tgi.generate_stream", _F.TGI, _B, "tgi.generate_stream",
       Stream.ALWAYS, "inputs", Coord.RELAY),
    _r("POST", "/", "tgi.root", _F.TGI, _B, "tgi.root", Stream.BODY, "inputs", Coord.RELAY),
    _r("POST", "/v1/chat/completions", "openai.chat", _F.OPENAI, _B, "openai.chat_completions",
       Stream.BODY, "messages", Coord.RELAY),
    _r("POST", "/v1/completions", "openai.completions", _F.OPENAI, _B, "openai.completions",
       Stream.BODY, "prompt", Coord.RELAY),
    _r("POST", f"{_M}/infer", "triton.infer", _F.TRITON, _B, "triton.infer",
       Stream.NEVER, "inputs", Coord.RELAY),
    _r("POST", f"{_M}/generate", "triton.generate", _F.TRITON, _B, "triton.generate",
       Stream.NEVER, "text_input", Coord.RELAY),
    _r("POST", f"{_M}/generate_stream", "triton.generate_stream", _F.TRITON, _B,
       "triton.generate_stream", Stream.ALWAYS, "text_input", Coord.RELAY),
    # --- the families' other routes ---------------------------------------------------------
    _r("GET", "/info", "tgi.info", _F.TGI, _MG, "tgi.info", coordinator=Coord.INFO),
    _r("GET", "/v1/models", "openai.models", _F.OPENAI, _B, "openai.list_models",
       coordinator=Coord.FORWARD),
    _r("GET", "/v1/models/{model}", "openai.model", _F.OPENAI, _B, "openai.get_model",
       coordinator=Coord.FORWARD),
    _r("GET", "/v2/health/live", "triton.live", _F.TRITON, _MG, "triton.health_live",
       coordinator=Coord.PROBE),
    _r("GET", "/v2/health/ready", "triton.ready", _F.TRITON, _MG, "triton.health_ready",
       coordinator=Coord.PROBE),
    _r("GET", f"{_M}/ready", "triton.model_ready", _F.TRITON, _MG, "triton.model_ready",
       coordinator=Coord.PROBE),
    _r("GET", "/v2", "triton.server_metadata", _F.TRITON, _B, "triton.server_metadata",
       coordinator=Coord.FORWARD),
    _r("GET", _M, "triton.model_metadata", _F.TRITON, _B, "triton.model_metadata",
       coordinator=Coord.FORWARD),
    _r("GET", f"{_M}/config", "triton.model_config", _F.TRITON, _B, "triton.model_config",
       coordinator=Coord.FORWARD),
    _r("GET", f"{_M}/getSlotCount", "triton.slot_count", _F.TRITON, _MG, "triton.slot_count",
       coordinator=Coord.SUM),
    _r("POST", "/v1/tokenizer", "mindie.tokenizer", _F.MINDIE, _B, "mindie_extra.tokenizer",
       coordinator=Coord.FORWARD),
    _r("POST", f"{_M}/stopInfer", "mindie.stop_infer", _F.MINDIE, _B, "mindie_extra.stop_infer",
       coordinator=Coord.STOP),
    # --- server: health, management, metrics (spec §3.6, §7) -------------------------------
    _r("GET", "/health", "server.health", _F.SERVER, _MG, "server.health",
       coordinator=Coord.FORWARD),
    _r("GET", "/health/timed", "server.health_timed", _F.SERVER, _MG, "management.timed",
       coordinator=Coord.FORWARD),
    _r("GET", "/health/timed-{n}", "server.health_timed_n", _F.SERVER, _MG, "management.timed",
       coordinator=Coord.FORWARD),
    _r("GET", "/v1/config", "server.config", _F.SERVER, _MG, "management.config",
       coordinator=Coord.FORWARD),
    _r("GET", "/metrics", "server.metrics", _F.SERVER, _MT, "metrics.prometheus",
       coordinator=Coord.MANAGE),
    _r("GET", "/metrics-json", "server.metrics_json", _F.SERVER, _MG, "metrics.json",
       coordinator=Coord.FORWARD),
    # --- PD instance side (PD spec §4-§6, §8-§9) ----------------------------------------------
    _r("GET", "/v1/status", "pd.status_v1", _F.SERVER, _MG, "pd.status_v1"),
    _r("GET", "/v2/status", "pd.status_v2", _F.SERVER, _MG, "pd.status_v2"),
    _r("POST", "/v1/role/{role}", "pd.role_v1", _F.SERVER, _MG, "pd.role_v1"),
    _r("POST", "/v2/role/{role}", "pd.role_v2", _F.SERVER, _MG, "pd.role_v2"),
    _r("POST", "/v1/pd/decode", "pd.decode", _F.SERVER, _MG, "pd_decode.decode"),
    _r("GET", "/dresult", "pd.dresult", _F.SERVER, _B, "pd_decode.dresult"),
    _r("POST", "/v1/pd/release", "pd.release", _F.SERVER, _MG, "pd.release"),
    # --- MindIE management routes we do not serve: classified, so a business listener
    # --- answers them 404 like any unknown path (spec §0.1) -----------------------------------
    _r("POST", "/stopService", "server.stop_service", _F.SERVER, _MG, None),
    _r("POST", "/v1/load_lora_adapter", "server.load_lora", _F.SERVER, _MG, None),
    _r("POST", "/v1/unload_lora_adapter", "server.unload_lora", _F.SERVER, _MG, None),
    _r("GET", "/v1/engine-server/{what}", "server.engine_server", _F.SERVER, _MG, None),
    # --- the coordinator's own status probes (PD spec §9.4) -----------------------------------
    _r("GET", "/v1/startup", "coordinator.startup", _F.COORDINATOR, _MG, None,
       coordinator=Coord.PROBE),
    _r("GET", "/v1/health", "coordinator.health", _F.COORDINATOR, _MG, None,
       coordinator=Coord.PROBE),
    _r("GET", "/v1/readiness", "coordinator.readiness", _F.COORDINATOR, _MG, None,
       coordinator=Coord.PROBE),
    # --- the coordinator's management routes (PD spec §9.4 manage_port; [I] add/remove) ---
    _r("GET", "/v1/instances", "coordinator.instances", _F.COORDINATOR, _MG, None,
       coordinator=Coord.MANAGE),
    _r("POST", "/v1/instances/refresh", "coordinator.instances_refresh", _F.COORDINATOR, _MG,
       None, coordinator=Coord.MANAGE),
    _r("POST", "/v1/instances/add", "coordinator.instances_add", _F.COORDINATOR, _MG, None,
       coordinator=Coord.MANAGE),
    _r("POST", "/v1/instances/remove", "coordinator.instances_remove", _F.COORDINATOR, _MG,
       None, coordinator=Coord.MANAGE),
    _r("POST", "/v1/instances/offline", "coordinator.instances_offline", _F.COORDINATOR, _MG,
       None, coordinator=Coord.MANAGE),
    _r("POST", "/v1/instances/online", "coordinator.instances_online", _F.COORDINATOR, _MG,
       None, coordinator=Coord.MANAGE),
    _r("GET", "/v1/coordinator_info", "coordinator.info", _F.COORDINATOR, _MG, None,
       coordinator=Coord.MANAGE),
)

BY_NAME: dict[str, Route] = {r.name: r for r in ROUTES}
assert len(BY_NAME) == len(ROUTES), "route names must be unique"
#: the rows an instance serves
SERVED: tuple[Route, ...] = tuple(r for r in ROUTES if r.handler is not None)
#: the inference rows
INFERENCE: tuple[Route, ...] = tuple(r for r in ROUTES if r.inference)
_EXACT: dict[tuple[str, str], Route] = {
    (r.method, r.path): r for r in ROUTES if "{" not in r.path}
_PATTERNS: tuple[Route, ...] = tuple(r for r in ROUTES if "{" in r.path)


def match(method: str, path: str) -> Route | None:
    """The row for ``method path`` (a concrete path), or None."""
    route = _EXACT.get((method, path))
    if route is not None:
        return route
    for r in _PATTERNS:
        if r.method == method and r.regex.fullmatch(path):
            return r
    return None


def inference_route(method: str, path: str) -> Route | None:
    """The inference row for ``method path``, or None (not an inference call)."""
    route = match(method, path)
    return route if route is not None and route.inference else None


def plane_of(path: str) -> Plane:
    """The plane that serves ``path`` whatever its method (spec §0.1); unknown paths are
    business."""
    for method in ("GET", "POST"):
        route = match(method, path)
        if route is not None:
            return route.plane
    return Plane.BUSINESS


def path_of(name: str, **params: str) -> str:
    """The concrete path of the route called ``name`` (``{param}`` filled from ``params``).

    Raises:
        KeyError: no such route, or a placeholder without a value.
    """
    return BY_NAME[name].path.format(**params)
