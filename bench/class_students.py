"""The students of bench.class_load: Locust users that speak Streamlit's protocol (bench.streamlit_client).

A light student opens the app, uploads its own image and walks the pages moving a slider on each,
checking every finished run; a heavy student asks for the work that is a job on a real-size model
and waits for it. What a student does is here; how many, where and for how long is
bench.class_run's, and the figures made of what they recorded (ClassReport, HeavyReport) are
bench.class_report's.
"""
from __future__ import annotations

import io
import itertools
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from locust import HttpUser, task
from locust.clients import HttpSession, LocustHttpAdapter
from locust.exception import StopUser
from PIL import Image
from streamlit.proto.WidgetStates_pb2 import WidgetState
from urllib3.util.retry import Retry

import vit_explorer as vx
from bench.app_load import Probe, is_own
from bench.streamlit_client import MAIN, SELECT_SLIDER, SIDEBAR, Page, ProtocolError, Shown, StreamlitSession, widget_value
from vit_explorer.data.datasets import shapes_sample

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

    Configured by `bench.class_run.student_class` (the roster of images, the shared report, the options).
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

    Configured by `bench.class_run.heavy_class`.
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
