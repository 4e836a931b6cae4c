"""The server survives a hostile open_clip upload: a real `streamlit run`, a folder whose
tokenizer.json holds ten million pieces (80 MB, under the byte limit; parsed in the server, the Rust
allocator's abort ended the process and every session) uploaded through the sidebar in Chromium
while a second session walks pages. The upload is refused in one sentence, the second session sees
no error, and the server is the same process afterwards.

Uses the system Chromium; skips when it or Playwright is missing.
"""
import os
import urllib.request

import pytest
import torch

import vit_explorer as vx
from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, app_server, settle
from vit_explorer.data.datasets import SHAPE_CLASSES

from textmodels import siglip_folder

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")
PIECES = 10**7


def go_to(page, title: str) -> None:
    page.locator('[data-testid="stSidebarNav"] a').filter(has_text=title).click()
    page.get_by_role("heading", name=title, level=1).wait_for(timeout=60_000)
    settle(page)


def test_a_hostile_tokenizer_upload_leaves_the_server_and_other_sessions_alone(tmp_path):
    torch.manual_seed(0)
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4,
        num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES, mean=(0.5,) * 3, std=(0.25,) * 3,
    )), weights)
    folder = siglip_folder(tmp_path / "hostile")
    with open(folder / "tokenizer.json", "wb") as file:  # ten million pieces, one short string each
        file.write(b'{"version": "1.0", "model": {"type": "Unigram", "unk_id": 0, "vocab": [')
        file.write(b'["a",0],' * (PIECES - 1) + b'["a",0]]}}')
    env = {
        "VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_RUNS_DIR": str(tmp_path / "runs"),
        "VIT_EXPLORER_UPLOADS_DIR": str(tmp_path / "uploads"),
    }
    expect = sync_api.expect
    expect.set_options(timeout=120_000)
    with app_server(env, log=tmp_path / "streamlit.log") as server, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        student, other = (browser.new_page(viewport={"width": 1400, "height": 2000}) for _ in range(2))
        for page in (student, other):
            page.set_default_timeout(120_000)
            page.goto(server.url)
            page.get_by_role("heading", name="Pipeline", level=1).wait_for()
            settle(page)
        uploader = student.locator('[data-testid="stFileUploader"]').filter(has_text="Checkpoint")
        uploader.locator('input[type="file"]').set_input_files(sorted(str(path) for path in folder.iterdir()))
        for title in ("Attention", "Patches", "Pipeline"):  # meanwhile, the other session walks pages
            go_to(other, title)
            expect(other.locator('[data-testid="stException"]')).to_have_count(0)
            expect(other.locator('[data-testid="stAlertContentError"]')).to_have_count(0)
        student.get_by_text("Load a checkpoint").click()  # the expander that holds the uploader and its refusal
        refusal = student.get_by_text("Could not load that model: the upload's tokenizer.json holds 10,000,")
        expect(refusal).to_be_visible()
        assert str(tmp_path) not in refusal.text_content()
        go_to(other, "Attention")  # after the refusal too
        expect(other.locator('[data-testid="stException"]')).to_have_count(0)
        expect(other.locator('[data-testid="stAlertContentError"]')).to_have_count(0)
        os.kill(server.pid, 0)  # the same process, still there
        assert urllib.request.urlopen(f"{server.url}/_stcore/health", timeout=10).status == 200
        with open(f"/proc/{server.pid}/cmdline", "rb") as cmdline:
            assert b"streamlit" in cmdline.read()
        browser.close()
