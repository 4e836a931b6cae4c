"""A load test on the real server: N people walking every page at once while a training run is active.

Starts `streamlit run app.py` on loopback (the shipped shapes model), launches one training run
from the Train page of an extra browser session and keeps it running, then for each N drives N
concurrent headless-Chromium sessions (one browser, a context each: separate Streamlit sessions).
Every session uploads its own shapes image (a different one, of a different class where there
are enough classes) and walks Pipeline -> Patches -> Attention -> Train -> Pipeline. It checks
that no page shows an exception or an error and that the Pipeline page always predicts what the
model says for that session's own image (computed here, in this process), and never another
session's image. Page time: from the click (or the upload) until the page is idle and its main
content is drawn. Prints p50 / p95 page times per N and every error and mix-up seen.

    python -m bench.app_load [N ...]      # default: 1 4 8
    python -m bench.app_load --vit-b16 1 4  # the same with a ViT-B/16-sized model (random weights)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

import vit_explorer as vx
from bench.browser import CHROMIUM_LAUNCH, ERROR_ELEMENTS, STATUS_WIDGET, log_tail, serve_app
from vit_explorer.data.datasets import SHAPE_CLASSES, shapes_sample
from vit_explorer.training.train import DEFAULT_WEIGHTS

# Text that is drawn once a page's main content is: the last figure or sentence it shows.
CONTENT = {
    "Pipeline": re.compile(r"The model says"),
    "Patches": "Position embedding similarity",
    "Attention": "Attention of the class token in layer",
    "Train": re.compile(r"run \d+ (running|stopped|finished|failed)|No runs yet"),
}
WALK = ("Patches", "Attention", "Train", "Pipeline")  # after the upload, which lands on Pipeline
PREDICTION = re.compile(r"The model says (.+?) with probability ([\d.]+)%")
FIRST_SAMPLE = 1000  # past the app's own shapes samples (0 to 5), so no upload is one of them


@dataclass(frozen=True)
class Probe:
    """One session's image and what the model predicts for it (computed outside the app)."""

    path: Path
    prediction: str
    probability: float  # percent


@dataclass
class SessionReport:
    name: str
    times: list[tuple[str, float]] = field(default_factory=list)  # (step, seconds)
    errors: list[str] = field(default_factory=list)  # "page: what the page or the driver said"
    mixups: list[str] = field(default_factory=list)  # "page: what it showed instead of its own"


def make_probes(count: int, folder: Path, weights: Path = DEFAULT_WEIGHTS, first: int = 0) -> list[Probe]:
    """``count`` PNGs of shapes (test stream images ``first`` on), cycling through the classes.

    For the shapes model, the first image of each class that it classifies as that class, so
    that sessions with different classes expect different predictions; another model (a random
    ViT-B/16) predicts what it predicts, and the probability tells the sessions apart.
    """
    model = vx.load_model(weights)
    config = model.config
    names = list(config.class_names or [f"class {index}" for index in range(config.num_classes)])
    folder.mkdir(parents=True, exist_ok=True)
    probes = []
    for number in range(first, first + count):
        label = number % len(SHAPE_CLASSES)
        for attempt in range(20):  # labels cycle through the classes: index % classes == label
            index = FIRST_SAMPLE + len(SHAPE_CLASSES) * (20 * number + attempt) + label
            image, name = shapes_sample(index, config.img_size)
            cap = vx.capture(model, vx.preprocess(image, config))
            probabilities = cap.logits[0].softmax(dim=-1)
            best = int(probabilities.argmax())
            if names[best] == name or config.class_names != SHAPE_CLASSES:
                break
        path = folder / f"session{number + 1}_{name}_{index}.png"
        image.save(path)
        probes.append(Probe(path, names[best], 100 * float(probabilities[best])))
    return probes


@contextlib.contextmanager
def random_vit_b16(folder: Path) -> Iterator[Path]:
    """A ViT-B/16-sized checkpoint with random weights (nothing downloaded), deleted after: the
    benches keep their folders for the logs, and 330 MB a run filled the disk."""
    torch.manual_seed(0)
    path = folder / "vit_b16_random.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, num_classes=1000)), path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def app_weights(folder: Path, vit_b16: bool) -> contextlib.AbstractContextManager[Path]:
    """The checkpoint a bench serves: a random ViT-B/16 in ``folder``, or the shipped model."""
    return random_vit_b16(folder) if vit_b16 else contextlib.nullcontext(DEFAULT_WEIGHTS)


# --- driving one page ---------------------------------------------------------------------------


async def settle(page) -> None:
    """Wait until Streamlit has finished the current run (its status widget disappears)."""
    await page.wait_for_timeout(300)
    await page.locator(STATUS_WIDGET).wait_for(state="hidden")


async def arrive(page, title: str) -> None:
    """Wait for page ``title``: its heading, its main content, then an idle app."""
    await page.get_by_role("heading", name=title, level=1).wait_for()
    await page.get_by_text(CONTENT[title]).first.wait_for()
    await settle(page)


async def go_to(page, title: str) -> None:
    await page.locator('[data-testid="stSidebarNav"] a').filter(has_text=title).click()
    await arrive(page, title)


async def upload_image(page, path: Path) -> None:
    """Upload ``path`` through the sidebar and wait until the image picker shows it."""
    uploader = page.locator('[data-testid="stFileUploader"]').filter(has_text="Upload an image")
    await uploader.locator('input[type="file"]').set_input_files(path)
    picker = page.get_by_role("combobox", name="Image", exact=True)
    for _ in range(600):  # the sidebar shows the upload once the app has taken it (<= 60 s)
        if await picker.input_value() == f"Uploaded: {path.name}":
            break
        await page.wait_for_timeout(100)


def summarize(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


async def errors_on(page) -> list[str]:
    return [" ".join(text.split())[:400] for text in await page.locator(ERROR_ELEMENTS).all_inner_texts()]


async def shown_prediction(page) -> tuple[str, float] | None:
    texts = await page.get_by_text(PREDICTION).all_inner_texts()
    found = [PREDICTION.search(text) for text in texts]
    return (found[0][1], float(found[0][2])) if len(found) == 1 and found[0] else None


def is_own(probe: Probe, shown: tuple[str, float] | None) -> bool:
    # The page rounds to 0.1 %; allow for that and for summation-order noise.
    return shown is not None and shown[0] == probe.prediction and abs(shown[1] - probe.probability) <= 0.11


async def check_own_image(page, probe: Probe, where: str, report: SessionReport) -> None:
    """The sidebar's image is this session's upload and Pipeline predicts what it should for it."""
    picked = await page.get_by_role("combobox", name="Image", exact=True).input_value()
    if picked != f"Uploaded: {probe.path.name}":
        report.mixups.append(f"{where}: the sidebar's image is {picked!r}, not Uploaded: {probe.path.name}")
    if where.startswith("Pipeline"):
        shown = await shown_prediction(page)
        if not is_own(probe, shown):
            await page.wait_for_timeout(2000)  # a late redraw is not a mix-up: look again once
            await settle(page)
            again = await shown_prediction(page)
            if not is_own(probe, again):
                report.mixups.append(
                    f"{where}: shows {shown} then {again}, expected"
                    f" ({probe.prediction!r}, {probe.probability:.1f}) for {probe.path.name}"
                )


# --- one person ------------------------------------------------------------------------------


async def new_page(browser, timeout_ms: float):
    """A page in a context of its own: its own cookies, so its own Streamlit session."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(timeout_ms)
    return await context.new_page()


async def walk(page, url: str, probe: Probe, name: str, shots: Path | None = None) -> SessionReport:
    """Open the app, upload ``probe``'s image, walk every page; time and check each step.

    A step that fails leaves a screenshot in ``shots`` (if given).
    """
    report = SessionReport(name)
    where = "Pipeline (opening)"
    try:
        start = time.perf_counter()
        await page.goto(url)
        await arrive(page, "Pipeline")
        report.times.append((where, time.perf_counter() - start))
        report.errors += [f"{where}: {error}" for error in await errors_on(page)]

        where = "Pipeline (upload)"
        start = time.perf_counter()
        await upload_image(page, probe.path)
        await arrive(page, "Pipeline")
        report.times.append((where, time.perf_counter() - start))
        report.errors += [f"{where}: {error}" for error in await errors_on(page)]
        await check_own_image(page, probe, where, report)

        for title in WALK:
            where = title
            start = time.perf_counter()
            await go_to(page, title)
            report.times.append((where, time.perf_counter() - start))
            report.errors += [f"{where}: {error}" for error in await errors_on(page)]
            await check_own_image(page, probe, where, report)
    except Exception as error:  # a timeout or a lost page: a finding of this session, not a crash
        report.errors.append(f"{where}: the driver failed: {summarize(error)}")
        if shots is not None:
            with contextlib.suppress(Exception):
                shots.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=shots / f"{name}_{where}.png".replace(" ", "_"), full_page=True)
    finally:
        await page.context.close()
    return report


# --- the training run ---------------------------------------------------------------------------
# All that depends on how the Train page launches and stops a run is here.

TRAINING_EPOCHS = 200  # far more than any load test lasts: it is stopped at the end


async def start_training(page, url: str):
    """Launch one long shapes run from the Train page of ``page`` (a session of its own).

    The page stays on Train (its live view polls every second), like a person watching the run.
    """
    await page.goto(url)
    await arrive(page, "Pipeline")
    await page.locator('[data-testid="stSidebarNav"] a').filter(has_text="Train").click()
    await page.get_by_role("heading", name="Train", level=1).wait_for()
    await settle(page)
    await page.get_by_role("spinbutton", name="Epochs").fill(str(TRAINING_EPOCHS))
    await page.get_by_role("button", name="Launch training").click()
    await page.get_by_text(re.compile(r"Training: step \d+ of \d+")).first.wait_for()  # it is stepping
    return page


async def stop_training(page) -> list[str]:
    """Stop the run from its Train page; what went wrong there (the run's own errors included)."""
    errors = await errors_on(page)
    try:
        status = await page.get_by_text(CONTENT["Train"]).first.inner_text()
        if " running" not in status:
            errors.append(f"the run did not last the whole load test: {status}")
        else:
            await page.locator('[data-testid="stButton"]').get_by_role("button", name="Stop").click()
            await page.get_by_text(re.compile(r"run \d+ stopped")).first.wait_for()
            await settle(page)
            errors += await errors_on(page)
    except Exception as error:  # a timeout: report it with the rest
        errors.append(f"stopping the run failed: {summarize(error)}")
    finally:
        await page.context.close()
    return [f"Train (training session): {error}" for error in errors]


# --- the whole load test ------------------------------------------------------------------------


async def load_test(
    url: str, rounds: list[list[Probe]], timeout_ms: float = 180_000, training: bool = True,
    shots: Path | None = None,
) -> tuple[list[list[SessionReport]], list[str]]:
    """For each round, its probes' sessions at once, all while one training run is active.

    Returns the reports per round and the training session's errors; screenshots of failed
    steps go to ``shots``.
    """
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(**CHROMIUM_LAUNCH)
        try:
            trainer = await start_training(await new_page(browser, timeout_ms), url) if training else None
            results, training_errors = [], []
            try:
                for probes in rounds:
                    pages = [await new_page(browser, timeout_ms) for _ in probes]
                    results.append(await asyncio.gather(*(
                        walk(page, url, probe, f"N{len(probes)} session {number}", shots)
                        for number, (page, probe) in enumerate(zip(pages, probes), 1)
                    )))
            finally:
                if trainer is not None:
                    training_errors = await stop_training(trainer)
            return results, training_errors
        finally:
            await browser.close()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 to 100), linear between the closest ranks."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summary(n: int, reports: list[SessionReport]) -> str:
    times = [seconds for report in reports for _, seconds in report.times]
    errors = sum(len(report.errors) for report in reports)
    mixups = sum(len(report.mixups) for report in reports)
    if not times:
        return f"N={n:<3} no page finished; errors {errors}, mix-ups {mixups}"
    return (
        f"N={n:<3} {len(times):4d} page loads  p50 {percentile(times, 50):6.2f} s  p95 {percentile(times, 95):6.2f} s"
        f"  max {max(times):6.2f} s  errors {errors}  mix-ups {mixups}"
    )


def run_rounds(args: argparse.Namespace, folder: Path, weights: Path) -> tuple[list, list[str]]:
    """Serve ``weights`` and load it with every round's sessions."""
    print(f"streamlit app.py on 127.0.0.1, {'a random ViT-B/16' if args.vit_b16 else 'shipped shapes model'},"
          f" torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" {'no' if args.no_training else 'one'} training run active throughout")
    firsts = [sum(args.sessions[:i]) for i in range(len(args.sessions))]
    rounds = [make_probes(n, folder / "images", weights, first) for n, first in zip(args.sessions, firsts)]
    log = folder / "streamlit.log"
    environment = {"VIT_EXPLORER_RUNS_DIR": str(folder / "runs"), "VIT_EXPLORER_DEFAULT_MODEL": str(weights)}
    with serve_app(environment, log=log) as url:
        results, training_errors = asyncio.run(load_test(
            url, rounds, args.timeout * 1000, not args.no_training, shots=folder / "failed"
        ))
    return results, training_errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sessions", nargs="*", type=int, default=[1, 4, 8], help="concurrent sessions per round")
    parser.add_argument("--timeout", type=float, default=180, help="seconds any one wait may take")
    parser.add_argument("--no-training", action="store_true", help="for comparison: no training run meanwhile")
    parser.add_argument("--verbose", action="store_true", help="also print every session's step times")
    parser.add_argument("--vit-b16", action="store_true", help="a random ViT-B/16 as the app's model")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="vit_explorer_load_"))  # kept: the server log and screenshots
    with app_weights(folder, args.vit_b16) as weights:
        results, training_errors = run_rounds(args, folder, weights)
    for n, reports in zip(args.sessions, results):
        print(summary(n, reports))
    for n, reports in zip(args.sessions, results):
        for report in reports:
            if args.verbose:
                steps = ", ".join(f"{step} {seconds:.2f}" for step, seconds in report.times)
                print(f"  {report.name}: {steps}")
            for line in report.errors + report.mixups:
                print(f"  {report.name}: {line}")
    for line in training_errors:
        print(f"  {line}")
    if any(report.errors or report.mixups for reports in results for report in reports) or training_errors:
        print("server log (last lines):\n" + log_tail(folder / "streamlit.log"))
        print(f"server log and screenshots of failed steps: {folder}")


if __name__ == "__main__":
    main()
