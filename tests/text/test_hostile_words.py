"""Hostile open_clip and Hugging Face text folders: what a student can upload for the words pages
(tokenizer files, tokenizer configs, text configs), in the style of tests/weights/test_hostile.py.

The corpus is generated here and loaded with load_image_text_model in one child process whose
address space is capped at its size after the imports plus 1 GB. Every case must end in one
CheckpointError sentence that names no server path, grow the process by well under 1 GB, and open
nothing outside its folder; the tokenizer's own child (text/tokenizer_check.py) takes what would
abort or hang a process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from vit_explorer.text import tokenizers
from vit_explorer.text.towers import LABEL_TEMPLATE, MAX_LABEL_CHARACTERS, MAX_TEXT_CHARACTERS, LabelError, parse_labels

from hostile import GROWTH_LIMIT_KB, run_capped
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

# The child's own part: each case read with load_image_text_model (tests/hostile.py caps and records it).
CHILD = r"""
from vit_explorer.text import load_image_text_model
from vit_explorer.weights.checks import CheckpointError

cap()
for name, path in json.load(open(sys.argv[1])):
    print(json.dumps({"name": name, **outcome(load_image_text_model, CheckpointError, path)}), flush=True)
"""


# ----------------------------------------------------------------------------- building blocks


def _unigram(pieces: list | bytes, **parts) -> dict | bytes:
    """A Unigram tokenizer.json (SentencePiece's model) of ``pieces`` ([piece, score] pairs), with
    ``parts`` (normalizer, post_processor, ...) in place of the defaults."""
    content = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": None, "decoder": None,
        "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["</s>", 0.0], ["\u2581a", -1.0], ["a", -2.0]]},
    } | parts
    return content


def _many_pieces(count: int, distinct: bool) -> bytes:
    """A tokenizer.json of ``count`` pieces, written as bytes (10**7 pieces: 80 MB, under the byte limit)."""
    head = b'{"version": "1.0", "added_tokens": [], "model": {"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], '
    body = b", ".join(b'["p%d", -1.0]' % index for index in range(count)) if distinct else b'["a",0],' * (count - 1) + b'["a",0]'
    return head + body + b"]}}"


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def _write(folder: Path, name: str, content) -> None:
    data = content if isinstance(content, bytes) else (content if isinstance(content, str) else json.dumps(content)).encode()
    (folder / name).write_bytes(data)


def _corpus(root: Path) -> dict[str, tuple[Path, str]]:
    """{case name: (folder, a regex its refusal must match)}: small SigLIP and CLIP folders, each
    with one hostile change."""
    siglip, clip = siglip_folder(root / "siglip-good"), root / "clip-good"
    open_clip_folder(clip, SMALL_CLIP)
    outside = root / "outside"  # what a link or a path out would read: a real tokenizer and config
    shutil.copytree(siglip, outside)
    cases: dict[str, tuple[Path, str]] = {}

    def case(name: str, expected: str, base: Path = siglip) -> Path:
        folder = root / re.sub(r"[^\w]+", "-", name)
        shutil.copytree(base, folder)
        cases[name] = (folder, expected)
        return folder

    # Tokenizers too large to parse, counted before the Rust parser allocates anything.
    _write(case("tokenizer.json of 10**7 pieces", r"holds 10,000,\d+ strings"), "tokenizer.json", _many_pieces(10**7, False))
    _write(case("tokenizer.json of 10**6 pieces", r"holds 1,000,\d+ pieces"), "tokenizer.json", _many_pieces(10**6, True))
    bpe = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]] * 1_500_000}}
    _write(case("tokenizer.json of 1.5 * 10**6 merges", r"holds 3,000,\d+ strings"), "tokenizer.json", bpe)
    added = [{"id": 4 + index, "content": f"<t{index}>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for index in range(30_000)]
    _write(case("tokenizer.json of 30,000 added tokens", r"holds 30,000 added tokens"), "tokenizer.json",
           _unigram([], added_tokens=added))
    # Rust panics (pyo3's PanicException, a BaseException) and parser errors.
    template = {"type": "TemplateProcessing", "special_tokens": {}, "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<missing>", "type_id": 0}}]}
    _write(case("template names a missing token", r"not a tokenizer we can read \(no entry found"), "tokenizer.json",
           _unigram([], post_processor=template))
    _write(case("precompiled_charsmap malformed", r"not a tokenizer we can read \(Precompiled"), "tokenizer.json",
           _unigram([], normalizer={"type": "Precompiled", "precompiled_charsmap": "AAAAAP8AAAA="}))
    _write(case("precompiled_charsmap out of bounds when used", r"not a tokenizer we can read \(index out of bounds"),
           "tokenizer.json", _unigram([], normalizer={"type": "Precompiled", "precompiled_charsmap": "CAAAAAAAAAAA//8AAAAA"}))
    _write(case("tokenizer.json nested 100,000 deep", r"not a tokenizer we can read \(.*recursion limit"),
           "tokenizer.json", '{"version": "1.0", "model": {"type": "Unigram", "vocab": ' + "[" * 100_000 + "]" * 100_000 + "}}")
    _write(case("tokenizer.json a 2-byte stub", r"not a tokenizer we can read \(Model missing"), "tokenizer.json", "{}")
    _write(case("tokenizer.json of an unknown model", r"not a tokenizer we can read"), "tokenizer.json",
           {"version": "1.0", "model": {"type": "Evil", "vocab": []}})
    # Files from outside the folder: through a config's names, or links.
    for key, value in {
        "fast_tokenizer_files ../": ["../outside/tokenizer.1.0.0.json"],
        "fast_tokenizer_files absolute": [str(outside / "tokenizer.1.0.0.json")],
        "tokenizer_file absolute": str(outside / "tokenizer.json"),
        "vocab_file ../": "../outside/tokenizer.json",
    }.items():
        folder = case(f"tokenizer_config {key}", r"in tokenizer_config.json in .* leads outside the model folder")
        _write(folder, "tokenizer.json", "{}")
        _write(folder, "tokenizer_config.json", _read(folder, "tokenizer_config.json") | {key.split()[0]: value})
    shutil.copy(outside / "tokenizer.json", outside / "tokenizer.1.0.0.json")
    folder = case("tokenizer_config fast_tokenizer_files inside", r"names other tokenizer files to read \(fast_tokenizer_files\)")
    shutil.copy(folder / "tokenizer.json", folder / "tokenizer.1.0.0.json")
    _write(folder, "tokenizer_config.json", _read(folder, "tokenizer_config.json") | {"fast_tokenizer_files": ["tokenizer.1.0.0.json"]})
    _write(case("tokenizer_config nested 100,000 deep", r"tokenizer_config.json in .* is not valid JSON"),
           "tokenizer_config.json", "[" * 100_000 + "]" * 100_000)
    for file_name in ("tokenizer.json", "tokenizer_config.json", "open_clip_config.json", "open_clip_model.safetensors"):
        folder = case(f"{file_name} a link out", rf"{re.escape(file_name)} in .* leads outside the model folder")
        (folder / file_name).unlink()
        (folder / file_name).symlink_to(outside / file_name)
    for file_name in ("special_tokens_map.json", "chat_template.jinja"):
        folder = case(f"{file_name} a link out", rf"{re.escape(file_name)} in .* leads outside the model folder")
        (outside / file_name).write_text("{}")
        (folder / file_name).symlink_to(outside / file_name)
    # Text configs that claim more than any text tower (or their file) holds.
    for change, expected in {
        "layers 10**6": "text_cfg layers must be a whole number from 1 to 256, not 1000000",
        "layers 2000": "text_cfg layers must be a whole number from 1 to 256, not 2000",
        "layers 100": "text_cfg says 100 layers, but its file holds 2",
        "layers '2'": "text_cfg layers must be a whole number",
        "width 10**9": "text_cfg width must be a whole number from 1 to 8,192",
        "heads 0": "text_cfg heads must be a whole number",
        "vocab_size 10**9": "text_cfg vocab_size must be a whole number from 1 to 400,000",
        "mlp_ratio 1e300": "text_cfg mlp_ratio must be a number above 0 and at most 16",
        "context_length 10**6": "text context length 1000000 is not one we read",
    }.items():
        key, value = change.split(" ", 1)
        folder = case(f"text_cfg {change}", expected, clip)
        config = _read(folder, "open_clip_config.json")
        config["model_cfg"]["text_cfg"][key] = eval(value)  # noqa: S307 - the test's own literals
        _write(folder, "open_clip_config.json", config)
    _write(case("open_clip_config nested 100,000 deep", r"open_clip_config.json in .* is not valid JSON", clip),
           "open_clip_config.json", "[" * 100_000 + "]" * 100_000)
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-words")
    cases = _corpus(root)
    lines, stderr = run_capped(CHILD, [[name, str(path)] for name, (path, _) in cases.items()], root)
    return root, cases, {line["name"]: line for line in lines}, stderr


CASE_NAMES = [
    "tokenizer.json of 10**7 pieces", "tokenizer.json of 10**6 pieces", "tokenizer.json of 1.5 * 10**6 merges",
    "tokenizer.json of 30,000 added tokens", "template names a missing token", "precompiled_charsmap malformed",
    "precompiled_charsmap out of bounds when used", "tokenizer.json nested 100,000 deep", "tokenizer.json a 2-byte stub",
    "tokenizer.json of an unknown model",
    "tokenizer_config fast_tokenizer_files ../", "tokenizer_config fast_tokenizer_files absolute",
    "tokenizer_config tokenizer_file absolute", "tokenizer_config vocab_file ../",
    "tokenizer_config fast_tokenizer_files inside", "tokenizer_config nested 100,000 deep",
    "tokenizer.json a link out", "tokenizer_config.json a link out", "open_clip_config.json a link out",
    "open_clip_model.safetensors a link out", "special_tokens_map.json a link out", "chat_template.jinja a link out",
    "text_cfg layers 10**6", "text_cfg layers 2000", "text_cfg layers 100", "text_cfg layers '2'", "text_cfg width 10**9",
    "text_cfg heads 0", "text_cfg vocab_size 10**9", "text_cfg mlp_ratio 1e300", "text_cfg context_length 10**6",
    "open_clip_config nested 100,000 deep",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_text_folder_is_refused_in_one_sentence_cheaply(outcomes, name):
    root, cases, results, stderr = outcomes
    assert name in results, f"the child died or hung before or during this case:\n{stderr}"
    result = results[name]
    folder, expected = cases[name]
    assert result["error"] is not None, "the hostile folder loaded"
    assert result["expected_error"], f"{result['error']}: {result['message']}"
    message = result["message"]
    assert "\n" not in message and "Errno" not in message and "Traceback" not in message, message
    assert str(root) not in message and not re.search(r"(^|\s)/\w", message), f"a server path: {message}"
    assert re.search(expected, message), message
    assert result["growth_kb"] < GROWTH_LIMIT_KB, f"the process grew by {result['growth_kb'] // 1024} MB"
    read_outside = [
        path for path in result["opened"]
        if Path(os.path.realpath(path)).is_relative_to(root) and not Path(path).is_relative_to(folder)
        and not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    ]
    assert not read_outside, f"opened outside the folder: {read_outside}"


def test_the_corpus_would_load_without_its_one_hostile_change(tmp_path):
    """The controls: the same generated folders load, and a generated tokenizer.json of many
    pieces is refused in the tokenizer's child, never parsed by this process."""
    from vit_explorer.text import load_image_text_model

    siglip = siglip_folder(tmp_path / "siglip")
    # What published tokenizer configs hold and transformers does not open: kept, not refused.
    legacy = {"special_tokens_map_file": "/home/author/.cache/special_tokens_map.json", "name_or_path": "/home/author/m"}
    _write(siglip, "tokenizer_config.json", _read(siglip, "tokenizer_config.json") | legacy | {"tokenizer_file": "tokenizer.json"})
    assert load_image_text_model(siglip).scoring == "sigmoid"
    clip = tmp_path / "clip"
    open_clip_folder(clip, SMALL_CLIP)
    assert load_image_text_model(clip).scoring == "softmax"
    good = tmp_path / "good.json"
    _write(tmp_path, "good.json", _many_pieces(1000, True))
    tokenizers.check_in_child(good, "good")  # a thousand pieces: a tokenizer


@pytest.mark.parametrize("ending", ["import os; os.abort()", "import time; time.sleep(30)"])
def test_a_tokenizer_child_that_dies_or_hangs_is_a_refusal(tmp_path, monkeypatch, ending):
    """What the child is there for: a parser that aborts the process (as ten million pieces did
    the server) or hangs ends the child only, and the server says so in one sentence."""
    script = tmp_path / "child.py"
    script.write_text(ending)
    monkeypatch.setattr(tokenizers, "CHECK_SCRIPT", script)
    monkeypatch.setattr(tokenizers, "_READ", {})  # bytes read before are not read again
    monkeypatch.setattr(tokenizers, "CHILD_SECONDS", 1)
    _write(tmp_path, "tokenizer.json", _many_pieces(1000, True))
    with pytest.raises(ValueError, match=r"^up's tokenizer.json could not be read within 1 s and 2,048 MB"):
        tokenizers.check_in_child(tmp_path / "tokenizer.json", "up")


def test_one_limit_on_what_is_embedded():
    """A label of 289-300 characters was taken by the box and then refused by embed_texts as
    "a photo of {label}.": the box now counts what is embedded."""
    assert len(LABEL_TEMPLATE.format("x" * MAX_LABEL_CHARACTERS)) == MAX_TEXT_CHARACTERS
    assert parse_labels("x" * MAX_LABEL_CHARACTERS) == ["x" * MAX_LABEL_CHARACTERS]
    with pytest.raises(LabelError, match=f"too long \\(at most {MAX_LABEL_CHARACTERS}\\)"):
        parse_labels("x" * (MAX_LABEL_CHARACTERS + 1))
