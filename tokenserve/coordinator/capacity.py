"""A PD cluster's slots, the one number behind Triton's ``getSlotCount`` ``total_slots``
and TGI's ``/info`` ``max_concurrent_requests`` on the coordinator (issue 40; spec
interfaces.md §3.5, §6.2; config.md ``maxBatchSize``). Pure: the coordinator
(:mod:`tokenserve.coordinator.forward`) asks the instances, these functions say which and
how their answers combine.

Which instances: the decode instances (the ``decode`` list: D, or a flex instance acting
as D), summed. [I] The reasoning, from the spec:

- Both fields are MindIE's ``maxBatchSize`` (config.md: "max sequences in a decode
  batch; also ``total_slots`` / TGI ``max_concurrent_requests``"; interfaces.md §3.5,
  §6.2), and ``free_slots`` / ``availSlotsNum`` are ``maxBatchSize`` minus the requests
  processing (pd_disaggregation.md §9.1): a slot is a place in the decode batch.
- In PD a request holds a slot on P only from its arrival to its hand-off (prefill, then
  until D has pulled its KV: pd_disaggregation.md §2 steps 4-6), and a slot on D for its
  whole decode, every token after the first (§2 step 7). So every request the cluster
  serves at once holds one D slot, and P's slots bound only how many prefills run at
  once: the cluster can serve as many requests at once as its decode instances'
  ``maxBatchSize`` add up to, and no more. The coordinator's own D choice charges each
  request to one D (§3.4).
- Summing over P and D (what getSlotCount did before issue 40) counts each request's
  capacity twice (once on P for its prefill, once on D), so a client that sizes its
  concurrency from ``total_slots`` would send up to twice what D can decode at once;
  one P's value (what ``/info`` forwarded before) ignores every D, and is wrong as soon
  as the Ds' batch sizes differ from that P's or there are several Ds.
- ``free_slots`` and ``available_tokens_length`` (free KV blocks x block size) follow:
  a request's KV lives on D for as long as it decodes; P's blocks are freed at the
  hand-off.

A flex instance listed in both lists is counted once (through the decode list).
"""

from __future__ import annotations

from typing import Any

from tokenserve.coordinator.pool import Instance, InstancePool

#: the ``getSlotCount`` field (spec §6.2) that ``/info`` reports as
#: ``max_concurrent_requests`` (spec §3.5)
TOTAL_SLOTS = "total_slots"
MAX_CONCURRENT = "max_concurrent_requests"


def slot_instances(pool: InstancePool) -> list[Instance]:
    """The instances whose slots are the cluster's: every usable decode instance."""
    return [d for d in pool.decode if d.usable()]


def sum_fields(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The instances' ``getSlotCount`` answers as the cluster's: every numeric field
    summed (bools are not numbers here), any other field as the first answer has it."""
    total: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            else:
                total.setdefault(key, value)
    return total


def with_cluster_slots(info: dict[str, Any], slots: dict[str, Any]) -> dict[str, Any]:
    """A P's ``/info`` answer with ``max_concurrent_requests`` = the cluster's
    ``total_slots`` (``slots``: :func:`sum_fields` of the decode instances' answers)."""
    return {**info, MAX_CONCURRENT: slots[TOTAL_SLOTS]}


def served_model(info: dict[str, Any]) -> str | None:
    """The model id in a ``/info`` answer (``models[0].model_id``), or None."""
    models = info.get("models")
    if isinstance(models, list) and models and isinstance(models[0], dict):
        model = models[0].get("model_id")
        return model if isinstance(model, str) and model else None
    return None
