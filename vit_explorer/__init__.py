"""vit_explorer: define, train and dissect Vision Transformers."""
import os

# Before torch loads its OpenMP runtime, which reads this once: idle OpenMP threads sleep instead
# of spinning. On a server whose sessions run passes side by side, spinning threads took the cores
# from each other: on a busy 2-core machine the shipped model's patch-size comparison cost 1.3-2.3
# CPU-seconds instead of 0.13-0.2, and a ViT-B/16 pass 2.5x the wall time. An explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import analysis, features, figures
from .analysis.head_types import HeadTypes, classify_heads
from .analysis.test_time_registers import RegisterNeurons, TestTimeRegister, find_register_neurons, register_capture
from .data.datasets import SHAPE_CLASSES, DatasetError, load_dataset, shapes_sample
from .data.images import InvalidImageError, load_image, preprocess
from .features.sae import SAEError, SparseAutoencoder, load_sae
from .features.steering import Steering
from .model.ablation import HeadSweep, KnockOut, head_sweep, sweep_cost
from .model.capture import Capture, capture, layer_attention, layer_attentions, layer_internals
from .model.config import PRESETS, TrainConfig, ViTConfig
from .model.internals import LayerInternals
from .model.vit import ViT
from .training.run import TrainingRun
from .training.train import DEFAULT_WEIGHTS, DoneEvent, EpochEvent, SnapshotEvent, StepEvent, TrainingError
from .weights import CheckpointError, load_model, load_pretrained, resize_model, save_model

__all__ = [
    "Capture", "ViT", "ViTConfig", "capture", "LayerInternals", "layer_internals",
    "layer_attention", "layer_attentions",
    "KnockOut", "HeadSweep", "head_sweep", "sweep_cost", "HeadTypes", "classify_heads",
    "TestTimeRegister", "RegisterNeurons", "find_register_neurons", "register_capture",
    "SparseAutoencoder", "SAEError", "load_sae", "Steering",
    "CheckpointError", "load_model", "load_pretrained", "resize_model", "save_model",
    "InvalidImageError", "load_image", "preprocess",
    "PRESETS", "SHAPE_CLASSES", "DatasetError", "load_dataset", "shapes_sample",
    "TrainConfig", "TrainingRun", "TrainingError", "DEFAULT_WEIGHTS",
    "StepEvent", "EpochEvent", "SnapshotEvent", "DoneEvent",
]
