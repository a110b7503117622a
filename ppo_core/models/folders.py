"""What a model folder must hold before anything loads it (layer 2).

Models come from local ``save_pretrained`` folders only, with safetensors weights: a missing
folder, one without ``config.json`` or one holding only pickled weights is a
:class:`ModelFolderError` naming the folder and its role. A LoRA adapter folder (its
``adapter_config.json`` without a ``config.json``) passes here; ``ppo_core.models.lora``
checks it and the base it names.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "ADAPTER_CONFIG",
    "POSITION_KEYS",
    "ModelFolderError",
    "check_model_folder",
    "declared_positions",
]

ADAPTER_CONFIG = "adapter_config.json"


class ModelFolderError(FileNotFoundError):
    """A model folder is missing or is not a Hugging Face ``save_pretrained`` folder."""


def check_model_folder(path: str | Path, role: str = "model") -> Path:
    """Return ``path`` as a Path if it is a local model folder, else raise a clear error."""
    folder = Path(path)
    if not folder.exists():
        raise ModelFolderError(
            f"{role} folder {str(folder)!r} does not exist; give a local folder written by "
            "save_pretrained (models are never downloaded), or run `ppo base` to build the "
            "tiny default"
        )
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        return folder  # a LoRA adapter: ppo_core.models.lora checks it and its base
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"{role} folder {str(folder)!r} has no config.json; it is not a Hugging Face "
            "save_pretrained folder"
        )
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.safetensors.index.json")):
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt*")
        )
        found = f" (found {', '.join(pickled)}: pickle files are never loaded)" if pickled else ""
        raise ModelFolderError(
            f"{role} folder {str(folder)!r} has no safetensors weights{found}; save the model "
            "with save_pretrained(..., safe_serialization=True)"
        )
    return folder


POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
"""Where a model's ``config.json`` says how many positions it has (Llama and most families,
GPT-2, older GPT-2 configs)."""


def declared_positions(folder: str | Path) -> tuple[str, int, Path] | None:
    """``(key, positions, path of config.json)`` for the first of :data:`POSITION_KEYS` the
    folder's ``config.json`` declares as an integer; None when it declares none or cannot be
    read (loading the model names what is wrong with it)."""
    path = Path(folder) / "config.json"
    try:
        declared = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(declared, dict):
        return None
    return next(
        ((k, declared[k], path) for k in POSITION_KEYS if type(declared.get(k)) is int), None
    )
