"""Every JSON message and header set on the PD wire between the coordinator, P and D
(spec/pd_disaggregation.md §4.1, §5.2, §5.3, §7.2; [I] where marked), typed, each encoded
and decoded here and nowhere else::

    coordinator -> P   PrefillHeaders (req-type, req-id, d-target, d-port, is-recompute)
                       + the client's headers through forward_headers()
    P -> coordinator   PrefillAnswer      {reqId, isStream, isLastResp, output, outputBytes}
    P -> D             DecodeParameters   POST /v1/pd/decode (MindIE's gRPC message, §5.2)
                       + RequestPlan      [I] its ``plan``: the engine request P planned
    D -> P             DecodeVerdict      {isValidDecodeParameters, errorMessage}
    D -> P             Release            POST /v1/pd/release {reqId}
    D -> coordinator   History / ids      the ``ids:`` bodies on /dresult (§7.2 "L,p..,o..")
    (P, D)             logprob entries    promptLogprobs, firstTokenLogprobs, origin_logprobs

The /dresult NUL framing that carries D's messages, and the ``lastBytes`` / ``outputBytes``
body (:class:`~tokenserve.pd.wire.WholeAnswer`), are :mod:`tokenserve.pd.wire`; the
recompute body, which rewrites a family's prompt field by the route table, is
:mod:`tokenserve.pd.recompute` (built on :class:`History` and the logprob codec here).

Decoding: a value that is not the JSON its type says (not JSON, not an object, a required
key missing, a value of another type) raises :class:`WireError` (a ``ValueError``) naming
the key. A ``null`` value counts as an absent key. [I] Unknown keys are ignored, not kept:
a newer peer may add a field during a rolling upgrade (MindIE's protobuf messages behave
the same), and a re-encoded message carries only the fields known here.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenserve.messages import TokenLogprob
from tokenserve.pd.wire import WholeAnswer
from tokenserve.sampling_params import ConstraintKind, SamplingParams, StructuredOutput

# ---------------------------------------------------------------------- headers (§4.1)

#: §4.1: the header names the coordinator sets on a request to P.
REQ_TYPE, REQ_ID, D_TARGET, D_PORT, IS_RECOMPUTE = (
    "req-type", "req-id", "d-target", "d-port", "is-recompute")
#: §4.1: the headers the coordinator owns; a client's values are never forwarded.
PD_HEADERS = frozenset({REQ_TYPE, REQ_ID, D_TARGET, D_PORT, IS_RECOMPUTE})
#: RFC 9110 §7.6.1 hop-by-hop fields, plus what an HTTP client sets itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
    "host", "content-length", "expect",
})
#: §4.2: the longest ``req-id`` P accepts (characters).
MAX_REQ_ID = 1024
_HEX = frozenset("0123456789abcdefABCDEF")


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers a request carries on to the next hop (coordinator -> P,
    §4.1; P -> D in :class:`DecodeParameters`): all but the hop-by-hop ones (and those
    the ``Connection`` header names) and the PD headers."""
    named = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    drop = HOP_BY_HOP | PD_HEADERS | named
    return {k: v for k, v in headers.items() if k.lower() not in drop}


class WireError(ValueError):
    """A PD message that is not what its type says; the text names the key."""


@dataclass(frozen=True)
class PrefillHeaders:
    """The PD headers of a request to P (§4.1).

    Attributes:
        req_id: the coordinator's request id (hex digits, at most :data:`MAX_REQ_ID`).
        d_target: D's ``ip[;inter-comm port]``.
        d_port: D's HTTP business port (set by the coordinator, ignored by P); None:
            absent.
        recompute: ``is-recompute: true`` (a resubmission, §7.3).
    """

    req_id: str
    d_target: str
    d_port: str | None = None
    recompute: bool = False

    def encode(self) -> dict[str, str]:
        """The header fields (``is-recompute`` only when true, as MindIE's Motor)."""
        out = {REQ_TYPE: "prefill", REQ_ID: self.req_id, D_TARGET: self.d_target}
        if self.d_port is not None:
            out[D_PORT] = self.d_port
        if self.recompute:
            out[IS_RECOMPUTE] = "true"
        return out

    @staticmethod
    def decode(headers: Mapping[str, str]) -> PrefillHeaders:
        """§4.2 checks 3 to 7 in the spec's order (P checks its role before).

        Raises:
            WireError: the first failing check, with the spec's text (P answers 400).
        """
        req_type, req_id, target = (headers.get(REQ_TYPE), headers.get(REQ_ID),
                                    headers.get(D_TARGET))
        if req_type is None or req_id is None or target is None:
            raise WireError("DMI request must have req-type, req-id, d-target headers")
        if not req_id or not set(req_id) <= _HEX:
            raise WireError("Invalid req-id, the character of req-id should be hex char "
                            f"[0-9, a-f, A-F], but got {req_id}")
        if len(req_id) > MAX_REQ_ID:
            raise WireError(f"The length of req-id cannot exceed {MAX_REQ_ID}")
        if req_type != "prefill":
            raise WireError(f"Parameter req-type must be prefill but got {req_type}")
        if not _is_ip(target.partition(";")[0]):
            raise WireError("Parameter d-target must be an IPv4 address")
        recompute = headers.get(IS_RECOMPUTE)
        if recompute not in (None, "true", "false"):
            raise WireError("Parameter is-recompute is an optional parameter. When it is "
                            "set, it must be true or false.")
        return PrefillHeaders(req_id, target, headers.get(D_PORT), recompute == "true")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- field readers

_REQUIRED: Any = object()


def _load(raw: bytes | str, what: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"{what} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{what} must be a JSON object")
    return obj


def _get(obj: Mapping[str, Any], key: str, kind: type, what: str,
         default: Any = _REQUIRED) -> Any:
    """``obj[key]``, a ``kind`` (a ``bool`` is not an ``int`` here); ``default`` when
    absent or null.

    Raises:
        WireError: absent without a default, or of another type."""
    value = obj.get(key)
    if value is None:
        if default is _REQUIRED:
            raise WireError(f"{key} is missing")
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise WireError(f"{key} must be {what}, got {type(value).__name__}")
    return value


def _id_list(value: Any, key: str) -> tuple[int, ...]:
    """A JSON list of token (or block) ids.

    Raises:
        WireError: not a list of non-negative integers."""
    # C-level passes (a prompt's ids are thousands on D's hand-off path); a bool's type
    # is not int
    if not isinstance(value, list) or (value and (set(map(type, value)) != {int}
                                                  or min(value) < 0)):
        raise WireError(f"{key} must be a list of non-negative integers")
    return tuple(value)


def b64_text(data: bytes) -> str:
    """``data`` as base64 text (the [I] binary fields: ``bodyB64``, ``generatorState``,
    ``origin_binary``)."""
    return base64.b64encode(data).decode()


def b64_bytes(value: Any, key: str) -> bytes:
    """The inverse of :func:`b64_text` for the value of ``key``.

    Raises:
        WireError: not a base64 string."""
    if not isinstance(value, str):
        raise WireError(f"{key} must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"bad {key}: {exc}") from None


# ---------------------------------------------------------------------- logprob entries


def encode_logprobs(entries: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
    """[I] ``promptLogprobs``, ``firstTokenLogprobs`` and ``origin_logprobs``: per token
    null (the prompt's first) or ``[token_id, logprob, rank, [[id, logprob], ...]]``
    (natural log); None when there are none. JSON floats round-trip exactly, so D answers
    the bits P computed."""
    if entries is None:
        return None
    return [None if e is None else [e.token_id, e.logprob, e.rank, [list(t) for t in e.top]]
            for e in entries]


def decode_logprobs(value: Any, key: str, *, nulls: bool = True
                    ) -> tuple[TokenLogprob | None, ...] | None:
    """The inverse of :func:`encode_logprobs` for the value of ``key``; None for null.

    Raises:
        WireError: a malformed entry, or a null entry when ``nulls`` is False (only a
            prompt's first token has none).
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise WireError(f"bad {key}: not a list")
    try:
        return tuple(_logprob(e, nulls) for e in value)
    except (TypeError, IndexError, ValueError) as exc:
        raise WireError(f"bad {key}: {exc}") from None


def _logprob(e: Any, nulls: bool) -> TokenLogprob | None:
    if e is None:
        if not nulls:
            raise ValueError("a null entry")
        return None
    token, lp, rank, top = e
    if not (type(token) is int and type(rank) is int and _number(lp)):
        raise ValueError(f"entry {e!r}")
    pairs = []
    for t, tlp in top:
        if not (type(t) is int and _number(tlp)):
            raise ValueError(f"top entry {[t, tlp]!r}")
        pairs.append((t, float(tlp)))
    return TokenLogprob(token, float(lp), tuple(pairs), rank)


def _number(x: Any) -> bool:
    return type(x) in (int, float)


# ---------------------------------------------------------------------- history (§7.2)


def encode_ids(ids: Sequence[int]) -> str:
    """Token ids as comma-separated decimals (an ``ids:`` body that appends)."""
    return ",".join(map(str, ids))


def decode_ids(text: str) -> tuple[int, ...]:
    """The inverse of :func:`encode_ids`.

    Raises:
        WireError: an item that is not a non-negative decimal integer."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise WireError(f"token ids must be comma-separated integers: {text[:80]!r}") from None
    if any(x < 0 for x in ids):
        raise WireError("token ids must be non-negative")
    return ids


@dataclass(frozen=True)
class History:
    """A request's token history (§7.2): the prompt's ids, then the output ids the client
    has been sent. Wire form ``"L,p1,..,pL,o1,..,oK"`` (a recompute body's prompt field,
    D's first ``ids:`` message), or Triton's list ``[L, p.., o..]``.

    Raises:
        ValueError: an empty prompt (on construction).
    """

    prompt: tuple[int, ...]
    outputs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a history needs at least one prompt token")

    def numbers(self) -> list[int]:
        """``[L, p.., o..]``."""
        return [len(self.prompt), *self.prompt, *self.outputs]

    def encode(self) -> str:
        """``"L,p1,..,pL,o1,..,oK"``."""
        return encode_ids(self.numbers())

    @staticmethod
    def decode(value: Any) -> History:
        """From ``"L,p..,o.."`` or ``[L, p.., o..]``.

        Raises:
            WireError: not that shape (non-integers, negatives, L < 1 or longer than
                the list).
        """
        shape = "recompute prompt must be 'L,p1,...,pL,o1,...'"
        if isinstance(value, str):
            try:
                nums = decode_ids(value)
            except WireError:
                raise WireError(shape) from None
        elif isinstance(value, list) and all(type(x) is int and x >= 0 for x in value):
            nums = tuple(value)
        else:
            raise WireError(shape)
        if not nums or not 1 <= nums[0] <= len(nums) - 1:
            raise WireError(f"{shape} with 1 <= L")
        n = nums[0]
        return History(nums[1:1 + n], nums[1 + n:])


# ---------------------------------------------------------------------- P's plan ([I])

#: [I] ``plan.sampling``: every :class:`SamplingParams` field but ``seed``, under its
#: own name, and the JSON it travels as (``ids``: non-negative integers, ``strs``: strings,
#: ``int?``: an integer or null, ``structured``: ``{"kind", "value"}`` or null).
SAMPLING_FIELDS: dict[str, str] = {
    "max_new_tokens": "int", "temperature": "float", "top_k": "int", "top_p": "float",
    "repetition_penalty": "float", "do_sample": "bool", "ignore_eos": "bool",
    "stop_token_ids": "ids", "skip_special_tokens": "bool", "stop": "strs",
    "include_stop_str_in_output": "bool", "presence_penalty": "float",
    "frequency_penalty": "float", "logprobs": "int?", "min_p": "float",
    "speculative": "bool", "structured": "structured", "prompt_logprobs": "int?",
    "keep_special_token_ids": "ids",
}


@dataclass(frozen=True)
class RequestPlan:
    """[I] ``plan`` of :class:`DecodeParameters`: the engine request P planned from the
    client's body, so D submits it as it is, without templating or tokenizing the prompt
    again (issue 40). Its prompt is ``tokens``, its seed ``seed``; wire form
    ``{"sampling": {<SAMPLING_FIELDS>}, "priority", "timeoutS"}``.

    Attributes:
        params: the sampling and stopping parameters (stop strings and ids, the
            structured-output constraint, logprobs, ``max_new_tokens``).
        priority: 1 (most urgent) .. 5.
        timeout_s: the client's timeout, seconds; None: none.
    """

    params: SamplingParams
    priority: int = 5
    timeout_s: float | None = None

    def encode(self) -> dict[str, Any]:
        sampling: dict[str, Any] = {}
        for name, kind in SAMPLING_FIELDS.items():
            value = getattr(self.params, name)
            if kind == "structured" and value is not None:
                value = {"kind": value.kind.value, "value": value.value}
            elif kind in ("ids", "strs"):
                value = list(value)
            sampling[name] = value
        return {"sampling": sampling, "priority": self.priority, "timeoutS": self.timeout_s}

    @staticmethod
    def decode(value: Any, seed: int | None) -> RequestPlan:
        """The inverse of :meth:`encode`, its parameters seeded with ``seed`` (None: a
        fresh one). An absent field takes its default.

        Raises:
            WireError: a malformed plan or a parameter out of range.
        """
        if not isinstance(value, dict):
            raise WireError("plan must be an object")
        raw = _get(value, "sampling", dict, "an object")
        fields: dict[str, Any] = {} if seed is None else {"seed": seed}
        for name, kind in SAMPLING_FIELDS.items():
            if raw.get(name) is not None:
                fields[name] = _sampling_field(raw[name], kind, f"plan.sampling.{name}")
        timeout = value.get("timeoutS")
        if timeout is not None and not _number(timeout):
            raise WireError("timeoutS must be a number")
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            raise WireError(f"plan.sampling: {exc}") from None
        return RequestPlan(params, _get(value, "priority", int, "an integer", 5),
                           None if timeout is None else float(timeout))


def _sampling_field(v: Any, kind: str, key: str) -> Any:
    """One ``plan.sampling`` value (not null) of ``kind`` (:data:`SAMPLING_FIELDS`).

    Raises:
        WireError: not that kind."""
    if kind in ("int", "int?") and type(v) is int:
        return v
    if kind == "float" and _number(v):
        return float(v)
    if kind == "bool" and type(v) is bool:
        return v
    if kind == "ids":
        return _id_list(v, key)
    if kind == "strs" and isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    if kind == "structured" and isinstance(v, dict) and isinstance(v.get("value"), str) \
            and v.get("kind") in {k.value for k in ConstraintKind}:
        return StructuredOutput(ConstraintKind(v["kind"]), v["value"])
    raise WireError(f"{key} must be {kind}, got {type(v).__name__}")


# ---------------------------------------------------------------------- P -> D (§5.2)


@dataclass(frozen=True)
class DecodeParameters:
    """What P hands D with a request (``POST /v1/pd/decode``): MindIE's gRPC
    ``DecodeParameters`` (§5.2; its field names where one exists) plus what D needs to
    run the same family handler on the client's request ([I]).

    Attributes:
        req_id: ``reqId``, the coordinator's request id.
        tokens: ``tokens``, the prompt's ids (a recompute: its history's prompt).
        first_token: ``firstToken``, every output id so far (a recompute's history's,
            then P's).
        path: [I] the client's request path (chooses D's handler).
        block_table: ``blockTable``, P's KV block ids, one list per DP rank (at least one).
        p_node_addr: ``pNodeAddr``, P's ``ip;inter-comm port`` (D calls its release there).
        num_computed: [I] tokens whose K/V D pulls instead of computing.
        body: the client's body bytes; on the wire [I] ``body`` (UTF-8 text) or, when
            not UTF-8 (Triton's binary tensors, spec/interfaces.md §6.4), ``bodyB64``.
        method, query, headers: [I] the client's method, query string and headers
            (:func:`forward_headers` of P's request).
        generator_state: [I] ``torch.Generator`` state after P's last draw (base64 on the
            wire); None: none (greedy, or D starts a fresh one from the seed).
        seed: [I] the seed P drew (or the client gave); None: none.
        prefix_cached_tokens: ``metrics.prefixCachedTokenNums``, prompt tokens P found in
            its prefix cache.
        kv: [I] P's KV regions, one per tensor-parallel rank in rank order (each
            :meth:`tokenserve.pd.kv_transfer.KvRegion.to_dict`), so their count is P's
            ``worldSize``; on the wire one region (``worldSize`` 1) is the object itself,
            as before, several a list of objects. None: P has no transfer engine. Checked
            when D pulls (D refuses a count other than its own world size).
        post_single_text: ``postsingletext``, the text P rendered.
        prefill_token_num: ``prefillTokenNum``, tokens P generated.
        pre_output_token_num: ``preOutputTokenNum``, tokens the client had before P.
        e2e_start_time_us: ``e2eStartTime``, microseconds since the epoch.
        prompt_logprobs: [I] ``promptLogprobs`` (:func:`encode_logprobs`), when asked.
        first_token_logprobs: [I] ``firstTokenLogprobs``, one entry per ``first_token``
            (no null), when asked.
        plan: [I] the engine request P planned (:class:`RequestPlan`); None: D plans it
            from ``body`` itself (a P without it, during a rolling upgrade).
    """

    req_id: str
    tokens: tuple[int, ...]
    first_token: tuple[int, ...]
    path: str
    block_table: tuple[tuple[int, ...], ...]
    p_node_addr: str
    num_computed: int
    body: bytes
    method: str = "POST"
    query: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    generator_state: bytes | None = None
    seed: int | None = None
    prefix_cached_tokens: int = 0
    kv: tuple[Mapping[str, Any], ...] | None = None
    post_single_text: str = ""
    prefill_token_num: int = 0
    pre_output_token_num: int = 0
    e2e_start_time_us: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    first_token_logprobs: tuple[TokenLogprob, ...] | None = None
    plan: RequestPlan | None = None

    def encode(self) -> bytes:
        """The JSON body of ``POST /v1/pd/decode``."""
        try:
            body: dict[str, str] = {"body": self.body.decode("utf-8")}
        except UnicodeDecodeError:
            body = {"bodyB64": b64_text(self.body)}
        return orjson.dumps({
            "reqId": self.req_id,
            "tokens": list(self.tokens),
            "firstToken": list(self.first_token),
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "headers": dict(self.headers),
            **body,
            "generatorState": (b64_text(self.generator_state)
                               if self.generator_state is not None else None),
            "numComputed": self.num_computed,
            "seed": self.seed,
            "prefixCachedTokenNums": self.prefix_cached_tokens,
            "blockTable": [list(b) for b in self.block_table],
            "pNodeAddr": self.p_node_addr,
            "kv": _encode_regions(self.kv),
            "postsingletext": self.post_single_text,
            "prefillTokenNum": self.prefill_token_num,
            "preOutputTokenNum": self.pre_output_token_num,
            "e2eStartTime": self.e2e_start_time_us,
            "promptLogprobs": encode_logprobs(self.prompt_logprobs),
            "firstTokenLogprobs": encode_logprobs(self.first_token_logprobs),
            "plan": self.plan.encode() if self.plan is not None else None,
        })

    @staticmethod
    def decode(raw: bytes) -> DecodeParameters:
        """The inverse of :meth:`encode` (module docstring for nulls and unknown keys).

        Raises:
            WireError: a malformed body.
        """
        p = _load(raw, "DecodeParameters")
        tables = _get(p, "blockTable", list, "a list of block id lists")
        if not tables:
            raise WireError("blockTable must hold at least one list")
        block_table = tuple(_id_list(t, "blockTable") for t in tables)
        b64 = p.get("bodyB64")
        if b64 is not None:
            body = b64_bytes(b64, "bodyB64")
        else:
            body = _get(p, "body", str, "a string").encode()
        headers = _get(p, "headers", dict, "an object", {})
        if not all(isinstance(v, str) for v in headers.values()):
            raise WireError("headers must map names to strings")
        state = p.get("generatorState")
        first_lp = decode_logprobs(p.get("firstTokenLogprobs"), "firstTokenLogprobs",
                                   nulls=False)
        seed = _get(p, "seed", int, "an integer", None)
        plan = p.get("plan")
        return DecodeParameters(
            req_id=_get(p, "reqId", str, "a string"),
            tokens=_id_list(_get(p, "tokens", list, "a list"), "tokens"),
            first_token=_id_list(_get(p, "firstToken", list, "a list"), "firstToken"),
            path=_get(p, "path", str, "a string"),
            block_table=block_table,
            p_node_addr=_get(p, "pNodeAddr", str, "a string"),
            num_computed=_get(p, "numComputed", int, "an integer"),
            body=body,
            method=_get(p, "method", str, "a string", "POST"),
            query=_get(p, "query", str, "a string", ""),
            headers=headers,
            generator_state=b64_bytes(state, "generatorState") if state is not None else None,
            seed=seed,
            prefix_cached_tokens=_get(p, "prefixCachedTokenNums", int, "an integer", 0),
            kv=_decode_regions(p.get("kv")),
            post_single_text=_get(p, "postsingletext", str, "a string", ""),
            prefill_token_num=_get(p, "prefillTokenNum", int, "an integer", 0),
            pre_output_token_num=_get(p, "preOutputTokenNum", int, "an integer", 0),
            e2e_start_time_us=_get(p, "e2eStartTime", int, "an integer", 0),
            prompt_logprobs=decode_logprobs(p.get("promptLogprobs"), "promptLogprobs"),
            first_token_logprobs=first_lp,  # type: ignore[arg-type]  # no nulls
            plan=RequestPlan.decode(plan, seed) if plan is not None else None,
        )


def _encode_regions(kv: tuple[Mapping[str, Any], ...] | None) -> Any:
    """``DecodeParameters.kv`` on the wire: one region as the object (world size 1, the
    format before tensor parallelism), several as a list."""
    if kv is None:
        return None
    regions = [dict(r) for r in kv]
    return regions[0] if len(regions) == 1 else regions


def _decode_regions(v: Any) -> tuple[Mapping[str, Any], ...] | None:
    """The inverse of :func:`_encode_regions` (the regions' own keys are checked where D
    pulls: ``KvRegion.from_dict``)."""
    if v is None:
        return None
    if isinstance(v, dict):
        return (v,)
    if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
        return tuple(v)
    raise WireError("kv must be an object or a non-empty list of objects (one per rank), "
                    f"got {type(v).__name__}")


@dataclass(frozen=True)
class DecodeVerdict:
    """D's answer to :class:`DecodeParameters` (§5.2 ``DecodeRequestResponse``):
    ``{"isValidDecodeParameters", "errorMessage"}``, status 200 either way."""

    valid: bool
    error_message: str = ""

    def encode(self) -> bytes:
        return orjson.dumps({"isValidDecodeParameters": self.valid,
                             "errorMessage": self.error_message})

    @staticmethod
    def decode(raw: bytes) -> DecodeVerdict:
        """Raises:
            WireError: a malformed body."""
        obj = _load(raw, "D's answer")
        return DecodeVerdict(_get(obj, "isValidDecodeParameters", bool, "a boolean"),
                             _get(obj, "errorMessage", str, "a string", ""))


@dataclass(frozen=True)
class Release:
    """``POST /v1/pd/release`` ``{"reqId"}`` (§8.1 ``ReleaseKVCacheChannel``): D has
    pulled the request's blocks (or failed to), P may free them."""

    req_id: str

    def encode(self) -> bytes:
        return orjson.dumps({"reqId": self.req_id})

    @staticmethod
    def decode(raw: bytes) -> Release:
        """Raises:
            WireError: a malformed body (``reqId must be a string`` when it lacks one)."""
        obj = _load(raw, "release body")
        rid = obj.get("reqId")
        if not isinstance(rid, str):
            raise WireError("reqId must be a string")
        return Release(rid)


# ---------------------------------------------------------------------- P -> coordinator


@dataclass(frozen=True)
class PrefillAnswer:
    """P's 200 answer to the coordinator (§5.3), keys in the spec's order::

        stream, continues on D      {"reqId","isStream":true,"isLastResp":false,"output"}
        stream, finished on P       {"reqId","isStream":true,"isLastResp":true,"output"}
        non-stream, continues on D  {"reqId","isStream":false}
        non-stream, finished on P   {"reqId","isStream":false,"isLastResp":true,"output"
                                     [,"outputBytes"]}

    Attributes:
        req_id: the coordinator's request id.
        is_stream: whether the client streams.
        is_last: ``isLastResp``; None: absent.
        output: the bytes a mixed server would have written, as text; None: absent.
        output_bytes: [I] ``outputBytes``, a whole answer that is not JSON text
            (:class:`~tokenserve.pd.wire.WholeAnswer`); None: absent.
    """

    req_id: str
    is_stream: bool
    is_last: bool | None = None
    output: str | None = None
    output_bytes: WholeAnswer | None = None

    @staticmethod
    def of(req_id: str, is_stream: bool, output: str, *, last: bool,
           whole: WholeAnswer | None = None) -> PrefillAnswer:
        """The §5.3 answer for a request that continues on D (``last`` False) or ended
        on P; ``whole`` only with a non-stream ``last``."""
        if not is_stream and not last:
            return PrefillAnswer(req_id, False)
        return PrefillAnswer(req_id, is_stream, last, output,
                             whole if last and not is_stream else None)

    def encode(self) -> bytes:
        body: dict[str, Any] = {"reqId": self.req_id, "isStream": self.is_stream}
        if self.is_last is not None:
            body["isLastResp"] = self.is_last
        if self.output is not None:
            body["output"] = self.output
        if self.output_bytes is not None:
            body["outputBytes"] = self.output_bytes.encode()
        return orjson.dumps(body)

    @staticmethod
    def decode(raw: bytes) -> PrefillAnswer:
        """Raises:
            WireError: a malformed answer (which keys a case needs is the
                coordinator's check, §5.3)."""
        obj = _load(raw, "P's answer")
        whole = _get(obj, "outputBytes", str, "a string", None)
        try:
            output_bytes = WholeAnswer.decode(whole) if whole is not None else None
        except ValueError as exc:
            raise WireError(f"outputBytes: {exc}") from None
        return PrefillAnswer(_get(obj, "reqId", str, "a string"),
                             _get(obj, "isStream", bool, "a boolean"),
                             _get(obj, "isLastResp", bool, "a boolean", None),
                             _get(obj, "output", str, "a string", None), output_bytes)
