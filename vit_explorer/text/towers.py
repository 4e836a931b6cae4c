"""Both towers of a CLIP or SigLIP model: our ViT for the image, open_clip's text transformer.

The image tower is the headless ViT every page explores (its output is the pooled token: CLIP's
class token after ln_post, SigLIP's attention pool); :class:`ImageTextModel` adds what turns it
into a point of the space the texts share (CLIP's projection), the text tower and its tokenizer,
and the score of an image with a text: CLIP's softmax over the texts at its logit scale, SigLIP's
sigmoid of each text on its own, with its scale and bias.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.vit import ViT
from .tokenizers import Tokenizer, is_parser_failure

# What one ask may hold: a class's labels fit, a pasted book does not. One limit, on the text that
# is embedded: a typed label is read as LABEL_TEMPLATE, so it may hold that much less.
MAX_LABELS = 1000
MAX_TEXT_CHARACTERS = 300
LABEL_TEMPLATE = "a photo of {}."
MAX_LABEL_CHARACTERS = MAX_TEXT_CHARACTERS - len(LABEL_TEMPLATE.format(""))
TEXT_BATCH = 64


class LabelError(ValueError):
    """Labels a person typed that cannot be scored; the message says why in one sentence."""


def parse_labels(text: str) -> list[str]:
    """"cat, dog, rocket" (commas or new lines) -> ["cat", "dog", "rocket"], checked as they will
    be embedded (LABEL_TEMPLATE); duplicates are kept once, in their first place."""
    if len(text) > MAX_LABELS * (MAX_LABEL_CHARACTERS + 2):
        raise LabelError(
            f"that is {len(text):,} characters; type at most {MAX_LABELS} labels of up to {MAX_LABEL_CHARACTERS} characters each"
        )
    labels = list(dict.fromkeys(part.strip() for part in text.replace("\n", ",").split(",") if part.strip()))
    check_labels(labels, LABEL_TEMPLATE)
    return labels


def check_labels(labels: list[str], template: str = "{}") -> None:
    """Labels that fit what embed_texts takes once each is read as ``template``."""
    if not labels:
        raise LabelError("type at least one label, for example: a cat, a dog, a rocket")
    if len(labels) > MAX_LABELS:
        raise LabelError(f"{len(labels):,} labels is too many; at most {MAX_LABELS} are scored at once")
    room = MAX_TEXT_CHARACTERS - len(template.format(""))
    long = next((label for label in labels if len(label) > room), None)
    if long is not None:
        raise LabelError(f"a label of {len(long):,} characters is too long (at most {room}): {long[:40]}...")


@dataclass(eq=False)
class ImageTextModel:
    """A CLIP or SigLIP model's two towers; shared between sessions, so never changed after
    loading (every method is a pure function of its arguments)."""

    image: ViT  # headless: capture(...).logits is the pooled token
    image_projection: torch.Tensor | None  # (E, D): CLIP's visual.proj; None for SigLIP's pool
    text: nn.Module  # open_clip's TextTransformer, in eval mode
    tokenizer: Tokenizer
    context_length: int
    scoring: str  # "softmax" (CLIP) or "sigmoid" (SigLIP)
    logit_scale: float  # exp of the trained log-scale
    logit_bias: float  # SigLIP's; 0 for CLIP

    @property
    def embed_dim(self) -> int:
        """E: the size of the space both towers embed into."""
        projection = self.text.text_projection
        return projection.out_features if isinstance(projection, nn.Linear) else projection.shape[1]

    def project_image(self, pooled: torch.Tensor) -> torch.Tensor:
        """(..., D) pooled image tokens (a headless capture's logits) -> (..., E), unit length."""
        return F.normalize(self.project_image_linear(pooled), dim=-1)

    def project_image_linear(self, pooled: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., E): into the shared space, not yet made unit length (a sum of parts
        projects to the sum of their projections)."""
        pooled = pooled.float()
        if self.image_projection is None:
            return pooled
        return pooled @ self.image_projection.t().to(pooled.device)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        try:
            return self.tokenizer(texts, context_length=self.context_length)
        except BaseException as error:  # a Rust panic (a BaseException) on an odd text ends no page
            if not is_parser_failure(error):
                raise
            raise LabelError("this model's tokenizer cannot read those texts") from None

    @torch.no_grad()
    def embed_texts(self, texts: list[str], progress=None) -> torch.Tensor:
        """(T, E) unit text embeddings, in batches; ``progress(done, total)`` after each."""
        check_labels(texts)
        device = next(self.text.parameters()).device
        out = []
        for start in range(0, len(texts), TEXT_BATCH):
            tokens = self.tokenize(texts[start:start + TEXT_BATCH]).to(device)
            out.append(F.normalize(self._encode(tokens).float(), dim=-1).cpu())
            if progress is not None:
                progress(min(start + TEXT_BATCH, len(texts)), len(texts))
        return torch.cat(out)

    def _encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(T, context) token ids -> (T, E) text embeddings, as open_clip's TextTransformer computes
        them. A causal tower (CLIP's) read at an end token is run only up to the last end token of
        the batch: nothing after it reaches the tokens read, so a short label costs a few tokens'
        pass, not 77 (the ImageNet job ~7x less); the numbers are the whole pass's (tests/text)."""
        text = self.text
        read = self._read_positions(tokens)
        if read is None:
            return text(tokens)
        length = int(read.max()) + 1
        x = text.token_embedding(tokens[:, :length]) + text.positional_embedding[:length]
        x = text.ln_final(text.transformer(x, attn_mask=text.attn_mask[:length, :length]))
        pooled = x[torch.arange(x.shape[0], device=x.device), read]
        if isinstance(text.text_projection, nn.Linear):
            return text.text_projection(pooled)
        return pooled if text.text_projection is None else pooled @ text.text_projection

    def _read_positions(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """(T,) the position each text's embedding is read at, for a plain causal tower; else None."""
        text = self.text
        plain = getattr(text, "attn_mask", None) is not None and getattr(text, "cls_emb", None) is None \
            and not getattr(text, "use_pad_mask", False)
        if not plain:
            return None
        if text.pool_type == "argmax":
            return tokens.argmax(dim=-1)
        if text.pool_type == "eos":
            return (tokens == text.eos_id).int().argmax(dim=-1)
        return None

    def logits(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """(B, E) and (T, E) unit embeddings -> (B, T) logits, as the model was trained to score."""
        return self.logit_scale * images @ texts.t() + self.logit_bias

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """CLIP: a softmax over the texts (they compete); SigLIP: each text's own sigmoid."""
        return logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()

    def scoring_sentence(self) -> str:
        if self.scoring == "softmax":
            return (
                f"CLIP scores the labels against each other: a softmax of {self.logit_scale:.0f} x the cosine"
                " of the image with each label, so the percentages add up to 100."
            )
        return (
            f"SigLIP scores each label on its own: the sigmoid of {self.logit_scale:.1f} x cosine"
            f" {self.logit_bias:+.1f}, the chance that this label describes the image, so they need not add up to 100."
        )
