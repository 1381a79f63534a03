"""The model families: one module each, found through :func:`family_for`.

A family module says how its ``config.json`` maps onto the shared decoder blocks
(:class:`~tokenserve.models.config.DecoderArch`) and how its checkpoint's tensor names map
onto the decoder's weights (:class:`~tokenserve.models.families.base.LayerWeights`); the
decoder itself (:mod:`tokenserve.models.decoder`) knows no family by name. A model type not
listed here is refused at start-up in one line naming it.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from tokenserve.models.families.base import Family

#: config.json ``model_type`` -> the module under ``tokenserve.models.families`` serving it.
MODEL_TYPES = MappingProxyType({
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "granite": "granite",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
})

#: Every model type served (the README's table of families is checked against it).
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)


def family_for(cfg: dict[str, Any]) -> Family:
    """The :class:`Family` serving a parsed ``config.json``.

    Raises:
        ValueError: ``model_type`` is not served (the message names it and lists the served
            ones).
    """
    model_type = cfg.get("model_type")
    module = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if module is None:
        raise ValueError(f"unsupported model_type {model_type!r} (architectures "
                         f"{cfg.get('architectures')}); supported: {', '.join(MODEL_TYPES)}")
    return importlib.import_module(f"tokenserve.models.families.{module}").FAMILY
