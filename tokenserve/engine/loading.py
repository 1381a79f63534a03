"""From an :class:`EngineConfig` to a loaded :class:`CausalLM`: the steps the server and
every tensor-parallel rank take alike (so all ranks resolve the same dtype, format and
config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenserve.config.resolve import select_device
from tokenserve.config.tree import EngineConfig
from tokenserve.models.config import ModelConfig
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights, resolve_dtype, resolve_model
from tokenserve.models.tensor_parallel import TpContext
from tokenserve.ops.host_memory import returned_to_os_after_load


@dataclass(frozen=True)
class ResolvedModel:
    """``cfg`` with its ``dtype`` resolved against the model (``auto`` -> a dtype name),
    where the model lives, its config and the device."""

    cfg: EngineConfig
    asked_dtype: str
    model_dir: Path
    model_cfg: ModelConfig
    device: torch.device


def resolve(cfg: EngineConfig) -> ResolvedModel:
    """Find the model and read its config (cheap: no weights are read).

    Raises:
        ValueError: a bad model path or an unsupported architecture.
    """
    model_dir = resolve_model(cfg.model)
    resolved = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, model_dir))
    return ResolvedModel(resolved, cfg.dtype, model_dir, load_config(model_dir),
                         select_device(cfg.device))


def load_model(r: ResolvedModel, tp: TpContext | None = None) -> CausalLM:
    """The model's weights, packed for the kernels (the whole model, or ``tp``'s rank's
    part); memory the load used and no longer needs goes back to the OS.

    Raises:
        ValueError: weights the model cannot use, or (``tp``) a split it cannot make.
        KeyError: a required tensor is missing.
    """
    cfg = r.cfg
    with returned_to_os_after_load():
        return CausalLM.from_state_dict(
            r.model_cfg, load_weights(r.model_dir, cfg.torch_dtype, cfg.quantization,
                                      cfg.model, cfg.max_batch_size),
            cfg.torch_dtype, r.device, consume=True, tp=tp)
