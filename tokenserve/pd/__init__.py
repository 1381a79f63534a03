"""Prefill/decode disaggregation: the coordinator, the P and D sides of the server, and
the KV hand-off between them (spec/pd_disaggregation.md)."""
