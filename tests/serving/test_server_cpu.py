"""What keeps the server's CPU per page view down: the import-time freeze of the collector.

Run in a fresh interpreter, since this pytest process imported vit_explorer.app long ago.
"""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FREEZE_PROBE = """
import gc, json, sys
before = gc.get_freeze_count()
import vit_explorer.app
frozen = gc.get_freeze_count()
from streamlit.testing.v1 import AppTest
app = AppTest.from_file(sys.argv[1], default_timeout=120)
app.run()
app.run()
print(json.dumps(dict(before=before, frozen=frozen, after=gc.get_freeze_count(),
                      exceptions=[e.value for e in app.exception])))
"""


def test_the_imports_are_frozen_once_and_runs_are_not(tmp_path):
    """Importing vit_explorer.app freezes torch's, plotly's and streamlit's objects (so that Streamlit's
    collection after each run skips them); runs of the app freeze nothing more."""
    env = {"VIT_EXPLORER_RUNS_DIR": str(tmp_path / "runs"), "VIT_EXPLORER_UPLOADS_DIR": str(tmp_path / "uploads")}
    done = subprocess.run(
        [sys.executable, "-c", FREEZE_PROBE, str(ROOT / "app.py")], cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, **env}, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["exceptions"] == []
    assert counts["before"] == 0
    assert counts["frozen"] > 100_000  # torch, plotly, streamlit and the package's modules
    # Two runs later: frozen objects may have been freed, none were added by a second freeze.
    assert counts["after"] <= counts["frozen"]


def test_the_sidebar_image_is_encoded_once_and_small():
    """st.image of a PIL image re-encodes it as PNG on every run; the sidebar gets bytes made
    once per image: a photo as a JPEG within SIDEBAR_IMAGE_PX, a small picture as it is (PNG)."""
    from PIL import Image

    from vit_explorer.app import images

    photo = Image.open(ROOT / "assets" / "samples" / "astronaut.png").convert("RGB")
    encoded = images.sidebar_image("photo:astronaut.png", photo)
    assert encoded is images.sidebar_image("photo:astronaut.png", photo)  # computed once, then shared
    shown = Image.open(io.BytesIO(encoded))
    assert shown.format == "JPEG" and max(shown.size) == images.SIDEBAR_IMAGE_PX
    assert shown.size[0] / shown.size[1] == photo.size[0] / photo.size[1]

    shapes = Image.new("RGB", (32, 32), (10, 200, 30))
    small = Image.open(io.BytesIO(images.sidebar_image("shapes:0", shapes)))
    assert small.format == "PNG" and small.size == (32, 32)
    assert small.getpixel((5, 5)) == (10, 200, 30)  # lossless


def test_sample_image_options_are_made_once_and_handed_out_fresh():
    """The sidebar's labels come from the shared cache, and the app adds its uploads to what it
    gets: that never reaches the cached labels or another session."""
    from vit_explorer.app import images

    first = images.sample_image_options((32, 32))
    assert "shapes:0" in first and any(key.startswith("photo:") for key in first)
    first["upload:mine"] = "Uploaded: mine.png"
    again = images.sample_image_options((32, 32))
    assert "upload:mine" not in again and again.keys() == first.keys() - {"upload:mine"}


def test_figures_serialize_the_same_with_orjson_as_with_the_standard_encoder():
    """st.plotly_chart serializes every figure on every run through plotly.io.to_json, which
    takes orjson where it is installed (a requirement, for speed): the browser must get the
    same figure, NaN gaps and float16 attention included."""
    import numpy as np
    import plotly.io as pio
    import pytest

    from vit_explorer import figures

    pytest.importorskip("orjson")
    image = np.random.default_rng(0).integers(0, 255, (12, 8, 3), dtype=np.uint8)
    maps = np.random.default_rng(1).random((3, 3, 2)).astype(np.float16)
    maps[0, 0, 0] = np.nan
    for fig in (figures.attention_heads_grid(image, maps, opacity=0.5, layer=1),
                figures.attention_overlay(image, maps[1].astype(np.float32), opacity=0.4, title="Rollout")):
        assert json.loads(pio.to_json(fig, validate=False, engine="orjson")) == json.loads(
            pio.to_json(fig, validate=False, engine="json")
        )


def test_the_bench_reads_a_process_cpu_time_from_proc():
    """bench.server_cpu's CPU-seconds of a process: this one's agrees with its own clock."""
    import time

    from bench.server_cpu import cpu_seconds

    before, clock = cpu_seconds(os.getpid()), time.process_time()  # both: every thread of it
    while time.process_time() - clock < 0.3:  # busy
        pass
    spent, counted = cpu_seconds(os.getpid()) - before, time.process_time() - clock
    assert spent > 0.2
    assert abs(spent - counted) < 0.05  # /proc counts in clock ticks of 10 ms


def test_a_memoised_figure_is_sent_as_its_own_json_made_once_and_holds_no_plotly_objects():
    """st.plotly_chart serializes every figure on every run, and Streamlit's collection after
    every run walks every object a cached figure holds; a memoised figure is its JSON, made
    when it was cached, and Streamlit sends the same JSON and the same size."""
    import gc

    import numpy as np
    import plotly.io as pio
    import plotly.tools
    from streamlit.elements.plotly_chart import _resolve_content_height, _resolve_content_width

    from vit_explorer import figures
    from vit_explorer.app import memo

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    maps = rng.random((3, 4, 4))

    def grid():
        return figures.attention_heads_grid(image, maps, layer=1, query="CLS")

    def sent(figure):  # what st.plotly_chart sends, and the size it gives the chart
        as_dict = plotly.tools.return_figure_from_figure_or_data(figure, True)
        size = _resolve_content_width("content", as_dict), _resolve_content_height("content", as_dict)
        return pio.to_json(as_dict, validate=False), size

    key = ("test sent figure", id(maps))
    shared = memo.memo(key, lambda: {"grid": grid(), "note": "text"})
    assert isinstance(shared["grid"], memo.SentFigure) and shared["note"] == "text"
    assert sent(shared["grid"]) == sent(grid())
    assert sent(shared["grid"])[1][1] == grid().layout.height  # the grid's own height, not a default
    assert shared["grid"].to_dict() is shared["grid"].to_dict()  # made once
    # The collector sees a handful of objects (besides classes), not a figure's hundreds.
    held = [shared["grid"]]
    for _ in range(3):
        held = [child for item in held for child in gc.get_referents(item)
                if gc.is_tracked(child) and not isinstance(child, type)]
        assert len(held) <= 4
    assert memo.memo(key, lambda: None) is shared
    # Arrays of numbers go as typed arrays, as to_dict writes them; the figure made from is not
    # kept, so serializing may change it, but never a figure made anew.
    vectors = {"x": rng.standard_normal(64).astype(np.float32), "y": np.arange(64)}
    strips = lambda: figures.vector_strips(vectors, "two strips")
    memoised = memo.memo(("test sent strips", id(maps)), strips)
    assert sent(memoised) == sent(strips()) and '"bdata"' in sent(memoised)[0]
