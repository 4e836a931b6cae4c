"""The app on loopback and a headless Chromium to drive it: shared by the browser tests and benches.

`serve_app` runs `streamlit run app.py` on a free 127.0.0.1 port and always ends it again (`app_server`
the same, with a port of one's choice, giving the process id too);
`CHROMIUM_LAUNCH` are the arguments for Playwright's `chromium.launch` (sync or async API) that
use the system Chromium (Debian: apt-get install chromium): Playwright's own browser download is
not needed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_LAUNCH = dict(
    executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
)
# Streamlit's "running" indicator: a run (or fragment run) is in progress while it is shown.
STATUS_WIDGET = '[data-testid="stStatusWidget"]'
# What Streamlit draws for an uncaught exception and for st.error.
ERROR_ELEMENTS = '[data-testid="stException"], [data-testid="stAlertContentError"]'


def settle(page, timeout_ms: float = 60_000) -> None:
    """Wait until Streamlit has finished the current run of a Playwright (sync) page: its status
    widget, shown a moment after the run starts, has gone again."""
    page.wait_for_timeout(300)
    page.locator(STATUS_WIDGET).wait_for(state="hidden", timeout=timeout_ms)


class ServerError(RuntimeError):
    """The app did not start, or ended on its own; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass(frozen=True)
class Server:
    url: str
    pid: int  # the streamlit process: its CPU time is in /proc/<pid>/stat


@contextlib.contextmanager
def serve_app(env: dict[str, str] | None = None, log: Path | None = None, start_timeout: float = 90.0) -> Iterator[str]:
    """`streamlit run app.py` on 127.0.0.1 with ``env`` added; yields its URL, terminates it after."""
    with app_server(env, log, start_timeout) as server:
        yield server.url


@contextlib.contextmanager
def app_server(
    env: dict[str, str] | None = None, log: Path | None = None, start_timeout: float = 90.0, port: int | None = None,
    args: Sequence[str] = (),
) -> Iterator[Server]:
    """`streamlit run app.py` (with ``args``) on 127.0.0.1 (``port``, else a free one) with ``env``
    added; yields its URL and process id once it answers, terminates it after.

    The server's output goes to ``log`` (by default a temporary file, removed after: a failed
    start's error quotes its end), not to a pipe that nobody reads and that would block the
    server once full.
    """
    if log is None:
        with tempfile.TemporaryDirectory(prefix="vit_explorer_app_") as folder:
            with app_server(env, Path(folder) / "streamlit.log", start_timeout, port, args) as server:
                yield server
        return
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
             "--server.address", "127.0.0.1", "--server.headless", "true",
             "--browser.gatherUsageStats", "false", *args],
            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=output, stderr=subprocess.STDOUT, text=True,
        )
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise ServerError(f"streamlit exited with {process.returncode}:\n{log_tail(log)}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerError(f"streamlit did not answer within {start_timeout:.0f} s:\n{log_tail(log)}")
            time.sleep(0.5)
        yield Server(url, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
