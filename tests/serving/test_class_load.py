"""The class load test (bench/class_load.py): Locust students speaking Streamlit's protocol.

A small class runs against a real server on loopback, and one through vit-explorer serve's nginx
in front of two replicas, each in a process of its own (Locust patches
the standard library for gevent on import, which this test process must not get). Times are
the bench's to print, not asserted here. The protocol client's reading of a page is checked on
hand-made protobufs: what it takes for an error, a prediction and a widget's value.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from streamlit.proto.Element_pb2 import Element

import vit_explorer as vx
from bench.browser import ROOT
from bench.streamlit_client import MAIN, SIDEBAR, Page, Shown, widget_value
from vit_explorer.serving.replicas import find_nginx

# Open, upload, then the Attention page and one of its sliders (a walk of two pages starts at the
# first for these students: their walks are seeded by their number). Two pages keep the server's
# unmeasured warm-up, every walked page once, short.
STUDENTS, ACTIONS, PAGES = 2, 4, "Attention,Pipeline"


def small_class(folder, *options: str, env: dict | None = None) -> tuple[dict, str]:
    """Run the bench on a small class (``env`` added to its environment); its figures and what it printed."""
    out = folder / "result.json"
    finished = subprocess.run(
        [sys.executable, "-m", "bench.class_load", "--think", "0.2,0.5", "--duration", "100", "--spawn-rate", "2",
         "--json", str(out), "--folder", str(folder), *options],
        cwd=ROOT, capture_output=True, text=True, timeout=170, env={**os.environ, **(env or {})},
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(out.read_text()), finished.stdout


def test_a_small_class_runs_without_errors_or_mixups(tmp_path):
    result, printed = small_class(tmp_path, "--students", str(STUDENTS), "--actions", str(ACTIONS), "--pages", PAGES)
    report = printed[-3000:]
    assert result["errors"] == [], report
    assert result["mixups"] == [], report
    assert sorted(result["actions"].values()) == [ACTIONS] * STUDENTS, report  # every student did all
    assert set(result["by_kind"]) == {"open", "upload", "page", "slider"}, report
    # Each upload lands on Pipeline: its "The model says ..." was read and was the student's own.
    assert result["predictions"] >= STUDENTS, report
    assert result["server_cpu"] > 0 and result["views"] >= 2 * STUDENTS, report
    assert "WS       upload" in printed  # Locust's own stats saw the runs


def test_predictions_are_checked_against_the_servers_default_model(tmp_path):
    """With VIT_EXPLORER_DEFAULT_MODEL naming another model, the students expect that model's
    predictions (they expected the shipped model's, and every student read as mixed up)."""
    torch.manual_seed(0)
    weights = tmp_path / "other.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10,
    )), weights)
    result, printed = small_class(
        tmp_path, "--students", "2", "--actions", "2", "--pages", "Pipeline",
        env={"VIT_EXPLORER_DEFAULT_MODEL": str(weights)},
    )
    assert result["errors"] == [] and result["mixups"] == [], printed[-3000:]
    assert result["predictions"] >= 2 and "the model other.safetensors" in printed


def test_heavy_students_jobs_finish_beside_the_light_ones(tmp_path):
    """One heavy student beside one light one, on a tiny model whose every timed pass counts as
    slow (VIT_EXPLORER_QUICK_SECONDS=0), so that its work is jobs as a ViT-B/16's is: the light
    class alone, then beside it, and the last line compares them and counts the heavy jobs."""
    torch.manual_seed(0)
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10,
    )), weights)
    result, printed = small_class(
        tmp_path, "--heavy", "1", "--heavy-think", "0.2,0.5", "--students", "1", "--duration", "15", "--pages", PAGES,
        env={"VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_QUICK_SECONDS": "0"},
    )
    report = printed[-4000:]
    last = printed.strip().splitlines()[-1]
    shape = re.fullmatch(
        r"light p95 beside 1 heavy / alone: ([\d.]+) s / ([\d.]+) s = ([\d.]+)x; slider moves .+ = [\d.]+x;"
        r" heavy 1: (\d+) finished / (\d+) cancelled / (\d+) lost, (\d+) errors", last,
    )
    assert shape, report
    _, _, ratio, finished, _, lost, errors = shape.groups()
    assert float(ratio) == pytest.approx(result["beside_heavy"]["p95"] / result["alone"]["p95"], abs=0.006)
    assert int(finished) >= 1 and (lost, errors) == ("0", "0"), report
    (heavy,) = result["heavy"]
    assert heavy["inline"] == 0 and heavy["failed"] == 0, report  # every piece of work was a job
    assert result["alone"]["errors"] == result["beside_heavy"]["errors"] == [], report
    assert result["beside_heavy"]["mixups"] == [] and result["workers_ended"] == 0, report


@pytest.mark.skipif(find_nginx() is None, reason="no nginx (apt-get install nginx)")
def test_a_class_through_the_replicas_proxy(tmp_path):
    """Behind vit-explorer serve's nginx: each student's cookies keep it on one replica, or its
    upload (a PUT to its session's replica) and its runs would fail."""
    students = 4
    result, printed = small_class(
        tmp_path, "--replicas", "2", "--students", str(students), "--actions", "3", "--pages", "Pipeline,Train"
    )
    report = printed[-3000:]
    assert result["errors"] == [] and result["mixups"] == [], report
    assert sorted(result["actions"].values()) == [3] * students, report
    assert sum(result["replicas"].values()) == students, report  # the proxy named the replica of each


def element(kind: str, **fields) -> Element:
    shown = Element()
    getattr(shown, kind).SetInParent()
    for name, value in fields.items():
        target = getattr(getattr(shown, kind), name)
        if isinstance(value, list):
            target.extend(value)
        else:
            setattr(getattr(shown, kind), name, value)
    return shown


def test_a_page_reads_errors_predictions_and_the_chosen_image():
    alert = element("alert", body="Could not use x.png: not an image.", format=1)  # Alert.Format.ERROR
    warning = element("alert", body="A warning is no error.", format=2)
    exception = element("exception", type="ValueError", message="boom")
    said = element("markdown", body="The model says **circle** with probability 99.9%.")
    picker = element("selectbox", id="picker", label="Image", options=["Shapes #0: ring", "Uploaded: mine.png"],
                     raw_value="Uploaded: mine.png", set_value=True)
    title = element("heading", tag="h1", body="Pipeline")
    page = Page([Shown((MAIN, 0), "p", title), Shown((MAIN, 1), "p", said), Shown((MAIN, 2), "p", alert),
                 Shown((MAIN, 3), "p", warning), Shown((MAIN, 4), "p", exception),
                 Shown((SIDEBAR, 0), "m", picker)], "p")
    assert page.title() == "Pipeline"
    assert page.prediction() == ("circle", 99.9)
    assert page.errors() == ["error: Could not use x.png: not an image.", "exception ValueError: boom"]
    assert page.selected("Image") == "Uploaded: mine.png"
    assert Page([Shown((MAIN, 0), "p", title)], "p").prediction() is None


def test_widget_values_are_what_the_frontend_would_send():
    layer = element("slider", id="layer", label="Layer", default=[0.0], value=[3.0], set_value=True)
    assert list(widget_value(layer).double_array_value.data) == [3.0]
    fresh = element("slider", id="layer", label="Layer", default=[2.0])
    assert list(widget_value(fresh).double_array_value.data) == [2.0]
    patch = element("slider", id="patch", label="Patch size", type=2, options=["2 px", "4 px", "8 px"],
                    default=[0.0], raw_value=["4 px"], set_value=True)  # a select slider: labels, not indices
    assert list(widget_value(patch).string_array_value.data) == ["4 px"]
    picker = element("selectbox", id="picker", label="Image", options=["a", "b"], default=1)
    assert widget_value(picker).string_value == "b"
    assert widget_value(element("button", id="go", label="Go")) is None  # a trigger: sent on a click only
