"""The views' heavy computations as jobs: admitted from their cost, queued on a jobs folder every
server of a machine shares, each run in a worker process of its own, followed through files.

A job is a ``JobSpec``: what to compute (``kind``, one of ``KINDS``: the head sweep, a model's
capture of one image for the Compare page, the tokens of several images in one batch, the head
types and the register neurons over several images, the Patches page's comparison of every patch
size), the model (a checkpoint file
or a catalogue name, at a patch size and input size), what the input is (``identity``, with the
input tensor handed over at submission) and its settings. Its ``key`` hashes all of that, so a
second person asking for the same result joins the job instead of starting another.

``JobBoard`` keeps the jobs in a folder (one sub-folder per job: its record, input, progress,
result or error, cancel request), changed under an flock on the folder as ``runs.RunManager``
does, so that the limits are the folder's, not each server's: at most ``max_jobs`` run at once,
at most ``queue_size`` wait, at most one waits per owner. A worker (``_work``) runs at nice 15
with capped torch threads and the memory its estimate was granted (``admission.limit_memory``);
it reports its progress to a file, checks for a cancel file between steps, writes its result
whole and, ending, starts the oldest waiting job, so that the queue moves with nobody looking (a
worker killed cannot: whichever server looks next starts it). A worker that ends without a
result leaves its job failed with a sentence.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .ablation import SWEEP_BATCH, HeadSweep, head_sweep, sweep_cost
from .admission import GB, available_memory, environment_number, inference_memory, limit_memory
from .analysis import AnalysisError, streamed_rollout
from .capture import Capture, capture, layer_attentions
from .head_types import HeadTypes, attention_share, classify_heads_from_tokens, held_floats
from .image_set import NormOutliers
from .model import ViT
from .patch_sizes import PlannedSize, held_out_accuracy, held_out_set, predictions
from .priority import run_below_the_servers
from .resources import child_python_path
from .runs import ordinal
from .test_time_registers import SEARCH_PASSES, RegisterNeurons, find_register_neurons
from .training_run import process_identity

LOCK_NAME = ".jobs.lock"
# An ended job's files stay this long, for the servers that follow it to load its result or say
# why it failed; then whichever server looks next removes them.
KEEP_SECONDS = 600.0


class JobRefused(Exception):
    """A job that cannot be admitted now; ``str()`` is the sentence to show."""


class Cancelled(Exception):
    """Raised in a worker when everybody who asked for its job has cancelled it."""


# --- what a job computes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One kind of job: its cost in forward passes and memory, what its worker computes (arrays
    out, progress reported as a share), and the values those arrays stand for (a tuple: the
    asker keeps each under a key of its own)."""

    forwards: Callable[[object, dict], float]  # the model's config, the settings -> forward passes
    memory: Callable[[object, dict], int]  # the model's config, the settings -> peak bytes of the worker
    compute: Callable[[ViT, torch.Tensor, dict, Callable[[float], None]], dict[str, np.ndarray]]
    decode: Callable[[dict[str, np.ndarray]], tuple]


def _sweep(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    sweep = head_sweep(model, x, settings["mode"], progress=progress)
    return {
        "values": sweep.values.numpy(), "target": np.array(-1 if sweep.target is None else sweep.target),
        "mode": np.array(sweep.mode),
    }


def _decoded_sweep(arrays: dict) -> tuple[HeadSweep]:
    target = int(arrays["target"])
    return (HeadSweep(
        values=torch.from_numpy(arrays["values"]), target=None if target < 0 else target, mode=str(arrays["mode"]),
    ),)


CAPTURED_TENSORS = ("logits", "attentions", "tokens", "patches", "patch_embeddings")


def _views(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """What a page draws of one image (the Compare page's model B): the capture (tokens, no
    attention), the rollout through every layer at its default settings, and the attention of
    layer ``settings["layer"]`` in float16, as app.selection.Selection computes them."""
    captured = capture(model, x, layers=())
    depth = model.config.depth
    progress(1 / (depth + 1))
    drawn = {}

    def layers():
        for layer, attention in enumerate(layer_attentions(model, captured)):
            if layer == settings["layer"]:
                drawn["attention"] = attention[0].to(torch.float16).numpy()
            progress((layer + 2) / (depth + 1))
            yield attention

    rollout = streamed_rollout(layers(), num_prefix_tokens=captured.num_prefix_tokens)
    arrays = {f"capture.{name}": getattr(captured, name).numpy() for name in CAPTURED_TENSORS}
    if captured.pool_attentions is not None:
        arrays["capture.pool_attentions"] = captured.pool_attentions.numpy()
    return {
        **arrays, "capture.grid_size": np.array(captured.grid_size), "capture.layers": np.array(captured.layers, int),
        "capture.num_prefix_tokens": np.array(captured.num_prefix_tokens),
        "capture.class_token": np.array(captured.class_token), "rollout": rollout.cpu().numpy(), **drawn,
    }


def _decoded_views(arrays: dict) -> tuple[Capture, torch.Tensor, torch.Tensor]:
    """(the capture, the rollout (1, N, N), the drawn layer's attention (heads, N, N))."""
    pool = arrays.get("capture.pool_attentions")
    captured = Capture(
        **{name: torch.from_numpy(arrays[f"capture.{name}"]) for name in CAPTURED_TENSORS},
        grid_size=tuple(int(size) for size in arrays["capture.grid_size"]),
        num_prefix_tokens=int(arrays["capture.num_prefix_tokens"]),
        layers=tuple(int(layer) for layer in arrays["capture.layers"]),
        class_token=bool(arrays["capture.class_token"]), pool_attentions=None if pool is None else torch.from_numpy(pool),
    )
    return captured, torch.from_numpy(arrays["rollout"]), torch.from_numpy(arrays["attention"])


def _tokens(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """Every block's tokens of the images ``x`` (B, C, H, W), in one pass (app.selection.ImageSet's)."""
    return {"tokens": capture(model, x, layers=()).tokens.numpy()}


def _decoded_tokens(arrays: dict) -> tuple[torch.Tensor, ...]:
    """(depth + 1, N, D) per image, each in storage of its own (kept apart)."""
    return tuple(torch.from_numpy(tokens.copy()) for tokens in arrays["tokens"])


def _head_types(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """Every head's type over the images ``x`` (head_types.classify_heads_from_tokens after one
    pass that keeps their tokens), and the tokens of the images ``settings["kept"]`` (indices in
    ``x``), as app.selection.ImageSet keeps them."""
    passes = x.shape[0]
    total = passes * (1 + attention_share(model.config))
    captured = capture(model, x, layers=())
    progress(passes / total)
    types = classify_heads_from_tokens(
        model, captured.tokens, progress=lambda share: progress((passes + share * (total - passes)) / total),
    )
    arrays = {f"types.{name}": values for name, values in types.to_arrays().items()}
    return {"tokens": captured.tokens[settings["kept"]].numpy(), **arrays}


def _decoded_head_types(arrays: dict) -> tuple:
    """(each kept image's tokens (depth + 1, N, D), ..., the head types)."""
    types = HeadTypes.from_arrays({
        name.removeprefix("types."): values for name, values in arrays.items() if name.startswith("types.")
    })
    return (*_decoded_tokens(arrays), types)


def _register_neurons(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The register neurons over the images ``x`` (B, C, H, W): their capture, then the search
    (test_time_registers.find_register_neurons), as app.selection.Selection.register_neurons."""
    neurons = find_register_neurons(model, x, settings["k"], settings["layer"], settings["last"], progress)
    found = neurons.outliers
    return {
        "scores": neurons.scores.numpy(), "norms": found.norms.numpy(), "outliers": found.outliers.numpy(),
        "statistics": np.array([found.threshold, found.median, found.mad]),
        "layers": np.array([neurons.layer, neurons.appears_at, neurons.images]),
    }


def _decoded_register_neurons(arrays: dict) -> tuple[RegisterNeurons]:
    threshold, median, mad = (float(value) for value in arrays["statistics"])
    layer, appears_at, images = (int(value) for value in arrays["layers"])
    outliers = NormOutliers(
        torch.from_numpy(arrays["norms"]), threshold, median, mad, torch.from_numpy(arrays["outliers"]),
    )
    return (RegisterNeurons(torch.from_numpy(arrays["scores"]), outliers, layer, appears_at, images),)


ROW_FIELDS = ("patch size", "grid", "tokens", "forward ms", "prediction", "probability")


def _patch_sizes(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The Patches page's comparison of every patch size (vit_explorer.patch_sizes), on the plans the
    server made: the image's rows (``settings["forward_ms"]``: times measured before, as pairs), then
    the held-out batch's accuracy where ``settings["held_out"]`` names it (images, start)."""
    plan = [PlannedSize(*planned) for planned in settings["plan"]]
    forward_ms = None if settings["forward_ms"] is None else {int(p): ms for p, ms in settings["forward_ms"]}
    share = settings["image_share"]  # of the whole work, for one progress bar over both parts
    rows = predictions(model, x, plan, lambda done, text: progress(share * done), forward_ms)
    arrays = {f"rows.{name}": np.array([row[name] for row in rows]) for name in ROW_FIELDS if name in rows[0]}
    if settings["held_out"] is not None:
        held_out_plan = [PlannedSize(*planned) for planned in settings["held_out_plan"]]
        accuracy = held_out_accuracy(
            model, held_out_set(model.config, *settings["held_out"]), held_out_plan,
            lambda done, text: progress(share + (1 - share) * done),
        )
        arrays.update({"held_out.patch size": np.array(list(accuracy)), "held_out.accuracy": np.array(list(accuracy.values()))})
    return arrays


def _decoded_patch_sizes(arrays: dict) -> tuple:
    """(the rows as predictions() returns them,) and the held-out accuracy by patch size where computed."""
    kinds = {"patch size": int, "grid": str, "tokens": int, "forward ms": float, "prediction": str, "probability": float}
    names = [name for name in ROW_FIELDS if f"rows.{name}" in arrays]
    rows = [
        {name: kinds[name](arrays[f"rows.{name}"][index]) for name in names}
        for index in range(len(arrays["rows.patch size"]))
    ]
    if "held_out.accuracy" not in arrays:
        return (rows,)
    return rows, {int(p): float(a) for p, a in zip(arrays["held_out.patch size"], arrays["held_out.accuracy"])}


def _patch_sizes_memory(config, settings: dict) -> int:
    """The largest pass (the held-out batch, else the image, at the finest patch size) and the
    largest resampled patch kernel, in float32 and float64 while it is resampled."""
    finest = min(planned[0] for planned in settings["plan"])
    batch = settings["held_out"][0] if settings["held_out"] is not None else 1
    largest = max(planned[0] for planned in settings["plan"])
    kernel = 12 * config.in_chans * config.embed_dim * largest**2
    return inference_memory(config.replace(patch_size=finest), batch) + kernel


def _views_memory(config, settings: dict) -> int:
    """The capture's tokens kept, a layer's float32 attention and the drawn one's in float16, the
    rollout's N x N matrices (app.models.view_bytes' count)."""
    tokens = config.num_tokens
    return inference_memory(config, 1, kept_floats=(
        (config.depth + 1) * tokens * config.embed_dim + 2 * config.num_heads * tokens**2 + 8 * tokens**2
    ))


KINDS = {
    "head sweep": Kind(
        forwards=lambda config, settings: sweep_cost(config),
        # SWEEP_BATCH copies of one layer's input at a time, the intact tokens of every layer kept.
        memory=lambda config, settings: inference_memory(
            config, SWEEP_BATCH, kept_floats=(config.depth + 1) * config.num_tokens * config.embed_dim,
        ),
        compute=_sweep, decode=_decoded_sweep,
    ),
    # The pass, then every layer's attention part again for the rollout (less than a pass).
    "views": Kind(forwards=lambda config, settings: 2.0, memory=_views_memory, compute=_views, decode=_decoded_views),
    # One pass of settings["images"] images, each one's tokens kept.
    "tokens": Kind(
        forwards=lambda config, settings: settings["images"],
        memory=lambda config, settings: inference_memory(
            config, settings["images"], kept_floats=settings["images"] * (config.depth + 1) * config.num_tokens * config.embed_dim,
        ),
        compute=_tokens, decode=_decoded_tokens,
    ),
    # One pass of settings["images"] images, then every layer's attention part again, a few images
    # at a time, their tokens kept meanwhile.
    "head types": Kind(
        forwards=lambda config, settings: settings["images"] * (1 + attention_share(config)),
        memory=lambda config, settings: inference_memory(config, settings["images"], kept_floats=(
            settings["images"] * (config.depth + 1) * config.num_tokens * config.embed_dim
            + held_floats(config, settings["images"])
        )),
        compute=_head_types, decode=_decoded_head_types,
    ),
    # The pass of settings["images"] images, then the search over them; their tokens and one
    # layer's MLP activations kept.
    "register neurons": Kind(
        forwards=lambda config, settings: settings["images"] * (1 + SEARCH_PASSES),
        memory=lambda config, settings: inference_memory(config, settings["images"], kept_floats=settings["images"] * (
            (config.depth + 1) * config.num_tokens * config.embed_dim + config.num_tokens * config.mlp_hidden
        )),
        compute=_register_neurons, decode=_decoded_register_neurons,
    ),
    # Every patch size side by side (app.costs plans it and counts its forward passes).
    "patch sizes": Kind(
        forwards=lambda config, settings: settings["forwards"], memory=_patch_sizes_memory,
        compute=_patch_sizes, decode=_decoded_patch_sizes,
    ),
}


@dataclass(frozen=True)
class JobSpec:
    kind: str  # a key of KINDS
    model: dict  # {"path": checkpoint file} or {"pretrained": catalogue name}
    patch_size: int
    image_size: tuple[int, int]
    identity: str  # what the input is (an image key): with the rest, what makes two asks the same
    settings: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class JobStatus:
    state: str  # "queued", "running", "done" or "failed"
    owners: tuple[str, ...]  # who asked for it and has not cancelled
    place: int | None = None  # queued: 1 for the next to start
    progress: float = 0.0  # running: the share done
    error: str | None = None  # failed: why, in one sentence
    forwards: float = 0.0  # its estimate

    @property
    def waiting(self) -> str:
        """Where a queued job stands, in words."""
        return "next in line" if self.place == 1 else f"{ordinal(self.place)} in line"


@dataclass(frozen=True)
class JobLimits:
    max_jobs: int  # jobs running at once on the folder
    queue_size: int  # jobs that may wait for a slot
    memory: int  # bytes one worker may use
    threads: int  # torch threads of one worker

    @classmethod
    def from_environment(cls) -> JobLimits:
        """VIT_EXPLORER_MAX_JOBS (default 1: the rest of the machine serves the pages),
        VIT_EXPLORER_JOB_QUEUE (default 8), VIT_EXPLORER_JOB_MEMORY_LIMIT in GB (default: a
        quarter of the available memory, shared by the workers) and VIT_EXPLORER_JOB_THREADS
        (default: the cores but one, shared by the workers)."""
        cores = os.cpu_count() or 1
        max_jobs = int(environment_number("VIT_EXPLORER_MAX_JOBS", 1))
        queue_size = int(environment_number("VIT_EXPLORER_JOB_QUEUE", 8, minimum=0))
        memory_gb = environment_number(
            "VIT_EXPLORER_JOB_MEMORY_LIMIT", available_memory() / 4 / max_jobs / GB, float, minimum=0.1,
        )
        threads = int(environment_number("VIT_EXPLORER_JOB_THREADS", max(1, (cores - 1) // max_jobs)))
        return cls(max_jobs=max_jobs, queue_size=queue_size, memory=int(memory_gb * GB), threads=threads)


# --- the folder ---------------------------------------------------------------------------------


def _write_whole(path: Path, data: bytes) -> None:
    """A reader finds the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


class JobBoard:
    """The jobs on one folder, shared by every server (replica) on it; thread-safe."""

    def __init__(self, folder: str | Path, limits: JobLimits | None = None):
        self.folder = Path(folder)
        self.limits = limits or JobLimits.from_environment()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self):
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / LOCK_NAME, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                yield

    def _files(self, key: str) -> dict[str, Path]:
        job = self.folder / key
        names = ("record", "input", "progress", "result", "error", "cancel")
        files = ("record.json", "input.npy", "progress", "result.npz", "error", "cancel")
        return {"folder": job, **{name: job / file for name, file in zip(names, files)}}

    def _record(self, key: str) -> dict | None:
        try:
            return json.loads(self._files(key)["record"].read_text())
        except (OSError, ValueError):
            return None

    def _write_record(self, key: str, record: dict) -> None:
        _write_whole(self._files(key)["record"], json.dumps(record).encode())

    def _state(self, key: str, record: dict, ended: str | None = None) -> str:
        """"queued", "running", "done", "failed" or "cancelled"; a worker found dead without a
        result leaves its job failed, in a sentence every server reads. ``ended``: the job whose
        worker asks, ending (no longer running)."""
        files = self._files(key)
        if files["result"].exists():
            return "done"
        if files["error"].exists():
            return "failed"
        if record["pid"] is None:
            return "queued"
        alive = key != ended and (record["host"] != socket.gethostname() or process_identity(record["pid"]) == (
            record["pid"], record["started"]
        ))
        if alive:
            return "running"
        if files["cancel"].exists():
            return "cancelled"
        if not files["result"].exists():  # it may have written its result since the first look
            _write_whole(files["error"], (
                "The computation's process ended before it finished (it was stopped from outside or ran"
                " out of memory); run it again."
            ).encode())
            return "failed"
        return "done"

    def _jobs(self, ended: str | None = None) -> dict[str, tuple[dict, str]]:
        """key -> (record, state), oldest first; cancelled jobs and old ended ones removed."""
        jobs = []
        for record_file in self.folder.glob("*/record.json"):
            key = record_file.parent.name
            record = self._record(key)
            if record is None:
                continue
            state = self._state(key, record, ended)
            ended_long_ago = state in ("done", "failed") and time.time() - record_file.stat().st_mtime > KEEP_SECONDS
            if state == "cancelled" or ended_long_ago:
                shutil.rmtree(record_file.parent, ignore_errors=True)
                continue
            jobs.append((record["submitted"], key, record, state))
        return {key: (record, state) for _, key, record, state in sorted(jobs)}

    def _promote(self, jobs: dict[str, tuple[dict, str]]) -> None:
        """Start the oldest waiting jobs while slots are free (called with the folder locked)."""
        running = sum(state == "running" for _, state in jobs.values())
        for key, (record, state) in jobs.items():
            if running >= self.limits.max_jobs:
                return
            if state == "queued":
                process = self._spawn(key)
                identity = process_identity(process.pid)
                record.update(pid=process.pid, started=identity[1] if identity else 0, host=socket.gethostname())
                self._write_record(key, record)
                jobs[key] = (record, "running")
                running += 1

    def _spawn(self, key: str) -> subprocess.Popen:
        threads = str(self.limits.threads)
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from vit_explorer.jobs import _work; _work(sys.argv[1])",
             str(self._files(key)["folder"])],
            # OpenMP's pool is sized when torch loads: capped before it does.
            env={**os.environ, "PYTHONPATH": child_python_path(), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # neither a Ctrl-C meant for the server nor its end reaches the job
        )
        # Reaped when it ends, so that it does not linger as a zombie of this server.
        threading.Thread(target=process.wait, name=f"job-{key[:8]}", daemon=True).start()
        return process

    def _status(self, key: str, record: dict, state: str, jobs: dict) -> JobStatus:
        files = self._files(key)
        place = progress = error = None
        if state == "queued":
            place = [k for k, (_, s) in jobs.items() if s == "queued"].index(key) + 1
        elif state == "running":
            with contextlib.suppress(OSError, ValueError):
                progress = float(files["progress"].read_text())
        elif state == "failed":
            with contextlib.suppress(OSError):
                error = files["error"].read_text()
        return JobStatus(
            state=state, owners=tuple(record["owners"]), place=place, progress=progress or 0.0,
            error=error, forwards=record["forwards"],
        )

    # --- what the servers ask -------------------------------------------------------------------

    def estimate(self, spec: JobSpec, config) -> tuple[float, int]:
        """(forward passes, peak bytes) of ``spec`` on a model of ``config``."""
        kind = KINDS[spec.kind]
        return kind.forwards(config, spec.settings), kind.memory(config, spec.settings)

    def submit(self, spec: JobSpec, x: torch.Tensor, config, owner: str) -> JobStatus:
        """Ask for ``spec`` on input ``x`` for ``owner``: joins the same job if there is one (a
        failed one is tried again), else admits it and starts or queues it. JobRefused says why not."""
        forwards, memory = self.estimate(spec, config)
        if memory > self.limits.memory:
            raise JobRefused(
                f"This would need about {memory / GB:.1f} GB of memory, more than the"
                f" {self.limits.memory / GB:.1f} GB a computation may use on this server; choose a"
                " larger patch size or a smaller input size."
            )
        key = spec.key
        with self._locked():
            jobs = self._jobs()
            if key in jobs and jobs[key][1] != "failed":
                record, state = jobs[key]
                if owner not in record["owners"]:
                    record["owners"].append(owner)
                    self._write_record(key, record)
                return self._status(key, record, state, jobs)
            waiting = [k for k, (record, state) in jobs.items() if state == "queued"]
            running = sum(state == "running" for _, state in jobs.values())
            if any(owner in jobs[k][0]["owners"] for k in waiting):
                raise JobRefused(
                    "You already have a computation waiting in the queue: cancel it, or wait until it"
                    " has started, to ask for another."
                )
            if running >= self.limits.max_jobs and len(waiting) >= self.limits.queue_size:
                raise JobRefused(
                    f"The server is busy: {running} computations are running and {len(waiting)} are"
                    " waiting, the most it takes; try again when one has ended."
                )
            files = self._files(key)
            shutil.rmtree(files["folder"], ignore_errors=True)  # a failed try's files
            files["folder"].mkdir(parents=True)
            with open(files["input"], "wb") as file:
                np.save(file, x.detach().cpu().float().numpy())
            record = {
                "spec": asdict(spec), "owners": [owner], "submitted": time.time(), "forwards": forwards,
                "memory": memory, "memory_limit": self.limits.memory, "threads": self.limits.threads,
                "max_jobs": self.limits.max_jobs,
                "pid": None, "started": None, "host": None,
            }
            self._write_record(key, record)
            jobs[key] = (record, "queued")
            self._promote(jobs)
            record, state = jobs[key]
            return self._status(key, record, state, jobs)

    def status(self, key: str) -> JobStatus | None:
        """Where job ``key`` stands (starting waiting jobs whose turn has come); None when there is
        no such job (never asked, cancelled, or ended long ago)."""
        with self._locked():
            jobs = self._jobs()
            self._promote(jobs)
            if key not in jobs:
                return None
            record, state = jobs[key]
            return self._status(key, record, state, jobs)

    def start_waiting(self, ended: str | None = None) -> None:
        """Start the oldest waiting jobs while slots are free; ``ended``: the job whose worker
        calls this as it ends, its slot free."""
        with self._locked():
            self._promote(self._jobs(ended))

    def result(self, key: str) -> tuple:
        """The values of a done job (its kind's ``decode``)."""
        record = self._record(key)
        with np.load(self._files(key)["result"], allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        return KINDS[record["spec"]["kind"]].decode(arrays)

    def cancel(self, key: str, owner: str) -> bool:
        """Withdraw ``owner``'s ask; the job stops once nobody else asks for it. Whether they had asked."""
        with self._locked():
            jobs = self._jobs()
            if key not in jobs or owner not in jobs[key][0]["owners"]:
                return False
            record, state = jobs[key]
            record["owners"].remove(owner)
            files = self._files(key)
            if record["owners"] or state in ("done", "failed"):
                self._write_record(key, record)
            elif state == "queued":
                shutil.rmtree(files["folder"], ignore_errors=True)
            else:  # running: its worker stops at its next step and the job is removed then
                self._write_record(key, record)
                files["cancel"].touch()
            return True


# --- the worker ---------------------------------------------------------------------------------


def _load(spec: dict) -> ViT:
    from .weights import load_model, load_pretrained, resize_model

    model = load_pretrained(spec["model"]["pretrained"]) if "pretrained" in spec["model"] else load_model(
        spec["model"]["path"]
    )
    image_size = tuple(spec["image_size"])
    if (spec["patch_size"], image_size) != (model.config.patch_size, model.config.img_size):
        model = resize_model(model, patch_size=spec["patch_size"], image_size=image_size)
    return model.eval()


def _sentence(error: BaseException) -> str:
    if isinstance(error, AnalysisError):  # a sentence for the person already
        return str(error)
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
        return "The computation needed more memory than it may use on this server; choose a larger patch size."
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"The computation failed ({type(error).__name__}{': ' + first_line if first_line else ''}); run it again."


def _work(folder: str) -> None:
    """A worker's whole life: load the model, compute, report progress, write the result or why
    not. Nothing it does reaches a server but its files."""
    folder = Path(folder)
    run_below_the_servers()
    inherited = resource.getrlimit(resource.RLIMIT_DATA)
    record = json.loads((folder / "record.json").read_text())
    torch.set_num_threads(record["threads"])
    spec, cancel = record["spec"], folder / "cancel"

    def progress(share: float) -> None:
        if cancel.exists():
            raise Cancelled
        _write_whole(folder / "progress", f"{share:.4f}".encode())

    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            limit_memory(record["memory_limit"])
        model = _load(spec).to(device)
        x = torch.from_numpy(np.load(folder / "input.npy", allow_pickle=False))
        arrays = KINDS[spec["kind"]].compute(model, x, spec["settings"], progress)
        temporary = folder / ".result.tmp.npz"
        np.savez(temporary, **arrays)
        os.replace(temporary, folder / "result.npz")
    except Cancelled:
        pass  # the board removes a cancelled job once its worker has ended
    except BaseException as failure:  # whoever follows the job reads why
        _write_whole(folder / "error", _sentence(failure).encode())
    # This slot goes to the oldest waiting job (a board that only starts jobs: it admits none).
    resource.setrlimit(resource.RLIMIT_DATA, inherited)
    limits = JobLimits(record["max_jobs"], queue_size=0, memory=record["memory_limit"], threads=record["threads"])
    JobBoard(folder.parent, limits).start_waiting(ended=folder.name)
