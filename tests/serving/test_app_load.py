"""A small load test on the real server: bench.app_load with 3 sessions at once.

Three headless-Chromium sessions (separate Streamlit sessions) each upload their own shapes image
of a different class and walk every page while a training run launched from the Train page is
active. No page may show an exception or an error, and each session's Pipeline page must predict
what the model says for its own image, never another session's. Times are measured by the bench
(python -m bench.app_load), not asserted here. Skips without the system Chromium or Playwright.
"""
import asyncio

import pytest

from bench.app_load import load_test, make_probes
from bench.browser import CHROMIUM, log_tail, serve_app

pytest.importorskip("playwright.async_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")

SESSIONS = 3


def test_three_sessions_walk_every_page_while_training(tmp_path):
    probes = make_probes(SESSIONS, tmp_path / "images")
    assert len({probe.prediction for probe in probes}) == SESSIONS  # each session expects its own answer
    log = tmp_path / "streamlit.log"
    with serve_app({"VIT_EXPLORER_RUNS_DIR": str(tmp_path / "runs")}, log=log) as url:
        (reports,), training_errors = asyncio.run(load_test(url, [probes], timeout_ms=240_000))

    assert [len(report.times) for report in reports] == [6] * SESSIONS  # open, upload, 4 pages each
    problems = [f"{report.name}: {line}" for report in reports for line in report.errors + report.mixups]
    problems += training_errors
    assert not problems, "\n".join(problems) + "\nserver log:\n" + log_tail(log)
