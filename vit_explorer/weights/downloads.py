"""One file from a publisher or a mirror into its place, or a DownloadError sentence: written to a
temporary file beside its final place, checked, and only then renamed into place; a whole
download ends at VIT_EXPLORER_DOWNLOAD_TIMEOUT (a mirror that drips its answer included) and at
the expected size plus a margin, and the temporary files of downloads that were killed are
removed. The catalogue (weights/catalogue.py) says what to fetch and how to check it."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import http.client
import math
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

CHUNK_BYTES = 1 << 20
# A whole download's time. 30 minutes bring a 350 MB model at 200 KB/s, a slow share of a
# classroom's line (SigLIP 2's both towers, 1.5 GB, need 0.85 MB/s); a mirror that drips slower
# than that is given up on.
TIMEOUT_VARIABLE = "VIT_EXPLORER_DOWNLOAD_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 1800.0
READ_TIMEOUT_SECONDS = 30.0  # the longest wait for a connection or for any next bytes


class DownloadError(OSError):
    """A catalogue download failed or gave a wrong file; the message says why in one sentence."""

    status: int | None = None  # the HTTP status the server answered with, where it answered one



def check_hash(path: Path, name: str) -> None:
    """torch.hub's convention for ``name``: "model-<first hex digits of the file's SHA-256>.pth"."""
    expected = re.search(torch.hub.HASH_REGEX, name)
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    if not digest.hexdigest().startswith(expected.group(1)):
        raise DownloadError(f"the downloaded file does not match its checksum ({expected.group(1)}...)")


def download_timeout() -> float:
    """Seconds a whole download may take (VIT_EXPLORER_DOWNLOAD_TIMEOUT, default 30 minutes)."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if not text:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise DownloadError(f"{TIMEOUT_VARIABLE} must be a number of seconds above 0, not {text!r}")
    return seconds


def size_limit(expected_bytes: int) -> int:
    """The most a download of ``expected_bytes`` may bring: a timm file's header and a mirror's
    slightly different copy fit, an endless stream does not."""
    return expected_bytes + expected_bytes // 20 + CHUNK_BYTES


class Deadline:
    """Ends a download's connections at its deadline: a read blocked on a mirror that drips its
    answer (the TLS handshake, status line and headers included) then returns at once."""

    def __init__(self, seconds: float):
        self.passed = False
        self._ended = False
        # Duplicates of the connections' sockets: shutting one down ends its connection, even
        # once TLS has taken the original over.
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock.dup())
            if self.passed:
                self._shut_all()
        return sock

    def _expire(self) -> None:
        with self._lock:
            if not self._ended:
                self.passed = True
                self._shut_all()

    def _shut_all(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # the server may have closed it already
                sock.shutdown(socket.SHUT_RDWR)

    def connection(self, connection_class: type[http.client.HTTPConnection]) -> Callable:
        """A factory of ``connection_class`` whose sockets this deadline watches."""

        def connect(*args, **kwargs) -> http.client.HTTPConnection:
            connection = connection_class(*args, **kwargs)
            create = connection._create_connection  # http.client's own hook for making the socket
            connection._create_connection = lambda *args, **kwargs: self.watch(create(*args, **kwargs))
            return connection

        return connect

    def __enter__(self) -> "Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._timer.cancel()
        with self._lock:
            self._ended = True
            for sock in self._sockets:
                sock.close()


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, request):
        return self.do_open(self._deadline.connection(http.client.HTTPConnection), request)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, request):
        return self.do_open(self._deadline.connection(http.client.HTTPSConnection), request)


def _unreachable(error: OSError) -> str:
    """Why a server could not be reached, in words (no errno)."""
    if isinstance(error, socket.gaierror):
        return "its name could not be resolved"
    if isinstance(error, ConnectionRefusedError):
        return "the connection was refused"
    if isinstance(error, TimeoutError):
        return "it did not answer"
    return (error.strerror or str(error) or type(error).__name__).rstrip(".").lower()


def _broken_answer(error: http.client.HTTPException) -> str:
    if isinstance(error, http.client.IncompleteRead):
        return "the connection was cut in the middle of the file"
    if isinstance(error, http.client.LineTooLong):
        return "an over-long header line"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the connection was closed without an answer"
    if isinstance(error, http.client.BadStatusLine):
        return "no HTTP status line"
    return type(error).__name__


def remove_abandoned(target: Path, seconds: float) -> None:
    """Temporary files (or an open_clip download's staging folders) of downloads that ended without
    cleaning up (their process was killed): older than a whole download may last, so no download
    is still writing them."""
    for temporary in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - temporary.lstat().st_mtime > seconds + READ_TIMEOUT_SECONDS:
                if temporary.is_dir() and not temporary.is_symlink():
                    shutil.rmtree(temporary)
                else:
                    temporary.unlink()


def fetch(
    title: str, source: str, target: Path, check: Callable[[Path], None],
    progress: Callable[[int, int | None], None] | None, *, expected_bytes: int, mirror_variable: str,
    ends: float | None = None,
) -> Path:
    """``source`` into ``target``, checked; ``ends``: the time.monotonic() by which a download of
    several files must end (the whole VIT_EXPLORER_DOWNLOAD_TIMEOUT for one file)."""
    if target.is_file():
        return target
    seconds = download_timeout()
    left = seconds if ends is None else ends - time.monotonic()
    limit = size_limit(expected_bytes)
    failed = f"could not download {title} from {source}"
    if left <= 0:
        raise DownloadError(f"{failed}: it took longer than {seconds:g} s ({TIMEOUT_VARIABLE} allows more)")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target, seconds)
    temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    with Deadline(left) as deadline:
        try:
            with opener(deadline).open(source, timeout=min(READ_TIMEOUT_SECONDS, left)) as response, \
                    open(temporary, "wb") as file:
                total = response.length
                if total is not None and total > limit:
                    raise DownloadError(
                        f"{failed}: the server announced {total} bytes for a file of about {expected_bytes}"
                    )
                done = 0
                # read1: whatever has arrived, so that the deadline and the size are checked as
                # the bytes come, however slowly.
                while chunk := response.read1(CHUNK_BYTES):
                    done += len(chunk)
                    if done > limit:
                        raise DownloadError(
                            f"{failed}: the server sent more than {limit} bytes for a file of about {expected_bytes}"
                        )
                    file.write(chunk)
                    if progress is not None:
                        progress(done, total)
                if deadline.passed and done != total:
                    raise TimeoutError  # cut short by the deadline, whatever the server meant to send
                if total is not None and done != total:
                    raise DownloadError(f"the download of {title} stopped after {done} of {total} bytes")
            check(temporary)
            os.replace(temporary, target)
        except DownloadError:
            raise
        except (OSError, http.client.HTTPException) as error:
            raise failure(error, deadline, title, source, seconds, mirror_variable) from None
        finally:
            temporary.unlink(missing_ok=True)
    return target


def opener(deadline: Deadline) -> urllib.request.OpenerDirector:
    """A urllib opener whose connections ``deadline`` ends."""
    return urllib.request.build_opener(_WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline))


def failure(
    error: OSError | http.client.HTTPException, deadline: Deadline, title: str, source: str, seconds: float,
    mirror_variable: str,
) -> DownloadError:
    """The sentence for a transfer of ``source`` that ended in ``error``."""
    failed = f"could not download {title} from {source}"
    if deadline.passed:
        return DownloadError(f"{failed}: it took longer than {seconds:g} s ({TIMEOUT_VARIABLE} allows more)")
    if isinstance(error, urllib.error.HTTPError):
        answered = DownloadError(f"could not download {title}: {source} answered {error.code} {error.reason}")
        answered.status = error.code
        return answered
    if isinstance(error, http.client.HTTPException):
        return DownloadError(f"{failed}: the server's answer was broken ({_broken_answer(error)})")
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, OSError):
        return DownloadError(f"{failed} (no internet?): {_unreachable(error.reason)}; {mirror_variable} can name a mirror")
    if isinstance(error, TimeoutError):
        return DownloadError(f"{failed}: the server sent nothing for {READ_TIMEOUT_SECONDS:g} s")
    return DownloadError(f"{failed}: {_unreachable(error)}")
