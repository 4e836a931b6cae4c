"""What the hostile-input corpora share (checkpoints, text folders, dictionaries): one child process
that caps its address space at its size after the imports plus 1 GB, records the files it opens
(an audit hook) and reads each case under a hang guard, one JSON line a case."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vit_explorer.resources import child_python_path

GROWTH_LIMIT_KB = 256 * 1024  # per case; the address-space cap (1 GB) stops anything worse

# Prepended to a corpus's own child code, which imports what it reads (before the cap) and calls
# ``outcome(read, expected_error, *arguments)`` for each case.
CAPPED = r'''
import json, resource, signal, sys, time

def hung(signum, frame):  # a hang guard, far above the second a case takes
    raise TimeoutError("still reading after 60 s")

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def cap():
    limit = vm_size() + 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGALRM, hung)
    sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and isinstance(args[0], str) else None)

opened = []

def outcome(read, expected_error, *arguments):
    """What ``read(*arguments)`` raised (None: nothing; what it returned joins the outcome), whether
    that is the project's own error, the files it opened, its time and the memory it grew by."""
    opened.clear()
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    signal.alarm(60)
    try:
        result = {"error": None, **(read(*arguments) or {})}
    except BaseException as error:
        result = {"error": type(error).__name__, "expected_error": isinstance(error, expected_error), "message": str(error)}
    signal.alarm(0)
    result.update(
        opened=list(opened), seconds=time.perf_counter() - started,
        growth_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
    )
    return result
'''


def run_capped(code: str, cases: list, root: Path) -> tuple[list[dict], str]:
    """Run CAPPED and ``code`` in a child in ``root`` with ``cases`` (JSON) as its sys.argv[1]:
    the JSON lines it printed, and the end of its standard error."""
    listing = root / "cases.json"
    listing.write_text(json.dumps(cases))
    child = subprocess.Popen(
        [sys.executable, "-c", CAPPED + code, str(listing)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": child_python_path()}, cwd=root,
    )
    try:
        stdout, stderr = child.communicate(timeout=600)  # the child's own guard ends a hung case
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")], stderr[-3000:]
