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
import json
import os
import tempfile
import urllib.parse
from pathlib import Path

from locust.stats import get_percentile_stats_summary, get_stats_summary

from bench.app_load import app_weights, make_probes
from bench.browser import log_tail
from bench.class_report import heavy_summary, ratio_line, summary
from bench.class_run import one_class, server_weights
from bench.class_students import PAGES, Options


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
