"""Small models shared by the tests."""
import torch
from timm.models.vision_transformer import VisionTransformer

import vit_explorer as vx

VARIANTS = {
    "cls token": dict(),
    "mean pool, no class token": dict(class_token=False, global_pool="mean"),
    "registers": dict(reg_tokens=3),
    "registers, no_embed_class": dict(reg_tokens=2, no_embed_class=True),
    "layer scale": dict(init_values=0.1),
    "non-square": dict(image_size=(16, 32)),
}


def tiny_config(**changes) -> vx.ViTConfig:
    base = dict(image_size=16, patch_size=4, num_classes=5, embed_dim=32, depth=2, num_heads=4)
    return vx.ViTConfig(**{**base, **changes})


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial weights everywhere (the zero-initialised head would hide errors)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


def timm_twin(config: vx.ViTConfig) -> VisionTransformer:
    return VisionTransformer(
        img_size=config.img_size,
        patch_size=config.patch_size,
        num_classes=config.num_classes,
        embed_dim=config.embed_dim,
        depth=config.depth,
        num_heads=config.num_heads,
        class_token=config.class_token,
        global_pool="token" if config.global_pool == "cls" else "avg",
        reg_tokens=config.reg_tokens,
        no_embed_class=config.no_embed_class,
        init_values=config.init_values,
    ).eval()


SMALL_RUN_MODEL = vx.ViTConfig(image_size=16, patch_size=4, num_classes=8, embed_dim=32, depth=2, num_heads=4)


def small_run_config(tmp_path, epochs: int, **changes) -> vx.TrainConfig:
    """A training run of SMALL_RUN_MODEL on a few shapes that logs every step, in ``tmp_path``."""
    base = dict(
        model=SMALL_RUN_MODEL, epochs=epochs, batch_size=16, train_size=64, test_size=32, lr=2e-3,
        warmup_steps=2, device="cpu", out_dir=str(tmp_path), log_every=1, snapshot_every=3,
    )
    return vx.TrainConfig(**{**base, **changes})


def counting_blocks(monkeypatch, model: vx.ViT) -> list[int]:
    """The layers of ``model`` whose block runs from now on (Block.forward, counted)."""
    ran = []
    original = vx.model.vit.Block.forward
    layer_of = {id(block): layer for layer, block in enumerate(model.blocks)}

    def counting(block, *args, **kwargs):
        ran.append(layer_of[id(block)])
        return original(block, *args, **kwargs)

    monkeypatch.setattr(vx.model.vit.Block, "forward", counting)
    return ran
