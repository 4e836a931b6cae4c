"""Where the app's own files are: beside the package in a checkout, under
<prefix>/share/vit_explorer once installed with pip (pyproject.toml's data-files)."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path


def app_root() -> Path:
    """The folder holding app.py, views/, assets/ and weights/."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "app.py").is_file():
        return checkout
    return Path(sysconfig.get_path("data")) / "share" / "vit_explorer"


def app_script() -> Path:
    return app_root() / "app.py"


def shipped_weights() -> Path:
    return app_root() / "weights" / "vit_shapes.safetensors"


def child_python_path() -> str:
    """PYTHONPATH for a Python this package starts (a run, a job, a test's child): the folder
    holding this package first, then what this interpreter was given, so that the child imports
    the same code and finds the same packages."""
    package_root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))


def default_runs_dir() -> Path:
    """Where runs trained in the app write their checkpoints and events: VIT_EXPLORER_RUNS_DIR,
    else runs/app beside the package (one folder for every server of this checkout)."""
    return Path(os.environ.get("VIT_EXPLORER_RUNS_DIR") or Path(__file__).resolve().parent.parent / "runs" / "app")
