"""Training-step throughput of vit_explorer's ViT against timm's and a per-head-modules ViT.

    python -m bench.train [--batch-size 128] [--rounds 7]

All three models have the same config (32x32 images, patch 4, dim 48, depth 4, heads 4) and
train with the same AdamW step on the same batch. Their steps are timed in interleaved rounds
(A B C, A B C, ...) so that a busy machine slows all of them alike; the medians are compared.
With CUDA it also compares images/s of a ViT-Ti/4 on 32x32 with bf16 autocast + torch.compile,
ours against timm's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vit_explorer as vx

CONFIG = vx.ViTConfig(image_size=32, patch_size=4, num_classes=10, embed_dim=48, depth=4, num_heads=4)


class HeadwiseAttention(nn.Module):
    """Attention as the tutorials' seeds write it: one q/k/v Linear per head, a loop over heads."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.q = nn.ModuleList(nn.Linear(dim, head_dim) for _ in range(num_heads))
        self.k = nn.ModuleList(nn.Linear(dim, head_dim) for _ in range(num_heads))
        self.v = nn.ModuleList(nn.Linear(dim, head_dim) for _ in range(num_heads))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = []
        for q, k, v in zip(self.q, self.k, self.v):
            scores = q(x) @ k(x).transpose(-2, -1) * self.scale  # (B, N, N)
            heads.append(torch.softmax(scores, dim=-1) @ v(x))  # (B, N, hd)
        return self.proj(torch.cat(heads, dim=-1))


class HeadwiseBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = HeadwiseAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HeadwiseViT(nn.Module):
    """A straightforward ViT: flatten patches with unfold, nn.Linear, per-head attention modules."""

    def __init__(self, config: vx.ViTConfig):
        super().__init__()
        dim, patch = config.embed_dim, config.patch_size
        self.patch = patch
        self.embed = nn.Linear(config.in_chans * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, config.num_tokens, dim) * 0.02)
        self.blocks = nn.Sequential(
            *(HeadwiseBlock(dim, config.num_heads, config.mlp_ratio) for _ in range(config.depth))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(images, self.patch, stride=self.patch).transpose(1, 2)  # (B, gh*gw, C*p*p)
        x = self.embed(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def timm_vit(config: vx.ViTConfig) -> VisionTransformer:
    return VisionTransformer(
        img_size=config.image_size, patch_size=config.patch_size, num_classes=config.num_classes,
        embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
        mlp_ratio=config.mlp_ratio,
    )


def make_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, bf16: bool = False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=images.is_cuda)

    def step() -> None:
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / steps


def interleaved(steps_by_name: dict, rounds: int, steps: int, device: torch.device, warm_up: int) -> dict[str, float]:
    """Median seconds per training step of each of ``steps_by_name``, after ``warm_up`` steps
    (allocator, kernels, optimizer state, compilation), timed in interleaved rounds."""
    for step in steps_by_name.values():
        time_steps(step, warm_up, device)
    timings: dict[str, list[float]] = {name: [] for name in steps_by_name}
    for _ in range(rounds):
        for name, step in steps_by_name.items():
            timings[name].append(time_steps(step, steps, device))
    return {name: statistics.median(values) for name, values in timings.items()}


def compare(batch_size: int, rounds: int, steps: int, device: torch.device) -> dict[str, float]:
    """Median seconds per training step of each model, measured in interleaved rounds."""
    torch.manual_seed(0)
    images = torch.randn(batch_size, 3, 32, 32, device=device)
    labels = torch.randint(0, CONFIG.num_classes, (batch_size,), device=device)
    models = {"vit_explorer": vx.ViT(CONFIG), "timm": timm_vit(CONFIG), "per-head modules": HeadwiseViT(CONFIG)}
    steps_by_name = {name: make_step(model.to(device).train(), images, labels) for name, model in models.items()}
    return interleaved(steps_by_name, rounds, steps, device, warm_up=3)


def cuda_vit_ti(batch_size: int = 1024, rounds: int = 5, steps: int = 10) -> dict[str, float]:
    """Images/s of a ViT-Ti/4 (dim 192, depth 12, heads 3) on 32x32 with bf16 + torch.compile: ours
    and timm's, in interleaved rounds (the medians)."""
    device = torch.device("cuda")
    config = vx.ViTConfig(image_size=32, patch_size=4, num_classes=10, **{
        key: value for key, value in vx.PRESETS["vit-ti"].items() if key != "patch_size"
    })
    images = torch.randn(batch_size, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    models = {"vit_explorer": vx.ViT(config), "timm": timm_vit(config)}
    steps_by_name = {
        name: make_step(torch.compile(model.to(device).train()), images, labels, bf16=True)
        for name, model in models.items()
    }
    seconds = interleaved(steps_by_name, rounds, steps, device, warm_up=5)
    return {name: batch_size / value for name, value in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="steps per model per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; 1 by default, as threads of a shared machine's busy cores"
                        " wait on each other and make timings noise")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    seconds = compare(args.batch_size, args.rounds, args.steps, device)
    print(f"training step, batch {args.batch_size}, 32x32 patch 4 dim 48 depth 4 heads 4, on {device}"
          f" ({torch.get_num_threads()} threads):")
    for name, value in seconds.items():
        print(f"  {name:18s} {value * 1e3:7.2f} ms/step  {args.batch_size / value:8.0f} images/s")
    ours = seconds["vit_explorer"]
    print(f"vit_explorer vs timm:             {seconds['timm'] / ours:.2f}x  (goal >= 1.0x)")
    print(f"vit_explorer vs per-head modules: {seconds['per-head modules'] / ours:.2f}x")
    if torch.cuda.is_available():
        throughput = cuda_vit_ti()
        print("ViT-Ti/4 on 32x32, batch 1024, bf16 + torch.compile, CUDA: "
              + ", ".join(f"{name} {value:.0f} images/s" for name, value in throughput.items())
              + f"; vit_explorer vs timm: {throughput['vit_explorer'] / throughput['timm']:.2f}x (goal >= 1.0x)")
    else:
        print("no CUDA: skipped the ViT-Ti/4 bf16 + compile throughput")


if __name__ == "__main__":
    main()
