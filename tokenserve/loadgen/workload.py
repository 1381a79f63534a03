"""Benchmark workloads, generated locally from the model's tokenizer (no downloads).

A prompt is a sequence of random *words*, each word one token of the vocabulary (a
lower-case alphabetic token with a leading space whose text encodes back to exactly that
token). Concatenating such words encodes back to the same ids, so a prompt has an exact
token length whether a backend sends ids (``/infer_token``) or text (``/infer``)::

    ids   [ 7412, 19077,   2731, ...]          word list: ids w with encode(" foo") == [w]
    text  " hegemon parsley isn ..."          decode(ids); encode(text) == ids (checked)

Length distributions (``--dataset``):

- ``fixed``: every request has ``input_len`` prompt tokens and ``output_len`` output tokens.
- ``uniform``: each length drawn uniformly from ``[len/2, 3*len/2]`` (integers).
- ``chat``: a long-tailed, chat-like mix: log-normal lengths (sigma 0.8) with means
  ``input_len`` / ``output_len``, clipped to ``[4, 4*len]`` - most requests short, a few long.
- ``mixed``: two populations, for head-of-line blocking studies (chunked prefill): a
  fraction ``long_fraction`` of requests has prompts uniform around ``long_input_len``,
  the rest uniform around ``input_len``; outputs uniform around ``output_len``.

- ``repeat``: input-grounded chat requests whose answers quote the prompt (repeat, correct or
  reformat a given passage: ``passages_repeat.json`` next to this module), where
  speculative decoding by prompt lookup pays; prompt lengths are those of the passages
  (``input_len`` is unused), outputs ``output_len`` tokens at most.

``shared_prefix_len`` makes the first that many tokens identical across requests (a system
prompt; exercises the prefix cache); it counts inside each request's input length.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("fixed", "uniform", "chat", "mixed", "repeat")
PASSAGES = Path(__file__).with_name("passages_repeat.json")
_WORD = re.compile(r"Ġ[a-z]{3,12}")
#: log-normal spread of the ``chat`` dataset (natural-log standard deviation)
CHAT_SIGMA = 0.8


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        index: position in the workload (0-based; warm-up requests are negative).
        prompt_ids: the prompt as token ids (exactly ``len(prompt_ids)`` tokens).
        prompt_text: the same prompt as text (encodes back to ``prompt_ids``).
        output_len: requested output tokens (``max_new_tokens``; fewer may come back when
            the backend cannot ignore EOS).
    """

    index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate (see the module docstring for the distributions)."""

    num_prompts: int
    input_len: int = 128
    output_len: int = 64
    dataset: str = "fixed"
    shared_prefix_len: int = 0
    seed: int = 0
    long_input_len: int = 2048
    long_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_prompts <= 0 or self.input_len <= 0 or self.output_len <= 0:
            raise ValueError("num_prompts, input_len and output_len must be > 0")
        if self.long_input_len <= 0 or not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_input_len must be > 0 and long_fraction in [0, 1]")
        if not 0 <= self.shared_prefix_len < self.input_len:
            raise ValueError(f"shared_prefix_len must be in [0, input_len), got "
                             f"{self.shared_prefix_len} with input_len {self.input_len}")


def word_ids(tokenizer: Any) -> list[int]:
    """Ids of vocabulary tokens that are single lower-case words with a leading space and
    encode back to themselves alone (so any sequence of them round-trips)."""
    pieces = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    out = []
    for i, piece in enumerate(pieces):
        if piece and _WORD.fullmatch(piece) \
                and tokenizer.encode(" " + piece[1:], add_special_tokens=False) == [i]:
            out.append(i)
    if len(out) < 100:
        raise ValueError(f"the tokenizer has only {len(out)} single-token words; the word-"
                         "list workload needs a GPT-2 style byte-level BPE vocabulary")
    return out


def sample_lengths(rng: np.random.Generator, n: int, mean: int, dataset: str) -> list[int]:
    """``n`` lengths around ``mean`` for ``dataset`` (each >= 1)."""
    if dataset == "fixed":
        return [mean] * n
    if dataset == "uniform":
        lo, hi = max(1, mean // 2), max(1, mean + mean // 2)
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    mu = math.log(mean) - CHAT_SIGMA**2 / 2  # so that E[lognormal] == mean
    raw = rng.lognormal(mu, CHAT_SIGMA, size=n)
    return [int(x) for x in np.clip(np.rint(raw), min(4, mean), 4 * mean)]


def build_workload(tokenizer: Any, cfg: WorkloadConfig, *, words: Sequence[int] | None = None,
                   first_index: int = 0) -> list[BenchRequest]:
    """The ``cfg.num_prompts`` requests of a workload, deterministic in ``cfg.seed``.

    Raises:
        ValueError: a generated prompt does not encode back to its ids (should not happen
            with :func:`word_ids`; checked because exact lengths are the point).
    """
    if cfg.dataset == "repeat":
        return _repeat_workload(tokenizer, cfg, first_index)
    words = list(words) if words is not None else word_ids(tokenizer)
    rng = np.random.default_rng(cfg.seed)
    if cfg.dataset == "mixed":
        in_lens = sample_lengths(rng, cfg.num_prompts, cfg.input_len, "uniform")
        long_ = sample_lengths(rng, cfg.num_prompts, cfg.long_input_len, "uniform")
        is_long = rng.random(cfg.num_prompts) < cfg.long_fraction
        in_lens = [b if pick else a for a, b, pick in zip(in_lens, long_, is_long)]
        out_lens = sample_lengths(rng, cfg.num_prompts, cfg.output_len, "uniform")
    else:
        in_lens = sample_lengths(rng, cfg.num_prompts, cfg.input_len, cfg.dataset)
        out_lens = sample_lengths(rng, cfg.num_prompts, cfg.output_len, cfg.dataset)
    prefix = [words[i] for i in rng.integers(0, len(words), size=cfg.shared_prefix_len)]
    out = []
    for k, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        n_in = max(n_in, cfg.shared_prefix_len + 1)
        tail = [words[i] for i in rng.integers(0, len(words), size=n_in - len(prefix))]
        ids = prefix + tail
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) != ids:
            raise ValueError(f"prompt {k} does not round-trip through the tokenizer")
        out.append(BenchRequest(first_index + k, tuple(ids), text, n_out))
    return out


def _repeat_workload(tokenizer: Any, cfg: WorkloadConfig,
                     first_index: int) -> list[BenchRequest]:
    """``cfg.num_prompts`` chat prompts (instruction x passage, in a seeded order, cycled)
    rendered with the model's chat template."""
    data = json.loads(PASSAGES.read_text())
    texts = [i.format(p) for i in data["instructions"] for p in data["passages"]]
    order = np.random.default_rng(cfg.seed).permutation(len(texts))
    out = []
    for k in range(cfg.num_prompts):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": texts[order[k % len(texts)]]}],
            add_generation_prompt=True)
        ids = tokenizer.encode(chat, add_special_tokens=False)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) != ids:
            raise ValueError(f"prompt {k} does not round-trip through the tokenizer")
        out.append(BenchRequest(first_index + k, tuple(ids), text, cfg.output_len))
    return out


def warmup_workload(tokenizer: Any, n: int, *, words: Sequence[int] | None = None,
                    seed: int = 12345) -> list[BenchRequest]:
    """``n`` short requests (16 in, 4 out) to run before measuring; indices are negative."""
    if n <= 0:
        return []
    reqs = build_workload(tokenizer, WorkloadConfig(n, 16, 4, seed=seed), words=words)
    return [BenchRequest(-1 - r.index, r.prompt_ids, r.prompt_text, r.output_len)
            for r in reqs]


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests: a Poisson process of
    ``request_rate`` requests/s (exponential gaps), or all at 0 when the rate is ``inf``."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 or inf, got {request_rate}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]
