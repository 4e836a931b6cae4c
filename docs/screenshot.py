"""Takes the README's screenshot: the app's Attention page with the shipped model, in Chromium.

    python -m docs.screenshot          # writes docs/screenshot.png

Runs the real app on loopback (bench.browser) and Debian's Chromium through Playwright.
"""
from __future__ import annotations

from pathlib import Path

from playwright.sync_api import sync_playwright

from bench.browser import CHROMIUM_LAUNCH, serve_app, settle

OUT = Path(__file__).resolve().parent / "screenshot.png"


def main() -> None:
    with serve_app() as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1280, "height": 2400})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/attention")
        page.get_by_role("heading", name="Attention", level=1).wait_for()
        settle(page, timeout_ms=120_000)
        # Plotly draws after the run ends: wait for every chart's drawing.
        page.wait_for_function(
            "document.querySelectorAll('.js-plotly-plot').length >= 3 && [...document.querySelectorAll("
            "'.js-plotly-plot')].every(plot => plot.querySelector('.main-svg'))"
        )
        page.wait_for_timeout(1000)
        page.screenshot(path=OUT, clip=dict(x=0, y=0, width=1280, height=1200))
        browser.close()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
