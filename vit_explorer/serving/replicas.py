"""Several app servers behind nginx: ``vit-explorer serve --replicas N``.

One Streamlit server is one Python process: every session's script shares one interpreter, so a
class too big for it is served by several (replicas) behind a reverse proxy. A student's session
lives in one replica (its session state, uploads in flight, media), so the proxy is sticky: on a
first visit nginx sets a cookie with a random value and routes by a consistent hash of it, which
works for a whole class behind one address (ip_hash would send them all to one replica).
Websockets are proxied with long timeouts; the upload limit is the app's server.maxUploadSize.

Replicas share the runs folder and the uploads folder (VIT_EXPLORER_RUNS_DIR,
VIT_EXPLORER_UPLOADS_DIR): runs are followed, stopped and admitted through that folder (see
vit_explorer.training.runs), so that any replica shows and controls every run. A replica that dies is
started again; its students reload. Stopping the whole (Ctrl-C, SIGTERM) stops nginx, the
replicas and the runs (each writes its checkpoint).
"""
from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .. import resources

COOKIE = "vit_explorer_replica"
DEFAULT_UPLOAD_MB = 200  # Streamlit's own default for server.maxUploadSize
START_SECONDS = 120.0  # how long a replica or nginx may take to answer
RESTART_BACKOFF_SECONDS = 5.0  # between restarts of a replica that keeps dying


class ServeError(OSError):
    """The replicas or the proxy could not be started; ``str()`` is the sentence to show."""


def find_nginx() -> str | None:
    """nginx's path: on PATH, else Debian's /usr/sbin/nginx (not on a user's PATH); None if absent."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def max_upload_mb() -> int:
    """The app's server.maxUploadSize (MB) from its .streamlit/config.toml (read with a pattern:
    tomllib is Python 3.11+, and the file is the project's own)."""
    config = resources.app_script().parent / ".streamlit" / "config.toml"
    with contextlib.suppress(OSError):
        server = re.search(r"^\[server\]$(.*?)(?=^\[|\Z)", config.read_text(), re.M | re.S)
        value = server and re.search(r"^maxUploadSize\s*=\s*(\d+)\s*$", server.group(1), re.M)
        if value and int(value.group(1)) > 0:
            return int(value.group(1))
    return DEFAULT_UPLOAD_MB


def nginx_config(
    replica_ports: list[int], *, listen: str = "127.0.0.1:8501", prefix: str | Path = "/tmp/vit-explorer-nginx",
    upload_mb: int | None = None, replica_host: str = "127.0.0.1", user: str | None = None,
) -> str:
    """An nginx.conf for the app's replicas at ``replica_host:replica_ports``, listening on
    ``listen``, with its pid, logs and temporary files in ``prefix`` (nothing needs root).
    ``user``: the user nginx's workers run as when it is started by root."""
    prefix = Path(prefix)
    servers = "\n".join(f"        server {replica_host}:{port} max_fails=1 fail_timeout=5s;" for port in replica_ports)
    return f"""# ViT Explorer: {len(replica_ports)} app replicas behind one proxy (vit-explorer serve writes this).
# Run by hand: nginx -p {prefix} -e {prefix}/error.log -c {prefix}/nginx.conf
daemon off;
{f"user {user};" if user else "# user: nginx runs as whoever starts it"}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;

    # Websockets: Streamlit's session is one long-lived websocket (/_stcore/stream).
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" close;
    }}

    # Sticky sessions: a session's state, uploads and media live in one replica. A first visit
    # gets a random cookie; every request is routed by a consistent hash of it. (ip_hash would
    # send a whole class behind one address to one replica.)
    map $cookie_{COOKIE} $replica_key {{
        "" $request_id;
        default $cookie_{COOKIE};
    }}
    map $cookie_{COOKIE} $replica_cookie {{
        "" "{COOKIE}=$request_id; Path=/; HttpOnly; SameSite=Lax";
        default "";
    }}

    upstream vit_explorer {{
        hash $replica_key consistent;
{servers}
    }}

    server {{
        listen {listen};
        # The app's server.maxUploadSize (checkpoints); the app checks every upload itself.
        client_max_body_size {upload_mb or max_upload_mb()}m;

        location / {{
            proxy_pass http://vit_explorer;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 1d;
            proxy_send_timeout 1d;
            proxy_buffering off;
            proxy_request_buffering off;
            add_header Set-Cookie $replica_cookie always;
            # Which replica answered: for whoever runs the class (and the tests).
            add_header X-Vit-Explorer-Replica $upstream_addr always;
        }}
    }}
}}
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    return False


class Replicas:
    """N app servers on loopback and nginx in front, as a context manager (tests, benchmarks) or
    until a signal (``vit-explorer serve``). A supervising thread starts a replica again when it
    dies. ``url`` is the proxy's address; ``replica_urls`` the replicas' own."""

    def __init__(
        self, count: int, *, port: int = 8501, host: str = "127.0.0.1", runs_dir: str | Path | None = None,
        uploads_dir: str | Path | None = None, replica_ports: list[int] | None = None,
        env: dict[str, str] | None = None, folder: str | Path | None = None, log=print,
    ):
        if count < 1:
            raise ServeError(f"--replicas must be at least 1, not {count}.")
        nginx = find_nginx()
        if nginx is None:
            raise ServeError(
                "nginx is not installed (looked on PATH and at /usr/sbin/nginx); install it, e.g."
                " `apt-get install nginx`, to serve several replicas."
            )
        self.nginx = nginx
        self.count, self.port, self.host = count, port, host
        self.replica_ports = replica_ports or [_free_port() for _ in range(count)]
        if len(self.replica_ports) != count:
            raise ServeError(f"{count} replicas need {count} ports, not {len(self.replica_ports)}.")
        self.folder = Path(folder or tempfile.mkdtemp(prefix="vit-explorer-serve-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        shared = {}
        if runs_dir is not None:
            shared["VIT_EXPLORER_RUNS_DIR"] = str(Path(runs_dir).resolve())
        if uploads_dir is not None:
            shared["VIT_EXPLORER_UPLOADS_DIR"] = str(Path(uploads_dir).resolve())
        self.env = {**os.environ, **shared, **(env or {})}
        self.url = f"http://{host}:{port}"
        self.replica_urls = [f"http://127.0.0.1:{replica}" for replica in self.replica_ports]
        self.processes: list[subprocess.Popen | None] = [None] * count
        self.restarts = [0] * count
        self._nginx: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._log = log

    # --- starting -----------------------------------------------------------------------------

    def _start_replica(self, index: int) -> subprocess.Popen:
        script = resources.app_script()
        if not script.is_file():
            raise ServeError(f"The app is not installed: {script} is missing.")
        output = open(self.folder / f"replica-{index + 1}.log", "a")  # noqa: SIM115 (the child holds it)
        with output:
            process = subprocess.Popen(
                [sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(self.replica_ports[index]),
                 "--server.address", "127.0.0.1", "--server.headless", "true",
                 "--browser.gatherUsageStats", "false"],
                cwd=script.parent, env=self.env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches this supervisor only, which stops them in order
            )
        self.processes[index] = process
        return process

    def _wait_until_answering(self, url: str, process: subprocess.Popen, what: str, log: Path) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not _answers(url):
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
                raise ServeError(f"{what} exited with code {process.returncode} while starting; see {log}.\n{tail}")
            if time.monotonic() > deadline:
                raise ServeError(f"{what} did not answer within {START_SECONDS:.0f} s; see {log}.")
            time.sleep(0.3)

    def start(self) -> "Replicas":
        try:
            for index in range(self.count):
                self._start_replica(index)
            for index, process in enumerate(self.processes):
                self._wait_until_answering(
                    f"{self.replica_urls[index]}/_stcore/health", process, f"Replica {index + 1}",
                    self.folder / f"replica-{index + 1}.log",
                )
            config = self.folder / "nginx.conf"
            user = getpass.getuser() if os.geteuid() == 0 else None  # root's workers would be nobody
            config.write_text(nginx_config(
                self.replica_ports, listen=f"{self.host}:{self.port}", prefix=self.folder, user=user,
            ))
            self._nginx = subprocess.Popen(
                [self.nginx, "-p", str(self.folder), "-e", str(self.folder / "error.log"), "-c", str(config)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
            )
            self._wait_until_answering(f"{self.url}/_stcore/health", self._nginx, "nginx", self.folder / "error.log")
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="replicas-watcher", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        """Start a replica again when it dies (its students reload and carry on)."""
        last_start = [time.monotonic()] * self.count
        while not self._stopping.wait(1.0):
            for index, process in enumerate(self.processes):
                if process is None or process.poll() is None or self._stopping.is_set():
                    continue
                if time.monotonic() - last_start[index] < RESTART_BACKOFF_SECONDS:
                    continue
                self._log(f"replica {index + 1} exited with code {process.returncode}; starting it again")
                self.restarts[index] += 1
                last_start[index] = time.monotonic()
                with contextlib.suppress(OSError, ServeError):
                    self._start_replica(index)
            if self._nginx is not None and self._nginx.poll() is not None and not self._stopping.is_set():
                self._log(f"nginx exited with code {self._nginx.returncode}; see {self.folder / 'error.log'}")
                self._stopping.set()

    # --- stopping -----------------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """nginx has gone: nothing reaches the replicas any more."""
        return self._nginx is not None and self._nginx.poll() is not None

    def stop(self, runs_timeout: float = 0) -> None:
        """Stop nginx and the replicas; with ``runs_timeout``, also ask every live run on the runs
        folder to stop and wait that long for their checkpoints."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)
        for process in [self._nginx, *self.processes]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [self._nginx, *self.processes]:
            if process is None:
                continue
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(15)
        runs_dir = self.env.get("VIT_EXPLORER_RUNS_DIR")
        if runs_timeout and runs_dir:
            from ..training.runs import stop_every_run  # torch: only when there are runs to stop  # torch: only when there are runs to stop

            stopped = stop_every_run(runs_dir, runs_timeout)
            if stopped:
                self._log(f"stopped {stopped} run{'s' if stopped > 1 else ''}")

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(
    replicas: int, *, port: int = 8501, host: str = "127.0.0.1", runs_dir: str | Path | None = None,
    uploads_dir: str | Path | None = None, replica_ports: list[int] | None = None,
) -> int:
    """``vit-explorer serve``: start, print the proxy's address, run until Ctrl-C or SIGTERM."""
    # One runs folder for every replica, resolved once here (each would find the same uploads
    # folder by itself: the user's cache, unless VIT_EXPLORER_UPLOADS_DIR says otherwise).
    runs_dir = runs_dir or resources.default_runs_dir()
    cluster = Replicas(
        replicas, port=port, host=host, runs_dir=runs_dir, uploads_dir=uploads_dir, replica_ports=replica_ports,
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"Starting {replicas} replica{'s' if replicas > 1 else ''} and nginx ...", file=sys.stderr, flush=True)
    cluster.start()
    print(f"ViT Explorer: {cluster.url}", flush=True)
    print(
        f"  {replicas} replica{'s' if replicas > 1 else ''} at {', '.join(cluster.replica_urls)};"
        f" runs in {runs_dir}; nginx config and logs in {cluster.folder}. Ctrl-C stops everything.",
        file=sys.stderr, flush=True,
    )
    while not stop.wait(1.0) and not cluster.failed:
        pass
    print("Stopping nginx, the replicas and the runs ...", file=sys.stderr, flush=True)
    cluster.stop(runs_timeout=60)
    return 1 if cluster.failed and not stop.is_set() else 0
