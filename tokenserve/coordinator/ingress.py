"""What the coordinator decides about a request before any instance sees it
(spec/pd_disaggregation.md §3.1-§3.2): its family, whether it streams and its cost. (The
headers forwarded to P are :func:`tokenserve.pd.messages.forward_headers`.)

The family and stream rule of each route are the route table's
(:mod:`tokenserve.api.routes`, the server's own: ``/generate`` is vLLM when ``prompt`` is
non-null, else TGI); where a family keeps its prompt, its description's
(:mod:`tokenserve.api.families`).

The coordinator validates nothing (§3.2 rule [I] (b), unlike MindIE Motor's checks in
§3.1): every body is P's to validate, and P's non-200 answer reaches the client unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from tokenserve.api.families import FamilyDescription, describe
from tokenserve.api.routes import Family, inference_route

#: §3.2: MindIE-MS's messages, the text of the errors the coordinator makes itself (in the
#: family's error shape, :func:`tokenserve.api.errors.error_json`, rule [I] of §3.2).
NOT_READY = "MindIE-MS Coordinator is not ready"
TOO_MANY = "Too many requests"
CONNECT_P_FAILED = "Connect to p instance failed"
SEND_P_FAILED = "Send messges to p instance failed"  # sic, MindIE's spelling
RECV_P_FAILED = "Receive messages from p instance failed"
P_ERROR = "P instance error"
RETRY_FAILED = "Request retry failed"
SCHEDULE_TIMEOUT = "Request schedule timeout"
FIRST_TOKEN_TIMEOUT = "Request first token timeout"
INFER_TIMEOUT = "Request inference timeout"
TOKENIZER_TIMEOUT = "Request tokenizer timeout"


class AdmissionError(Exception):
    """A request refused by the coordinator itself (§3.2): ``status`` with MindIE-MS's
    ``message``, answered in the family's error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Ingress:
    """One admitted request.

    Attributes:
        family: ``mindie``, ``tgi``, ``vllm``, ``openai`` or ``triton``.
        stream: whether the client gets ``text/event-stream`` (§3.1).
        body: the parsed JSON body (the recompute body is built from it).
        cost: estimated prompt tokens (text: characters / ``chars_per_token``).
        prompt: the prompt as text (chat: the messages' JSON; ids: comma-separated),
            what prefix affinity hashes the start of.
    """

    family: str
    stream: bool
    body: dict[str, Any]
    cost: int
    prompt: str = ""

    @property
    def description(self) -> FamilyDescription:
        """The family's description (:mod:`tokenserve.api.families`)."""
        return describe(self.family)


def classify(path: str, raw: bytes, chars_per_token: float = 4.0) -> Ingress:
    """Family, stream flag and cost of an inference request on ``path``; never refuses.

    [I] drop-in rule (§3.2 (b)): the coordinator does not validate a body. A body that is
    not a JSON object, or lacks its prompt, is classified as well as it can be (the
    route's family, no stream) and forwarded to P, whose answer (the family's own 4xx)
    reaches the client unchanged. ``/generate`` with neither ``prompt`` nor ``inputs`` is
    TGI's (the server's error shape for it is the same for both families).

    Raises:
        ValueError: ``path`` is not an inference route (a programming error).
    """
    route = inference_route("POST", path)
    if route is None:
        raise ValueError(f"{path} is not an inference route")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        body = {}
    try:
        resolved = route.resolve(body)
    except ValueError:  # /generate with neither prompt nor inputs: P answers 422
        return Ingress(Family.TGI.value, False, body, 1)
    prompt = describe(resolved.family).prompt(body, resolved.prompt)
    text = "" if prompt is None else (
        prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode())
    return Ingress(resolved.family.value, resolved.stream, body,
                   _cost(prompt, chars_per_token), text)


def _cost(prompt: Any, chars_per_token: float) -> int:
    """Estimated prompt tokens: ids count one each, text ``len / chars_per_token``,
    chat messages the text of their contents; at least 1."""
    if isinstance(prompt, str):
        return max(1, math.ceil(len(prompt) / chars_per_token))
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
        chars = sum(len(str(m.get("content", ""))) for m in prompt)
        return max(1, math.ceil(chars / chars_per_token))
    if isinstance(prompt, list):
        return max(1, len(prompt))
    return 1

