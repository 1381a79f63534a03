"""Typed field getters and the field parsers several API families share
(spec/interfaces.md §1.2, §1.5, §2.1).

Field rules (spec §2.1 "Type rules (all interfaces)"): a JSON ``null`` means absent;
booleans must be JSON booleans; float fields accept any JSON number; integer fields reject
floats (``5.0`` included). Every getter and parser raises ``ValueError`` with a
MindIE-style message; the family turns it into 422 (spec §0.4 steps 5-6).

Lengths of strings are counted in UTF-16 code units, as MindIE counts them (spec §1.2).
Families never import each other, so what two of them parse alike lives here,
parametrised by each family's bounds and field name (its messages stay its own).
"""

# ValueError, not TypeError, is the contract of every parser here (the family answers 422).
# ruff: noqa: TRY004

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson

from tokenserve.sampling_params import MAX_SEED

#: C ``FLT_MAX``: upper bound of MindIE's float parameters (spec §2.1).
FLT_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
#: spec §1.5 ``MAX_TOKENS_NUM``: the most prompt tokens any request may carry.
MAX_TOKENS_NUM = 1_048_576
#: spec §1.2: one stop string of a list is 1..1024 UTF-16 units, all together <= 32768
#: (vLLM §4.1, OpenAI §5.1: a lone string may use the whole total).
STOP_ITEM_MAX = 1024
STOP_TOTAL_MAX = 32768
#: spec §3.2 (TGI), §5.1 (native OpenAI): at most this many stop strings.
STOP_COUNT_MAX = 1024
#: spec §2.1, §6.3 ``timeout``: (0, 65535] seconds.
MAX_TIMEOUT_S = 65535
#: spec §4.1, §5.1: ``n`` in [1, 8192], ``best_of`` in [1, 128].
MAX_N = 8192
MAX_BEST_OF = 128
#: spec §6.3 request ``id`` (also §2.3 stopInfer).
ID_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,256}", re.ASCII)
#: spec §2.1: media item types of a multimodal prompt (OpenAI §5.1 adds ``input_audio``).
MEDIA_TYPES = ("image_url", "video_url", "audio_url")


def show(value: Any, limit: int = 64) -> str:
    """``str(value)`` cut to ``limit`` characters (plus ``...``) for an error message."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------- typed getters


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo},{'inf' if hi is None else hi}{right}"


def _check_range(
    name: str, value: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool
) -> None:
    ok = True
    if lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        interval = _interval(lo, hi, lo_open, hi_open)
        raise ValueError(f"Parameter {name} must be in {interval}, got {show(value)}.")


def get_float(
    obj: Mapping[str, Any],
    key: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    default: float | None = None,
    *,
    name: str | None = None,
) -> float | None:
    """A number field as float, checked against the interval given by ``lo``/``hi``
    (``*_open`` makes that end exclusive). Absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    name = name or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"Parameter {name} must be a number, got {show(orjson.dumps(value).decode())}."
        )
    try:
        f = float(value)
    except OverflowError:
        f = math.inf if value > 0 else -math.inf
    if math.isnan(f):
        raise ValueError(f"Parameter {name} must be a number, got {show(value)}.")
    _check_range(name, f, lo, hi, lo_open, hi_open)
    return f


def get_int(
    obj: Mapping[str, Any],
    key: str,
    lo: int | None = None,
    hi: int | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    default: int | None = None,
    *,
    name: str | None = None,
) -> int | None:
    """An integer field (floats such as ``5.0`` are rejected), checked against the
    interval. Absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    name = name or key
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"Parameter {name} must be integer, got {show(orjson.dumps(value).decode())}."
        )
    _check_range(name, value, lo, hi, lo_open, hi_open)
    return value


def get_bool(
    obj: Mapping[str, Any], key: str, default: bool | None = None, *, name: str | None = None
) -> bool | None:
    """A JSON boolean field; absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(
            f"Parameter {name or key} must be a boolean, got {show(orjson.dumps(value).decode())}."
        )
    return value


def get_str(
    obj: Mapping[str, Any], key: str, default: str | None = None, *, name: str | None = None
) -> str | None:
    """A JSON string field; absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"Parameter {name or key} must be a string.")
    return value


def get_object(obj: Mapping[str, Any], key: str, *, name: str | None = None) -> dict[str, Any]:
    """A JSON object field; absent or ``null`` -> ``{}``."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"Parameter {name or key} must be an object.")
    return value


# --------------------------------------------------------------------------- sampling


class Bounds(NamedTuple):
    """An interval for :func:`get_int` / :func:`get_float` (``get_int(p, key, *bounds)``);
    ``None`` is unbounded, ``*_open`` makes that end exclusive."""

    lo: Any = None
    hi: Any = None
    lo_open: bool = False
    hi_open: bool = False


#: spec §2.1, §3.2: ``top_k`` (0, 2^31-1] and ``top_p`` (0, 1) of the native and TGI
#: families (Triton's own ranges are in its protocol, spec §6.3).
NATIVE_TOP_K = Bounds(0, INT32_MAX, lo_open=True)
NATIVE_TOP_P = Bounds(0.0, 1.0, lo_open=True, hi_open=True)


def given(**values: Any) -> dict[str, Any]:
    """The keyword arguments whose value is not ``None`` (the fields a body set)."""
    return {key: value for key, value in values.items() if value is not None}


def parse_sampling(
    p: Mapping[str, Any],
    *,
    top_k: Bounds,
    top_p: Bounds,
    typical_p: bool = True,
    priority: bool = False,
) -> tuple[dict[str, Any], int | None]:
    """The sampling ``parameters`` the native, TGI and Triton families share (spec §2.1,
    §3.2, §6.3), checked in this order: ``temperature`` (0, FLT_MAX], ``top_k`` and
    ``top_p`` in the family's ``Bounds``, ``typical_p`` (0, 1] (validated, then ignored;
    only when ``typical_p``), ``do_sample``, ``seed`` [0, MAX_SEED],
    ``repetition_penalty`` (0, FLT_MAX], ``watermark`` (validated, then ignored),
    ``priority`` [1, 5] default 5 (only when ``priority``), ``max_new_tokens``
    (0, 2^31-1] default 20.

    ``do_sample`` [I]: an explicit value wins; when absent, sample iff ``temperature``,
    ``top_k`` or ``top_p`` was given (the TGI rule).

    Returns:
        The ``SamplingParams`` keyword arguments (``max_new_tokens``, ``do_sample`` and
        the fields given) and the priority (``None`` unless ``priority``).
    """
    temperature = get_float(p, "temperature", 0.0, FLT_MAX, lo_open=True)
    k = get_int(p, "top_k", *top_k)
    top_p_value = get_float(p, "top_p", *top_p)
    if typical_p:
        get_float(p, "typical_p", 0.0, 1.0, lo_open=True)
    do_sample = get_bool(p, "do_sample")
    seed = get_int(p, "seed", 0, MAX_SEED)
    repetition_penalty = get_float(p, "repetition_penalty", 0.0, FLT_MAX, lo_open=True)
    get_bool(p, "watermark")
    level = get_int(p, "priority", 1, 5, default=5) if priority else None
    max_new_tokens = get_int(p, "max_new_tokens", 0, INT32_MAX, lo_open=True, default=20)
    if do_sample is None:
        do_sample = temperature is not None or k is not None or top_p_value is not None
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    kwargs.update(given(temperature=temperature, top_k=k, top_p=top_p_value,
                        repetition_penalty=repetition_penalty, seed=seed))
    return kwargs, level


def choice_seed(seed: int, i: int) -> int:
    """The seed of sequence ``i`` of a request seeded ``seed`` (vLLM ``best_of``/``n``,
    OpenAI choices): ``seed + i``, wrapped into [0, MAX_SEED]."""
    return (seed + i) % (MAX_SEED + 1)


# --------------------------------------------------------------------------- ids, prompts


def check_id(value: Any) -> str:
    """A request ``id`` (spec §6.3, §2.3): a string matching ``^[a-zA-Z0-9_-]{1,256}$``."""
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError("Parameter id must match ^[a-zA-Z0-9_-]{1,256}$.")
    return value


def required(obj: Mapping[str, Any], key: str) -> Any:
    """The value of a field that must be given (not absent, not ``null``)."""
    value = obj.get(key)
    if value is None:
        raise ValueError(f"Not found {key}.")
    return value


def check_token_ids(ids: Any, vocab_size: int, name: str = "input_id") -> list[int]:
    """Validate a prompt given as token ids (spec §2.1): an array of 1..1048576 integers,
    each in [0, vocab_size).

    Raises:
        ValueError: ``Parameter <name> must be an array`` / ``must be integer`` /
            ``Data element in param <name> is invalid``.
    """
    if not isinstance(ids, list):
        raise ValueError(f"Parameter {name} must be an array")
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise ValueError(
            f"Parameter {name} must hold between 1 and {MAX_TOKENS_NUM} ids, got {len(ids)}."
        )
    if not all(type(i) is int for i in ids):
        raise ValueError(f"Parameter {name} must be integer")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(
            f"Data element in param {name} is invalid: ids must be in [0, {vocab_size})."
        )
    return ids


def parse_text_input(
    value: Any, name: str, *, media_types: tuple[str, ...] = (), max_media: int = 0
) -> str:
    """A text prompt (spec §1.5): a non-empty string, or a multimodal list whose ``text``
    items are joined. The models we serve are text-only [I]: an item whose ``type`` is in
    ``media_types`` (the native family, spec §2.1) is checked (non-null, at most
    ``max_media`` of them) and then the whole input is refused; any other non-text item is
    an unsupported element. ``name`` is the field (``inputs``, ``prompt``) in messages.
    """
    if isinstance(value, str):
        if not value:
            raise ValueError(f"Parameter {name} must not be empty.")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"Parameter {name} must be a non-empty string or a list.")
    texts: list[str] = []
    media = 0
    for item in value:
        if not isinstance(item, dict):
            raise ValueError(f"Each element of {name} must be an object.")
        kind = item.get("type")
        if kind in media_types:
            if item.get(kind) is None:
                raise ValueError(f"The {kind} of an element in {name} must not be null.")
            media += 1
            if media > max_media:
                raise ValueError(f"At most {max_media} media items are allowed in {name}.")
            continue
        if kind != "text":
            raise ValueError(f"Unsupported element type in {name}: {str(kind)[:32]}.")
        if not isinstance(item.get("text"), str):
            raise ValueError(f"The text of a text element in {name} must be a string.")
        texts.append(item["text"])
    if media:
        raise ValueError(f"Multimodal {name} are not supported by this model.")
    text = "".join(texts)
    if not text:
        raise ValueError(f"Parameter {name} must not be empty.")
    return text


# --------------------------------------------------------------------------- stopping


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units (how MindIE measures strings, spec §1.2)."""
    return len(text.encode("utf-16-le")) // 2


def parse_stop(
    value: Any,
    *,
    max_single: int | None = None,
    max_items: int | None = None,
    max_len: int = STOP_ITEM_MAX,
    max_total: int = STOP_TOTAL_MAX,
) -> tuple[str, ...]:
    """``stop`` (spec §1.2; TGI §3.2, vLLM §4.1): a string or a list of strings, each of
    1..``max_len`` UTF-16 units and ``max_total`` together. ``null`` or ``[]`` means none.

    ``max_single`` (vLLM): a lone string has its own bound, 1..``max_single`` units;
    ``None`` (TGI): a lone string is checked as a one-item list. ``max_items``: the most
    strings a list may hold (``None``: no limit). Checks run list shape, item count, item
    types, item lengths, total.
    """
    if value is None:
        return ()
    if isinstance(value, str) and max_single is not None:
        if not 0 < utf16_len(value) <= max_single:
            raise ValueError(f"Parameter stop must have 1 to {max_single} characters.")
        return (value,)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError("Parameter stop must be a string or a list of strings.")
    if max_items is not None and len(items) > max_items:
        raise ValueError(f"Parameter stop must have at most {max_items} items.")
    if not all(isinstance(s, str) for s in items):
        raise ValueError("Parameter stop must be a string or a list of strings.")
    lengths = [utf16_len(s) for s in items]
    if not all(0 < n <= max_len for n in lengths):
        raise ValueError(f"Each stop string must have 1 to {max_len} characters.")
    if sum(lengths) > max_total:
        raise ValueError(f"The stop strings must have at most {max_total} characters in total.")
    return tuple(items)


def parse_stop_token_ids(value: Any) -> tuple[int, ...]:
    """``stop_token_ids`` (spec §1.2): integers; ids outside [0, 2^31-1] are dropped, the
    rest de-duplicated and sorted. ``null`` means none."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError("Parameter stop_token_ids must be a list of integers.")
    return tuple(sorted({i for i in value if 0 <= i <= INT32_MAX}))
