"""The training runs of a shared server: the queue, owners, and the runs folder every server shares.

One ``RunManager`` per server owns every run launched from the app. A launch is admitted first
(``admission.admit``: its memory estimate against the server's ``Limits``), before anything is
allocated. At most ``max_runs`` train at once, each in its own process
(``run.TrainingRun(process=True)``); further launches wait in a queue of ``queue_size``
and start by themselves when a slot frees; beyond that they are refused. Only the person who
launched a run (its owner token) may stop it. Ended runs are found again in the runs folder
after a restart, from the sidecar every checkpoint has.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import socket
import threading
import time
from pathlib import Path

from .admission import Limits, RunRefused, admit
from .run import RunConfig, TrainingRun, has_ended, process_identity, run_config, run_files, run_kind
from .train import TrainingError

MAX_LISTED_RUNS = 50  # ended runs kept in the list (their files stay in the runs folder)

logger = logging.getLogger(__name__)


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


RECORD_SUFFIX = ".run.json"  # a launched run's record in the runs folder: owner, config, process
LOCK_NAME = ".runs.lock"  # held (flock) while a server admits, starts, numbers or withdraws runs
# A server looks at the runs folder again when its modification time changed (a record or a
# checkpoint written), else at most this often (a network file system may report it late).
REFRESH_SECONDS = 2.0


def _number_of(path: Path) -> int | None:
    """N of a run file named ..._N.json (a sidecar) or ..._N.run.json (a record)."""
    number = re.search(r"_(\d+)$", path.name.removesuffix(RECORD_SUFFIX).removesuffix(".json"))
    return int(number.group(1)) if number else None


class RunManager:
    """Every run on one runs folder, by id ("run 1", "run 2", ...), in launch order; thread-safe.

    The folder is the truth, so that several servers (replicas) on it share one set of runs: a
    launch leaves a record there (``<name>.run.json``: its number, owner, config, memory estimate,
    and once started the pid and start time of its process); a run appends its events beside its
    checkpoint (``run.run_files``), which every server follows; stopping leaves a stop file.
    Admitting, numbering, starting and withdrawing runs happen under an flock on the folder, so
    that ``max_runs`` and the queue count the runs of every server, and whichever server sees a
    slot free first starts the oldest waiting run. A run's owner is known to a server that sees it
    waiting or training; ViT runs found ended are no one's, a sparse autoencoder's stays its
    owner's (read from its record), since its dictionary is offered to others only once its owner
    keeps it (``keep``: "kept" in its record).
    """

    def __init__(self, runs_dir: str | Path, limits: Limits | None = None, *, process: bool = True):
        self.runs_dir = Path(runs_dir)
        self.limits = limits or Limits.from_environment()
        self._process = process  # False: threads of this process (quick tests of the bookkeeping)
        self._lock = threading.RLock()
        self._runs: dict[str, TrainingRun] = {}
        self._owners: dict[str, str] = {}
        self._records: dict[str, Path] = {}  # run id -> record, for runs waiting or training
        self._seen: set[int] = set()  # run numbers listed once: never listed again, never reused
        self._failed_files: set[Path] = set()  # files logged once as unreadable
        self._refreshed, self._stamp = -math.inf, None
        self._folder_depth = 0  # the flock is taken once per thread holding self._lock
        with self._lock:
            self._refresh(initial=True)

    # --- the folder ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _folder_lock(self):
        """The folder's flock, with self._lock held; re-entrant (a second flock on another open
        file of the same process would wait for the first forever)."""
        with self._lock:
            if self._folder_depth:
                self._folder_depth += 1
                try:
                    yield
                finally:
                    self._folder_depth -= 1
                return
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            with open(self.runs_dir / LOCK_NAME, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                self._folder_depth = 1
                try:
                    yield
                finally:
                    self._folder_depth = 0

    def _write_record(self, path: Path, record: dict) -> None:
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, path)

    def _read_record(self, path: Path) -> dict | None:
        try:
            record = json.loads(path.read_text())
            record["config"] = run_config(record.get("kind", "vit"), record["config"])
            owner, number = record["owner"], record["number"]
            if not (isinstance(owner, str) and isinstance(number, int)):
                raise ValueError("owner or number of the wrong type")
            return record
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            if path not in self._failed_files:
                self._failed_files.add(path)
                logger.warning("not listed as a run: %s could not be read (%s)", path, error)
            return None

    def _refresh(self, *, force: bool = False, initial: bool = False) -> None:
        """Bring this server's view up to the folder: runs launched, started, withdrawn or ended
        elsewhere (see REFRESH_SECONDS)."""
        try:
            stamp = self.runs_dir.stat().st_mtime_ns
        except OSError:  # no runs yet
            return
        if not (force or initial) and stamp == self._stamp and time.monotonic() - self._refreshed < REFRESH_SECONDS:
            return
        self._refreshed, self._stamp = time.monotonic(), stamp
        found: list[tuple[int, TrainingRun]] = []
        restored_owners: dict[int, str] = {}  # ended SAE runs' owners, from their records
        records = {}
        for path in self.runs_dir.glob(f"*{RECORD_SUFFIX}"):
            number = _number_of(path)
            if number is not None:
                records[number] = path
        for run_id, path in list(self._records.items()):
            run = self._runs.get(run_id)
            record = self._read_record(path) if run is not None and run.status == "pending" else None
            if run is None or run.status not in ("pending", "running"):
                del self._records[run_id]
            elif run.status == "pending" and record is None:  # withdrawn by its owner elsewhere
                del self._runs[run_id], self._records[run_id]
                self._owners.pop(run_id, None)
            elif record is not None and record.get("pid") is not None:  # started elsewhere
                run.follow(record["pid"], record["started"], record.get("host"))
        for number, path in sorted(records.items()):
            if number in self._seen:
                continue
            record = self._read_record(path)
            if record is None or record["number"] != number:
                continue
            config = record["config"]
            pid, started, host = record.get("pid"), record.get("started"), record.get("host")
            live = pid is None or (
                (host != socket.gethostname() or process_identity(pid) == (pid, started))
                and not has_ended(config)
            )
            if not live:  # ended: a ViT run is listed from its checkpoint's sidecar below
                if run_kind(config) == "sae" and (run := TrainingRun.restored_sae(config)) is not None:
                    found.append((number, run))  # its events file and dictionary; still its owner's
                    restored_owners[number] = record["owner"]
                continue
            run = TrainingRun(
                config, process=self._process, threads=self.limits.threads, memory_limit=self.limits.memory,
                on_end=self._promote, publish=True,
            )
            if pid is not None:
                run.follow(pid, started, host)
            run_id = f"run {number}"
            self._seen.add(number)
            self._runs[run_id], self._owners[run_id], self._records[run_id] = run, record["owner"], path
        for sidecar in self.runs_dir.glob("*.json"):
            number = _number_of(sidecar)
            checkpoint = sidecar.with_suffix(".safetensors")
            if (
                number is None or number in self._seen or sidecar.name.endswith(RECORD_SUFFIX)
                or sidecar in self._failed_files or not checkpoint.is_file()
            ):
                continue
            try:
                found.append((number, TrainingRun.restored(checkpoint)))
            except TrainingError as error:  # its sentence names the file
                self._failed_files.add(sidecar)
                logger.warning("not listed as a run: %s", error)
            except Exception as error:  # whatever one file holds, the server and the other runs go on
                self._failed_files.add(sidecar)
                logger.warning(
                    "not listed as a run: %s could not be read (%s: %s)", sidecar, type(error).__name__, error
                )
        if initial:  # the most recent only; those beyond are not listed, now or later
            self._seen.update(number for number, _ in found)
            found = sorted(found, key=lambda item: item[0])[-MAX_LISTED_RUNS:]
        for number, run in found:
            self._seen.add(number)
            self._runs[f"run {number}"] = run
            if number in restored_owners:
                self._owners[f"run {number}"] = restored_owners[number]
        self._seen.update(records)  # those ended without a checkpoint (failed) included: numbers stay used
        if found:
            self._runs = dict(sorted(self._runs.items(), key=lambda item: int(item[0].split()[-1])))
            self._forget_old_runs()

    # --- runs ---------------------------------------------------------------------------------

    def launch(self, config: RunConfig, owner: str) -> str:
        """Admit ``config`` and start it, or queue it; its id. RunRefused says why not."""
        estimate = admit(config, self.limits)
        with self._folder_lock():
            self._refresh(force=True)
            waiting = self.queued()
            if len(self.running()) >= self.limits.max_runs and len(waiting) >= self.limits.queue_size:
                raise RunRefused(
                    f"The server is busy: {self.limits.max_runs} runs are training and"
                    f" {len(waiting)} are waiting, the most it takes; try again when one has ended."
                )
            number = max(self._seen, default=0) + 1
            run_id = f"run {number}"
            prefix = "app" if run_kind(config) == "vit" else "sae"
            name = f"{prefix}_{config.dataset.split(':')[0]}_{time.strftime('%Y%m%d-%H%M%S')}_{number}"
            config = config.replace(out_dir=str(self.runs_dir), name=name)
            record = self.runs_dir / f"{name}{RECORD_SUFFIX}"
            self._write_record(record, {
                "number": number, "owner": owner, "kind": run_kind(config), "config": config.to_dict(),
                "estimate": estimate.total,
                "launched": time.time(), "pid": None, "started": None,
            })
            self._seen.add(number)
            self._runs[run_id] = TrainingRun(
                config, process=self._process, threads=self.limits.threads, memory_limit=self.limits.memory,
                on_end=self._promote, publish=True,
            )
            self._owners[run_id], self._records[run_id] = owner, record
            self._forget_old_runs()
            self._promote()
        return run_id

    def _forget_old_runs(self) -> None:
        ended = [run_id for run_id, run in self._runs.items() if run.status not in ("pending", "running")]
        for run_id in ended[: max(0, len(ended) - MAX_LISTED_RUNS)]:
            del self._runs[run_id]
            self._owners.pop(run_id, None)
            self._records.pop(run_id, None)

    def _promote(self) -> None:
        """Start waiting runs, of any server, first come first served, while there are free slots."""
        with self._folder_lock():
            self._refresh(force=True)
            waiting = self.queued()
            while waiting and len(self.running()) < self.limits.max_runs:
                run_id = waiting.pop(0)
                run, path = self._runs[run_id], self._records[run_id]
                record = self._read_record(path)
                if record is None:  # withdrawn meanwhile
                    continue
                run.start()
                pid = (run.pid if self._process else os.getpid()) if run.status == "running" else 0
                identity = process_identity(pid) if pid else None  # pid 0: failed to start, not waiting
                record.update(
                    config=run.config.to_dict(), pid=pid, started=identity[1] if identity else 0,
                    host=socket.gethostname(),
                )
                self._write_record(path, record)

    def runs(self) -> dict[str, TrainingRun]:
        with self._lock:
            self._refresh()
            if self.queued() and len(self.running()) < self.limits.max_runs:
                self._promote()  # its launcher's server may be gone: any server starts it
            return dict(self._runs)

    def running(self) -> dict[str, TrainingRun]:
        with self._lock:
            self._refresh()
            return {run_id: run for run_id, run in self._runs.items() if run.status == "running"}

    def queued(self) -> list[str]:
        with self._lock:
            self._refresh()
            return [run_id for run_id, run in self._runs.items() if run.status == "pending"]

    def place(self, run_id: str) -> int | None:
        """1 for the next run to start, 2 for the one after, ...; None when not waiting."""
        waiting = self.queued()
        return waiting.index(run_id) + 1 if run_id in waiting else None

    def owns(self, run_id: str, owner: str) -> bool:
        with self._lock:
            return self._owners.get(run_id) == owner

    def owner_of(self, run_id: str) -> str | None:
        """The token that launched a run; None for runs found ended in the runs folder."""
        with self._lock:
            return self._owners.get(run_id)

    def keep(self, run_id: str, owner: str) -> bool:
        """Offer an ended SAE run's dictionary to everyone, if ``owner`` launched it; whether it did."""
        with self._folder_lock():
            run = self._runs.get(run_id)
            if run is None or run_kind(run.config) != "sae" or run.checkpoint is None or not self.owns(run_id, owner):
                return False
            path = self.runs_dir / f"{run.config.run_name}{RECORD_SUFFIX}"
            record = self._read_record(path)
            if record is None:
                return False
            self._write_record(path, {**record, "config": run.config.to_dict(), "kept": True})
            return True

    def stop(self, run_id: str, owner: str) -> bool:
        """Stop a running run, or withdraw a waiting one, if ``owner`` launched it; whether it did.
        Any server on the runs folder can: the run's process watches for its stop file."""
        with self._folder_lock():
            if not self.owns(run_id, owner):
                return False
            self._refresh(force=True)
            if run_id in self.queued():
                self._records[run_id].unlink(missing_ok=True)
                del self._runs[run_id], self._owners[run_id], self._records[run_id]
                return True
            self._runs[run_id].stop()
            return True

    def shutdown(self, timeout: float = 60) -> None:
        """Withdraw the waiting runs, stop the running ones and wait for them (their checkpoints)."""
        with self._folder_lock():
            for run_id in self.queued():
                self._records[run_id].unlink(missing_ok=True)
                del self._runs[run_id], self._owners[run_id], self._records[run_id]
            running = list(self.running().values())
        for run in running:
            run.stop()
        for run in running:
            run.join(timeout)


def run_record(checkpoint: str | Path) -> dict | None:
    """{"owner", "number", "kept"} of the run of the app that wrote ``checkpoint`` (its record
    beside it, of the same name); None for a file no such run wrote, or a record that cannot be read."""
    path = Path(checkpoint)
    try:
        record = json.loads(path.with_name(f"{path.stem}{RECORD_SUFFIX}").read_text())
        owner, number, kept = record["owner"], record["number"], record.get("kept", False)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if not (isinstance(owner, str) and isinstance(number, int) and isinstance(kept, bool)):
        return None
    return {"owner": owner, "number": number, "kept": kept}


def stop_every_run(runs_dir: str | Path, timeout: float) -> int:
    """Withdraw the waiting runs on ``runs_dir`` and ask every one training on this machine
    (whichever server started it) to stop, then wait up to ``timeout`` seconds for them to end, each writing its
    checkpoint; how many were training."""
    runs_dir, training = Path(runs_dir), []
    if not runs_dir.is_dir():
        return 0
    with open(runs_dir / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for path in runs_dir.glob(f"*{RECORD_SUFFIX}"):
            try:
                record = json.loads(path.read_text())
                config = run_config(record.get("kind", "vit"), record["config"])
                pid, started, files = record["pid"], record["started"], run_files(config)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue  # not a record this server can act on
            if pid is None:
                path.unlink(missing_ok=True)
            elif record.get("host") == socket.gethostname() and process_identity(pid) == (pid, started):
                files["stop"].touch()
                training.append((pid, started))
    count, deadline = len(training), time.monotonic() + timeout
    while training and time.monotonic() < deadline:
        time.sleep(0.5)
        training = [identity for identity in training if process_identity(identity[0]) == identity]
    return count
