"""The app in a real browser: `streamlit run app.py` driven by Playwright in headless Chromium.

Uses the system Chromium (Debian: apt-get install chromium); skips when it or Playwright is
missing. Screenshots of every step go to $VIT_EXPLORER_SCREENSHOTS, or to pytest's tmp_path.
"""
import os
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import torch

import vit_explorer as vx
from apptest import tiny_app_server
from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, ROOT, serve_app, settle
from vit_explorer.data.datasets import SHAPE_CLASSES
from vit_explorer.serving.jobs import JobBoard, JobLimits, JobSpec

PHOTO = ROOT / "assets" / "samples" / "chelsea.png"
sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")


@pytest.fixture
def own_server(tmp_path):
    """A server of its own (the shared one is conftest's ``server``), for a test that numbers its run
    "run 1" too."""
    with tiny_app_server(tmp_path) as url:
        yield url


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("VIT_EXPLORER_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def go_to(page, title: str) -> None:
    page.locator('[data-testid="stSidebarNav"] a').filter(has_text=title).click()
    page.get_by_role("heading", name=title, level=1).wait_for(timeout=60_000)
    settle(page)


def test_the_app_in_chromium(server, shots):
    expect = sync_api.expect
    expect.set_options(timeout=60_000)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2600})
        page.set_default_timeout(60_000)
        page.goto(server)
        page.get_by_role("heading", name="Pipeline", level=1).wait_for()
        settle(page)
        expect(page.get_by_text("Top-5 predictions")).to_be_visible()
        page.screenshot(path=shots / "1_pipeline.png", full_page=True)

        # Upload a photo: it becomes the image on every page.
        uploader = page.locator('[data-testid="stFileUploader"]').filter(has_text="Upload an image")
        uploader.locator('input[type="file"]').set_input_files(PHOTO)
        expect(page.get_by_text("451x300 px as given")).to_be_visible()
        settle(page)
        expect(page.locator('[data-testid="stException"]')).to_have_count(0)

        # A larger patch size: a coarser grid.
        go_to(page, "Patches")
        expect(page.get_by_text("Input image as a 8 x 8 grid of 64 patches")).to_be_visible()
        page.get_by_role("slider").first.press("ArrowRight")
        expect(page.get_by_text("Input image as a 4 x 4 grid of 16 patches")).to_be_visible()
        settle(page)
        page.screenshot(path=shots / "2_patches.png", full_page=True)

        # Step back a layer, then click a patch to make it the query.
        go_to(page, "Attention")
        expect(page.get_by_text("Attention of the class token in layer 3, per head")).to_be_visible()
        page.get_by_role("button", name="Previous").click()
        expect(page.get_by_text("Attention of the class token in layer 2, per head")).to_be_visible()
        settle(page)
        picker = page.locator(".st-key-patch_click .nsewdrag").first
        box = picker.bounding_box()
        # The top-left patch of the 4 x 4 grid.
        page.mouse.click(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1)
        expect(page.get_by_text(re.compile(r"Attention of the patch 0 \(row 0, col 0\) in layer 2"))).to_be_visible()
        settle(page)
        page.screenshot(path=shots / "3_attention.png", full_page=True)

        # A short training run: the curves grow while it runs.
        go_to(page, "Train")
        page.get_by_role("spinbutton", name="Epochs").fill("1")
        page.get_by_role("spinbutton", name="Training images (0: the whole dataset)").fill("8192")
        page.get_by_role("spinbutton", name="Batch size").fill("32")
        page.get_by_role("button", name="Launch training").click()
        # .first: while the live view redraws, the chart it replaces can still be on the page.
        step_title = page.get_by_text(re.compile(r"Training: step \d+ of 256")).first
        step_title.wait_for()
        first = int(re.search(r"step (\d+)", step_title.text_content()).group(1))
        page.screenshot(path=shots / "4_training.png", full_page=True)
        expect(page.get_by_text(re.compile(r"Training: step (?!%d )\d+ of 256" % first)).first).to_be_visible()
        page.get_by_role("button", name="Explore this model").wait_for(timeout=240_000)
        # The sidebar's progress bar goes once the app has seen the run end, and that rerun of
        # the whole page is over: a click during it could be lost (Streamlit coalesces the two).
        expect(page.get_by_text(re.compile(r"^Training run \d+: "))).to_have_count(0, timeout=30_000)
        settle(page)
        page.screenshot(path=shots / "5_trained.png", full_page=True)
        # Under a loaded machine a click can still land while Streamlit replaces the fragment that
        # holds the button, and is lost (a person would click again): asking twice is harmless.
        for attempt in range(3):
            page.get_by_role("button", name="Explore this model").click()
            try:
                expect(page.get_by_role("combobox", name="Model", exact=True)).to_have_value(
                    "Trained here: run 1", timeout=20_000,
                )
                break
            except AssertionError:
                if attempt == 2:
                    raise
        go_to(page, "Attention")
        expect(page.locator('[data-testid="stException"]')).to_have_count(0)
        page.screenshot(path=shots / "6_trained_attention.png", full_page=True)
        browser.close()


def test_moving_between_pages_keeps_the_control_of_a_run(own_server, shots):
    """Streamlit's page links drop the address's parameters: the owner token must come back."""
    server = own_server
    expect = sync_api.expect
    expect.set_options(timeout=60_000)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.set_default_timeout(60_000)
        page.goto(server)
        page.get_by_role("heading", name="Pipeline", level=1).wait_for()
        settle(page)
        go_to(page, "Train")
        page.get_by_role("spinbutton", name="Epochs").fill("200")  # still running when we come back
        page.get_by_role("spinbutton", name="Epochs").press("Enter")
        settle(page)
        page.get_by_role("button", name="Launch training").click()
        stop = page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop")  # not the header's
        stop.wait_for()
        page.wait_for_url(re.compile(r"[?&]owner="))
        token = parse_qs(urlparse(page.url).query)["owner"]

        go_to(page, "Attention")
        expect(page.get_by_text(re.compile(r"Attention of the class token"))).to_be_visible()
        page.wait_for_url(re.compile(r"[?&]owner="))
        assert parse_qs(urlparse(page.url).query)["owner"] == token
        go_to(page, "Train")
        expect(stop).to_be_visible()
        expect(page.get_by_text("only they can stop it")).to_have_count(0)
        assert parse_qs(urlparse(page.url).query)["owner"] == token
        page.screenshot(path=shots / "7_train_again.png", full_page=True)

        stop.click()
        # Said at once; the run's process sees the request at its next step: at nice 15 on a busy
        # machine, a while.
        expect(page.get_by_text(re.compile(r"run 1 stopping"))).to_be_visible()
        expect(stop).to_have_count(0)
        expect(page.get_by_text(re.compile(r"run 1 stopped"))).to_be_visible(timeout=240_000)
        browser.close()


@pytest.fixture
def rope_server(tmp_path):
    """The app with a DINOv3-shaped random default model: no position embedding, 4 registers,
    rotary positions, LayerScale, a 14 x 14 grid (small width and depth, so that it is quick)."""
    torch.manual_seed(0)
    weights = tmp_path / "dinov3_shaped.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=224, patch_size=16, embed_dim=192, depth=2, num_heads=3, reg_tokens=4, abs_pos_embed=False,
        rope_type="dinov3", init_values=1e-5, num_classes=0, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
    )), weights)
    env = {
        "VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_RUNS_DIR": str(tmp_path / "runs"),
        "VIT_EXPLORER_UPLOADS_DIR": str(tmp_path / "uploads"),
    }
    with serve_app(env, log=tmp_path / "streamlit.log") as url:
        yield url


def test_the_pages_that_teach_rotary_positions_in_chromium(rope_server, shots):
    expect = sync_api.expect
    expect.set_options(timeout=60_000)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2600})
        page.set_default_timeout(60_000)
        page.goto(rope_server)
        page.get_by_role("heading", name="Pipeline", level=1).wait_for()
        settle(page)
        expect(page.get_by_text("6. Positions: nothing is added")).to_be_visible()
        expect(page.get_by_text(re.compile(r"^Each patch's rotation angle, for 8 of its 32 pairs"))).to_be_visible()
        page.get_by_text("Where positions enter").evaluate("element => element.scrollIntoView()")
        page.screenshot(path=shots / "rope_1_pipeline.png", full_page=True)

        go_to(page, "Inside a layer")
        picker = page.locator(".st-key-inside_patch_click .nsewdrag").first
        box = picker.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.75, box["y"] + box["height"] * 0.25)  # a patch up and right
        expect(page.get_by_text(re.compile(r"^Query q and key k of patch \d+, layer 1, head 0, before and after"))).to_be_visible()
        expect(page.get_by_text(re.compile(r"^The same q and k of patch \d+ \(layer 1, head 0\)"))).to_be_visible()
        settle(page)
        page.get_by_text("This model's positions enter here").evaluate("element => element.scrollIntoView()")
        page.screenshot(path=shots / "rope_2_inside_q_k.png", full_page=True)
        page.get_by_text("Why rotate: the score sees only the offset").evaluate("element => element.scrollIntoView()")
        page.screenshot(path=shots / "rope_3_inside_offsets.png", full_page=True)
        expect(page.locator('[data-testid="stException"]')).to_have_count(0)
        expect(page.locator('[data-testid="stAlertContentError"]')).to_have_count(0)
        browser.close()


def test_a_heavy_sweep_waits_its_turn_and_then_shows_in_chromium(tmp_path, shots):
    """A sweep that is not quick is a job: the page says its place in the queue behind another
    person's, then its progress, then draws the sweep."""
    torch.manual_seed(0)
    weights = tmp_path / "small.safetensors"
    model = vx.ViT(vx.ViTConfig(  # a sweep of about 50e9 multiply-adds: not quick
        image_size=224, patch_size=16, embed_dim=384, depth=6, num_heads=6,
        num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES,
    ))
    vx.save_model(model, weights)
    runs_dir = tmp_path / "runs"
    env = {
        "VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_RUNS_DIR": str(runs_dir),
        "VIT_EXPLORER_UPLOADS_DIR": str(tmp_path / "uploads"), "VIT_EXPLORER_MAX_JOBS": "1",
    }
    # Somebody else's computation holds the one slot, on the folder the server's jobs are on.
    board = JobBoard(runs_dir / "jobs", JobLimits(max_jobs=1, queue_size=8, memory=8 * 2**30, threads=1))
    ahead = JobSpec("head sweep", {"path": str(weights)}, 16, (224, 224), "somebody's image", {"mode": "mean"})
    with serve_app(env, log=tmp_path / "streamlit.log") as url, sync_api.sync_playwright() as playwright:
        expect = sync_api.expect
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/knockout")
        page.get_by_role("heading", name="Knock-out", level=1).wait_for()
        settle(page)
        assert board.submit(ahead, torch.randn(1, 3, 224, 224), model.config, "somebody").state == "running"
        page.get_by_role("button", name="Run the sweep").click()
        expect(page.get_by_text(re.compile("Waiting for its turn: next in line"))).to_be_visible(timeout=60_000)
        page.screenshot(path=shots / "sweep_queued.png", full_page=True)
        expect(page.get_by_text(re.compile(r"Computing beside the server: \d+%"))).to_be_visible(timeout=240_000)
        expect(page.get_by_text(re.compile(r"Each head knocked out alone \(zero\)"))).to_be_visible(timeout=240_000)
        expect(page.get_by_role("button", name="Cancel")).to_have_count(0)
        page.screenshot(path=shots / "sweep_done.png", full_page=True)
        browser.close()


def test_the_lesson_in_chromium(server, shots):
    """A student walks the lesson, answers the patch question by clicking a patch, and a teacher's
    link to a step, opened in a new session, shows that step on the same image."""
    expect = sync_api.expect
    expect.set_options(timeout=60_000)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(60_000)
        page.goto(server)
        page.get_by_role("heading", name="Pipeline", level=1).wait_for()
        settle(page)
        page.get_by_text("New to Vision Transformers? The Lesson walks").click()  # offered on the first page
        page.get_by_role("heading", name="Lesson", level=1).wait_for()
        settle(page)
        for step in (2, 3, 4):
            page.get_by_role("button", name="Next", exact=True).click()
            page.get_by_role("heading", name=re.compile(rf"^{step}\. ")).wait_for()
            settle(page)
        expect(page.get_by_text(re.compile("click the patch you think the class token attends to most"))).to_be_visible()
        picker = page.locator(".st-key-lesson_patch_click .nsewdrag").first
        box = picker.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1)  # the top-left patch
        expect(page.get_by_text(re.compile(r"Your patch 0 \(row 0, col 0\) gets [\d.]+% of the class token's attention"))).to_be_visible()
        settle(page)
        page.screenshot(path=shots / "lesson_1_patch_answered.png", full_page=True)

        page.get_by_role("button", name="Next", exact=True).click()
        page.get_by_role("heading", name=re.compile(r"^5\. ")).wait_for()
        settle(page)
        assert parse_qs(urlparse(page.url).query)["step"] == ["5"]
        page.get_by_text("For teachers: a link to this step").click()
        link = page.locator('[data-testid="stCode"]').filter(has_text="step=5").inner_text().strip()
        assert parse_qs(urlparse(link).query) == {"step": ["5"], "image": ["shapes:4"], "model": ["default"]}
        page.screenshot(path=shots / "lesson_2_teachers_link.png", full_page=True)

        student = browser.new_page(viewport={"width": 1400, "height": 2400})
        student.set_default_timeout(60_000)
        student.goto(link.replace("shapes%3A4", "shapes%3A2"))  # the teacher's link, for another picture
        student.get_by_role("heading", name=re.compile(r"^5\. How a head decides")).wait_for()
        settle(student)
        expect(student.get_by_role("combobox", name="Image")).to_have_value("Shapes #2: triangle")
        expect(student.get_by_text(re.compile("Your patch"))).to_have_count(0)  # a new session: no answers
        expect(student.locator('[data-testid="stException"]')).to_have_count(0)
        student.screenshot(path=shots / "lesson_3_link_opened.png", full_page=True)
        student.reload()  # the address is still the link
        student.get_by_role("heading", name=re.compile(r"^5\. How a head decides")).wait_for()
        browser.close()


def test_no_request_leaves_the_server_with_the_network_cut(server, shots):
    """An offline classroom: every request a walk through the pages makes goes to the app's own
    server (the page icon included: a :material: or emoji icon is fetched from a font server)."""
    outside = []

    def cut(route):
        if route.request.url.startswith(server):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        context = browser.new_context(viewport={"width": 1400, "height": 2000})
        context.route("**/*", cut)
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(server)
        page.get_by_role("heading", name="Pipeline", level=1).wait_for()
        settle(page)
        for title in ("Lesson", "Attention"):
            go_to(page, title)
        page.screenshot(path=shots / "offline.png", full_page=True)
        icon = page.locator('link[rel~="icon"]').first.get_attribute("href")
        browser.close()
    assert outside == []
    assert not icon.startswith("http") or icon.startswith(server), icon
