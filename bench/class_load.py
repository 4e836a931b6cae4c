"""A class without browsers: Locust students that speak Streamlit's own protocol to the real server.

Chromium on the same two cores costs more than the server, so it cannot simulate a class. Each
simulated student here is a Locust user (gevent) that does what the browser's frontend does, with
the protobufs that ship with streamlit (`streamlit.proto`): it fetches the page and
`/_stcore/health` (cookies kept per student: Streamlit's XSRF cookie, a proxy's sticky cookie),
opens the websocket `/_stcore/stream`, sends `rerun_script` BackMsgs (query string, page script
hash, every widget's state, the hashes of the messages it caches) and reads the ForwardMsgs
(`new_session`, deltas, `script_finished`) into the page they draw. It uploads its own shapes image
the way `st.file_uploader` does (a `file_urls_request`, an HTTP PUT to the URL the server gives,
a rerun with the uploader's state), then walks every page and moves one slider on each (widgets
found by id and label in the deltas), waiting for each run to finish, with think time between.

Each finished run is checked: no exception or `st.error` on the page, the expected page's title,
the sidebar's image is the student's own upload (the picker's label and the thumbnail's pixels,
which must be closer to its own image than to any other student's), and the Pipeline page
predicts what the model says for that image at the patch size the session uses (computed here). Locust's stats get one request per
action ("WS" requests) beside the HTTP ones. The server's CPU time is read from /proc before and
after.

    python -m bench.class_load --students 30                  # starts `streamlit run app.py` on loopback
    python -m bench.class_load --students 30 --think 5,10 --duration 120 --spawn-rate 1
    python -m bench.class_load --url http://127.0.0.1:8501/ --server-pid 1234   # an existing server or proxy
    python -m bench.class_load --replicas 2                   # vit-explorer serve's replicas behind nginx
    python -m bench.class_load --pages Pipeline,Patches,Attention,Train     # bench.app_load's walk

It stops by itself: after --actions actions per student or --duration seconds, whichever first.
Loopback only.
"""
from __future__ import annotations

# Locust patches the standard library for gevent when imported: before anything opens a socket.
# isort: off
import locust  # noqa: F401
# isort: on

import argparse
import io
import itertools
import json
import os
import random
import re
import statistics
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import numpy as np
from locust import HttpUser, between, task
from locust.clients import HttpSession, LocustHttpAdapter
from locust.env import Environment
from locust.event import Events
from locust.exception import StopUser
from locust.stats import get_percentile_stats_summary, get_stats_summary
from PIL import Image
from streamlit.proto.WidgetStates_pb2 import WidgetState
from urllib3.util.retry import Retry

import vit_explorer as vx
from bench.app_load import Probe, is_own, make_probes, percentile
from bench.browser import app_server, free_port, log_tail
from bench.streamlit_client import MAIN, SELECT_SLIDER, SIDEBAR, Page, ProtocolError, Shown, StreamlitSession, widget_value
from vit_explorer.serve import Replicas
from vit_explorer.train import DEFAULT_WEIGHTS

# The pages a student walks, in the sidebar's order; it starts at a random one after the upload.
PAGES = ("Pipeline", "Patches", "Attention", "Inside a layer", "Train", "Several images", "Knock-out", "Compare")
IMAGE_PICKER = "Image"  # the sidebar's selectbox of images
# The sidebar's caption of the model (vit_explorer.app.models.describe): the input and patch size the pages use.
SIZES = re.compile(r"(\d+)x(\d+) px input, patch (\d+) ")


class Expected:
    """What the model predicts for each student's image at the patch and input size its session
    uses (a student may move the Patches page's patch size): computed here, once for each."""

    def __init__(self, probes: list[Probe], weights: Path):
        self.model = vx.load_model(weights).eval()
        self.images = {number: Image.open(probe.path).convert("RGB") for number, probe in enumerate(probes, 1)}
        self.native = {number: (probe.prediction, probe.probability) for number, probe in enumerate(probes, 1)}
        self._models: dict[tuple, vx.ViT] = {}
        self._found: dict[tuple, tuple[str, float]] = {}

    def __call__(self, number: int, patch: int, size: tuple[int, int]) -> tuple[str, float]:
        config = self.model.config
        if patch == config.patch_size and size == tuple(config.img_size):
            return self.native[number]
        if (number, patch, size) not in self._found:
            if (patch, size) not in self._models:  # as the app's models.model_at resizes
                self._models[patch, size] = vx.resize_model(
                    self.model, patch_size=patch, image_size=size, share_weights=True).eval()
            model = self._models[patch, size]
            probabilities = vx.capture(model, vx.preprocess(self.images[number], model.config)).logits.softmax(-1)[0]
            best = int(probabilities.argmax())
            names = model.config.class_names or [f"class {index}" for index in range(model.config.num_classes)]
            self._found[number, patch, size] = (names[best], 100 * float(probabilities[best]))
        return self._found[number, patch, size]


# --- a student ------------------------------------------------------------------------------------


@dataclass
class ClassReport:
    """Everything the students saw, shared by their greenlets (one thread: no locks needed)."""

    runs: list[tuple[str, float]] = field(default_factory=list)  # (kind of action, seconds to its finished run)
    views: int = 0  # finished page views: opening the app and every page switch
    errors: list[str] = field(default_factory=list)
    mixups: list[str] = field(default_factory=list)
    predictions: int = 0  # Pipeline pages whose prediction was checked against the student's image
    actions: dict[int, int] = field(default_factory=dict)  # student -> actions finished
    done: int = 0  # students that finished all their actions (or had to give up)
    sessions: list[StreamlitSession] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    actions: int = 20  # per student, opening the app and the upload included
    timeout: float = 60.0  # the longest wait for one run
    pages: tuple[str, ...] = PAGES  # the pages walked, in this order


def image_array(data: bytes | Path) -> np.ndarray:
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float32)


class Student(HttpUser):
    """One student: opens the app, uploads its own image, walks the pages moving a slider on each.

    Configured by `student_class` (the roster of images, the shared report, the options).
    """

    abstract = True
    roster: list[tuple[int, Probe]]
    images: dict[int, np.ndarray]  # every student's image, to tell whose the thumbnail is
    expected: Expected
    report: ClassReport
    options: Options

    def on_start(self) -> None:
        # Like a browser: a request on a kept-alive connection the server has just closed (uvicorn
        # closes them after 5 s idle, shorter than a student's think) is sent again, once.
        retry = Retry(total=1, connect=1, read=1, status=0, other=0, allowed_methods=None, raise_on_status=False)
        self.client.mount("http://", LocustHttpAdapter(pool_manager=None, max_retries=retry))
        self.streamlit = None
        if not self.roster:
            # A user Locust starts after every student has come (seen at the end of short classes,
            # 1 run in 4): it has no student to be, so it leaves at its first task.
            return
        self.number, self.probe = self.roster.pop(0)
        self.rng = random.Random(self.number)
        self.streamlit = StreamlitSession(self.host, self.client, self.options.timeout)
        self.report.sessions.append(self.streamlit)
        self.report.actions[self.number] = 0
        self.uploaded = False
        self.thumbnails: dict[str, int] = {}  # media URL -> the student whose image it is
        self.plan = self.walk()

    def on_stop(self) -> None:
        if self.streamlit is not None:
            self.streamlit.close()

    def walk(self) -> Iterator[tuple[str, object]]:
        """The actions, in order: open, upload, then the pages from a random one on, moving one
        slider (if the page has any) after each page."""
        yield "open", self.streamlit.open
        data = self.probe.path.read_bytes()
        yield "upload", lambda: self.streamlit.upload("Upload an image", self.probe.path.name, data)
        pages = self.options.pages
        start = self.rng.randrange(len(pages))
        for step in itertools.count():
            name = pages[(start + step) % len(pages)]
            yield f"page: {name}", lambda name=name: self.streamlit.go_to(name)
            sliders = self.streamlit.page.widgets("slider", MAIN)
            if sliders:
                slider = self.rng.choice(sliders)
                yield f"slider: {name}", lambda slider=slider: self.streamlit.rerun(changed=self.moved(slider))

    def moved(self, shown: Shown) -> WidgetState:
        """The slider's state after the student drags it to another value."""
        slider, state = shown.widget, WidgetState(id=shown.widget.id)
        if slider.type == SELECT_SLIDER:
            current = widget_value(shown.element).string_array_value.data[0]
            state.string_array_value.data.append(self.rng.choice([o for o in slider.options if o != current]))
            return state
        steps = round((slider.max - slider.min) / slider.step)
        current = widget_value(shown.element).double_array_value.data[0]
        values = [slider.min + i * slider.step for i in range(steps + 1)]
        value = self.rng.choice([v for v in values if abs(v - current) > slider.step / 2] or values)
        state.double_array_value.data.append(round(value, 10))
        return state

    @task
    def act(self) -> None:
        if self.streamlit is None:
            raise StopUser()
        if self.report.actions[self.number] >= self.options.actions:
            self.give_up()
        kind, action = next(self.plan)
        where = f"student {self.number}, {kind}"
        received = self.streamlit.bytes_received
        start = time.perf_counter()
        try:
            page = action()
        except Exception as error:  # a lost connection, a timeout, an HTTP error: this student stops
            self.fire(kind, time.perf_counter() - start, received, error)
            self.report.errors.append(f"{where}: {type(error).__name__}: {error}")
            self.give_up()
        seconds = time.perf_counter() - start
        problems = page.errors()
        expected = kind.partition(": ")[2] if kind.startswith("page: ") else None
        if expected and page.title() != expected:
            problems.append(f"shows the page titled {page.title()!r}, not {expected!r}")
        self.fire(kind, seconds, received, ProtocolError("; ".join(problems)) if problems else None)
        self.report.errors += [f"{where}: {problem}" for problem in problems]
        self.report.runs.append((kind.partition(":")[0], seconds))
        self.report.views += kind == "open" or kind.startswith("page: ")
        self.report.actions[self.number] += 1
        self.uploaded = self.uploaded or kind == "upload"
        if self.uploaded:
            try:
                self.report.mixups += [f"{where}: {line}" for line in self.mixups(page)]
            except Exception as error:  # the thumbnail could not be fetched or read
                self.report.errors.append(f"{where}: checking the image failed: {type(error).__name__}: {error}")

    def fire(self, kind: str, seconds: float, received: int, error: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="WS", name=kind, response_time=seconds * 1000, context={},
            response_length=self.streamlit.bytes_received - received, exception=error,
        )

    def give_up(self):
        self.report.done += 1
        raise StopUser()

    def mixups(self, page: Page) -> list[str]:
        """What on the page is not this student's own image."""
        found = []
        picked = page.selected(IMAGE_PICKER)
        if picked != f"Uploaded: {self.probe.path.name}":
            found.append(f"the sidebar's image is {picked!r}, not Uploaded: {self.probe.path.name}")
        url = page.thumbnail_url()
        if url is None:
            found.append("the sidebar shows no image")
        else:
            if url not in self.thumbnails:
                self.thumbnails[url] = self.whose(image_array(self.streamlit.fetch(url)))
            if self.thumbnails[url] != self.number:
                found.append(f"the sidebar's picture is student {self.thumbnails[url]}'s")
        if page.title() == "Pipeline":
            sizes = next(filter(None, map(SIZES.search, page.texts(SIDEBAR))), None)
            if sizes is None:
                found.append("the sidebar does not say the model's input and patch size")
                return found
            height, width, patch = map(int, sizes.groups())
            expected = self.expected(self.number, patch, (height, width))
            shown = page.prediction()
            self.report.predictions += 1
            if not is_own(Probe(self.probe.path, *expected), shown):
                found.append(f"predicts {shown}, expected ({expected[0]!r}, {expected[1]:.1f}) at patch {patch}")
        return found

    def whose(self, picture: np.ndarray) -> int:
        """The student whose image is closest to ``picture`` (a JPEG of one, maybe resized)."""
        def distance(image: np.ndarray) -> float:
            if image.shape != picture.shape:
                resized = Image.fromarray(picture.astype(np.uint8)).resize(image.shape[1::-1], Image.BILINEAR)
                return float(np.abs(np.asarray(resized, dtype=np.float32) - image).mean())
            return float(np.abs(picture - image).mean())
        return min(self.images, key=lambda number: distance(self.images[number]))


def server_weights() -> Path:
    """The server's default model, as it finds it (app.models.default_weights): the students'
    predictions are checked against that model, not the shipped one."""
    return Path(os.environ.get("VIT_EXPLORER_DEFAULT_MODEL") or DEFAULT_WEIGHTS)


def student_class(probes: list[Probe], report: ClassReport, options: Options, think: tuple[float, float],
                  weights: Path):
    """A Student class for this run (Locust builds users from a class)."""
    return type("ConfiguredStudent", (Student,), dict(
        abstract=False, wait_time=between(*think), report=report, options=options,
        expected=Expected(probes, weights),
        roster=list(enumerate(probes, 1)),
        images={number: image_array(probe.path) for number, probe in enumerate(probes, 1)},
    ))


# --- the class ------------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    """One class's figures, as printed (and written with --json)."""

    students: int
    seconds: float
    runs: int
    views: int
    runs_per_s: float
    views_per_s: float
    p50: float | None
    p95: float | None
    max: float | None
    by_kind: dict[str, tuple[int, float, float]]  # kind -> (count, p50, p95)
    server_cpu: float | None
    cpu_per_run: float | None
    cpu_per_view: float | None
    generator_cpu: float
    predictions: int
    actions: dict[int, int]
    errors: list[str]
    mixups: list[str]
    replicas: dict[str, int]  # behind vit-explorer serve's proxy: replica -> students it served


def run_class(url: str, probes: list[Probe], think: tuple[float, float], spawn_rate: float, duration: float,
              options: Options, pids: list[int], warm_urls: list[str] | None = None) -> tuple[Result, Environment]:
    """``len(probes)`` students at ``url`` until each has done its actions or ``duration`` is up.

    ``warm_urls`` (default ``url``) are visited first, every page once, unmeasured: a fresh
    server's first views load the model and import what each page needs.
    """
    for warm_url in warm_urls or [url]:
        warm = StreamlitSession(warm_url, _http(warm_url), options.timeout)
        try:
            warm.open()
            for page in options.pages:
                warm.go_to(page)
        except Exception as error:
            raise SystemExit(f"The app at {warm_url} did not open: {type(error).__name__}: {error}") from None
        finally:
            warm.close()
    report = ClassReport()
    environment = Environment(user_classes=[student_class(probes, report, options, think, server_weights())], host=url)
    runner = environment.create_local_runner()
    cpu_before, own_before, start = cpu_seconds(pids), _own_cpu(), time.monotonic()
    runner.start(len(probes), spawn_rate=spawn_rate)
    while report.done < len(probes) and time.monotonic() - start < duration:
        gevent.sleep(0.2)
    seconds = time.monotonic() - start
    try:
        server_cpu = cpu_seconds(pids) - cpu_before if pids else None
    except FileNotFoundError:  # a server process ended (a replica started again): no total to give
        server_cpu = None
        report.errors.append("a server process ended during the class")
    generator_cpu = _own_cpu() - own_before
    runner.quit()
    for session in report.sessions:
        session.close()
    # Whatever escaped a student (a bug here, not the server's) is an error too: Locust caught it.
    report.errors += [f"load generator: {error['msg']}" for error in runner.exceptions.values()]
    times = [seconds_ for _, seconds_ in report.runs]
    kinds = sorted({kind for kind, _ in report.runs})
    by_kind = {}
    for kind in kinds:
        values = [s for k, s in report.runs if k == kind]
        by_kind[kind] = (len(values), percentile(values, 50), percentile(values, 95))
    return Result(
        students=len(probes), seconds=seconds, runs=len(times), views=report.views,
        runs_per_s=len(times) / seconds, views_per_s=report.views / seconds,
        p50=percentile(times, 50) if times else None, p95=percentile(times, 95) if times else None,
        max=max(times, default=None), by_kind=by_kind, server_cpu=server_cpu,
        cpu_per_run=server_cpu / len(times) if server_cpu is not None and times else None,
        cpu_per_view=server_cpu / report.views if server_cpu is not None and report.views else None,
        generator_cpu=generator_cpu, predictions=report.predictions, actions=dict(report.actions),
        errors=report.errors, mixups=report.mixups,
        replicas=dict(Counter(session.replica for session in report.sessions if session.replica)),
    ), environment


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _http(url: str) -> HttpSession:
    """An HTTP client for a session outside the class (its requests are not counted)."""
    return HttpSession(url, request_event=Events().request, user=None)


def summary(result: Result, think: tuple[float, float]) -> list[str]:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    done = sorted(result.actions.values()) or [0]
    lines = [
        (f"students: {result.students}, {len(result.actions)} started; actions finished per student:"
         f" min {done[0]}, median {statistics.median(done):g}, max {done[-1]}"),
        (f"throughput: {result.runs_per_s:.2f} finished runs/s, {result.views_per_s:.2f} page views/s"
         f" ({result.runs} runs, {result.views} page views in {result.seconds:.0f} s)"),
        f"time to a finished run: p50 {s(result.p50)}, p95 {s(result.p95)}, max {s(result.max)}",
    ]
    lines += [f"  {kind:<7} {count:4d} runs  p50 {s(p50)}  p95 {s(p95)}" for kind, (count, p50, p95) in result.by_kind.items()]
    if result.server_cpu is None:
        lines.append("server CPU: not measured (give --server-pid with --url)")
    else:
        lines.append(
            f"server CPU: {result.server_cpu:.1f} s in {result.seconds:.0f} s"
            f" ({result.server_cpu / result.seconds:.2f} cores): {s(result.cpu_per_run)} per finished run,"
            f" {s(result.cpu_per_view)} per page view"
        )
    if result.replicas:
        lines.append("students per replica: " + ", ".join(f"{name} {count}" for name, count in sorted(result.replicas.items())))
    lines.append(f"load generator's own CPU: {result.generator_cpu:.1f} s (on the same machine)")
    lines.append(f"errors: {len(result.errors)}")
    lines += [f"  {line}" for line in result.errors[:20]]
    lines.append(f"mix-ups: {len(result.mixups)} (every run's sidebar image checked;"
                 f" {result.predictions} Pipeline predictions checked)")
    lines += [f"  {line}" for line in result.mixups[:20]]
    if result.students >= 30 and think == (5, 10):
        met = result.p95 is not None and result.p95 <= 2 and not result.errors and not result.mixups
        lines.append(f"goal (30 students, think 5-10 s: p95 <= 2 s, 0 errors, 0 mix-ups): {'met' if met else 'MISSED'}")
    return lines


def loopback(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise argparse.ArgumentTypeError(f"load tests run against loopback only, not {host}")
    return url if url.endswith("/") else url + "/"


def think_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    low, high = float(low), float(high or low)
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError("--think takes MIN,MAX seconds with 0 <= MIN <= MAX")
    return low, high


def page_list(text: str) -> tuple[str, ...]:
    pages = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in pages if name not in PAGES]
    if unknown or not pages:
        raise argparse.ArgumentTypeError(f"--pages takes names among {', '.join(PAGES)}; not {unknown}")
    return pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--think", type=think_range, default=(5.0, 10.0), help="MIN,MAX seconds between actions (5,10)")
    parser.add_argument("--actions", type=int, default=20, help="actions per student, opening and upload included (20)")
    parser.add_argument("--duration", type=float, default=120, help="stop after this many seconds at most (120)")
    parser.add_argument("--spawn-rate", type=float, default=1.0, help="students arriving per second (1)")
    parser.add_argument("--timeout", type=float, default=60, help="the longest wait for one run (60 s)")
    parser.add_argument("--pages", type=page_list, default=PAGES,
                        help=f"the pages walked, comma-separated (default: all, {','.join(PAGES)})")
    parser.add_argument("--url", type=loopback, help="an app (or a proxy in front of several) already running on loopback")
    parser.add_argument("--server-pid", type=int, action="append", default=[],
                        help="with --url: the server process(es) whose CPU time to read (repeat for replicas)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="start this many app servers behind nginx (vit-explorer serve) instead of one")
    parser.add_argument("--port", type=int, help="the port of the server (or proxy) this starts (default: a free one)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--folder", type=Path, help="for the images, runs, uploads and server log (default: a new"
                        " temporary folder, kept)")
    args = parser.parse_args()

    folder = args.folder or Path(tempfile.mkdtemp(prefix="vit_explorer_class_"))
    weights = server_weights()
    probes = make_probes(args.students, folder / "images", weights)
    options = Options(actions=args.actions, timeout=args.timeout, pages=args.pages)
    log = folder / "streamlit.log"
    environment = {"VIT_EXPLORER_RUNS_DIR": str(folder / "runs"), "VIT_EXPLORER_UPLOADS_DIR": str(folder / "uploads")}
    print(f"{args.students} students, think {args.think[0]:g}-{args.think[1]:g} s, {args.spawn_rate:g} arriving/s,"
          f" up to {args.actions} actions each or {args.duration:g} s")
    if args.url:
        print(f"against {args.url}")
        result, stats = run_class(args.url, probes, args.think, args.spawn_rate, args.duration, options, args.server_pid)
    elif args.replicas:
        with Replicas(args.replicas, port=args.port or free_port(), folder=folder / "serve", log=lambda line: None,
                      runs_dir=folder / "runs", uploads_dir=folder / "uploads") as cluster:
            pids = [process.pid for process in cluster.processes]
            print(f"{args.replicas} replicas (pids {', '.join(map(str, pids))}) behind nginx at {cluster.url},"
                  f" the model {weights.name}")
            result, stats = run_class(cluster.url + "/", probes, args.think, args.spawn_rate, args.duration, options,
                                      pids, warm_urls=cluster.replica_urls)
        log = folder / "serve" / "replica-1.log"
    else:
        with app_server(environment, log=log, port=args.port) as server:
            print(f"streamlit run app.py at {server.url} (pid {server.pid}), the model {weights.name}")
            result, stats = run_class(server.url, probes, args.think, args.spawn_rate, args.duration, options,
                                      [server.pid])
    print("\n".join(get_stats_summary(stats.stats, current=False)))
    print("\n".join(get_percentile_stats_summary(stats.stats)))
    print("\n".join(summary(result, args.think)))
    if result.errors and not args.url:
        print("server log (last lines):\n" + log_tail(log))
    if args.json:
        args.json.write_text(json.dumps(result.__dict__, indent=1))


if __name__ == "__main__":
    main()
