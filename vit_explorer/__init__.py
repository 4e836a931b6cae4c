"""vit_explorer: define, train and dissect Vision Transformers."""
from . import analysis, figures
from .ablation import HeadSweep, KnockOut, head_sweep, sweep_cost
from .capture import Capture, capture, layer_internals
from .config import PRESETS, TrainConfig, ViTConfig
from .data import SHAPE_CLASSES, DatasetError, load_dataset, shapes_sample
from .images import InvalidImageError, load_image, preprocess
from .internals import LayerInternals
from .model import ViT
from .train import (
    DEFAULT_WEIGHTS, DoneEvent, EpochEvent, SnapshotEvent, StepEvent, TrainingError, TrainingRun,
)
from .weights import CheckpointError, load_model, load_pretrained, resize_model, save_model

__all__ = [
    "Capture", "ViT", "ViTConfig", "capture", "LayerInternals", "layer_internals",
    "KnockOut", "HeadSweep", "head_sweep", "sweep_cost",
    "CheckpointError", "load_model", "load_pretrained", "resize_model", "save_model",
    "InvalidImageError", "load_image", "preprocess",
    "PRESETS", "SHAPE_CLASSES", "DatasetError", "load_dataset", "shapes_sample",
    "TrainConfig", "TrainingRun", "TrainingError", "DEFAULT_WEIGHTS",
    "StepEvent", "EpochEvent", "SnapshotEvent", "DoneEvent",
]
