"""Settings to things, at start-up: the torch device ``EngineConfig.device`` names, and
the model path ``EngineConfig.model`` names, checked before anything loads. torch is
imported inside the functions that need it, never at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



def select_device(name: str) -> torch.device:
    """Resolve ``auto|cpu|cuda|npu`` to a torch device.

    Raises:
        ValueError: the requested accelerator is not available.
    """
    import torch

    if name == "auto":
        try:
            import torch_npu

            return torch.device("npu")
        except ImportError:
            pass
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise ValueError("--device npu needs the optional torch_npu package") from exc
    return torch.device(name)


def check_model_path(path: str | None) -> None:
    """Check a model argument before anything is loaded (start-up errors in one line).

    ``None`` (the default model) passes; otherwise ``path`` must be a ``.gguf`` file or a
    Hugging Face directory: ``config.json`` naming a supported ``model_type`` and at
    least one ``*.safetensors`` file (``tokenserve.models.loader`` then checks that the
    ``model_type`` is one it serves).

    Raises:
        ValueError: the path is missing, empty, or not a model (the message says why).
    """
    import json
    from pathlib import Path

    if path is None:
        return
    if not path.strip():
        raise ValueError("model path is empty")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {p} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model path {p} is a file but not a .gguf file")
        return
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model path {p} is not a model directory: it has no config.json")
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"model path {p}: config.json is not a JSON object") from None
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model path {p} is not a model directory: its config.json has "
                         "no model_type")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model path {p} has no *.safetensors weights")
