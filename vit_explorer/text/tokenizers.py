"""The text tower's tokenizer: CLIP's byte-pair encoding (it ships inside open_clip) or the
Hugging Face tokenizer a model's folder brings (SigLIP's SentencePiece, SigLIP 2's Gemma).

A folder's tokenizer is untrusted input like its weights: only the fast tokenizer's JSON is read
(no pickle, no code, nothing from the network), bounded in size; its tokenizer_config.json may
name no other file; the tokenizer.json is first counted, built and tried in a child process with
an address-space and a time limit (tokenizer_check.py), because the Rust parser can abort or hang
the whole process; only then does the server read it. Anything that still fails, Rust panics
included, is a CheckpointError sentence that names no server path.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

import torch

from ..weights.checks import CheckpointError, folder_file, read_json, without_paths

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
# Gemma's 256,000-token vocabulary (SigLIP 2) is 34 MB of JSON; ten times that is no tokenizer.
MAX_TOKENIZER_BYTES = 128 * 2**20
# Counted before the server parses them: Gemma's 262,144 pieces are the most of any real tokenizer
# (the server holds ~0.2 GB more while it reads one of MAX_PIECES). The strings (pieces, merges of
# two strings each, added tokens) are counted on the bytes before any parser allocates them.
MAX_PIECES = 400_000
MAX_MERGES = 1_000_000
MAX_ADDED_TOKENS = 20_000
MAX_STRINGS = 2 * MAX_PIECES + 2 * MAX_MERGES + 4 * MAX_ADDED_TOKENS
CHILD_BYTES = 2 * 2**30  # the child's address space beyond the interpreter's own
CHILD_SECONDS = 20
CHECK_SCRIPT = Path(__file__).with_name("tokenizer_check.py")
# The files a tokenizer config may name for transformers to open (its older names included).
_NAMED_FILES = ("tokenizer_file", "vocab_file", "merges_file", "spm_file", "added_tokens_file", "chat_template_file")
# What the child tries the tokenizer on: a label, the longest text a page embeds, odd characters,
# a run a backtracking pattern could stall on.
TRIALS = ["a photo", "a photo of " + "a tabby cat " * 24 + ".", "Ünïcödé 猫 🚀 </s> <pad> \t\n", "a" * 288 + "!"]


class Tokenizer(Protocol):
    """open_clip's tokenizers: a list of texts -> (T, context_length) token ids."""

    def __call__(self, texts: list[str], context_length: int | None = None) -> torch.Tensor: ...


def clip_tokenizer(context_length: int) -> Tokenizer:
    """OpenAI CLIP's byte-pair encoding, lower-cased, as open_clip ships it."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer(context_length=context_length)


def tokenizer_path(folder: Path) -> Path:
    """``folder``'s tokenizer.json, refused if missing, leading outside the folder or too large."""
    if not os.path.lexists(folder / TOKENIZER_FILE):
        raise CheckpointError(
            f"{folder.name} names a Hugging Face tokenizer but has no {TOKENIZER_FILE} beside its weights"
        )
    path = folder_file(folder, TOKENIZER_FILE, TOKENIZER_FILE)
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(f"{folder.name}'s {TOKENIZER_FILE} is over {MAX_TOKENIZER_BYTES >> 20} MB, which no tokenizer is")
    return path


def folder_tokenizer(folder: Path, context_length: int, text_cfg: dict, check: TokenizerCheck | None = None) -> Tokenizer:
    """The Hugging Face tokenizer in ``folder`` (its tokenizer.json), cleaned as the model's
    text_cfg says (SigLIP: "canonicalize"); ``check``: its child's check, started by the caller
    (beside the weights' reading), else run here."""
    from open_clip.tokenizer import HFTokenizer

    path = tokenizer_path(folder)
    kwargs = text_cfg.get("tokenizer_kwargs") or {}
    clean = kwargs.get("clean", "whitespace") if isinstance(kwargs, dict) else "whitespace"
    if clean not in ("canonicalize", "lower", "whitespace"):
        raise CheckpointError(f"{folder.name}'s text_cfg asks for a text cleaning we do not know ({clean!r})")
    check_side_files(folder)
    if check is None:
        check_in_child(path, folder.name)
    else:
        check.result()
    try:
        tokenizer = HFTokenizer(
            str(folder), context_length=context_length, clean=clean, local_files_only=True,
            trust_remote_code=False, use_fast=True,
        )
        tokenizer(["a photo"])  # a file that parses but cannot tokenize fails here, not on a page
    except BaseException as error:  # transformers raises anything from OSError to a Rust panic
        if not is_parser_failure(error):
            raise
        reason = without_paths((str(error).strip().splitlines() or [type(error).__name__])[0][:160], folder)
        raise CheckpointError(f"{folder.name}'s {TOKENIZER_FILE} is not a tokenizer we can read ({reason})") from None
    return tokenizer


def is_parser_failure(error: BaseException) -> bool:
    """Whether a parser's exception is the input's fault: any Exception, and pyo3's PanicException,
    which is a BaseException (a Rust panic) that ``except Exception`` does not catch."""
    return isinstance(error, Exception) or type(error).__name__ == "PanicException"


def check_side_files(folder: Path) -> None:
    """tokenizer_config.json and special_tokens_map.json, which transformers reads beside
    tokenizer.json: inside the folder, JSON objects, every file they name inside the folder, and
    no other tokenizer file named (transformers reads fast_tokenizer_files' in place of ours)."""
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE):
        if not os.path.lexists(folder / name):
            continue
        settings = read_json(folder_file(folder, name, name), name, folder.name)
        if not isinstance(settings, dict):
            raise CheckpointError(f"{name} in {folder.name} is not a JSON object of settings")
        for key in (*_NAMED_FILES, "fast_tokenizer_files"):
            value = settings.get(key)
            for file_name in value if isinstance(value, list) else [value]:
                if file_name is not None:  # outside the folder: the same sentence as a shard's
                    folder_file(folder, file_name, f"{key} in {name}", must_exist=False)
        if settings.get("fast_tokenizer_files"):
            raise CheckpointError(
                f"{name} in {folder.name} names other tokenizer files to read (fast_tokenizer_files), which we do not:"
                f" only {TOKENIZER_FILE}"
            )


def check_in_child(path: Path, name: str) -> None:
    """Count, build and try ``path`` (a tokenizer.json) in a child process with an address-space
    and a time limit (tokenizer_check.py): what would crash or hang the server ends the child."""
    with TokenizerCheck(path, name) as check:
        check.result()


# The digests of the tokenizer.json files a child has read: the same bytes are not checked again
# (an upload's text tower is loaded twice: checked as it is kept, then by the page that asks).
_READ: dict[str, None] = {}
_READ_LOCK = threading.Lock()  # every session's thread adds and trims it
MAX_REMEMBERED = 256


class TokenizerCheck:
    """``path`` (a tokenizer.json, of the model ``name``) being checked in a child process
    (tokenizer_check.py), from its start until :meth:`result`; a context manager that ends the
    child if nobody asks for its result (the load failed elsewhere first)."""

    def __init__(self, path: Path, name: str):
        self.path, self.name, self.started = path, name, time.monotonic()
        with open(path, "rb") as file:
            self.digest = hashlib.file_digest(file, "sha256").hexdigest()
        self.process = None
        if self.digest in _READ:
            return
        limits = {
            "pieces": MAX_PIECES, "added tokens": MAX_ADDED_TOKENS,
            "strings": MAX_STRINGS, "bytes": CHILD_BYTES, "seconds": CHILD_SECONDS, "trials": TRIALS,
        }
        environment = {"PATH": os.environ.get("PATH", ""), "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(CHECK_SCRIPT), str(path), json.dumps(limits)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, env=environment,
        )

    def result(self) -> None:
        """Wait for the child's answer: None for a tokenizer it read, else a CheckpointError."""
        if self.process is None:  # these bytes were read before
            return
        left = 2 * CHILD_SECONDS - (time.monotonic() - self.started)  # the wall-clock guard of a hang
        try:
            stdout, _ = self.process.communicate(timeout=max(left, 0.1))
            answer = json.loads(stdout.splitlines()[-1]) if stdout.strip() else None
        except (subprocess.TimeoutExpired, ValueError):
            answer = None
        finally:
            self.close()
        if not isinstance(answer, dict) or "refused" not in answer:
            raise CheckpointError(
                f"{self.name}'s {TOKENIZER_FILE} could not be read within {CHILD_SECONDS} s and"
                f" {CHILD_BYTES >> 20:,} MB, which any tokenizer is"
            )
        if answer["refused"]:
            raise CheckpointError(f"{self.name}'s {TOKENIZER_FILE} {without_paths(str(answer['refused']), self.path.parent)}")
        with _READ_LOCK:
            _READ[self.digest] = None
            while len(_READ) > MAX_REMEMBERED:
                del _READ[next(iter(_READ))]

    def close(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> TokenizerCheck:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
