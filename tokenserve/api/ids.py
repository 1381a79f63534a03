"""Response ids under PD (issue 22: one id per response, spec/pd_disaggregation.md §7.3).

P and D each run the family handler of one request, and a resubmission runs it again on
another P: the id a family writes into its answer (OpenAI's ``chatcmpl-<hex>``, Triton's
default ``id``) is then derived from the coordinator's ``req-id``, the same everywhere.
Pure (no engine): the coordinator uses it too, to find a request by the id its client
saw (``stopInfer``).
"""

from __future__ import annotations

import uuid

#: the namespace of :func:`derived_id` (any fixed UUID).
_NAMESPACE = uuid.UUID("6f1c9a52-8d0e-4c39-9b55-2d7e4a1f0c11")


def derived_id(req_id: str, n: int) -> str:
    """The ``n``-th (from 1) response id of the PD request ``req_id``: 32 hex digits like
    ``uuid4().hex``, a function of ``req_id`` and ``n`` only."""
    return uuid.uuid5(_NAMESPACE, f"{req_id}/{n}").hex
