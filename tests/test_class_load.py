"""The class load test (bench/class_load.py): Locust students speaking Streamlit's protocol.

A small class runs against a real server on loopback, in a process of its own (Locust patches
the standard library for gevent on import, which this test process must not get). Times are
the bench's to print, not asserted here. The protocol client's reading of a page is checked on
hand-made protobufs: what it takes for an error, a prediction and a widget's value.
"""
import json
import subprocess
import sys

from streamlit.proto.Element_pb2 import Element

from bench.browser import ROOT
from bench.streamlit_client import MAIN, SIDEBAR, Page, Shown, widget_value

# Open, upload, then two more: the students' walks are seeded by their number, so student 1 visits
# Attention and moves one of its sliders, student 2 visits Pipeline (no slider) and Patches.
STUDENTS, ACTIONS = 2, 4


def test_a_small_class_runs_without_errors_or_mixups(tmp_path):
    out = tmp_path / "result.json"
    finished = subprocess.run(
        [sys.executable, "-m", "bench.class_load", "--students", str(STUDENTS), "--actions", str(ACTIONS),
         "--think", "0.2,0.5", "--duration", "100", "--spawn-rate", "2", "--json", str(out),
         "--folder", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads(out.read_text())
    report = finished.stdout[-3000:]
    assert result["errors"] == [], report
    assert result["mixups"] == [], report
    assert sorted(result["actions"].values()) == [ACTIONS] * STUDENTS, report  # every student did all
    assert set(result["by_kind"]) == {"open", "upload", "page", "slider"}, report
    # Each upload lands on Pipeline: its "The model says ..." was read and was the student's own.
    assert result["predictions"] >= STUDENTS, report
    assert result["server_cpu"] > 0 and result["views"] >= 2 * STUDENTS, report
    assert "WS       upload" in finished.stdout  # Locust's own stats saw the runs


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
