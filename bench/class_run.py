"""One class run for bench.class_load: the server it runs on, its roster, Locust's run, the CPU read.

The server is `streamlit run app.py` or vit-explorer serve's replicas behind nginx, started on
loopback with runs, uploads and log in a folder of the class's own (or an app already running);
the roster is the Locust user classes configured with the students' images and numbers. A class
is warmed up unmeasured, then run until its students are done or its time is up, with the
server's CPU read from /proc around it; the job workers it left are ended after.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path

import gevent
from locust import between
from locust.clients import HttpSession
from locust.env import Environment
from locust.event import Events

from bench.app_load import Probe
from bench.browser import app_server, free_port
from bench.class_report import Class, Result, figures
from bench.class_students import ClassReport, Expected, HeavyReport, HeavyStudent, Options, Student, image_array
from bench.streamlit_client import StreamlitSession
from vit_explorer.serving.replicas import Replicas
from vit_explorer.training.run import process_identity
from vit_explorer.training.train import DEFAULT_WEIGHTS


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


def heavy_class(count: int, reports: list[HeavyReport], options: Options, think: tuple[float, float],
                image_size: tuple[int, int]):
    """A HeavyStudent class for ``count`` heavy students (Locust builds users from a class)."""
    return type("ConfiguredHeavyStudent", (HeavyStudent,), dict(
        abstract=False, fixed_count=count, wait_time=between(*think), reports=reports, options=options,
        numbers=list(range(1, count + 1)), ends_at=[math.inf], image_size=image_size,
    ))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / os.sysconf("SC_CLK_TCK")


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
    result = figures(report, len(probes), seconds, measured_runs, measured_views, server_cpu, generator_cpu)
    return result, environment, heavy_reports


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _http(url: str) -> HttpSession:
    """An HTTP client for a session outside the class (its requests are not counted)."""
    return HttpSession(url, request_event=Events().request, user=None)


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
