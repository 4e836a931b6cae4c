"""What the hostile-input checks of a text folder cost: loading a good small open_clip folder
(both towers, as the app loads an upload) with the checks and without them, in the same run.

The checks: no link out of the folder, the text_cfg's sizes bounded against the file's layers,
the tokenizer config's file names, and (a folder with a tokenizer.json) the tokenizer counted,
built and tried in a child process. A CLIP folder's tokenizer ships inside open_clip, so it has
no child; a SigLIP folder has one; a Hugging Face CLIP folder carries CLIP's 49,408-piece
tokenizer.json. The child starts before the weights are read and runs beside them, so a load waits
for it only as long as it outlasts them. Interleaved rounds, medians; the goal is at most 0.1 s
more per load.

    python -m bench.text_checks [--rounds 7]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from vit_explorer.text import files, load_image_text_model, tokenizers


class _Unchecked(contextlib.nullcontext):
    def result(self) -> None:
        pass


@contextlib.contextmanager
def without_checks():
    nothing = lambda *args, **kwargs: None  # noqa: E731
    unchecked = lambda folder, wanted: _Unchecked(_Unchecked()) if wanted else contextlib.nullcontext()  # noqa: E731
    with mock.patch.object(files, "links_inside", nothing), mock.patch.object(files, "_check_text_size", nothing), \
            mock.patch.object(tokenizers, "check_side_files", nothing), mock.patch.object(files, "_tokenizer_check", unchecked):
        yield


def folders(root: Path) -> dict[str, Path]:
    from tests.textmodels import SMALL_CLIP, hf_clip_folder, open_clip_folder, siglip_folder

    open_clip_folder(root / "clip", SMALL_CLIP)
    hf_clip_folder(root / "hf-clip", text={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 2}, vision={"hidden_size": 64, "intermediate_size": 128,
                                           "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 8,
                                           "image_size": 32}, projection_dim=32)
    return {
        "open_clip CLIP (CLIP's BPE from open_clip)": root / "clip",
        "open_clip SigLIP (a 120-piece tokenizer.json)": siglip_folder(root / "siglip"),
        "Hugging Face CLIP (CLIP's 49,408-piece tokenizer.json)": root / "hf-clip",
    }


def seconds(folder: Path) -> float:
    start = time.perf_counter()
    load_image_text_model(folder)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as root:
        for name, folder in folders(Path(root)).items():
            seconds(folder)  # imports and the page cache, once
            checked, again, plain = [], [], []
            for _ in range(rounds):
                tokenizers._READ.clear()  # a tokenizer.json not read before: its child runs
                checked.append(seconds(folder))
                again.append(seconds(folder))  # the same bytes again (an upload's second load)
                with without_checks():
                    plain.append(seconds(folder))
            without = statistics.median(plain)
            first, second = statistics.median(checked), statistics.median(again)
            print(
                f"{name}: {without * 1000:.0f} ms without the checks; with them {first * 1000:.0f} ms"
                f" (+{(first - without) * 1000:.0f} ms, {first / without:.2f}x), {second * 1000:.0f} ms for the"
                f" same tokenizer again (+{(second - without) * 1000:.0f} ms)"
            )


if __name__ == "__main__":
    main()
