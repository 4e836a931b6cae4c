"""A prediction in words: the image scored against ImageNet's 1,000 classes or the labels a
person types, as open_clip's zero-shot classifier does (zero_shot_classifier.py): each class's
prompts ("a photo of the small {}.") embedded, averaged and made unit length, once per model.

ImageNet's class embeddings take minutes on a CPU the first time (7,000 prompts), so they are
kept on disk beside the model (:func:`load_class_embeddings`); typed labels are a few prompts,
embedded as "a photo of {label}." in a fraction of a second.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..analysis.patching import Metric
from .towers import LABEL_TEMPLATE, ImageTextModel, check_labels

EMBEDDINGS_KEY = "class_embeddings"


def imagenet_classes() -> tuple[str, ...]:
    """open_clip's ImageNet class names, written for prompts ("tench", "goldfish", ...)."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    return tuple(IMAGENET_CLASSNAMES)


def imagenet_templates() -> tuple[str, ...]:
    """open_clip's seven short ImageNet templates (nearly the 80 of OpenAI's at a tenth the cost)."""
    from open_clip.zero_shot_metadata import SIMPLE_IMAGENET_TEMPLATES

    return tuple(template("{}") for template in SIMPLE_IMAGENET_TEMPLATES)


def label_prompts(labels: list[str]) -> list[str]:
    return [LABEL_TEMPLATE.format(label) for label in labels]


def class_embeddings(
    model: ImageTextModel, classes: list[str] | tuple[str, ...], templates: tuple[str, ...], progress=None
) -> torch.Tensor:
    """(C, E) unit embeddings: each class's prompts embedded, averaged, made unit length again;
    ``progress(done_prompts, total)`` as they go."""
    check_labels(list(classes))
    prompts = [template.format(name) for name in classes for template in templates]
    embedded = torch.cat([
        model.embed_texts(prompts[start:start + 1000]) for start in _steps(len(prompts), 1000, progress)
    ])
    per_class = embedded.reshape(len(classes), len(templates), -1).mean(dim=1)
    return torch.nn.functional.normalize(per_class, dim=-1)


def _steps(total: int, step: int, progress):
    for start in range(0, total, step):
        yield start
        if progress is not None:
            progress(min(start + step, total), total)


@dataclass(frozen=True)
class Prediction:
    """The image's scores over a set of labels, best first."""

    labels: tuple[str, ...]  # in the order of ``scores``
    scores: torch.Tensor  # (T,) probabilities: softmax (CLIP) or sigmoid (SigLIP)
    logits: torch.Tensor  # (T,)
    scoring: str

    def top(self, count: int = 5) -> list[tuple[str, float]]:
        order = self.scores.argsort(descending=True)[:count]
        return [(self.labels[index], float(self.scores[index])) for index in order]


def predict(model: ImageTextModel, pooled: torch.Tensor, labels: tuple[str, ...], texts: torch.Tensor) -> Prediction:
    """One image's (1, D) pooled token scored against ``texts`` (T, E), the embeddings of ``labels``."""
    logits = model.logits(model.project_image(pooled), texts.to(pooled.device).float())[0].cpu()
    return Prediction(tuple(labels), model.probabilities(logits), logits, model.scoring)


def save_class_embeddings(path: Path, embeddings: torch.Tensor, classes: tuple[str, ...], templates: tuple[str, ...]) -> None:
    """Written whole under a temporary name, then renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    metadata = {"classes": json.dumps(list(classes)), "templates": json.dumps(list(templates))}
    try:
        save_file({EMBEDDINGS_KEY: embeddings.contiguous().float()}, str(temporary), metadata=metadata)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def load_class_embeddings(path: Path, classes: tuple[str, ...], templates: tuple[str, ...], embed_dim: int) -> torch.Tensor | None:
    """The embeddings saved at ``path`` for exactly these classes and templates, else None."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as file:
            metadata = file.metadata() or {}
        if json.loads(metadata.get("classes", "null")) != list(classes) or \
                json.loads(metadata.get("templates", "null")) != list(templates):
            return None
        embeddings = load_file(str(path))[EMBEDDINGS_KEY]
    except (OSError, SafetensorError, KeyError, ValueError):
        return None
    return embeddings if tuple(embeddings.shape) == (len(classes), embed_dim) else None


def score_difference(model: ImageTextModel, texts: torch.Tensor, labels: tuple[str, str]) -> Metric:
    """Activation patching's metric for a CLIP or SigLIP (analysis.patching): the score of the
    first label minus the second's, ``texts`` (2, E) their unit embeddings, from the pooled output."""
    texts = texts.detach()

    def score(pooled: torch.Tensor) -> torch.Tensor:
        logits = model.logits(model.project_image(pooled), texts.to(pooled.device).float())
        return (logits[:, 0] - logits[:, 1]).to(pooled.dtype)

    return Metric(f"score of {labels[0]!r} - score of {labels[1]!r}", score)
