"""The server's CPU-seconds per page view on the real app, and the page time the browser sees.

Starts `streamlit run app.py` on loopback, warms it up with one headless-Chromium session that
walks every page once (imports, the model, the captures), then lets N sessions at once do what a
class does and reads the server process's CPU time (user + system, all its threads, from
/proc/PID/stat) before and after. A view is one thing a person does that the server answers with
a run: opening the app, uploading an image, going to a page, moving a slider.

- shipped model (default): each session opens the app, uploads its own shapes image and walks
  every page twice;
- `--vit-b16` (a random ViT-B/16, nothing downloaded): warm views only; each session opens the
  app on the image the warm-up used, walks the explorer's pages twice and moves the layer slider
  on Attention and on Inside a layer.

Prints the server's CPU-seconds per view and the browsers' page times (p50 / p95, from the click
until the page's content is drawn and the app is idle), for all the views and for each walk: the
first (opening the app, a new image on every page) and the second (revisits, nothing new). The browsers share the machine's cores
with the server, so page times rise with N; the CPU per view is the server's alone.

    python -m bench.server_cpu                       # shipped model, 4 sessions
    python -m bench.server_cpu --sessions 1 8
    python -m bench.server_cpu --vit-b16 --sessions 1 2
    python -m bench.server_cpu --server-arg=--runner.postScriptGC=false   # A/B a streamlit option
    python -m bench.server_cpu --profile /tmp/server.txt   # py-spy (50 Hz) on the measured part
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.app_load import CONTENT as LOAD_CONTENT
from bench.app_load import (
    Probe,
    app_weights,
    errors_on,
    make_probes,
    new_page,
    percentile,
    settle,
    summarize,
    upload_image,
)
from bench.browser import CHROMIUM_LAUNCH, app_server, log_tail

# Text drawn once a page's main content is (None: its heading and an idle app).
CONTENT = {
    **LOAD_CONTENT,
    "Inside a layer": re.compile(r"^5\. The MLP"),
    "Several images": None, "Head types": None, "Knock-out": None, "Compare": None,
}
EXPLORE = ("Pipeline", "Patches", "Attention", "Inside a layer", "Train")
EVERY_PAGE = (*EXPLORE, "Several images", "Head types", "Knock-out", "Compare")
SLIDERS = ("Attention", "Inside a layer")  # pages whose "Layer" slider the --vit-b16 walk moves


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads (not its children).
    (bench.class_run has the like; importing it would patch the standard library for gevent.)"""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Walk:
    name: str
    times: list[tuple[str, float]] = field(default_factory=list)  # (view, seconds)
    errors: list[str] = field(default_factory=list)
    view: str = ""  # the view under way
    first: int = 0  # how many of ``times`` the first walk took (opening and upload included)


async def arrive(page, title: str) -> None:
    await page.get_by_role("heading", name=title, level=1).wait_for()
    if CONTENT[title] is not None:
        await page.get_by_text(CONTENT[title]).first.wait_for()
    await settle(page)


async def timed(walk: Walk, page, view: str, action) -> None:
    walk.view = view
    start = time.perf_counter()
    await action()
    walk.times.append((view, time.perf_counter() - start))
    walk.errors += [f"{view}: {error}" for error in await errors_on(page)]


async def go_to(page, title: str) -> None:
    await page.locator('[data-testid="stSidebarNav"] a').filter(has_text=title).click()
    await arrive(page, title)


async def upload(page, probe: Probe) -> None:
    await upload_image(page, probe.path)
    await arrive(page, "Pipeline")


async def move_layer(page, title: str) -> None:
    """One step down on this page's "Layer" slider (a rerun), then wait for the page again."""
    thumb = page.locator('[data-testid="stSlider"]').filter(has_text="Layer").first.get_by_role("slider")
    await thumb.focus()
    await page.keyboard.press("ArrowLeft")
    await arrive(page, title)


async def open_and_walk(page, url: str, walk: Walk, pages: tuple[str, ...], probe: Probe | None, sliders: bool) -> None:
    """Open the app, upload ``probe`` (if any), walk ``pages`` once."""
    async def open_app() -> None:
        await page.goto(url)
        await arrive(page, "Pipeline")

    await timed(walk, page, "open", open_app)
    if probe is not None:
        await timed(walk, page, "upload", lambda: upload(page, probe))
    await walk_pages(page, walk, pages, sliders)


async def walk_pages(page, walk: Walk, pages: tuple[str, ...], sliders: bool) -> None:
    """Go to every page (from Pipeline, back to it), moving the sliders of SLIDERS if asked."""
    for title in pages[1:] + pages[:1]:
        await timed(walk, page, title, lambda title=title: go_to(page, title))
        if sliders and title in SLIDERS:
            await timed(walk, page, f"{title}: layer slider", lambda title=title: move_layer(page, title))


async def guarded(walk: Walk, steps) -> None:
    """Await ``steps`` unless this session already failed; a failure is a finding, not a crash."""
    if any("driver failed" in error for error in walk.errors):
        steps.close()
        return
    try:
        await steps
    except Exception as error:  # a timeout or a lost page
        walk.errors.append(f"{walk.view}: the driver failed: {summarize(error)}")


async def measure(
    url: str, pid: int, rounds: list[list[Probe | None]], pages: tuple[str, ...], sliders: bool,
    timeout_ms: float, profile: Path | None,
) -> list[tuple[float, float, list[Walk]]]:
    """Warm the server up with one walk, then per round its sessions at once, each opening the
    app and walking every page, then walking them again: (CPU-s of the first walks, CPU-s of the
    second walks, the walks)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(**CHROMIUM_LAUNCH)
        try:
            page, warm = await new_page(browser, timeout_ms), Walk("warm-up")
            await guarded(warm, open_and_walk(page, url, warm, pages, None, sliders))
            await page.context.close()
            if warm.errors:
                raise RuntimeError("the warm-up failed: " + "; ".join(warm.errors))
            spy = None
            if profile is not None:
                spy = subprocess.Popen(
                    [str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(pid), "-r", "50", "--gil",
                     "-f", "raw", "-o", str(profile), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                )
            results = []
            try:
                for probes in rounds:
                    walks = [Walk(f"N{len(probes)} session {number}") for number in range(1, len(probes) + 1)]
                    tabs = [await new_page(browser, timeout_ms) for _ in probes]
                    start = cpu_seconds(pid)
                    await asyncio.gather(*(
                        guarded(walk, open_and_walk(tab, url, walk, pages, probe, sliders))
                        for walk, tab, probe in zip(walks, tabs, probes)
                    ))
                    middle = cpu_seconds(pid)
                    for walk in walks:
                        walk.first = len(walk.times)
                    await asyncio.gather(*(guarded(walk, walk_pages(tab, walk, pages, sliders)) for walk, tab in zip(walks, tabs)))
                    results.append((middle - start, cpu_seconds(pid) - middle, walks))
                    for tab in tabs:
                        await tab.context.close()
            finally:
                if spy is not None:
                    spy.send_signal(2)  # SIGINT: py-spy writes what it has
                    spy.wait(timeout=60)
            return results
        finally:
            await browser.close()


def per_view(label: str, cpu: float, times: list[float]) -> str:
    if not times:
        return f"{label}: no view finished"
    return (
        f"{label}: {len(times):3d} views, {cpu:5.1f} CPU-s = {cpu / len(times):.3f} CPU-s/view,"
        f" page p50 {percentile(times, 50):5.2f} s p95 {percentile(times, 95):5.2f} s"
    )


def report(n: int, first: float, second: float, walks: list[Walk]) -> str:
    errors = sum(len(walk.errors) for walk in walks)
    firsts = [took for walk in walks for _, took in walk.times[:walk.first]]
    revisits = [took for walk in walks for _, took in walk.times[walk.first:]]
    return "\n".join((
        f"N={n:<3} {per_view('all', first + second, firsts + revisits)}  errors {errors}",
        f"      {per_view('first walk (opening the app; an upload, if any)', first, firsts)}",
        f"      {per_view('second walk (revisits, nothing new)', second, revisits)}",
    ))


def by_view(walks: list[Walk]) -> str:
    views: dict[str, list[float]] = {}
    for walk in walks:
        for view, seconds in walk.times:
            views.setdefault(view, []).append(seconds)
    return "  ".join(f"{view} {percentile(times, 50):.2f}" for view, times in views.items())


def measure_rounds(args: argparse.Namespace, folder: Path, weights: Path) -> list:
    """Serve ``weights`` and walk it with every round's sessions."""
    pages = EXPLORE if args.vit_b16 else EVERY_PAGE
    firsts = [sum(args.sessions[:i]) for i in range(len(args.sessions))]
    rounds = [
        [None] * n if args.vit_b16 else make_probes(n, folder / "images", weights, first)
        for n, first in zip(args.sessions, firsts)
    ]
    print(f"streamlit app.py on 127.0.0.1 {' '.join(args.server_arg)}: "
          f"{'warm views of a random ViT-B/16' if args.vit_b16 else 'the shipped shapes model'}, "
          f"{os.cpu_count()} cores shared with the browsers")
    log = folder / "streamlit.log"
    environment = {"VIT_EXPLORER_RUNS_DIR": str(folder / "runs"), "VIT_EXPLORER_DEFAULT_MODEL": str(weights)}
    with app_server(environment, log=log, port=args.port, args=args.server_arg) as server:
        results = asyncio.run(measure(
            server.url, server.pid, rounds, pages, args.vit_b16, args.timeout * 1000, args.profile
        ))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", nargs="+", type=int, default=[4], help="concurrent sessions per round")
    parser.add_argument("--vit-b16", action="store_true", help="warm views of a random ViT-B/16")
    parser.add_argument("--timeout", type=float, default=240, help="seconds any one wait may take")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra `streamlit run` option")
    parser.add_argument("--port", type=int, help="the server's port (default: a free one)")
    parser.add_argument("--profile", type=Path, help="py-spy's collapsed stacks of the measured part, to this file")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="vit_explorer_cpu_"))  # kept: the server log
    with app_weights(folder, args.vit_b16) as weights:
        results = measure_rounds(args, folder, weights)
    for n, (first, second, walks) in zip(args.sessions, results):
        print(report(n, first, second, walks))
        print(f"      p50 per view: {by_view(walks)}")
        for walk in walks:
            for line in walk.errors:
                print(f"  {walk.name}: {line}")
    log = folder / "streamlit.log"
    if any(walk.errors for *_, walks in results for walk in walks):
        print("server log (last lines):\n" + log_tail(log))
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
