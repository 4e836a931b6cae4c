"""vit_explorer: define, train and dissect Vision Transformers."""
from .capture import Capture, capture
from .config import ViTConfig
from .model import ViT

__all__ = ["Capture", "ViT", "ViTConfig", "capture"]
