"""Several app servers on one runs folder: behind nginx (vit-explorer serve), and two managers.

The browser test starts two replicas behind nginx on loopback: a run launched through one
replica is followed live and stopped by its owner through the other, after the first one was
killed (and started again by the supervisor). It skips when nginx, Chromium or Playwright is
missing.
"""
import re
import signal
import socket

import pytest
import torch

import vit_explorer as vx
from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, ROOT
from vit_explorer import cli
from vit_explorer.training import admission
from vit_explorer.training import runs
from vit_explorer.serving import replicas as serve
from vit_explorer.training import train as training
from vit_explorer.model.config import TrainConfig
from vit_explorer.data.datasets import SHAPE_CLASSES
from helpers import SMALL_RUN_MODEL, small_run_config

SMALL_MODEL = SMALL_RUN_MODEL
ONE_SLOT = admission.Limits(max_runs=1, queue_size=0, memory=64 * admission.GB, threads=1)


def small_config(tmp_path, **changes) -> TrainConfig:
    return small_run_config(tmp_path, **{"epochs": 500, **changes})


def test_two_servers_on_one_runs_folder_share_runs_owners_admission_and_stop(tmp_path):
    """Two managers stand for two replicas: each sees the other's run live, the owner stops it
    from the other, and admission counts the runs of both."""
    a = runs.RunManager(tmp_path, ONE_SLOT)
    b = runs.RunManager(tmp_path, ONE_SLOT)
    run_id = a.launch(small_config(tmp_path), owner="alice")
    followed = b.runs()[run_id]
    assert followed is not a.runs()[run_id] and followed.status == "running"
    assert b.owner_of(run_id) == "alice"
    while not followed.history["steps"] and not followed.join(0.05):
        pass
    assert followed.status == "running", followed.error
    assert followed.pid == a.runs()[run_id].pid  # the same process, followed through its files
    with pytest.raises(admission.RunRefused, match="The server is busy: 1 runs are training and 0 are waiting"):
        b.launch(small_config(tmp_path), owner="bob")
    while followed.latest_snapshot is None and not followed.join(0.05):
        pass
    assert torch.allclose(followed.latest_snapshot.attentions.sum(-1), torch.ones(1))

    assert not b.stop(run_id, owner="bob") and b.stop(run_id, owner="alice")
    assert followed.join(60) and followed.status == "stopped", followed.error
    assert a.runs()[run_id].join(60) and a.runs()[run_id].status == "stopped"
    assert followed.history == a.runs()[run_id].history
    assert not training.load_history(followed.checkpoint)["finished"]
    assert b.launch(small_config(tmp_path, epochs=1), owner="bob") == "run 2"  # the slot is free again
    assert b.runs()["run 2"].join(60)


def test_a_server_started_later_finds_a_live_run_with_its_owner(tmp_path):
    """A replica that restarts finds the runs training on its folder, and their owners (the
    browser test below kills a replica for real)."""
    first = runs.RunManager(tmp_path, ONE_SLOT)
    run_id = first.launch(small_config(tmp_path), owner="alice")
    pid = first.runs()[run_id].pid
    again = runs.RunManager(tmp_path, ONE_SLOT)
    run = again.runs()[run_id]
    assert run.status == "running" and run.pid == pid and again.owns(run_id, "alice")
    assert again.stop(run_id, owner="alice")
    assert run.join(60) and run.status == "stopped", run.error


def test_the_shipped_nginx_config_is_what_serve_prints(capsys):
    assert cli.main(["serve", "--print-nginx-config", "--replica-ports", "8502,8503"]) == 0
    assert capsys.readouterr().out == (ROOT / "deploy" / "nginx.conf").read_text()


def test_serve_without_nginx_says_so_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(serve, "find_nginx", lambda: None)
    assert cli.main(["serve", "--replicas", "2"]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: nginx is not installed") and "\n" not in message


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(serve.find_nginx() is None, reason="no nginx (apt-get install nginx)")
@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")
def test_a_run_launched_through_one_replica_is_followed_and_stopped_through_another(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    expect = sync_api.expect
    expect.set_options(timeout=60_000)
    torch.manual_seed(0)
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4,
        num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES,
    )), weights)
    cluster = serve.Replicas(
        2, port=free_port(), runs_dir=tmp_path / "runs", uploads_dir=tmp_path / "uploads",
        env={"VIT_EXPLORER_DEFAULT_MODEL": str(weights)}, folder=tmp_path / "serve", log=lambda text: None,
    )
    with cluster, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)

        def open_train_page(address: str):
            """A new browser (no cookie yet) on the Train page; the replica nginx chose for it."""
            context = browser.new_context(viewport={"width": 1400, "height": 1600})
            page = context.new_page()
            page.set_default_timeout(60_000)
            replica = page.goto(address).headers["x-vit-explorer-replica"]
            page.get_by_role("heading", name="Train", level=1).wait_for()
            return context, page, replica

        # Alice launches a run through the replica nginx picks for her.
        _, alice, replica_a = open_train_page(f"{cluster.url}/train")
        # A model so small that its steps and evaluations cost little, on enough images that it
        # is still training when stopped.
        settings = [("Dim", "32"), ("Depth", "1"), ("Heads", "2"), ("Epochs", "200"),
                    ("Training images (0: the whole dataset)", "2000"), ("Batch size", "32")]
        for label, value in settings:
            alice.get_by_role("spinbutton", name=label).fill(value)
            alice.get_by_role("spinbutton", name=label).press("Enter")
        alice.wait_for_timeout(500)
        alice.get_by_role("button", name="Launch training").click()
        alice.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop").wait_for()
        alice.wait_for_url(re.compile(r"[?&]owner="))
        token = re.search(r"[?&]owner=([^&]+)", alice.url).group(1)

        # Her replica dies (the supervisor starts it again): the run is a process of its own.
        a_index = cluster.replica_ports.index(int(replica_a.rsplit(":", 1)[1]))
        cluster.processes[a_index].send_signal(signal.SIGKILL)

        # Alice again, with her address, in a browser that nginx sends to the other replica.
        for _ in range(30):
            context, again, replica = open_train_page(f"{cluster.url}/train?owner={token}")
            if replica != replica_a:
                break
            context.close()
        else:
            pytest.fail("nginx sent 30 new browsers to the same replica")
        expect(again.get_by_text(re.compile(r"run 1 running"))).to_be_visible()
        step = again.get_by_test_id("stMetricValue").first
        expect(step).to_have_text(re.compile(r"^\d+ / \d+$"))
        seen = step.inner_text()
        expect(step).not_to_have_text(seen)  # it follows the run live
        expect(again.get_by_text("only they can stop it")).to_have_count(0)

        stop = again.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop")
        stop.click()
        # Said at once; the run's process sees the request at its next step, then tests itself
        # and writes its checkpoint: at nice 15 beside two servers and a browser, a while.
        expect(again.get_by_text(re.compile(r"run 1 stopping"))).to_be_visible()
        expect(stop).to_have_count(0)
        expect(again.get_by_text(re.compile(r"run 1 stopped"))).to_be_visible(timeout=240_000)
        browser.close()
    (checkpoint,) = (tmp_path / "runs").glob("*.safetensors")
    assert not training.load_history(checkpoint)["finished"]
    assert cluster.restarts[a_index] == 1 and all(process.poll() is not None for process in cluster.processes)
