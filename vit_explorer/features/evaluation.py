"""How good a dictionary is, measured as the field measures SAEs, over an image set:

- ``nmse``: sum |x - x_hat|^2 / sum |x - mean x|^2 over the evaluation tokens (the tokens it reads),
  ``mean x`` their own mean: 1 - explained variance. (saev's released 0.1.0 divides each token's
  squared error by its norm instead; its later NMSE could not be checked here.)
- ``l0``: active latents per token; ``dead_share``: latents active on none of the evaluation
  tokens; ``dense_share``: latents active on more than ``DENSE_FREQUENCY`` (10%) of them (saev
  0.1.0 counts > 1%, which a small TopK dictionary's ordinary latents pass: k / width is near 1%).
- the spliced score: the model run with the dictionary's reconstruction in place of the tokens it
  reads at its layer (the patch tokens, or every token when it was trained on the prefix tokens
  too), from that layer on. With a classifier: ``prediction_kept`` (the share of images whose
  top-1 class is unchanged), ``kl`` (KL(clean || spliced) of the class distributions, nats, mean
  over images) and ``loss_recovered`` as ViT-Prisma defines "% CE recovered":
  (L_zero - L_sae) / (L_zero - L_clean), L the mean cross-entropy of the model's own clean top-1
  class (the image sets' labels are not the model's classes in general), L_zero with those tokens
  set to zero. Headless (num_classes = 0): ``pooled_cosine``, the spliced pooled output's cosine
  with the clean one, mean over images.

The passes: the blocks up to the layer run once, then the rest of the pass three times (clean,
zero-ablated, spliced; the last block for the pooled rows only, model.patching.rest_of_pass). The
clean and zero-ablated outputs do not depend on the dictionary (:class:`Reference`): shared by the
dictionaries of one model and layer, each further dictionary costs one forward per image.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.patching import rest_of_pass
from ..model.recorder import eval_mode
from ..model.vit import ViT
from .sae import CARD_KEY, SparseAutoencoder
from .tokens import ImageSource, model_input

DENSE_FREQUENCY = 0.1  # a latent active on more than this share of the tokens is dense
EVALUATION_TOKENS = 2**14  # tokens per pass (images per pass: this over the tokens of one image)
ENCODED_TOKENS = 2**12  # tokens encoded at once: (4,096, F) latents, 200 MB for a ViT-B's 12,288
Progress = Callable[[int, int], None]  # (images done, images in all)


@dataclass(frozen=True)
class Reference:
    """What the evaluation of any dictionary of this model, layer and images compares with: the
    clean outputs (n, classes or D) and, with a classifier, the zero-ablated ones."""

    clean: torch.Tensor
    zero: torch.Tensor | None


@dataclass(frozen=True)
class Evaluation:
    images: int
    tokens: int
    nmse: float
    l0: float
    dead_share: float
    dense_share: float
    prediction_kept: float | None = None  # a classifier's
    kl: float | None = None
    loss_recovered: float | None = None  # NaN when zeroing the tokens does not change the loss
    pooled_cosine: float | None = None  # a headless model's

    def to_card(self) -> dict:
        """The card's "evaluation" entry (sae.check_card): numbers by name, null where not measured."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_card(cls, entry: dict) -> Evaluation | None:
        """The evaluation on a card (its values numbers or null: sae.check_card), None unless it has
        every measure of a classifier's or a headless model's."""
        try:
            evaluation = cls(**entry)
        except TypeError:  # names this version does not write
            return None
        spliced = ((evaluation.pooled_cosine,) if evaluation.pooled_cosine is not None
                   else (evaluation.prediction_kept, evaluation.kl, evaluation.loss_recovered))
        always = (evaluation.images, evaluation.tokens, evaluation.nmse, evaluation.l0, evaluation.dead_share,
                  evaluation.dense_share)
        return evaluation if all(value is not None for value in (*always, *spliced)) else None

    def summary(self) -> str:
        """One line: the numbers as the field reports them."""
        parts = [f"NMSE {self.nmse:.3f} at L0 {self.l0:.1f}", f"dead {100 * self.dead_share:.1f}%",
                 f"dense (> {100 * DENSE_FREQUENCY:.0f}% of tokens) {100 * self.dense_share:.1f}%"]
        if self.pooled_cosine is not None:
            parts.append(f"spliced in, the pooled output's cosine with the clean one {self.pooled_cosine:.4f}")
        else:
            parts.append(f"spliced in, {100 * self.prediction_kept:.1f}% of predictions kept, KL {self.kl:.4f} nats,"
                         f" {100 * self.loss_recovered:.1f}% of the loss recovered against zero-ablation")
        return f"{', '.join(parts)} ({self.images:,} images, {self.tokens:,} tokens)"


def read_tokens(tokens: torch.Tensor, num_prefix: int, prefix_tokens: bool) -> slice:
    """The positions of (B, N, D) tokens a dictionary reads: every token or the patches."""
    return slice(0, tokens.shape[1]) if prefix_tokens else slice(num_prefix, tokens.shape[1])


def _entering(model: ViT, x: torch.Tensor, layer: int) -> torch.Tensor:
    """(B, N, D) the tokens leaving block ``layer`` for normalised images x: the blocks above do not run."""
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    rope = model.rope_tables(model.grid_size())
    for block in model.blocks[: layer + 1]:
        tokens = block(tokens, rope)
    return tokens


def rest(model: ViT, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """(B, classes or D) the output of the pass whose tokens leaving block ``layer`` are ``tokens``."""
    if layer + 1 == model.config.depth:
        return model.forward_head(model.norm(tokens))
    return rest_of_pass(model, tokens, layer + 1, model.grid_size())


def spliced(model: ViT, tokens: torch.Tensor, layer: int, replacement: torch.Tensor, prefix_tokens: bool) -> torch.Tensor:
    """The output with the read tokens of ``tokens`` (B, N, D, leaving block ``layer``) replaced by
    ``replacement`` (B, P, D)."""
    read = read_tokens(tokens, model.num_prefix_tokens, prefix_tokens)
    edited = tokens.clone()
    edited[:, read] = replacement.to(tokens.dtype)
    return rest(model, edited, layer)


def _batches(model: ViT, source: ImageSource, indices: torch.Tensor | None, batch_size: int | None):
    chosen = torch.arange(len(source)) if indices is None else indices
    size = batch_size or max(1, EVALUATION_TOKENS // model.config.num_tokens)
    for batch in chosen.split(size):
        yield len(chosen), len(batch), model_input(model, source.images(batch))


def reference(
    model: ViT, source: ImageSource, layer: int, prefix_tokens: bool, indices: torch.Tensor | None = None,
    batch_size: int | None = None, progress: Progress | None = None,
) -> Reference:
    """The clean (and zero-ablated) outputs of images ``indices`` of ``source`` (default: all)."""
    clean, zero, done = [], [], 0
    with torch.no_grad(), eval_mode(model):
        for total, count, x in _batches(model, source, indices, batch_size):
            tokens = _entering(model, x, layer)
            clean.append(rest(model, tokens, layer).float().cpu())
            if model.config.num_classes > 0:
                read = tokens[:, read_tokens(tokens, model.num_prefix_tokens, prefix_tokens)]
                zero.append(spliced(model, tokens, layer, torch.zeros_like(read), prefix_tokens).float().cpu())
            done += count
            if progress is not None:
                progress(done, total)
    return Reference(torch.cat(clean), torch.cat(zero) if zero else None)


def evaluate(
    sae: SparseAutoencoder, model: ViT, source: ImageSource, layer: int, prefix_tokens: bool,
    indices: torch.Tensor | None = None, batch_size: int | None = None, progress: Progress | None = None,
    compared: Reference | None = None,
) -> Evaluation:
    """The dictionary ``sae`` (reading the tokens leaving ``layer``) measured on images ``indices``
    of ``source`` (default: all), ``batch_size`` images a pass; ``compared``: their
    :func:`reference`, when already computed for another dictionary. ``progress(done, total)``
    after each pass."""
    width, device = sae.config.width, sae.W_dec.device
    classifier = model.config.num_classes > 0
    fired = torch.zeros(width, dtype=torch.int64)
    sums = torch.zeros(3, dtype=torch.float64)  # squared error, squared distance to the centre, active latents
    centre = spread = None  # the first batch's mean (sums around it do not cancel), and the sum of x - centre
    outputs, clean, zero, count_tokens, done = [], [], [], 0, 0
    with torch.no_grad(), eval_mode(model):
        for total, count, x in _batches(model, source, indices, batch_size):
            tokens = _entering(model, x, layer)
            read = tokens[:, read_tokens(tokens, model.num_prefix_tokens, prefix_tokens)].float()  # (B, P, D)
            flat = read.flatten(0, 1).to(device)  # (B P, D)
            reconstruction = torch.empty_like(flat)
            for rows in torch.arange(flat.shape[0], device=device).split(ENCODED_TOKENS):  # (n, F) at a time
                reconstruction[rows], latents = sae(flat[rows])
                active = latents > 0
                sums[2] += float(active.sum())
                fired += active.sum(0).cpu()
            centre = flat.double().mean(0) if centre is None else centre
            centred = flat.double() - centre
            spread = centred.sum(0) if spread is None else spread + centred.sum(0)
            sums[:2] += torch.stack([(reconstruction - flat).double().pow(2).sum(), centred.pow(2).sum()]).cpu()
            count_tokens += flat.shape[0]
            outputs.append(spliced(model, tokens, layer, reconstruction.view_as(read), prefix_tokens).float().cpu())
            if compared is None:
                clean.append(rest(model, tokens, layer).float().cpu())
                if classifier:
                    zero.append(spliced(model, tokens, layer, torch.zeros_like(read), prefix_tokens).float().cpu())
            done += count
            if progress is not None:
                progress(done, total)
    if compared is None:
        compared = Reference(torch.cat(clean), torch.cat(zero) if zero else None)
    variance = float(sums[1]) - float(spread.pow(2).sum()) / max(count_tokens, 1)
    frequency = fired.double() / max(count_tokens, 1)
    measured = dict(
        images=done, tokens=count_tokens, nmse=float(sums[0]) / variance if variance > 0 else float("nan"),
        l0=float(sums[2]) / max(count_tokens, 1), dead_share=float((fired == 0).double().mean()),
        dense_share=float((frequency > DENSE_FREQUENCY).double().mean()),
    )
    return Evaluation(**measured, **spliced_score(compared, torch.cat(outputs)))


def spliced_score(compared: Reference, outputs: torch.Tensor) -> dict[str, float]:
    """The spliced measures of ``outputs`` (n, classes or D) against the clean and zero-ablated ones."""
    if compared.zero is None:
        return {"pooled_cosine": float(F.cosine_similarity(outputs, compared.clean, dim=-1).mean())}
    target = compared.clean.argmax(-1, keepdim=True)  # (n, 1) the model's own clean prediction
    clean, ours, zero = (logits.log_softmax(-1) for logits in (compared.clean, outputs, compared.zero))

    def loss(log_p: torch.Tensor) -> float:
        return float(-log_p.gather(-1, target).mean())

    lost = loss(zero) - loss(clean)
    return {
        "prediction_kept": float((outputs.argmax(-1, keepdim=True) == target).float().mean()),
        "kl": float((clean.exp() * (clean - ours)).sum(-1).mean()),
        "loss_recovered": (loss(zero) - loss(ours)) / lost if abs(lost) > 1e-12 else float("nan"),
    }


def held_out(source: ImageSource, count: int) -> ImageSource:
    """The images a finished run is measured on: ``count`` shapes of the next seed's stream (none
    of them trained on), or the first ``count`` images of a stored set (those it trained on)."""
    if source.dataset == "shapes":
        return ImageSource("shapes", count, source.image_size, source.seed + 1)
    return ImageSource(source.dataset, min(count, len(source)), source.image_size, source.seed)


def write_evaluation(path, result: Evaluation, source: ImageSource) -> None:
    """Put ``result`` (measured on ``source``) on the card of the SAE file at ``path``, replacing the
    file whole once the new one is written (its tensors unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = Path(path)
    with safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
    card = json.loads(metadata.get(CARD_KEY, "{}"))
    card.update(evaluation=result.to_card(), evaluation_images=source.to_dict())
    metadata[CARD_KEY] = json.dumps(card)
    temporary = path.with_name(f".{path.name}.tmp")
    save_file(load_file(str(path)), str(temporary), metadata=metadata)
    os.chmod(temporary, path.stat().st_mode & 0o777)  # as readable as it was (safetensors writes 0600)
    os.replace(temporary, path)
