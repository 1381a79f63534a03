"""The one description of each API family (issue 40): what the mixed server's API layer,
the PD coordinator and ``pd/`` need to know about a family, read from here instead of
comparing a family's name with a literal (a test fails if another module does).

=======  =============  ========  ==================  ==========  =====================
family   prompt         framing   error object        stream end  several sequences
         aliases /                (whole answer;                  (coordinator fan-out)
         tensor                   in a stream: framed)
=======  =============  ========  ==================  ==========  =====================
mindie   ``input_id``   SSE       MindIE's            --          --
tgi      --             SSE       MindIE's            --          --
vllm     --             NUL JSON  MindIE's            --          ``text`` list; only
                                                                  the first keeps
                                                                  ``prompt_logprobs``
openai   ``prompt``     SSE       OpenAI's + MindIE   ``[DONE]``  ``choices``, ``usage``
                                  ``error_type``
triton   ``inputs[0]``  SSE, no   MindIE's            --          --
         ``.data``      space
=======  =============  ========  ==================  ==========  =====================

What stays elsewhere: each route's own prompt field and stream rule are the route table's
(:mod:`tokenserve.api.routes`: a family has several routes, and ``POST /generate`` is
vLLM's or TGI's by the body); the bytes of one event are :mod:`tokenserve.api.framing`'s;
the functions everyone calls to write an error are :mod:`tokenserve.api.errors`'s (over
these shapes). Ids are family-independent under PD (:mod:`tokenserve.api.ids`). Pure: the
coordinator reads it too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tokenserve.api.framing import NUL_JSON, SSE, SSE_DONE, SSE_NO_SPACE, Framing
from tokenserve.api.routes import Family
from tokenserve.transport.errors import error_obj, error_type_for


def openai_error(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """The error body of every OpenAI route ([I], issue "errors in each family's own shape").

    OpenAI's ``{"error": {message, type, param, code}}``, so the ``openai`` SDK shows the
    message, plus MindIE's top-level ``error_type`` (spec §0.3) for MindIE tooling; both
    ``type`` fields carry the MindIE class of ``status`` (e.g. ``Input Validation Error``)
    and ``code`` is the status. The status codes themselves are MindIE's (spec §0.4).
    """
    kind = error_type or error_type_for(status)
    return {"error": {"message": message, "type": kind, "param": None, "code": status},
            "error_type": kind}


class Several(enum.Enum):
    """How one body asks for several sequences, and how their answers make one
    (the coordinator splits such a request: :mod:`tokenserve.coordinator.fanout`, and
    merges the parts' answers: :mod:`tokenserve.coordinator.merge`)."""

    #: OpenAI: ``n`` / ``best_of`` per prompt and a completions list of prompts; the
    #: answer's ``choices`` re-indexed, one ``id`` / ``created``, ``usage`` merged
    CHOICES = "choices"
    #: vLLM ``/generate``: ``n`` / ``best_of``; the answer's ``text`` list
    TEXTS = "texts"


ErrorObject = Callable[[int, str], dict[str, Any]]


@dataclass(frozen=True)
class FamilyDescription:
    """One API family, as every reader needs it (module table).

    Attributes:
        family: its route-table name.
        framing: how its stream puts each JSON event on the wire (and its in-stream
            error event).
        error_object: ``(status, message)`` -> its error object (a whole answer is its
            JSON; in a started stream it is framed as an event, then the stream closes).
        prompt_aliases: body fields that hold the prompt when the route's own field
            (the route table's) is absent, in order (MindIE ``input_id``: token ids).
        prompt_tensor: a body field whose first tensor's ``data`` is the prompt when
            the route's field holds no text (Triton ``inputs``).
        stream_end: the bytes that end a stream that did not fail (OpenAI ``[DONE]``).
        several: how a body asks for several sequences; None: one per request.
        first_sequence_only: body fields only the first of several sequences keeps
            (vLLM computes ``prompt_logprobs`` once).
    """

    family: Family
    framing: Framing
    error_object: ErrorObject = error_obj
    prompt_aliases: tuple[str, ...] = ()
    prompt_tensor: str | None = None
    stream_end: bytes = b""
    several: Several | None = None
    first_sequence_only: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.family.value

    def error_body(self, status: int, message: str) -> bytes:
        """A whole error answer's body (``application/json``)."""
        return orjson.dumps(self.error_object(status, message))

    def error_event(self, message: str, status: int = 500) -> bytes:
        """The event that ends a started stream on a failure."""
        return self.framing.event(self.error_object(status, message))

    def prompt(self, body: dict[str, Any], field: str) -> Any:
        """The prompt of ``body`` whose route keeps it in ``field``: that field, else an
        alias's, else (no text) the first tensor's ``data``; None when there is none."""
        prompt = body.get(field)
        for alias in self.prompt_aliases:
            if prompt is not None:
                break
            prompt = body.get(alias)
        if self.prompt_tensor is not None and not isinstance(prompt, str):
            tensors = body.get(self.prompt_tensor)
            first = tensors[0] if isinstance(tensors, list) and tensors else None
            prompt = first.get("data") if isinstance(first, dict) else None
        return prompt


#: every API family's description
FAMILIES: dict[Family, FamilyDescription] = {d.family: d for d in (
    FamilyDescription(Family.MINDIE, SSE, prompt_aliases=("input_id",)),
    FamilyDescription(Family.TGI, SSE),
    FamilyDescription(Family.VLLM, NUL_JSON, several=Several.TEXTS,
                      first_sequence_only=("prompt_logprobs",)),
    FamilyDescription(Family.OPENAI, SSE, openai_error, prompt_aliases=("prompt",),
                      stream_end=SSE_DONE, several=Several.CHOICES),
    FamilyDescription(Family.TRITON, SSE_NO_SPACE, prompt_tensor="inputs"),
)}


def describe(family: Family | str) -> FamilyDescription:
    """The description of ``family`` (a :class:`Family` or its value).

    Raises:
        ValueError: not a family's value.
        KeyError: a :class:`Family` that is no API family (``server``, ...).
    """
    return FAMILIES[Family(family)]


def answering(family: Family) -> FamilyDescription:
    """The description a route of ``family`` answers its errors by: its own, and
    MindIE's (the server's own shape) for the routes no API family defines (the server's,
    the coordinator's, ``/generate`` before its body is read)."""
    return FAMILIES.get(family, FAMILIES[Family.MINDIE])
