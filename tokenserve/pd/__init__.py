"""Prefill/decode (PD) disaggregation, the instance side (spec/pd_disaggregation.md):
MindIE Server's ``dmi`` mode. The coordinator is its own program
(:mod:`tokenserve.coordinator`).

How the parts fit::

    client -> tokenserve.coordinator                   any of the five families
                 | req-type/req-id/d-target headers     (§4.1)
                 v
              P: prefill.py  -- family handler runs unchanged, writing into a capture
                 |              sink; the engine parks the request after its first token
                 |              (KvHandoff) and P POSTs our DecodeParameters (§5.2) to D
                 |              on the management plane, then answers {reqId, isStream,
                 |              isLastResp, output} (§5.3)
                 v
              D: decode.py   -- the SAME family handler runs on the client's body; the
                 |              engine adopts the request (KvAdoption), pulls P's blocks
                 |              with kv_transfer.py (Mooncake, one batched read; under
                 |              tensor parallelism every rank its own shard, rank to rank:
                 |              rank_kv.py), releases P, replays P's tokens (rendered,
                 |              not sent) and decodes; every rendered step goes out on
                 |              GET /dresult (wire.py framing, dresult_hub.py the one
                 v              stream), evictions as retry: with recompute.py's body
              coordinator relays D's bodies into the client's response

Why the family handler runs on both sides instead of a per-family "PD encoder": the bytes
P and D send are then, by construction, the bytes a mixed instance sends (the spec's
correctness bar), for all five families and their options, with no second copy of any
encoder. What makes it work is that the engine re-delivers the tokens generated elsewhere
as one ``replay`` output: the handler's own state (texts, token counts, ``first``
flags, the OpenAI role chunk) is rebuilt from it, and the sink drops what it writes.
node.py holds the instance's role, status and links (§9), and the engine as P and D use
it (``PdEngine``, api/engine_client.py). messages.py types every JSON
message and header set on this wire, the coordinator's side included (wire.py the /dresult
framing, recompute.py the recompute body).
"""
