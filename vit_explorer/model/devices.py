"""Where a model runs: the device a name means, and the process group a run joins under torchrun
(a ViT's training and a sparse autoencoder's alike)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class DeviceError(ValueError):
    """A device that is not here; ``str()`` is one sentence."""


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" picks cuda, then mps, then cpu; an explicit device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device mps was asked for but is not available; use --device cpu")
    return device


def distributed_setup(device_name: str) -> tuple[int, int, torch.device, bool]:
    """(rank, world size, device, whether we started the process group) under torchrun: one process
    per rank, each on its own GPU (LOCAL_RANK) or on the CPU with gloo; (0, 1, device, False) alone."""
    device = resolve_device(device_name)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device, False
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device, started
