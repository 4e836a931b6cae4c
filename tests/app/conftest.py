"""The app's tests that drive a real server."""
import pytest

from apptest import tiny_app_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One `streamlit run` with tiny_model() for the Chromium tests that each open their own sessions
    and launch at most one run (test_browser's walk, its "run 1"): a server's start and its first page
    (importing torch in it) took 9-10 s of the 3 s a later session's first page takes."""
    with tiny_app_server(tmp_path_factory.mktemp("server")) as url:
        yield url
