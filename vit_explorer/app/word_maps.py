"""Where each word is, for the pages (vit_explorer.text.maps): each prompt's dense similarity over
the patches, by the open-vocabulary method a person picks (text.open_vocabulary.METHODS), the
relevance of one label's score, over one image (``Selection``) or several (``ImageSet``).
Computed once for everybody through ``memo``, keyed by model, sizes, image, method and the
labels (their digest, app.words.labels_id), never by session; the prompts are read as the
sidebar's labels are ("a photo of {label}.") and their embeddings shared with the prediction
(app.words.label_embeddings).

Costs: the patches are carried into the texts' space once per image and method (the last block
at most, re-run from the captured tokens), then each prompt costs a pass of the text tower and one
small matrix product; a label's relevance is a forward and a backward pass of the image tower
(about three forwards), its LeGrad map (text.legrad) the last two blocks forward and backward
from the page's capture.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..text import ImageTextModel, parse_labels
from ..text import legrad as legrad_maps
from ..text import maps, open_vocabulary
from ..text.zero_shot import LABEL_TEMPLATE
from ..weights import catalogue
from . import models, proxies, words
from .selection import ImageSet, Selection, uniform_attention_caveat

DEFAULT_PROMPTS = "a cat, a dog, a rocket"
READ_AS = LABEL_TEMPLATE.format("{prompt}")  # how each prompt goes through the text tower
# Maps drawn at once: a grid of that many panels, each prompt a colour of its own in the best-prompt map.
MAX_PROMPTS = 12
# A prompt most like at least this share of the patches says little about where it is.
MOST_PATCHES = 0.9
METHODS = open_vocabulary.METHODS
# MaskCLIP stays the first map shown: the others' published gains are CLIP ViT-B/16's on benchmark
# photos, not yet measured on SigLIP's or the catalogue's towers (bench.segment will say).
DEFAULT_METHOD = "maskclip"
# The methods a set of pictures is mapped by: those computed from the tokens the set has read.
SET_METHODS = {name: entry for name, entry in METHODS.items() if entry.from_tokens is not None}


def model_for(selection: Selection) -> ImageTextModel | None:
    """Both towers of the selected model, the image tower at the selection's sizes and normalisation
    (the shared words model with its image tower swapped: a new small object, nothing shared
    changes); None for a model without a text tower."""
    model = words.words_model(selection.model_key)
    if model is None or model.image is selection.model:
        return model
    return replace(model, image=selection.model)


def read_prompts(text: str, model_key: str) -> tuple[tuple[str, ...], str | None]:
    """The prompts typed ("a cat, a dog, a rocket"), checked (text.LabelError: one sentence, also
    when ``model_key``'s tokenizer cannot read them: they are embedded here, once for everybody),
    the first MAX_PROMPTS of them; and a sentence when some were left out, else None."""
    prompts = tuple(parse_labels(text))
    left_out = None
    if len(prompts) > MAX_PROMPTS:
        prompts, left_out = prompts[:MAX_PROMPTS], f"The first {MAX_PROMPTS} of your {len(prompts)} prompts are mapped."
    words.label_embeddings(model_key, prompts)  # as the maps ask for them (memoised)
    return prompts, left_out


def best_prompt_caveats(selection: Selection, similarities: np.ndarray, prompts: tuple[str, ...]) -> list[str]:
    """Why the best-prompt map of ``similarities`` (T, gh, gw) says little, one sentence each, said
    beside it: one prompt taking nearly every patch, or heads that pick no token out (the page's
    top says so too, far from this map)."""
    said = []
    counts = np.bincount(similarities.argmax(axis=0).reshape(-1), minlength=len(prompts))
    top = int(counts.argmax())
    if counts[top] >= MOST_PATCHES * counts.sum():
        said.append(
            f"'{prompts[top]}' is the closest prompt for {counts[top]} of the {counts.sum()} patches: it is nearer than the"
            " others to what every patch shares, so this map says little about where each prompt is; the per-prompt"
            " colour scale above shows where each is strongest."
        )
    uniform = uniform_attention_caveat(selection)
    if uniform is not None:
        said.append(f"Read little into these maps: {uniform[0].lower()}{uniform[1:]}")
    return said


def how(model: ImageTextModel, detail: bool = False, method: str = DEFAULT_METHOD) -> str:
    """How the patches meet the texts, in a few words (a title's) or step by step (a caption's)."""
    return open_vocabulary.how(model, method, detail)


def method_label(method: str) -> str:
    """A method as its choice reads: its name and what it changes."""
    return f"{METHODS[method].label} ({METHODS[method].short})"


def methods_help() -> str:
    """Every method in a line, for the choice's help."""
    return "  \n".join(f"{entry.label}: {entry.description}." for entry in METHODS.values())


def patch_embeddings(selection: Selection, method: str = DEFAULT_METHOD) -> torch.Tensor:
    """(1, P, E) the image's patches in the texts' space as ``method`` reads them
    (text.open_vocabulary.patch_embeddings), from the page's capture, once per model, sizes, image
    and method."""
    return selection.memo("words patch embeddings", method, compute=lambda: open_vocabulary.patch_embeddings(
        model_for(selection), selection.capture(), method,
    ))


def similarities(
    selection: Selection, prompts: tuple[str, ...], method: str = DEFAULT_METHOD, proxy_key: str | None = None,
) -> np.ndarray:
    """(T, gh, gw) each prompt's map over the patches of the image by ``method``
    (text.open_vocabulary.similarity_maps): its cosine with every patch, or CLIP Surgery's
    cosines after the feature surgery; ProxyCLIP's on the grid of the proxy ``proxy_key`` (a
    model key). An OpenVocabularyError (one sentence) where the method is not defined."""
    if not METHODS[method].needs_proxy:
        proxy_key = None
    elif proxy_key is None:
        raise open_vocabulary.OpenVocabularyError("ProxyCLIP borrows another model's attention: choose a proxy model first")

    def compute() -> np.ndarray:
        texts = words.label_embeddings(selection.model_key, prompts)
        if METHODS[method].maps is None and not METHODS[method].needs_proxy:  # the patches kept for every prompt
            return maps.similarity_maps(patch_embeddings(selection, method), texts, selection.capture().grid_size)[0].numpy()
        proxy = None if proxy_key is None else proxies.proxy(selection, proxy_key)
        return open_vocabulary.similarity_maps(model_for(selection), selection.capture(), texts, method, proxy)[0].numpy()

    return selection.memo("words similarities", words.labels_id(prompts), method, proxy_key, compute=compute)


def proxy_options(selection: Selection) -> dict[str, str]:
    """The models ProxyCLIP may borrow attention from: model key -> label, the app's models but
    the selected one and the CLIPs and SigLIPs; those already here first (a download is a choice),
    DINOs first among them."""
    def catalogue_name(key: str) -> str | None:
        kind, _, name = key.partition(":")
        return name if kind == "pretrained" else None

    def has_words(key: str) -> bool:
        name = catalogue_name(key)
        return catalogue.entry(name).open_clip is not None if name else words.text_folder(key) is not None

    def order(key: str) -> tuple[bool, bool]:
        name = catalogue_name(key)
        return (name is not None and not catalogue.is_downloaded(name), "dino" not in key.lower())

    options = {key: label for key, label in models.model_options().items() if key != selection.model_key and not has_words(key)}
    return {key: options[key] for key in sorted(options, key=order)}


def label_similarity(selection: Selection, labels: tuple[str, ...] | None, index: int) -> np.ndarray | None:
    """(gh, gw) the cosine of every patch with label ``index`` of ``labels`` (None: ImageNet's
    classes, by their class embeddings); None while those are not there yet."""
    texts = words.label_embeddings(selection.model_key, labels)
    if texts is None:
        return None
    return selection.memo("words label similarity", words.labels_id(labels), index, compute=lambda: maps.similarity_maps(
        patch_embeddings(selection), texts[index:index + 1], selection.capture().grid_size,
    )[0, 0].numpy())


def relevance(selection: Selection, labels: tuple[str, ...] | None, index: int) -> np.ndarray | None:
    """(gh, gw) relevance of each patch to the image's cosine with label ``index`` of ``labels``
    (text.maps.relevance: the class attribution with that cosine as its target), computed with
    the selected model at its sizes; None while ImageNet's class embeddings are not there yet."""
    texts = words.label_embeddings(selection.model_key, labels)
    if texts is None:
        return None
    return selection.memo(
        "words relevance", words.labels_id(labels), index, spinner="Tracing the words back to the patches ...",
        compute=lambda: maps.relevance(model_for(selection), selection.model_input(), texts[index])[0].numpy(),
    )


RELEVANCE_METHODS = {
    "chefer": "Chefer et al. (every layer)",
    "legrad": "LeGrad (the last layers' gradients)",
}


def legrad(selection: Selection, labels: tuple[str, ...], index: int) -> np.ndarray:
    """(gh, gw) LeGrad's relevance of each patch to the image's cosine with label ``index`` of
    ``labels`` (text.legrad), from the page's capture; a ValueError (one sentence) for a model
    LeGrad is not defined for."""
    model = model_for(selection)
    legrad_maps.check_model(model)
    texts = words.label_embeddings(selection.model_key, labels)
    return selection.memo(
        "words legrad", words.labels_id(labels), index,
        compute=lambda: legrad_maps.legrad(model, selection.capture(), texts[index])[0].numpy(),
    )


def set_similarities(image_set: ImageSet, prompt: str, method: str = DEFAULT_METHOD) -> np.ndarray:
    """(B, gh, gw) one prompt's cosine with every patch of every image of the set, from the tokens
    the set has read (ImageSet.image_tokens); the patches carried once per set and method."""
    selection = image_set.selection

    def patches() -> torch.Tensor:
        last_two = torch.stack([image_set.tokens(-2), image_set.tokens(-1)], dim=1)  # (B, 2, N, D)
        return open_vocabulary.last_block_embeddings(
            model_for(selection), last_two, selection.config.num_prefix_tokens, selection.config.grid_size, method,
        )

    def compute() -> np.ndarray:
        embedded = image_set.memo("words patch embeddings", method, compute=patches)
        texts = words.label_embeddings(selection.model_key, (prompt,))
        return maps.similarity_maps(embedded, texts, selection.config.grid_size)[:, 0].numpy()

    return image_set.memo("words similarities", words.labels_id((prompt,)), method, compute=compute)
