"""The vit-explorer command: every subcommand's help, and `app` starting streamlit on app.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vit_explorer import cli, resources

ROOT = Path(__file__).resolve().parents[2]


def test_help_of_every_subcommand():
    # The commands at once: each is mostly its interpreter's start and imports, one core's work.
    commands = [[], ["train"], ["evaluate"], ["inspect"], ["app"], ["serve"]]
    started = [
        subprocess.Popen([sys.executable, "-m", "vit_explorer", *arguments, "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for arguments in commands
    ]
    for arguments, process in zip(commands, started):
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, (arguments, stderr)
        assert stdout.startswith(f"usage: vit-explorer {' '.join(arguments)}".rstrip()), arguments


def test_app_becomes_streamlit_on_the_app_script(monkeypatch):
    started = {}

    def execve(program, command, environment):
        started.update(program=program, command=command, environment=environment)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.chdir(ROOT)  # app changes to the app's folder; restored afterwards
    cli.main(["app", "--server.port", "8502"])
    assert started["program"] == sys.executable
    assert started["command"] == [
        sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.port", "8502"
    ]
    assert resources.app_script() == ROOT / "app.py"


def test_unknown_arguments_are_refused_outside_app(capsys):
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--weights", "x", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_an_installed_app_gets_every_file_of_the_checkout_it_reads():
    """pip install puts the app under share/vit_explorer: the same layout as the checkout, the
    server settings (.streamlit/config.toml: upload size, no file watcher) included."""
    tomllib = pytest.importorskip("tomllib")
    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    installed = {}
    for target, patterns in data_files.items():
        for pattern in patterns:
            for path in ROOT.glob(pattern):
                installed[path] = target
    needed = [ROOT / "app.py", ROOT / ".streamlit" / "config.toml", *ROOT.glob("views/*.py"),
              *ROOT.glob("assets/samples/*"), *ROOT.glob("weights/*")]
    for path in needed:
        assert installed.get(path) == str(Path("share/vit_explorer") / path.parent.relative_to(ROOT)).rstrip("/."), path
