"""Structured output: constraints (``sampling_params.StructuredOutput``) compiled with
llguidance and enforced as token masks on the fp32 logits.

compiler.py   StructuredOutput -> CompiledGrammar (pure, sync): kind -> llguidance
              grammar, bounds (size, parser limits, time), LRU cache per tokenizer
matcher.py    GrammarMatcher (one per request, on the model thread) and the batch's
              bitmask: fill for the constrained rows only, apply to fp32 logits
service.py    the async shell: compiles in a worker thread off the event loop, with a
              time bound

Why llguidance and not xgrammar: bench/README.md "Structured output" (measured).
"""
