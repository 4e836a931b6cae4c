"""Our own checkpoint format: one ``.safetensors`` file whose metadata holds the ViTConfig (class
names included) and any string entries the writer added (how the model was trained)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from safetensors.torch import save as safetensors_bytes

from ..model.config import ViTConfig
from ..model.vit import ViT
from .checks import CheckpointError, looks_like_safetensors, safetensors_header

CONFIG_KEY = "vit_explorer.config"
# The publisher's transform (data/transforms.py), written only where it is not ours.
TRANSFORM_FIELDS = ("resize_mode", "crop_pct", "interpolation", "fill_color", "transform_library")  # safetensors metadata entry that marks a project checkpoint


def save_model(model: ViT, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write the weights and the config (class names included) to one ``.safetensors`` file.

    ``metadata`` adds string entries (e.g. how the model was trained); read them back with
    :func:`load_metadata`. The file appears atomically: a crash leaves the old file or none.
    """
    extra = dict(metadata or {})
    bad = [
        key
        for key, value in extra.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    if bad:
        raise ValueError(f"checkpoint metadata must map strings to strings (bad entries: {bad})")
    if CONFIG_KEY in extra or "format" in extra:
        raise ValueError(f"metadata keys {CONFIG_KEY!r} and 'format' are reserved")
    tensors = {
        name: value.detach().cpu().contiguous() for name, value in model.state_dict().items()
    }
    header = {"format": "pt", CONFIG_KEY: _config_json(model.config), **extra}

    path = Path(path)
    data = safetensors_bytes(tensors, metadata=header)
    # The temporary file lives in the target folder so that os.replace is an atomic rename;
    # plain open() gives it the usual permissions (safetensors' save_file makes files 0600).
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _config_json(config: ViTConfig) -> str:
    """The config as the file keeps it: normalization_source only where it is not "given" (the
    default, which the files written before it existed mean), so that those files' readers
    read ours too; likewise the input's transform where it is ours (the whole picture squeezed)."""
    fields = config.to_dict()
    defaults = ViTConfig().to_dict()
    for name in ("normalization_source", *TRANSFORM_FIELDS):
        if fields[name] == defaults[name]:
            del fields[name]
    return json.dumps(fields)


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The extra metadata :func:`save_model` stored (the config entry and 'format' left out)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    header = safetensors_header(path) if looks_like_safetensors(path) else None
    if header is None:
        raise CheckpointError(f"{path.name} is not a safetensors checkpoint, so it has no metadata")
    return {key: value for key, value in header.items() if key not in (CONFIG_KEY, "format")}


def saved_config(metadata: dict[str, str], name: str) -> dict | None:
    """The config a project file's metadata holds, as ViTConfig fields; None for any other file."""
    if CONFIG_KEY not in metadata:
        return None
    try:
        saved = ViTConfig.from_json(metadata[CONFIG_KEY])
    except (ValueError, TypeError, RecursionError) as error:
        raise CheckpointError(f"{name} has an unreadable config ({str(error)[:200]})") from None
    return saved.to_dict()
