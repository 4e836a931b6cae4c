"""python -m vit_explorer app | serve: the explorer app, alone or as several servers behind nginx."""
from __future__ import annotations

import argparse
import sys


def add_app(subparsers) -> None:
    parser = subparsers.add_parser(
        "app", help="start the Streamlit app",
        description="Start the explorer app (streamlit run app.py); further arguments go to"
        " streamlit, e.g. `vit-explorer app --server.port 8502`.",
    )
    parser.set_defaults(run=_run_app)


def _run_app(args: argparse.Namespace) -> int:
    import os

    from .. import resources

    script = resources.app_script()
    if not script.is_file():
        raise FileNotFoundError(f"the app is not installed: {script} is missing")
    command = [sys.executable, "-m", "streamlit", "run", str(script), *args.streamlit_args]
    # Become the streamlit process (no child left behind when this one is stopped); in the app's
    # folder, so that streamlit reads its .streamlit/config.toml.
    os.chdir(script.parent)
    os.execve(sys.executable, command, dict(os.environ))


def _ports(text: str) -> list[int]:
    """--replica-ports 8502,8503 -> [8502, 8503]; argparse shows a bad list as a usage error."""
    try:
        ports = [int(part) for part in text.split(",")]
    except ValueError:
        ports = []
    if not ports or not all(0 < port < 65536 for port in ports):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of ports, like 8502,8503")
    return ports


def add_serve(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the app from several processes behind nginx",
        description="Start N app servers (replicas) on loopback and nginx in front of them, with"
        " sticky sessions and websockets; print the proxy's address; Ctrl-C stops everything."
        " The replicas share the runs and uploads folders. Needs nginx (apt-get install nginx).",
    )
    parser.add_argument("--replicas", type=int, default=2, help="app servers (default 2; about one per core)")
    parser.add_argument("--port", type=int, default=8501, help="the proxy's port (default 8501)")
    parser.add_argument("--host", default="127.0.0.1", help="the proxy's address (default 127.0.0.1; 0.0.0.0 for a class)")
    parser.add_argument("--replica-ports", type=_ports, default=None, metavar="P1,P2,...",
                        help="the replicas' loopback ports (default: free ones)")
    parser.add_argument("--runs-dir", default=None, help="runs folder shared by the replicas (VIT_EXPLORER_RUNS_DIR)")
    parser.add_argument("--uploads-dir", default=None, help="uploads folder shared by the replicas (VIT_EXPLORER_UPLOADS_DIR)")
    parser.add_argument("--print-nginx-config", action="store_true",
                        help="print the nginx.conf for these replica ports and exit (to run nginx by hand)")
    parser.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from ..serving import replicas as serve

    if args.print_nginx_config:
        ports = list(args.replica_ports or range(8502, 8502 + args.replicas))
        print(serve.nginx_config(ports, listen=f"{args.host}:{args.port}"), end="")
        return 0
    return serve.serve(
        args.replicas, port=args.port, host=args.host, runs_dir=args.runs_dir, uploads_dir=args.uploads_dir,
        replica_ports=args.replica_ports,
    )

