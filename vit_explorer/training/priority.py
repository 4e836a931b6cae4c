"""Work beside the app servers (a training run, a job) runs below them: on a small machine the
people browsing come first and the work takes what they leave."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

# At nice 5 eight sessions beside one training run stalled the app.
BACKGROUND_NICE = 15


def run_below_the_servers() -> None:
    """Put this process at nice BACKGROUND_NICE, and its autogroup too.

    Runs and jobs begin sessions of their own (they outlive the server that started them), and
    where the kernel groups tasks by session (autogroup, on in most distributions' kernels) it
    shares the CPU between the groups first, by each group's own nice: a process's nice then
    weighs only against its own group. A job at nice 15 in a group at nice 0 took a core's fair
    share from a 2-thread server: beside two students' jobs, eight others waited 3.4x longer (p95).
    """
    with contextlib.suppress(OSError):
        os.nice(max(0, BACKGROUND_NICE - os.nice(0)))
    with contextlib.suppress(OSError):  # no such file: no autogroups, and the nice above suffices
        Path("/proc/self/autogroup").write_text(str(BACKGROUND_NICE))
