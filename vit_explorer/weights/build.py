"""Building a ViT from a converted state dict and its config: every tensor is checked against the
config first, so that the model is never larger than what the file holds; the model is built on
the meta device and takes the tensors as its parameters."""

from __future__ import annotations

import torch

from ..model.config import ViTConfig, _brief
from ..model.vit import ViT
from .checks import CheckpointError


def adopt(config: ViTConfig, state: dict[str, torch.Tensor]):
    """A ViT built on the meta device that takes ``state``'s tensors as its parameters.

    Skips the random init (~4 s for ViT-B/16 on a CPU), which the state dict would overwrite;
    returns (model, load result) so the caller can check for missing or unexpected keys.
    """
    with torch.device("meta"):
        model = ViT(config)
    return model, model.load_state_dict(state, strict=False, assign=True)


def _expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape for ``config``, from a one-block model on "meta" (no memory used)."""
    with torch.device("meta"):
        one_block = ViT(config.replace(depth=1))
    shapes = {}
    for key, value in one_block.state_dict().items():
        if key.startswith("blocks.0."):
            for index in range(config.depth):
                shapes[f"blocks.{index}.{key.removeprefix('blocks.0.')}"] = tuple(value.shape)
        else:
            shapes[key] = tuple(value.shape)
    return shapes


def build(state: dict[str, torch.Tensor], config: ViTConfig, name: str) -> ViT:
    """A ViT of ``config`` in eval mode holding ``state`` (as float32). Checked against the config
    before any model is built, so the model is no larger than the tensors the file holds."""
    expected = _expected_shapes(config)
    problems = []
    unexpected = [_brief(key)[1:-1] for key in state if key not in expected]
    if unexpected:
        problems.append(f"parameters our ViT does not have: {', '.join(unexpected[:5])}")
    missing = [key for key in expected if key not in state]
    if missing:
        problems.append(f"missing parameters: {', '.join(missing[:5])}")
    if problems:
        raise CheckpointError(f"{name} does not fit our ViT ({'; '.join(problems)})")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{name} does not fit the config: {key} has shape {tuple(state[key].shape)},"
                f" not {shape}"
            )
        if not state[key].is_floating_point():
            raise CheckpointError(f"{name}'s {key} holds {state[key].dtype} values, not weights")
    model, _ = adopt(config, {key: value.float() for key, value in state.items()})
    return model.eval()
