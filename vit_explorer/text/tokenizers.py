"""The text tower's tokenizer: CLIP's byte-pair encoding (it ships inside open_clip) or the
Hugging Face tokenizer a model's folder brings (SigLIP's SentencePiece, SigLIP 2's Gemma).

A folder's tokenizer is untrusted input like its weights: only the fast tokenizer's JSON is read
(no pickle, no code, nothing from the network), bounded in size, and a file that is not one is a
sentence, never a traceback.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..weights.checks import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
# Gemma's 256,000-token vocabulary (SigLIP 2) is 34 MB of JSON; ten times that is no tokenizer.
MAX_TOKENIZER_BYTES = 128 * 2**20


class Tokenizer(Protocol):
    """open_clip's tokenizers: a list of texts -> (T, context_length) token ids."""

    def __call__(self, texts: list[str], context_length: int | None = None) -> torch.Tensor: ...


def clip_tokenizer(context_length: int) -> Tokenizer:
    """OpenAI CLIP's byte-pair encoding, lower-cased, as open_clip ships it."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer(context_length=context_length)


def folder_tokenizer(folder: Path, context_length: int, text_cfg: dict) -> Tokenizer:
    """The Hugging Face tokenizer in ``folder`` (its tokenizer.json), cleaned as the model's
    text_cfg says (SigLIP: "canonicalize")."""
    from open_clip.tokenizer import HFTokenizer

    path = folder / TOKENIZER_FILE
    if not path.is_file() or path.is_symlink():
        raise CheckpointError(
            f"{folder.name} names a Hugging Face tokenizer but has no {TOKENIZER_FILE} beside its weights"
        )
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{folder.name}'s {TOKENIZER_FILE} is over {MAX_TOKENIZER_BYTES >> 20} MB, which no tokenizer is")
    kwargs = text_cfg.get("tokenizer_kwargs") or {}
    clean = kwargs.get("clean", "whitespace") if isinstance(kwargs, dict) else "whitespace"
    if clean not in ("canonicalize", "lower", "whitespace"):
        raise CheckpointError(f"{folder.name}'s text_cfg asks for a text cleaning we do not know ({clean!r})")
    try:
        tokenizer = HFTokenizer(
            str(folder), context_length=context_length, clean=clean, local_files_only=True,
            trust_remote_code=False, use_fast=True,
        )
        tokenizer(["a photo"])  # a file that parses but cannot tokenize fails here, not on a page
    except Exception as error:  # transformers raises anything from OSError to a Rust panic's text
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{folder.name}'s {TOKENIZER_FILE} is not a tokenizer we can read ({reason})") from None
    return tokenizer
