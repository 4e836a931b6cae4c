"""vit_explorer: define, train and dissect Vision Transformers."""
from . import analysis, figures
from .capture import Capture, capture
from .config import ViTConfig
from .images import InvalidImageError, load_image, preprocess
from .model import ViT
from .weights import CheckpointError, load_model, load_pretrained, resize_model, save_model

__all__ = [
    "Capture", "ViT", "ViTConfig", "capture",
    "CheckpointError", "load_model", "load_pretrained", "resize_model", "save_model",
    "InvalidImageError", "load_image", "preprocess",
]
