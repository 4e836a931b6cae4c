"""Whether a downloaded file is the catalogue entry's: a safetensors header whose tensors have,
under our names, exactly the shapes the entry's architecture expects (built on the meta device,
nothing allocated); an open_clip entry's weights against both towers of its own configs, its
config and tokenizer files read as what they claim to be. Each refusal is a DownloadError
sentence."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import _brief
from ..model.vit import ViT, from_timm_eva
from . import from_huggingface, from_open_clip, from_qwen_vl, from_vlm
from .checks import CheckpointError, read_json
from .downloads import DownloadError
from .entries import entry

def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; a DownloadError if the file has no valid
    header or its size is not the header's plus the tensor data the header announces."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        start = file.read(8)
        if len(start) < 8:
            raise DownloadError("too short to be a safetensors file")
        (length,) = struct.unpack("<Q", start)
        if length > 100 * 2**20 or length > size - 8:
            raise DownloadError("not a safetensors file")
        try:
            header = json.loads(file.read(length))
            tensors = {key: value for key, value in header.items() if key != "__metadata__"}
            data_bytes = max((value["data_offsets"][1] for value in tensors.values()), default=0)
            shapes = {key: tuple(value["shape"]) for key, value in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise DownloadError("not a safetensors file") from None
    if size != 8 + length + data_bytes:
        raise DownloadError(f"truncated ({size} of {8 + length + data_bytes} bytes)")
    return shapes


def our_names(name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A file's tensor shapes under our names: timm Eva's renamed as model.from_timm_eva renames
    the tensors themselves (on the meta device, nothing allocated)."""
    if not entry(name).eva_names:
        return shapes
    try:
        with torch.device("meta"):
            renamed = from_timm_eva({key: torch.empty(shape) for key, shape in shapes.items()})
    except (KeyError, RuntimeError, ValueError):  # q and v biases that are missing or do not fit
        raise DownloadError(f"the downloaded {name} file is not the expected model (its q and v biases do not fit)") from None
    return {key: tuple(value.shape) for key, value in renamed.items()}


def expected_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The parameter shapes the entry's architecture has (built on the meta device, no memory)."""
    with torch.device("meta"):
        model = ViT(entry(name).config_without_names())
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def check_file(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` holds exactly the tensors the entry's model needs."""
    try:
        found = _header_shapes(path)
    except DownloadError as error:
        raise DownloadError(f"the downloaded {name} file is {error}") from None
    for key in entry(name).drop_keys:
        found.pop(key, None)
    found = our_names(name, found)
    expected = expected_shapes(name)
    if found != expected:
        raise DownloadError(f"the downloaded {name} file is not the expected model ({_differences(expected, found)})")


def _differences(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str:
    """What keeps ``found`` from being ``expected``, in words ("" when nothing does)."""
    missing = sorted(set(expected) - set(found))[:3]
    extra = sorted(set(found) - set(expected))[:3]
    wrong = [key for key in expected if key in found and found[key] != expected[key]][:3]
    return "; ".join(
        f"{what}: {', '.join(keys)}"
        for what, keys in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong))
        if keys
    )


@dataclass(frozen=True)
class OpenClipShapes:
    """The tensors an open_clip entry's weights file holds, from the entry's own configs: its image
    tower under our names (the entry's ViT), the projection into the shared space as
    (embed_dim, width) or None, the projection's bias where it is a timm trunk's own head (the
    Perception Encoder's, zeros), the text tower under open_clip's names, and the one-number
    scores (logit_scale; SigLIP's logit_bias)."""

    image: dict[str, tuple[int, ...]]
    projection: tuple[int, int] | None
    text: dict[str, tuple[int, ...]]
    scalars: tuple[str, ...]
    projection_bias: tuple[int] | None = None

    @property
    def numel(self) -> int:
        shapes = [*self.image.values(), *self.text.values(), *(shape for shape in (self.projection, self.projection_bias) if shape)]
        return sum(math.prod(shape) for shape in shapes) + len(self.scalars)


def _text_tower_shapes(model_cfg: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of open_clip's TextTransformer of ``model_cfg``, made on the meta device."""
    from open_clip.model import _build_text_tower

    with torch.device("meta"):
        tower = _build_text_tower(
            model_cfg["embed_dim"], dict(model_cfg["text_cfg"]), quick_gelu=bool(model_cfg.get("quick_gelu")),
        )
    return {key: tuple(value.shape) for key, value in tower.state_dict().items()}


def open_clip_shapes(name: str) -> OpenClipShapes:
    """What an open_clip entry's weights must hold (nothing allocated; imports open_clip)."""
    known = entry(name)
    model_cfg = known.open_clip_config()
    vision = model_cfg["vision_cfg"]
    width = known.config_without_names().embed_dim
    # A timm trunk's projection is its head ("none": the trunk's own output, SigLIP's); open_clip's
    # own ViT (CLIP) projects with visual.proj.
    # timm_proj null: the trunk's own classifier of embed_dim outputs (open_clip's TimmModel).
    timm_unprojected = vision.get("timm_model_name") and vision.get("timm_proj", "linear") == "none"
    trunk_head = vision.get("timm_model_name") and not vision.get("timm_proj", "linear")
    scalars = ("logit_scale", "logit_bias") if model_cfg.get("init_logit_bias") is not None else ("logit_scale",)
    return OpenClipShapes(
        image=expected_shapes(name),
        projection=None if timm_unprojected else (model_cfg["embed_dim"], width),
        text=_text_tower_shapes(model_cfg),
        scalars=scalars,
        projection_bias=(model_cfg["embed_dim"],) if trunk_head else None,
    )


def _read_tensor(path: Path, key: str, name: str) -> torch.Tensor:
    """One tensor of a file whose header was checked (safetensors reads only its bytes)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            return file.get_tensor(key)
    except (OSError, SafetensorError):
        raise DownloadError(f"the downloaded {name} file could not be read") from None


def check_open_clip_weights(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` holds exactly both towers the entry's configs make."""
    try:
        found = _header_shapes(path)
    except DownloadError as error:
        raise DownloadError(f"the downloaded {name} file is {error}") from None
    expected = open_clip_shapes(name)
    custom_text = bool(entry(name).open_clip_config().get("custom_text"))
    with torch.device("meta"):
        state = {key: torch.empty(shape) for key, shape in found.items()}
    problems = []
    try:
        image, projection = from_open_clip.image_tower(state, name)
    except (CheckpointError, RuntimeError):  # no tower of either layout, or one torch cannot reshape
        image, projection = {}, None
        problems.append("image tower: none we can read")
    else:
        if detail := _differences(expected.image, {key: tuple(value.shape) for key, value in image.items()}):
            problems.append(f"image tower {detail}")
        projection = None if projection is None else tuple(projection.shape)
        if projection != expected.projection:
            problems.append(f"image projection: {projection or 'none'} where {expected.projection or 'none'} is expected")
        bias = found.get("visual.trunk.head.bias")
        if bias != expected.projection_bias:
            problems.append(f"image projection bias: {bias or 'none'} where {expected.projection_bias or 'none'} is expected")
        elif bias is not None:  # its few numbers read now, so that a download that could never load is not kept
            try:
                from_open_clip.no_bias(_read_tensor(path, "visual.trunk.head.bias", name), name)
            except CheckpointError:
                problems.append("its image projection has a bias that is not zero")
    text = {key: tuple(value.shape) for key, value in from_open_clip.text_tower(state, custom_text).items()}
    if detail := _differences(expected.text, text):
        problems.append(f"text tower {detail}")
    scores = [key for key in expected.scalars if key not in found or math.prod(found[key]) != 1]
    if scores:
        problems.append(f"not one number: {', '.join(scores)}")
    # A CLIP's text tower is every top-level tensor but the scores (from_open_clip.text_tower).
    in_text = (lambda key: key.startswith("text.")) if custom_text else (lambda key: key not in ("logit_scale", "logit_bias"))
    others = sorted(key for key in found if not key.startswith("visual.") and key not in expected.scalars and not in_text(key))
    if others:
        problems.append(f"unexpected: {', '.join(others[:3])}")
    if problems:
        raise DownloadError(f"the downloaded {name} file is not the expected model ({'; '.join(problems)})")


def _same_text_tower(found: dict, expected: dict) -> bool:
    """Whether the model config ``found`` (a downloaded file's) makes the text tower ``expected``
    does: the same sizes and activation, then (on the meta device) the same tensors."""
    from open_clip.model import CLIPTextCfg

    try:
        text, wanted = CLIPTextCfg(**found["text_cfg"]), CLIPTextCfg(**expected["text_cfg"])
    except TypeError:  # settings open_clip does not know
        return False
    sizes = ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio")
    if any(getattr(text, size) != getattr(wanted, size) for size in sizes) or text.hf_model_name \
            or found.get("embed_dim") != expected["embed_dim"] \
            or bool(found.get("custom_text")) != bool(expected.get("custom_text")) \
            or bool(text.hf_tokenizer_name) != bool(wanted.hf_tokenizer_name):
        return False
    try:  # its sizes are the entry's: made on the meta device, it costs what the entry's does
        return _text_tower_shapes(found) == _text_tower_shapes(expected)
    except Exception:  # any other setting open_clip cannot make a tower of
        return False


def _read_json(name: str, file_name: str, path: Path):
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise DownloadError(f"the downloaded {name} {file_name} is not JSON") from None


def check_open_clip_config(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` is an open_clip config whose model_cfg makes the entry's
    text tower (vit_explorer.text makes the text tower from this file)."""
    what = f"the downloaded {name} {from_open_clip.CONFIG_FILE}"
    config = _read_json(name, from_open_clip.CONFIG_FILE, path)
    model_cfg = config.get("model_cfg") if isinstance(config, dict) else None
    if not isinstance(model_cfg, dict) or not isinstance(model_cfg.get("text_cfg"), dict) \
            or not isinstance(model_cfg.get("vision_cfg"), dict):
        raise DownloadError(f"{what} has no model_cfg with a text_cfg and a vision_cfg")
    if not _same_text_tower(model_cfg, entry(name).open_clip_config()):
        raise DownloadError(f"{what} describes another text tower than {entry(name).title}'s")
    # The text tower is then made as the entry knows it was trained: a hub config that leaves out
    # an activation flag (OpenAI's QuickGELU) must not change the tower silently.
    config["model_cfg"] = entry(name).open_clip_config()
    path.write_text(json.dumps(config), encoding="utf-8")


def check_tokenizer_file(name: str, file_name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` is a JSON object (tokenizer.json: with a model);
    vit_explorer.text reads the tokenizer itself when the text tower is loaded."""
    content = _read_json(name, file_name, path)
    if not isinstance(content, dict) or (file_name == "tokenizer.json" and not isinstance(content.get("model"), dict)):
        raise DownloadError(f"the downloaded {name} {file_name} is not a tokenizer's {file_name}")



def check_vlm_config(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` is the config of a VLM whose tower we read, its language
    model reading the layer the entry says; a Qwen-VL's every setting, as its folder reads them
    (with the preprocessor_config.json beside ``path``, fetched first), the entry's."""
    try:
        hf_config = read_json(path, "config.json", name)
        if isinstance(hf_config, dict) and from_qwen_vl.recognises(hf_config):
            _check_settings(name, from_qwen_vl.settings(path.parent, hf_config, name))
            return
        if not isinstance(hf_config, dict) or not from_vlm.is_vlm(hf_config):
            raise CheckpointError("not a vision-language model's config")
        from_vlm.tower_config(hf_config, name)
        reads = from_vlm.language_model_reads(hf_config, name)
    except CheckpointError as error:
        raise DownloadError(f"the downloaded {name} config.json is not the expected model's ({error})") from None
    expected = {key: entry(name).config.get(key) for key in reads}
    if reads != expected:
        raise DownloadError(f"the downloaded {name} config.json is not the expected model's (its language model reads {reads})")


def _check_settings(name: str, settings: dict) -> None:
    """Raise DownloadError unless the config fields a VLM folder gives are the entry's (compared
    as configs: lists and tuples alike)."""
    expected = entry(name).config_without_names()
    try:
        found = expected.replace(**settings)
    except ValueError as error:
        raise DownloadError(f"the downloaded {name} config.json is not the expected model's ({error})") from None
    for key in settings:
        if getattr(found, key) != getattr(expected, key):
            raise DownloadError(
                f"the downloaded {name} config.json and preprocessor_config.json are not the expected model's"
                f" (its {key} is {_brief(getattr(found, key))}, not {_brief(getattr(expected, key))})"
            )


def vlm_tower_keys(keys: list[str], name: str, hf_config: dict) -> tuple[str, list[str]]:
    """(the tower's prefix, the names of its tensors, a merger's with them) among a VLM's tensor
    names, under the names its family gives them (Qwen-VL's ``visual.``)."""
    if from_qwen_vl.recognises(hf_config):
        return from_vlm.tower_keys(keys, name, from_qwen_vl.PREFIXES, from_qwen_vl.PATCH_KEY)
    return from_vlm.tower_keys(keys, name)


def tower_shapes(name: str, shapes: dict[str, tuple[int, ...]], hf_config: dict) -> dict[str, tuple[int, ...]]:
    """A VLM file's tower under our names and shapes, as the VLM's ``hf_config`` names it
    (converted on the meta device, nothing allocated); a CheckpointError if it holds none."""
    prefix, keys = vlm_tower_keys(list(shapes), name, hf_config)
    with torch.device("meta"):
        state = {key.removeprefix(prefix): torch.empty(shapes[key]) for key in keys}
        if from_qwen_vl.recognises(hf_config):
            converted = from_qwen_vl.convert(state, name)
        else:
            converted, _ = from_huggingface.convert(state, from_vlm.tower_config(hf_config, name), name)
    return {key: tuple(value.shape) for key, value in converted.items()}


def check_vlm_tower(name: str, path: Path, hf_config: dict) -> None:
    """Raise DownloadError unless ``path`` holds exactly the vision tower the entry's architecture
    needs."""
    try:
        found = _header_shapes(path)
    except DownloadError as error:
        raise DownloadError(f"the downloaded {name} tower is {error}") from None
    try:
        shapes = tower_shapes(name, found, hf_config)
    except CheckpointError as error:
        raise DownloadError(f"the downloaded {name} tower is not the expected model ({error})") from None
    expected = expected_shapes(name)
    if shapes != expected:
        raise DownloadError(f"the downloaded {name} tower is not the expected model ({_differences(expected, shapes)})")
