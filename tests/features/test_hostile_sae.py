"""Hostile dictionaries and indexes: the Features page reads every SAE file in weights/ and the runs
folder (a run's, the CLI's, or copied there by anyone), and the index beside the one chosen.

The corpus is generated here and read, in one child process whose address space is capped at its
size after the imports plus 1 GB, by the project's own readers: vx.load_sae, the index reader
(load_index, then LatentIndex.check_fits against its dictionary) and the Features page's picker
(app.features.choices over a folder holding the case beside a good dictionary). Every case must
end in one SAEError sentence that names no path (the picker: the file skipped with it, the good
one still offered), grow the process by well under 1 GB and open nothing outside its folder.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.features.index import LatentIndex, load_index, save_index
from vit_explorer.features.sae import CARD_KEY, SAE_KEY, SAEConfig, SparseAutoencoder
from vit_explorer.features.train import model_identity

from helpers import tiny_config
from hostile import GROWTH_LIMIT_KB, run_capped

D, WIDTH, K, LAYER, IMAGES = 32, 64, 4, 1, 8  # the dictionary of the tiny model's layer 1
GRID, TOP = (8, 8), 3  # tiny_config: 32 px images, 4 px patches

# The child's own part: each case read by its reader (tests/hostile.py caps and records it).
CHILD = r"""
from pathlib import Path
import vit_explorer as vx
from vit_explorer.app import features
from vit_explorer.features.index import load_index

root = Path(sys.argv[1]).parent
model_file = root / "model.safetensors"
model = vx.load_model(model_file)

class Selection:  # what the picker reads of the sidebar's selection
    model_key = f"file:{model_file}"
    base_model = model
    config = model.config

def read(reader, path):
    if reader == "load_sae":
        vx.load_sae(path, model)
        return {}
    if reader == "index":
        index = load_index(path, %(width)d)
        index.check_fits(%(images)d, %(grid)r, 0)
        return {}
    features._folders = lambda: [Path(path).parent]
    offered, skipped = features.choices(Selection())
    offered = [label.partition(" ")[0] for label in offered]
    if len(skipped) != 1 or offered != ["good"]:  # the bad file skipped, the good one beside it offered
        return {"offered": offered, "skipped": skipped}
    raise vx.SAEError(skipped[0].partition(" was skipped: ")[2].removesuffix("."))

cap()
for name, reader, path in json.load(open(sys.argv[1])):
    print(json.dumps({"name": name, "reader": reader, **outcome(read, vx.SAEError, reader, path)}), flush=True)
""" % {"width": WIDTH, "images": IMAGES, "grid": GRID}

# ----------------------------------------------------------------------------- building blocks


def _model(root: Path) -> Path:
    path = root / "model.safetensors"
    torch.manual_seed(0)
    vx.save_model(vx.ViT(tiny_config(depth=2)), path)
    return path


def _card(model_path: Path, **changes) -> dict:
    """The card a run writes for the tiny model's layer 1 over 8 shapes images, with ``changes``."""
    card = {
        "model": model_identity(model_path), "embed_dim": D, "depth": 2, "layer": LAYER, "prefix_tokens": False,
        "images": {"dataset": "shapes", "count": IMAGES, "image_size": [32, 32], "seed": 0},
        "settings": {}, "metrics": {"explained_variance": 0.9, "mse": 0.1, "l0": 4.0, "dead_share": 0.0},
        "mean": [0.0] * D, "stopped": False,
    }
    return {**card, **changes}


def _sae() -> SparseAutoencoder:
    torch.manual_seed(0)
    return SparseAutoencoder(SAEConfig(D, WIDTH, K))


def _sae_file(path: Path, card: dict, tensors: dict | None = None, config: str | None = None) -> Path:
    """An SAE file as save_sae writes it, its card, tensors or config (JSON text) replaced."""
    sae = _sae()
    state = {name: value.detach().contiguous() for name, value in sae.state_dict().items()}
    metadata = {SAE_KEY: config or sae.config.to_json(), CARD_KEY: json.dumps(card)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({**state, **(tensors or {})}, str(path), metadata=metadata)
    return path


def _index(**changes) -> LatentIndex:
    """An index of the dictionary over its 8 images, with ``changes``."""
    generator = np.random.default_rng(0)
    fields = dict(
        images=generator.integers(0, IMAGES, (WIDTH, TOP)), patches=generator.integers(0, 64, (WIDTH, TOP)),
        values=np.ones((WIDTH, TOP), np.float32), frequency=np.full(WIDTH, 0.1), histogram=np.ones((WIDTH, 5), np.int64),
        maxima=np.ones(WIDTH, np.float32), tokens_seen=512, grid_size=GRID, num_prefix_tokens=0,
    )
    return LatentIndex(**{**fields, **changes})


def _arrays(index: LatentIndex) -> dict[str, np.ndarray]:
    """The index as save_index's arrays (to edit one before writing them)."""
    return {name: np.asarray(value) for name, value in index.__dict__.items()}


def _npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def _npy_header(shape: tuple, descr: str = "<i8") -> bytes:
    """A .npy version 1.0 header alone (no data) declaring ``shape``."""
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def _zip(path: Path, members: dict[str, bytes], declared: dict[str, int] | None = None,
         compress: int = zipfile.ZIP_STORED) -> Path:
    """An archive of ``members``; ``declared``: sizes its directory claims instead of the real ones."""
    with zipfile.ZipFile(path, "w", compression=compress) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    if declared:
        blob = bytearray(path.read_bytes())
        for name, size in declared.items():
            encoded = name.encode()
            for start in (m.start() for m in re.finditer(re.escape(encoded), blob)):
                if blob[start - 46 : start - 42] == b"PK\x01\x02":  # central directory: uncompressed size at +24
                    blob[start - 46 + 24 : start - 46 + 28] = struct.pack("<I", size)
                    blob[start - 46 + 20 : start - 46 + 24] = struct.pack("<I", size)
        path.write_bytes(bytes(blob))
    return path


def _deflated(data: bytes) -> bytes:
    """A raw deflate stream of ``data`` (mostly zeros), in milliseconds: after a full flush the
    compressor starts afresh, so each MiB of zeros compresses to the same bytes."""
    chunk, whole = 2**20, len(data) // 2**20 * 2**20
    zeros = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = zeros.compress(bytes(chunk)) + zeros.flush(zlib.Z_FULL_FLUSH)
    first = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = first.compress(data[:chunk]) + first.flush(zlib.Z_FULL_FLUSH)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    return start + piece * (whole // chunk - 1) + tail.compress(data[whole:]) + tail.flush()


def _handmade_zip(path: Path, members: dict[str, tuple[bytes, int, int]]) -> Path:
    """A zip written by hand, a member stored pre-deflated: name -> (data, method, size). A deflated
    member's CRC is left 0: it is only checked after inflating, which is what must not happen."""
    local, central = bytearray(), bytearray()
    for name, (data, method, size) in members.items():
        encoded, crc = name.encode(), zlib.crc32(data) if method == zipfile.ZIP_STORED else 0
        fields = struct.pack("<HHHHHIIIHH", 20, 0, method, 0, 0, crc, len(data), size, len(encoded), 0)
        central += struct.pack("<IH", 0x02014B50, 20) + fields + struct.pack("<HHHII", 0, 0, 0, 0, len(local)) + encoded
        local += struct.pack("<I", 0x04034B50) + fields + encoded + data
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(bytes(local + central) + end)
    return path


def _index_members(index: LatentIndex, **replaced: bytes) -> dict[str, bytes]:
    members = {f"{name}.npy": _npy(array) for name, array in _arrays(index).items()}
    return {**members, **{f"{name}.npy": data for name, data in replaced.items()}}


# ----------------------------------------------------------------------------- the corpus

# Readers: "load_sae" (vx.load_sae with the model), "index" (load_index + check_fits), "picker"
# (the Features page's picker over the case's folder, a good dictionary beside it).


def _corpus(root: Path) -> list[tuple[str, str, Path, str]]:
    """[(case, reader, path, a regex its sentence must match)]."""
    model_path = _model(root)
    outside = root / "outside"
    outside.mkdir()
    secret = _sae_file(outside / "secret.safetensors", _card(model_path))
    (outside / "cats" / "a").mkdir(parents=True)
    (outside / "cats" / "b").mkdir(parents=True)
    cases: list[tuple[str, str, Path, str]] = []

    def sae_case(name: str, expected: str, readers=("load_sae", "picker")) -> Path:
        folder = root / "cases" / re.sub(r"\W+", "_", name)
        folder.mkdir(parents=True)
        _sae_file(folder / "good.safetensors", _card(model_path))  # the picker must still offer it
        for reader in readers:
            cases.append((name, reader, folder / "bad.safetensors", expected))
        return folder / "bad.safetensors"

    def index_case(name: str, expected: str) -> Path:
        folder = root / "cases" / re.sub(r"\W+", "_", name)
        folder.mkdir(parents=True)
        cases.append((name, "index", folder / "bad.index.npz", expected))
        return folder / "bad.index.npz"

    # Files that are no safetensors file, or claim more than they hold.
    sae_case("SAE file of 3 bytes", "too short").write_bytes(b"abc")
    sae_case("SAE file empty", "too short").write_bytes(b"")
    sae_case("SAE file of text", "not a readable SAE file").write_text("a dictionary, honestly, " * 10)
    sae_case("header length 2**63", "header is too large").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    header = json.dumps({
        "__metadata__": {SAE_KEY: json.dumps({"d_model": D, "width": 10**8, "k": 32})},
        "W_enc": {"dtype": "F32", "shape": [D, 10**8], "data_offsets": [0, 4 * D * 10**8]},
    }).encode()
    sae_case("tensors declaring 12 GB in 300 bytes", "not a readable SAE file").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(16))
    _sae_file(sae_case("config of 10**9 latents", "1,000,000,000 latents over 32 dimensions is larger"), _card(model_path),
              config=json.dumps({"d_model": D, "width": 10**9, "k": 32}))
    # Cards and configs of the wrong shape: deep, lists where numbers belong, absurd values.
    deep = "[" * 100_000 + "]" * 100_000
    _sae_file(sae_case("config nested 100,000 deep", "settings are unreadable: nested too deeply"), _card(model_path),
              config=deep)
    path = sae_case("card nested 100,000 deep", "settings are unreadable: nested too deeply")
    _sae_file(path, {})
    save_file(SparseAutoencoder(SAEConfig(D, WIDTH, K)).state_dict(), str(path),
              metadata={SAE_KEY: SAEConfig(D, WIDTH, K).to_json(), CARD_KEY: deep})
    _sae_file(sae_case("config a list", "settings are unreadable"), _card(model_path), config="[1, 2]")
    _sae_file(sae_case("config k a list", "settings are unreadable"), _card(model_path),
              config=json.dumps({"d_model": D, "width": WIDTH, "k": [4]}))
    _sae_file(sae_case("card a list", "card is unreadable"), [1, 2])
    _sae_file(sae_case("card layer a list", re.escape("card has layer [1], not a layer number")),
              _card(model_path, layer=[1]))
    _sae_file(sae_case("card layer 10**6", "reads layer 1000000, which the model .* does not have"),
              _card(model_path, layer=10**6))
    _sae_file(sae_case("card metrics a list", "card has metrics .*, not numbers by name"),
              _card(model_path, metrics={"explained_variance": [1] * 5}))
    _sae_file(sae_case("card mean of lists", "card has mean .*, not 32 finite numbers"),
              _card(model_path, mean=[[0.0]] * D))
    _sae_file(sae_case("card mean NaN", "card has mean .*, not 32 finite numbers"), _card(model_path, mean=[math.nan] * D))
    _sae_file(sae_case("card mean of 3 numbers", "card has mean .*, not 32 finite numbers"), _card(model_path, mean=[0.0] * 3))
    _sae_file(sae_case("card model a string", "card has model .*, not a model's name and digest"),
              _card(model_path, model="vit"))
    _sae_file(sae_case("card prefix_tokens a string", "card has prefix_tokens 'yes', not true or false"),
              _card(model_path, prefix_tokens="yes"))
    _sae_file(sae_case("card evaluation a list", "card has evaluation .*, not numbers by name"),
              _card(model_path, evaluation=[0.5] * 5))
    _sae_file(sae_case("card evaluation of strings", "card has evaluation .*, not numbers by name"),
              _card(model_path, evaluation={"nmse": "0.1"}))
    _sae_file(sae_case("card evaluation of 1,000 names", "card has evaluation .*, not numbers by name"),
              _card(model_path, evaluation={f"m{index}": 0.0 for index in range(1000)}))
    _sae_file(sae_case("card evaluation images unknown", "card names an unknown image set$"),
              _card(model_path, evaluation_images={"dataset": "/etc/passwd", "count": 8, "image_size": [32, 32]}))
    _sae_file(sae_case("config activation unknown", "a dictionary's activation must be one of topk, batchtopk, not 'relu'"),
              _card(model_path), config=json.dumps({"d_model": D, "width": WIDTH, "k": K, "activation": "relu"}))
    _sae_file(sae_case("config prefixes decreasing", "the Matryoshka prefixes must increase"),
              _card(model_path), config=json.dumps({"d_model": D, "width": WIDTH, "k": K, "prefixes": [32, 16]}))
    _sae_file(sae_case("config of 1,000 prefixes", "the Matryoshka prefixes must be a list of at most 16"),
              _card(model_path), config=json.dumps({"d_model": D, "width": WIDTH, "k": K, "prefixes": [1] * 1000}))
    batchtopk = SAEConfig(D, WIDTH, K, "batchtopk").to_json()
    _sae_file(sae_case("batchtopk without its threshold", "tensors do not match the dictionary"), _card(model_path),
              config=batchtopk)
    _sae_file(sae_case("batchtopk threshold NaN", "weights are not all finite numbers"), _card(model_path),
              {"threshold": torch.tensor(math.nan)}, config=batchtopk)
    images = {"dataset": "shapes", "count": IMAGES, "image_size": [32, 32], "seed": 0}
    for name, changed, expected in [
        ("image set 100,000 pixels wide", {"image_size": [32, 100_000]}, "image sides of at most 2048 pixels"),
        ("image set of 10**30 pixels", {"image_size": 10**15}, "image sides of at most 2048 pixels"),
        ("image set count a list", {"count": [8]}, "count must be a whole number"),
        ("image set image_size a list of lists", {"image_size": [[32], [32]]}, "image_size must be a side or"),
        ("image set with an unknown field", {"pickle": "x"}, "unknown ImageSource fields"),
    ]:
        _sae_file(sae_case(name, "card names an image set no run makes: .*" + expected),
                  _card(model_path, images={**images, **changed}))
    for name, dataset in [("image set unknown", "/etc/passwd"), ("image set a list", ["shapes"])]:
        _sae_file(sae_case(name, "card names an unknown image set$"), _card(model_path, images={**images, "dataset": dataset}))
    _sae_file(sae_case("image set a number", "card names an unknown image set$"), _card(model_path, images=5))
    _sae_file(sae_case("card without its image set", "card lacks its image set", readers=("picker",)),
              {key: value for key, value in _card(model_path).items() if key != "images"})
    _sae_file(sae_case("card without its tokens' mean", "card lacks its tokens' mean", readers=("picker",)),
              {key: value for key, value in _card(model_path).items() if key != "mean"})
    for name, folder in [("image set folder: elsewhere on the server", outside / "cats"),
                         ("image set folder: ../ out of the runs folder", Path("..") / ".." / "outside" / "cats")]:
        _sae_file(sae_case(name, "names an image folder outside the data and dictionary folders", readers=("picker",)),
                  _card(model_path, images={**images, "dataset": f"folder:{folder}"}))
    # Weights a run never writes.
    nan = torch.full((WIDTH, D), math.nan)
    _sae_file(sae_case("decoder weights NaN", "weights are not all finite numbers"), _card(model_path), {"W_dec": nan})
    _sae_file(sae_case("encoder bias infinite", "weights are not all finite numbers"), _card(model_path),
              {"b_enc": torch.full((WIDTH,), math.inf)})
    _sae_file(sae_case("input scale 0", "its input scale is not positive"), _card(model_path), {"input_scale": torch.zeros(())})
    _sae_file(sae_case("weights in float16", "tensors do not match the dictionary"), _card(model_path),
              {"W_dec": torch.zeros(WIDTH, D, dtype=torch.float16)})
    _sae_file(sae_case("another model's width", "reads 48-wide tokens and the model's are 32-wide"),
              _card(model_path, mean=[0.0] * 48),
              {"W_enc": torch.zeros(48, WIDTH), "W_dec": torch.zeros(WIDTH, 48), "b_dec": torch.zeros(48)},
              config=SAEConfig(48, WIDTH, K).to_json())
    sae_case("a link to a dictionary outside", "leads outside its folder", readers=("picker",)).symlink_to(secret)
    os.mkfifo(sae_case("a pipe", "not a plain file"))  # opening it would wait for a writer
    sae_case("a folder", "not a plain file").mkdir()

    # Indexes: headers that claim more than the file holds, members that are not arrays, entries
    # that point outside the dictionary, its image set or its grid.
    index_case("index of 3 bytes", "not a readable SAE index file").write_bytes(b"abc")
    index_case("index of text", "not a readable SAE index file").write_text("no archive " * 20)
    os.mkfifo(index_case("index a pipe", "not a readable SAE index file"))
    index_case("index a link to a device", "not a readable SAE index file").symlink_to("/dev/zero")
    path = index_case("an encrypted member", "truncated or holds something else than arrays")
    _zip(path, _index_members(_index()))
    blob = bytearray(path.read_bytes())
    for signature, flags in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # each header's general-purpose flags
        for match in re.finditer(re.escape(signature), bytes(blob)):
            blob[match.start() + flags] |= 1
    path.write_bytes(bytes(blob))
    members = _index_members(_index(), images=_npy_header((2**20, 2**17)))
    _zip(index_case("npy header claiming 1 TiB", "truncated or holds something else than arrays"), members)
    # Headers of small entries (the zip's directory agreeing: about 1 GB each) in a file of 2 KB,
    # which LatentIndex's types would widen to 20 GB: 2**20 latents, or the dictionary's 64 x 2**24.
    for name, claims, expected in [
        ("2**20 latents of one-byte headers widening to 20 GB",
         {"images": ((2**20, 1000), "|u1"), "patches": ((2**20, 1000), "|u1"), "values": ((2**20, 1000), "<f2"),
          "histogram": ((2**20, 5), "|u1"), "frequency": ((2**20,), "<f2"), "maxima": ((2**20,), "<f2")},
         "describes 1,048,576 latents and its dictionary has 64"),
        ("64 x 2**24 one-byte headers widening to 20 GB",
         {"images": ((WIDTH, 2**24), "|u1"), "patches": ((WIDTH, 2**24), "|u1"), "values": ((WIDTH, 2**24), "<f2")},
         re.escape("64 latents x 16,777,216 patches, 5 bins) would hold more than 2 GB")),
    ]:
        members = {**_index_members(_index()), **{f"{key}.npy": _npy_header(*claim) for key, claim in claims.items()}}
        declared = {f"{key}.npy": len(_npy_header(shape, descr)) + math.prod(shape) * np.dtype(descr).itemsize
                    for key, (shape, descr) in claims.items()}
        _zip(index_case(name, expected), members, declared=declared)
    # 1.2 GB of zeros deflated to about 1 MB, as np.savez_compressed would write a histogram.
    size = 1200 * 2**20
    header = _npy_header((WIDTH, (size - 128) // (8 * WIDTH)))
    members = {name: (data, zipfile.ZIP_STORED, len(data)) for name, data in _index_members(_index()).items()}
    members["histogram.npy"] = (_deflated(header + bytes(size - len(header))), zipfile.ZIP_DEFLATED, size)
    _handmade_zip(index_case("deflated member widening to 1.2 GB", "compressed, which save_index never does"), members)
    _zip(index_case("member of text", "truncated or holds something else than arrays"),
         _index_members(_index(), images=b"these are not arrays " * 4))
    _zip(index_case("member a pickled object array", "holds the wrong kinds"),
         _index_members(_index(), images=_npy(np.array([{"a": 1}, None], dtype=object))))
    _zip(index_case("member of strings", "holds the wrong kinds"),
         _index_members(_index(), values=_npy(np.full((WIDTH, TOP), "x"))))
    _zip(index_case("member of complex numbers", "holds the wrong kinds"),
         _index_members(_index(), values=_npy(np.zeros((WIDTH, TOP), np.complex64))))
    _zip(index_case("tokens_seen a matrix", "holds the wrong kinds"),
         _index_members(_index(), tokens_seen=_npy(np.zeros((3, 3), np.int64))))
    _zip(index_case("a member missing", "lacks some of its arrays"),
         {name: data for name, data in _index_members(_index()).items() if name != "maxima.npy"})
    _zip(index_case("a tenth member", "lacks some of its arrays"), {**_index_members(_index()), "extra.npy": _npy(np.zeros(2))})
    # An archive whose end record claims 65,535 members (zipfile would make an entry for each).
    path = index_case("end record claiming 65,535 members", "lacks some of its arrays")
    _zip(path, _index_members(_index()))
    blob = bytearray(path.read_bytes())
    end = blob.rfind(b"PK\x05\x06")
    blob[end + 8 : end + 12] = struct.pack("<HH", 65_535, 65_535)
    path.write_bytes(bytes(blob))
    for name, changes, expected in [
        ("entries at image 10**9", {"images": np.full((WIDTH, TOP), 10**9)}, "points at images beyond its image set's 8"),
        ("entries at position 10**6", {"patches": np.full((WIDTH, TOP), 10**6)}, "points at positions beyond the tokens"),
        ("entries at image -5", {"images": np.full((WIDTH, TOP), -5)}, "negative counts, images, positions"),
        ("latents the dictionary lacks", {name: value[: WIDTH // 2] for name, value in _arrays(_index()).items()
                                          if name in ("images", "patches", "values", "frequency", "histogram", "maxima")},
         "describes 32 latents and its dictionary has 64"),
        ("a grid of 10**6 x 10**6", {"grid_size": (10**6, 10**6)}, "describes a 1000000x1000000 grid"),
        ("a grid of 0 x 8", {"grid_size": (0, 8)}, "negative counts, images, positions or grid sides"),
        ("values NaN", {"values": np.full((WIDTH, TOP), np.nan, np.float32)}, "not finite numbers"),
        ("frequency 7", {"frequency": np.full(WIDTH, 7.0)}, "shares outside 0 to 1"),
        ("histogram negative", {"histogram": -np.ones((WIDTH, 5), np.int64)}, "negative counts"),
        ("grid of 3 sides", {"grid_size": (8, 8, 8)}, "do not agree on the number of latents"),
    ]:
        _zip(index_case(name, expected), {f"{key}.npy": _npy(value) for key, value in _arrays(_index(**changes)).items()})
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_sae")
    cases = _corpus(root)
    lines, stderr = run_capped(CHILD, [[name, reader, str(path)] for name, reader, path, _ in cases], root)
    return root, cases, {(line["name"], line["reader"]): line for line in lines}, stderr


def test_every_hostile_file_is_refused_in_one_sentence_cheaply(outcomes):
    root, cases, results, stderr = outcomes
    failures = []
    for name, reader, path, expected in cases:
        result = results.get((name, reader))
        if result is None:
            failures.append(f"{name} ({reader}): the child died or hung before or during it:\n{stderr}")
            break
        message = result.get("message", "")
        folder = os.path.realpath(path.parent)
        outside = [opened for opened in result["opened"] if Path(os.path.realpath(opened)).is_relative_to(root)
                   and not Path(os.path.realpath(opened)).is_relative_to(folder)
                   and Path(opened).name != "model.safetensors"]  # the picker's model: its identity
        problems = [
            result["error"] is None and f"read without an error ({result})",
            result["error"] is not None and not result["expected_error"] and f"{result['error']}: {message}",
            not re.search(expected, message) and f"the sentence {message!r} does not match {expected!r}",
            ("\n" in message or str(root) in message or "/" in message) and f"not one sentence without a path: {message!r}",
            result["growth_kb"] >= GROWTH_LIMIT_KB and f"the process grew by {result['growth_kb'] // 1024} MB",
            outside and f"opened outside its folder: {outside}",
        ]
        failures += [f"{name} ({reader}): {problem}" for problem in problems if problem]
    assert not failures, "\n".join(failures)


def test_the_corpus_would_load_without_its_one_hostile_change(tmp_path):
    """The controls: the same generated files, minus the hostile part, are a dictionary and its index."""
    model_path = _model(tmp_path)
    model = vx.load_model(model_path)
    sae, card = vx.load_sae(_sae_file(tmp_path / "good.safetensors", _card(model_path)), model)
    assert card["layer"] == LAYER and torch.equal(sae.W_dec, _sae().W_dec)
    for name, path in [("saved", tmp_path / "saved.index.npz"), ("zipped", tmp_path / "zipped.index.npz")]:
        if name == "saved":
            save_index(_index(), path)
        else:
            _zip(path, _index_members(_index()))
        index = load_index(path, WIDTH)
        index.check_fits(IMAGES, GRID, 0)
        assert np.array_equal(index.images, _index().images) and index.grid_size == GRID
    stored = {name: (data, zipfile.ZIP_STORED, len(data)) for name, data in _index_members(_index()).items()}
    assert load_index(_handmade_zip(tmp_path / "handmade.index.npz", stored), WIDTH).tokens_seen == 512
