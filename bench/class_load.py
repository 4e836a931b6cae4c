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
    python -m bench.class_load --vit-b16 --students 8 --think 3,6 --duration 100   # a random ViT-B/16
    python -m bench.class_load --heavy 2      # 8 light students alone, then beside 2 heavy ones (ViT-B/16)

It stops by itself: after --actions actions per student or --duration seconds, whichever first.
Loopback only.

Heavy students (``--heavy K``): beside the light ones, K students who compute. Each uploads
pictures of its own and, round after round, asks for the work that is a job on a real-size model
(app.costs.is_heavy): Several images on its five new pictures, the Knock-out page's sweep of every
head, Compare with model B the same model at half the patch size; it presses the button each page
shows and waits as a person would, the page's live fragment (its place in line, its progress)
rerun every second as the frontend reruns it, until the result is drawn; between actions it
thinks ``--heavy-think`` seconds (1-2: its jobs come nearly back to back). When the class ends it
cancels what it still waits for. Each job asked for ends finished, cancelled, failed with a
sentence (an error) or lost (neither a result nor a sentence). The same invocation runs the light
students first alone, then beside the heavy ones, each on a fresh server (the same images, walks
and duration), and prints as its last line the light students' p95 beside heavy neighbours over
their p95 alone, the same for slider moves, and each heavy student's jobs. Without
VIT_EXPLORER_DEFAULT_MODEL, ``--heavy`` serves a random ViT-B/16, 8 light students thinking 3-6 s
for 100 s (the goal: light p95 at most 1.5x, 0 errors, every job finished or cancelled).
"""
from __future__ import annotations

# Locust patches the standard library for gevent when imported: before anything opens a socket.
# isort: off
import locust  # noqa: F401
# isort: on

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import random
import re
import signal
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
from bench.app_load import Probe, app_weights, is_own, make_probes, percentile
from bench.browser import app_server, free_port, log_tail
from bench.streamlit_client import MAIN, SELECT_SLIDER, SIDEBAR, Page, ProtocolError, Shown, StreamlitSession, widget_value
from vit_explorer.data import shapes_sample
from vit_explorer.serve import Replicas
from vit_explorer.train import DEFAULT_WEIGHTS
from vit_explorer.training_run import process_identity

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
        retry_once(self.client)
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


def retry_once(client: HttpSession) -> None:
    """Like a browser: a request on a kept-alive connection the server has just closed (uvicorn
    closes them after 5 s idle, shorter than a student's think) is sent again, once."""
    retry = Retry(total=1, connect=1, read=1, status=0, other=0, allowed_methods=None, raise_on_status=False)
    client.mount("http://", LocustHttpAdapter(pool_manager=None, max_retries=retry))


# --- a heavy student ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """What a heavy student asks for on a page: the button the page shows when it is a job, and
    the start of the title of the figure that shows its result."""

    name: str
    page: str
    button: str
    drawn: str


PICTURES = Work("pictures", "Several images", "Read the pictures", "Joint PCA of")
SWEEP = Work("sweep", "Knock-out", "Run the sweep", "Each head knocked out alone")
MODEL_B = Work("model B", "Compare", "Run model B", "B:")
# New pictures a heavy student reads together each round: more than app.costs.HEAVY_FORWARDS
# passes (one of them may have been read by a page), so that they are a job on a real-size model.
NEW_PICTURES = 5
FIRST_PICTURE = 100_000  # shapes test stream images past any light student's


@dataclass
class HeavyReport:
    """One heavy student's jobs. A job asked for ends finished, cancelled (the class ended while
    it waited), failed (the page said why in a sentence) or lost (neither a result nor a sentence)."""

    number: int
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    lost: int = 0
    inline: int = 0  # work drawn without a job (quick on this server)
    waits: list[float] = field(default_factory=list)  # seconds from the click to the result drawn
    errors: list[str] = field(default_factory=list)
    done: bool = False


def drawn(page: Page, work: Work) -> bool:
    return any(title.startswith(work.drawn) for title in page.figure_titles())


class HeavyStudent(HttpUser):
    """A student who computes: round after round, new pictures of its own, then the work that is a
    job on a real-size model, waited for as a person waits (the page's live fragment rerun on its
    timer until the result is drawn). When the class ends it cancels what it waits for.

    Configured by `heavy_class`.
    """

    abstract = True
    numbers: list[int]  # the heavy students still to come
    image_size: tuple[int, int]
    reports: list[HeavyReport]
    ends_at: list[float]  # [when the class ends, time.monotonic()], set as it starts
    options: Options

    def on_start(self) -> None:
        retry_once(self.client)
        self.streamlit = None
        if not self.numbers:
            return
        self.report = HeavyReport(self.numbers.pop(0))
        self.reports.append(self.report)
        self.streamlit = StreamlitSession(self.host, self.client, self.options.timeout)
        self.plan = self.rounds()

    def on_stop(self) -> None:
        if self.streamlit is not None:
            self.streamlit.close()
            self.report.done = True

    def rounds(self) -> Iterator[tuple[str, object]]:
        session = self.streamlit
        yield "open", session.open
        for round_ in itertools.count(1):
            yield f"page: {PICTURES.page}", lambda: session.go_to(PICTURES.page)
            names = [f"heavy{self.report.number}_{round_}_{index}.png" for index in range(1, NEW_PICTURES + 1)]
            for index, name in enumerate(names):
                data = self.picture(round_ * NEW_PICTURES + index)
                yield "upload", lambda name=name, data=data: session.upload("Upload an image", name, data)
            yield "choose the pictures", lambda: session.rerun(changed=self.chosen(names))
            yield f"job: {PICTURES.name}", lambda: self.job(PICTURES)
            yield f"page: {SWEEP.page}", lambda: session.go_to(SWEEP.page)
            yield f"job: {SWEEP.name}", lambda: self.job(SWEEP)
            yield f"page: {MODEL_B.page}", lambda: session.go_to(MODEL_B.page)
            yield "B at half the patch size", lambda: session.rerun(changed=self.half_patch())
            yield f"job: {MODEL_B.name}", lambda: self.job(MODEL_B)

    def picture(self, index: int) -> bytes:
        image, _ = shapes_sample(FIRST_PICTURE + 1000 * self.report.number + index, self.image_size)
        data = io.BytesIO()
        image.save(data, format="PNG")
        return data.getvalue()

    def chosen(self, names: list[str]) -> WidgetState:
        """The Several images page's picker holding this round's pictures (by their labels)."""
        (picker,) = [s for s in self.streamlit.page.widgets("multiselect", MAIN) if s.widget.label == "Images"]
        state = WidgetState(id=picker.widget.id)
        state.string_array_value.data.extend(f"Uploaded: {name}" for name in names)
        return state

    def half_patch(self) -> WidgetState:
        """Compare's B at half the sidebar's patch size (the finest there is below it otherwise)."""
        (slider,) = [s for s in self.streamlit.page.widgets("slider", MAIN) if s.widget.label == "B's patch size"]
        sizes = next(filter(None, map(SIZES.search, self.streamlit.page.texts(SIDEBAR))))
        patch = int(sizes[3])
        finer = [int(option.split()[0]) for option in slider.widget.options if int(option.split()[0]) < patch]
        state = WidgetState(id=slider.widget.id)
        state.string_array_value.data.append(f"{patch // 2 if patch // 2 in finer else min(finer)} px")
        return state

    def job(self, work: Work) -> Page:
        """Press the page's button for ``work`` and wait for its result (or a sentence saying why
        not); cancel it if the class ends first."""
        session, report = self.streamlit, self.report
        if work.button not in {button.widget.label for button in session.page.widgets("button")}:
            report.inline += drawn(session.page, work)  # quick here: drawn with the page (or an error said why not)
            return session.page
        asked = time.monotonic()
        try:
            session.click(work.button)
            page = session.follow(lambda page: drawn(page, work) or bool(page.errors()),
                                  max(0.0, self.ends_at[0] - time.monotonic()))
        except Exception as error:  # a lost connection, a run never finished: no result, no sentence
            report.lost += 1
            raise error
        if drawn(page, work):
            report.finished += 1
            report.waits.append(time.monotonic() - asked)
        elif page.errors():
            report.failed += 1  # the sentence is the action's error
        elif "Cancel" in {b.widget.label for b in page.widgets("button")}:  # the class is over: the person leaves
            page = session.click("Cancel")
            report.cancelled += 1
        else:
            report.lost += 1
            report.errors.append(f"heavy student {report.number}: asked for the {work.name} and got neither it nor a sentence")
        return page

    @task
    def act(self) -> None:
        if self.streamlit is None or time.monotonic() >= self.ends_at[0]:
            raise StopUser()
        kind, action = next(self.plan)
        where = f"heavy student {self.report.number}, {kind}"
        received, start = self.streamlit.bytes_received, time.perf_counter()
        try:
            page = action()
        except Exception as error:
            self.fire(kind, time.perf_counter() - start, received, error)
            self.report.errors.append(f"{where}: {type(error).__name__}: {error}")
            raise StopUser() from None
        problems = page.errors()
        expected = kind.partition(": ")[2] if kind.startswith("page: ") else None
        if expected and page.title() != expected:
            problems.append(f"shows the page titled {page.title()!r}, not {expected!r}")
        self.fire(kind, time.perf_counter() - start, received, ProtocolError("; ".join(problems)) if problems else None)
        self.report.errors += [f"{where}: {problem}" for problem in problems]

    def fire(self, kind: str, seconds: float, received: int, error: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="WS", name=f"heavy {kind}", response_time=seconds * 1000, context={},
            response_length=self.streamlit.bytes_received - received, exception=error,
        )


def heavy_class(count: int, reports: list[HeavyReport], options: Options, think: tuple[float, float],
                image_size: tuple[int, int]):
    """A HeavyStudent class for ``count`` heavy students (Locust builds users from a class)."""
    return type("ConfiguredHeavyStudent", (HeavyStudent,), dict(
        abstract=False, fixed_count=count, wait_time=between(*think), reports=reports, options=options,
        numbers=list(range(1, count + 1)), ends_at=[math.inf], image_size=image_size,
    ))


def server_weights() -> Path:
    """The server's default model, as it finds it (app.models.default_weights): the students'
    predictions are checked against that model, not the shipped one."""
    return Path(os.environ.get("VIT_EXPLORER_DEFAULT_MODEL") or DEFAULT_WEIGHTS)


def student_class(probes: list[Probe], report: ClassReport, options: Options, think: tuple[float, float],
                  expected: Expected):
    """A Student class for this run (Locust builds users from a class)."""
    return type("ConfiguredStudent", (Student,), dict(
        abstract=False, fixed_count=len(probes), wait_time=between(*think), report=report, options=options,
        expected=expected,
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
              options: Options, pids: list[int], warm_urls: list[str] | None = None, heavy: int = 0,
              heavy_think: tuple[float, float] = (1.0, 2.0)) -> tuple[Result, Environment, list[HeavyReport]]:
    """``len(probes)`` students at ``url`` until each has done its actions or ``duration`` is up,
    beside ``heavy`` heavy students thinking ``heavy_think`` seconds between actions (who then
    cancel what they wait for and leave).

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
    report, heavy_reports = ClassReport(), []
    expected = Expected(probes, server_weights())
    users = [student_class(probes, report, options, think, expected)]
    if heavy:
        users.append(heavy_class(heavy, heavy_reports, options, heavy_think, expected.model.config.img_size))
    environment = Environment(user_classes=users, host=url)
    runner = environment.create_local_runner()
    cpu_before, own_before, start = cpu_seconds(pids), _own_cpu(), time.monotonic()
    if heavy:
        users[1].ends_at[0] = start + duration
    runner.start(len(probes) + heavy, spawn_rate=spawn_rate)
    while report.done < len(probes) and time.monotonic() - start < duration:
        gevent.sleep(0.2)
    seconds = time.monotonic() - start
    try:
        server_cpu = cpu_seconds(pids) - cpu_before if pids else None
    except FileNotFoundError:  # a server process ended (a replica started again): no total to give
        server_cpu = None
        report.errors.append("a server process ended during the class")
    generator_cpu = _own_cpu() - own_before
    measured_runs, measured_views = list(report.runs), report.views
    # The heavy students cancel what they wait for as the class ends: a run's wait at most.
    while len(heavy_reports) < heavy or not all(heavy.done for heavy in heavy_reports):
        if time.monotonic() - start > duration + options.timeout:
            break
        gevent.sleep(0.2)
    runner.quit()
    for session in report.sessions:
        session.close()
    # Whatever escaped a student (a bug here, not the server's) is an error too: Locust caught it.
    report.errors += [f"load generator: {error['msg']}" for error in runner.exceptions.values()]
    times = [seconds_ for _, seconds_ in measured_runs]
    kinds = sorted({kind for kind, _ in measured_runs})
    by_kind = {}
    for kind in kinds:
        values = [s for k, s in measured_runs if k == kind]
        by_kind[kind] = (len(values), percentile(values, 50), percentile(values, 95))
    return Result(
        students=len(probes), seconds=seconds, runs=len(times), views=measured_views,
        runs_per_s=len(times) / seconds, views_per_s=measured_views / seconds,
        p50=percentile(times, 50) if times else None, p95=percentile(times, 95) if times else None,
        max=max(times, default=None), by_kind=by_kind, server_cpu=server_cpu,
        cpu_per_run=server_cpu / len(times) if server_cpu is not None and times else None,
        cpu_per_view=server_cpu / measured_views if server_cpu is not None and measured_views else None,
        generator_cpu=generator_cpu, predictions=report.predictions, actions=dict(report.actions),
        errors=report.errors, mixups=report.mixups,
        replicas=dict(Counter(session.replica for session in report.sessions if session.replica)),
    ), environment, heavy_reports


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


def end_workers(jobs: Path, grace: float = 30.0) -> int:
    """Wait for the job workers a class left on the jobs folder ``jobs`` (a cancelled one stops
    at its next step), then end those still running after ``grace`` seconds (each checked to be
    the worker its record names); how many had to be ended. They run beside the servers, so the
    next class (or whatever the machine does next) would share the cores with them."""
    def running() -> list[int]:
        alive = []
        for record_file in jobs.glob("*/record.json"):
            try:
                record = json.loads(record_file.read_text())
            except (OSError, ValueError):
                continue
            if record.get("pid") and process_identity(record["pid"]) == (record["pid"], record["started"]):
                alive.append(record["pid"])
        return alive

    deadline = time.monotonic() + grace
    while running() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = running()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return len(left)


@dataclass
class Class:
    """One class's outcome: the light students' figures, Locust's stats, the heavy students'."""

    result: Result
    environment: Environment
    heavy: list[HeavyReport]
    workers_ended: int
    log: Path


def one_class(args, folder: Path, probes: list[Probe], options: Options, heavy: int) -> Class:
    """The class on a server (or replicas) of its own with its runs, uploads and log in ``folder``,
    or at ``args.url``."""
    weights = server_weights()
    folder.mkdir(parents=True, exist_ok=True)
    log, jobs = folder / "streamlit.log", folder / "runs" / "jobs"
    if args.url:
        print(f"against {args.url}")
        outcome = run_class(args.url, probes, args.think, args.spawn_rate, args.duration, options, args.server_pid)
        return Class(*outcome, workers_ended=0, log=log)
    if args.replicas:
        with Replicas(args.replicas, port=args.port or free_port(), folder=folder / "serve", log=lambda line: None,
                      runs_dir=folder / "runs", uploads_dir=folder / "uploads") as cluster:
            pids = [process.pid for process in cluster.processes]
            print(f"{args.replicas} replicas (pids {', '.join(map(str, pids))}) behind nginx at {cluster.url},"
                  f" the model {weights.name}")
            outcome = run_class(cluster.url + "/", probes, args.think, args.spawn_rate, args.duration, options,
                                pids, warm_urls=cluster.replica_urls, heavy=heavy, heavy_think=args.heavy_think)
            return Class(*outcome, workers_ended=end_workers(jobs), log=folder / "serve" / "replica-1.log")
    environment = {"VIT_EXPLORER_RUNS_DIR": str(folder / "runs"), "VIT_EXPLORER_UPLOADS_DIR": str(folder / "uploads")}
    with app_server(environment, log=log, port=args.port) as server:
        print(f"streamlit run app.py at {server.url} (pid {server.pid}), the model {weights.name}")
        outcome = run_class(server.url, probes, args.think, args.spawn_rate, args.duration, options, [server.pid],
                            heavy=heavy, heavy_think=args.heavy_think)
        return Class(*outcome, workers_ended=end_workers(jobs), log=log)


def heavy_summary(heavy: HeavyReport) -> str:
    waits = sorted(heavy.waits)
    took = f" ({waits[0]:.0f}-{waits[-1]:.0f} s from the click)" if waits else ""
    return (f"heavy student {heavy.number}: jobs {heavy.finished} finished{took}, {heavy.cancelled} cancelled,"
            f" {heavy.failed} failed, {heavy.lost} lost; {heavy.inline} drawn without a job; errors {len(heavy.errors)}")


def ratio_line(alone: Result, beside: Class, heavy: int) -> str:
    """The last line: the light students' p95 beside the heavy ones over alone, and the heavy jobs."""
    def ratio(what: str, before: float | None, after: float | None) -> str:
        if not before or after is None:
            return f"{what} -"
        return f"{what} {after:.2f} s / {before:.2f} s = {after / before:.2f}x"

    slider = [result.by_kind.get("slider", (0, None, None))[2] for result in (alone, beside.result)]
    return "; ".join([
        ratio(f"light p95 beside {heavy} heavy / alone:", alone.p95, beside.result.p95),
        ratio("slider moves", *slider),
        *(f"heavy {report.number}: {report.finished} finished / {report.cancelled} cancelled / {report.lost} lost,"
          f" {len(report.errors)} errors" for report in beside.heavy),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, help="light students (30; 8 with --heavy)")
    parser.add_argument("--heavy", type=int, default=0, help="heavy students beside them, after a class of the"
                        " light ones alone (0)")
    parser.add_argument("--think", type=think_range, help="MIN,MAX seconds between actions (5,10; 3,6 with --heavy)")
    parser.add_argument("--heavy-think", type=think_range, default=(1.0, 2.0),
                        help="MIN,MAX seconds between a heavy student's actions (1,2: its jobs nearly back to back)")
    parser.add_argument("--actions", type=int, help="actions per light student, opening and upload included"
                        " (20; unbounded with --heavy: the duration ends the class)")
    parser.add_argument("--duration", type=float, help="stop after this many seconds at most (120; 100 with --heavy)")
    parser.add_argument("--spawn-rate", type=float, default=1.0, help="students arriving per second (1)")
    parser.add_argument("--timeout", type=float, default=60, help="the longest wait for one run (60 s)")
    parser.add_argument("--pages", type=page_list, default=PAGES,
                        help=f"the pages walked, comma-separated (default: all, {','.join(PAGES)})")
    parser.add_argument("--vit-b16", action="store_true", help="serve a random ViT-B/16 (the default with --heavy,"
                        " unless VIT_EXPLORER_DEFAULT_MODEL names a model)")
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
    if args.heavy and args.url:
        parser.error("--heavy starts a fresh server for each of its two classes: not with --url")
    light = dict(students=30, think=(5.0, 10.0), actions=20, duration=120.0)
    for name, default in (light if not args.heavy else dict(students=8, think=(3.0, 6.0), actions=10**9, duration=100.0)).items():
        if getattr(args, name) is None:
            setattr(args, name, default)

    folder = args.folder or Path(tempfile.mkdtemp(prefix="vit_explorer_class_"))
    folder.mkdir(parents=True, exist_ok=True)
    options = Options(actions=args.actions, timeout=args.timeout, pages=args.pages)
    with contextlib.ExitStack() as stack:
        if args.vit_b16 or (args.heavy and not os.environ.get("VIT_EXPLORER_DEFAULT_MODEL")):
            os.environ["VIT_EXPLORER_DEFAULT_MODEL"] = str(stack.enter_context(app_weights(folder, vit_b16=True)))
        probes = make_probes(args.students, folder / "images", server_weights())
        actions = f"up to {args.actions} actions each or " if not args.heavy else ""
        print(f"{args.students} students, think {args.think[0]:g}-{args.think[1]:g} s, {args.spawn_rate:g} arriving/s,"
              f" {actions}{args.duration:g} s")
        if not args.heavy:
            outcome = one_class(args, folder, probes, options, heavy=0)
            print("\n".join(get_stats_summary(outcome.environment.stats, current=False)))
            print("\n".join(get_percentile_stats_summary(outcome.environment.stats)))
            print("\n".join(summary(outcome.result, args.think)))
            if outcome.result.errors and not args.url:
                print("server log (last lines):\n" + log_tail(outcome.log))
            if args.json:
                args.json.write_text(json.dumps(outcome.result.__dict__, indent=1))
            return
        print("The light students alone:")
        alone = one_class(args, folder / "alone", probes, options, heavy=0)
        print("\n".join(summary(alone.result, args.think)))
        print(f"\nThe same light students beside {args.heavy} heavy student(s):")
        beside = one_class(args, folder / "beside heavy", probes, options, heavy=args.heavy)
        print("\n".join(get_stats_summary(beside.environment.stats, current=False)))
        print("\n".join(summary(beside.result, args.think)))
        print("\n".join(map(heavy_summary, beside.heavy)))
        for report in beside.heavy:
            print("".join(f"  {line}\n" for line in report.errors[:20]), end="")
        print(f"job workers still running after the class: {beside.workers_ended} (ended)")
        if (alone.result.errors or beside.result.errors or any(report.errors for report in beside.heavy)) and not args.url:
            print("server log (last lines):\n" + log_tail(beside.log))
        if args.json:
            args.json.write_text(json.dumps({
                "alone": alone.result.__dict__, "beside_heavy": beside.result.__dict__,
                "heavy": [report.__dict__ for report in beside.heavy], "workers_ended": beside.workers_ended,
            }, indent=1))
        print(ratio_line(alone.result, beside, args.heavy))


if __name__ == "__main__":
    main()
