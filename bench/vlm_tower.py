"""A VLM folder's vision tower: what loading it costs against the tower's own bytes.

Builds a LLaVA-1.5-shaped folder as transformers writes one (random weights in float16, sharded):
CLIP ViT-L/14 at 336 px and a language model of ``--language-layers`` Llama layers 2,048 wide
(8: 1.1 GB of the folder's 1.7), then loads it with ``vx.load_model`` in a fresh process and
prints the peak memory that load adds, against the float32 bytes of the tower it returns (goal
<= 1.3x) and against the admission's estimate from the headers (weights.footprint), and its time
against one forward of that tower.

    python -m bench.vlm_tower [--language-layers 8]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
import vit_explorer as vx
from vit_explorer.weights.footprint import model_footprint
def peak():  # VmHWM: this process's own peak (ru_maxrss keeps the parent's across exec)
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
estimate = model_footprint(sys.argv[1]).peak  # the admission's, from the headers
before, start = peak(), time.perf_counter()
model = vx.load_model(sys.argv[1])
seconds = time.perf_counter() - start
grown = peak() - before
tower = sum(p.numel() * p.element_size() for p in model.parameters())
x = torch.randn(1, 3, *model.config.img_size)
with torch.inference_mode():
    model(x)
    start = time.perf_counter(); model(x); forward = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "grown": grown, "tower": tower, "forward": forward, "estimate": estimate}))
"""


def make_folder(folder: Path, language_layers: int) -> None:
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336,
        patch_size=14, projection_dim=768, hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=language_layers, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32064,
    )
    config = LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=32000,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    # float16, as LLaVA's checkpoints are: half the bytes to write
    LlavaForConditionalGeneration(config).half().save_pretrained(folder, max_shard_size="500MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--language-layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlm_tower_") as temporary:
        folder = Path(temporary) / "llava-1.5-shaped"
        make_folder(folder, args.language_layers)
        on_disk = sum(path.stat().st_size for path in folder.iterdir())
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        shards = len(set(index.values()))
        out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    tower_gb, grown_gb = result["tower"] / 2**30, result["grown"] / 2**30
    print(f"LLaVA-1.5-shaped folder: {on_disk / 2**30:.2f} GB in {shards} shards, CLIP ViT-L/14-336 tower")
    print(f"load: {result['seconds']:.1f} s = {result['seconds'] / result['forward']:.1f} forwards of the tower")
    print(f"peak memory added {grown_gb:.2f} GB / the tower's float32 bytes {tower_gb:.2f} GB = {grown_gb / tower_gb:.2f}x (goal <= 1.3x)")
    estimate_gb = result["estimate"] / 2**30
    print(f"admission's estimate from the headers {estimate_gb:.2f} GB / the peak added = {estimate_gb / grown_gb:.2f}x")


if __name__ == "__main__":
    main()
