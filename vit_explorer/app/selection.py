"""What a page looks at and everything computed from it: ``Selection`` (a model at a patch size
and input size, and an image), ``ImageSet`` (several images for one model), and what a prediction
on them is worth (``prediction_caveats``)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import streamlit as st
import torch
from PIL import Image

from ..model.ablation import HeadSweep, KnockOut, head_sweep
from ..analysis import (
    attribution, captured_head_statistics, display_image, entropy_evenness, logit_lens, near_chance, near_uniform, query_map,
    streamed_query_maps, streamed_rollout,
)
from ..analysis.dense_pca import image_features
from ..analysis.head_types import HeadTypes, classify_heads_from_tokens
from ..analysis.image_set import MAX_IMAGES, MIN_IMAGES, first_component, last_layer_features, layer_keys
from ..analysis.test_time_registers import RegisterNeurons, TestTimeRegister, find_register_neurons, register_capture
from ..data.datasets import SHAPE_CLASSES
from ..data.images import preprocess
from ..data.transforms import describe
from ..model.capture import Capture, capture, layer_attention, layer_attentions, layer_internals
from ..model.internals import LayerInternals
from ..model.vit import ViT
from . import costs, models
from .images import photo_names, resolve_image
from .memo import memo, shared_results

T = TypeVar("T")

@dataclass(frozen=True)
class Selection:
    """What every page looks at: the chosen model at the chosen patch size and the chosen image."""

    model_key: str
    patch_size: int
    image_key: str  # includes the render size for shapes
    model: ViT
    image: Image.Image  # the picture as given, before resizing
    # A normalisation this person chose (models.normalization_choice) for a model whose own was
    # assumed: ``model`` says it, and every key says so (model_id), so no other session's results mix.
    normalization: str | None = None
    # The whole picture squeezed to the input size, chosen in the sidebar (session.whole_picture)
    # for a model whose publisher crops or pads it: every key says so (model_id).
    whole: bool = False

    @property
    def config(self):
        return self.model.config

    @property
    def model_id(self) -> str | tuple:
        """What the results are keyed by: the model key, with the normalisation chosen if any, and
        "whole picture" where the picture is read whole rather than as its publisher crops it."""
        model_id = self.model_key if self.normalization is None else (self.model_key, self.normalization)
        return (model_id, "whole picture") if self.whole else model_id

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """(1, C, H, W) ``image`` as this selection's model reads it: as its publisher crops (or
        pads) it, or whole."""
        return preprocess(image, self.config, whole=self.whole)

    @property
    def base_model(self) -> ViT:
        """The model at its own patch size (and at the chosen input size)."""
        own_patch = models.base_model(self.model_key).config.patch_size
        return models.model_at(self.model_key, own_patch, self.config.img_size, self.normalization)

    @property
    def key(self) -> tuple[str | tuple[str, str], int, tuple[int, int], str]:
        return (self.model_id, self.patch_size, self.config.img_size, self.image_key)

    def memo(self, *key, compute: Callable[[], T], spinner: str | None = None) -> T:
        """``compute()`` once per (this model, patch size and image, ``key``) for everybody."""
        return memo((*self.key, *key), compute, spinner)

    def capture(self) -> Capture:
        """The forward pass dissected: every layer's tokens, and every layer's attention in float16
        where that is small (models.KEEP_EVERY_LAYER_BYTES). Past it no layer's attention is kept:
        the views ask for the layers they draw (:meth:`attention`), and the analyses over all
        layers compute them from the tokens a layer at a time (:meth:`rollout`,
        :meth:`head_statistics`), so a view holds what models.view_bytes counts at any input
        size, not (depth, heads, N, N)."""
        return self.memo("capture", compute=self._timed_capture, spinner="Running the model ...")

    def _kept_layers(self) -> tuple[int, ...] | None:
        """The layers whose attention a capture keeps: all (None) when that is small, else none."""
        return None if models.keeps_every_layer(self.config) else ()

    def _timed_capture(self) -> Capture:
        """The capture, its pass's seconds kept beside it (:meth:`capture_seconds`)."""
        started = time.perf_counter()
        captured = capture(self.model, self.model_input(), layers=self._kept_layers(), attention_dtype=torch.float16)
        seconds = time.perf_counter() - started  # the tensors are on the CPU: the pass has run
        self.memo("capture seconds", compute=lambda: seconds)
        costs.pass_times().record(self.config, seconds)  # what is quick at this size (costs.is_quick)
        return captured

    def capture_seconds(self) -> float | None:
        """Seconds the pass of :meth:`capture` took, if it ran in this process and is still kept."""
        return shared_results().get((*self.key, "capture seconds"))

    def _captured(self, knock_out: KnockOut | None) -> Capture:
        return self.capture() if knock_out is None else self.knock_out_capture(knock_out)

    def attention(self, layer: int, knock_out: KnockOut | None = None) -> torch.Tensor:
        """(heads, N, N) float16: layer ``layer``'s attention on this image (with ``knock_out``:
        in the pass without those heads and branches), computed from the captured tokens entering
        it (capture.layer_attention: the attention part of one block) once for everybody. A
        knock-out changes only the layers after the first one it touches."""
        if knock_out is not None and (knock_out.is_empty or layer <= knock_out.first_layer()):
            knock_out = None
        captured = self._captured(knock_out)
        if layer in captured.layers:  # kept by the pass itself
            return captured.attentions[0, captured.layers.index(layer)]
        return self.memo(
            "attention", layer, knock_out, spinner=f"Computing the attention of layer {layer} ...",
            compute=lambda: layer_attention(self.model, captured.tokens[:, layer], layer, captured.grid_size, torch.float16)[0],
        )

    def rollout(self, head_fusion: str = "mean", discard_ratio: float = 0.0, knock_out: KnockOut | None = None) -> torch.Tensor:
        """(1, N, N) attention rollout through every layer (with ``knock_out``: of that pass),
        each layer computed from the captured tokens and dropped once multiplied in (the Attention
        page's, a job where its view is heavy: app.jobs.rollout, under the same key)."""
        if knock_out is not None and knock_out.is_empty:
            knock_out = None
        captured = self._captured(knock_out)
        return self.memo(
            "rollout", head_fusion, discard_ratio, knock_out, spinner="Rolling the attention out through the layers ...",
            compute=lambda: streamed_rollout(
                layer_attentions(self.model, captured), head_fusion, discard_ratio,
                num_prefix_tokens=captured.num_prefix_tokens,
            ),
        )

    def head_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth, heads) mean attention distance in pixels and (depth, heads) mean entropy in nats
        of each head's attention on this image: one pass over the layers, each reduced as it is
        computed from the captured tokens (a job where the Attention page's view with them is
        heavy: app.jobs.head_statistics, under the same key)."""
        captured = self.capture()
        return self.memo("head statistics", spinner="Measuring every head of every layer ...", compute=lambda: (
            captured_head_statistics(self.model, captured)
        ))

    def query_maps_by_layer(self, query: int | None) -> torch.Tensor:
        """(depth, gh, gw) the attention of ``query`` (analysis.query_map's: None is the class token,
        without one the mean over the patch queries; else a patch index) to the patches in every
        layer, the mean of its heads: one layer at a time, from the capture."""
        captured = self.capture()
        return self.memo(
            "query maps by layer", query, spinner="Following the attention through the layers ...",
            compute=lambda: streamed_query_maps(
                layer_attentions(self.model, captured), captured.grid_size, captured.num_prefix_tokens, query,
                class_token=self.config.class_token,
            )[0],
        )

    def logit_lens(self) -> torch.Tensor:
        """(depth + 1, classes) the probabilities read out after every block (analysis.logit_lens:
        row 0 the embeddings, the last row the prediction), once for everybody."""
        return self.memo("logit lens probabilities", compute=lambda: logit_lens(self.model, self.capture())[0].softmax(dim=-1))

    def cached_capture(self) -> Capture | None:
        """:meth:`capture` if a page has made it already (for anybody), else None: nothing runs."""
        return shared_results().get((*self.key, "capture"))

    def cached_rollout(self, head_fusion: str, discard_ratio: float) -> torch.Tensor | None:
        """:meth:`rollout` (no knock-out) if made already, in the server or by its job, else None."""
        return shared_results().get((*self.key, "rollout", head_fusion, discard_ratio, None))

    def cached_head_statistics(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`head_statistics` if made already (a page's, the Pipeline's caveat's, its job's), else None."""
        return shared_results().get((*self.key, "head statistics"))

    def attribution(self, target: int) -> np.ndarray:
        """(gh, gw) relevance of each patch for class ``target``; one backward pass per class."""
        return self.memo(
            "attribution", target,
            compute=lambda: attribution(self.model, self.model_input(), target)[0].cpu().numpy(),
            spinner="Tracing the class back to the patches ...",
        )


    def dense_features(self, image_key: str, image: Image.Image, size: tuple[int, int]) -> tuple[torch.Tensor, np.ndarray]:
        """(features, picture) of ``image`` read by this model at ``size`` (dense_pca.image_features:
        DINOv3's PCA at 768 px high), once for everybody and for every page that shows it."""
        return memo(
            (self.model_id, self.patch_size, size, image_key, "dense features"),
            lambda: image_features(models.model_at(self.model_key, self.patch_size, size, self.normalization), image),
            spinner=f"Reading the picture at {size[0]}x{size[1]} px ...",
        )

    def input_described(self) -> str:
        """What the model reads of the picture, in words (data/transforms.describe)."""
        return describe(self.image.size, self.config, self.whole)

    def model_input(self) -> torch.Tensor:
        return self.preprocess(self.image)  # (1, C, H, W)

    def display_image(self) -> np.ndarray:
        """(H, W, 3) uint8: the picture exactly as the model sees it (resized, 8-bit)."""
        return self.memo("display image", compute=lambda: display_image(self.model_input(), self.config))

    def class_names(self) -> list[str]:
        names = self.config.class_names
        return list(names) if names else [f"class {i}" for i in range(self.config.num_classes)]

    def internals(self, layer: int, token: int) -> LayerInternals:
        """Every step of encoder layer ``layer`` for query ``token`` of this image
        (vit_explorer.model.internals), from the captured tokens entering the layer: this layer's q, k, v
        projection and the rest of the block for that one token, so that another layer or query
        costs a fifth of a block (at patch 8 the whole block was most of a view) and another head
        nothing."""
        return self.memo(
            "internals", layer, token,
            compute=lambda: layer_internals(self.model, self.capture().tokens[:, layer], layer, queries=[token]),
            spinner=f"Opening layer {layer} ...",
        )

    def knock_out_capture(self, knock_out: KnockOut) -> Capture:
        """:meth:`capture` of the pass with ``knock_out``'s heads and branches removed (that call
        only: the shared model is untouched); nothing knocked out is the intact capture. The
        layers before the first one knocked out are the intact capture's, not run again."""
        intact = self.capture()
        if knock_out.is_empty:
            return intact
        return self.memo(
            "knock-out capture", knock_out, spinner="Running the model without them ...",
            # The layers and dtype of the intact capture, whose layers before the knocked one it reuses.
            compute=lambda: capture(
                self.model, self.model_input(), layers=intact.layers, attention_dtype=intact.attentions.dtype,
                knock_out=knock_out, intact=intact,
            ),
        )

    def register_neurons(self, layer: int, k: float, with_photos: bool = False, last: int | None = None) -> RegisterNeurons:
        """The MLP units of layers 0 to ``last`` (default: where the outliers appear) scored as
        register neurons on the outliers after ``layer`` (median norm + ``k`` MADs;
        test_time_registers.find_register_neurons), once for everybody: on this image, from its
        capture's tokens (the blocks run again up to each MLP); ``with_photos``, on this image and
        the bundled photos together (:meth:`with_photos`: their capture too; a job when heavy,
        app.jobs.register_neurons, under the same key)."""
        source = self.with_photos if with_photos else self.capture
        return self.memo(
            "register neurons", layer, k, with_photos, last, spinner="Scoring the MLP units on the outliers ...",
            compute=lambda: find_register_neurons(self.model, source(), k, layer, last),
        )

    def with_photos(self) -> torch.Tensor:
        """(B, C, H, W): this image, then each bundled photo that is not this image, at the model's
        input (once per model, sizes and image)."""
        others = [f"photo:{name}" for name in photo_names() if f"photo:{name}" != self.image_key]
        return self.memo("with photos", compute=lambda: torch.cat([self.model_input(), *(
            self.preprocess(resolve_image(key, self.config.img_size)[1]) for key in others
        )]))

    def register_capture(self, register: TestTimeRegister) -> Capture:
        """:meth:`capture` of the pass with ``register`` (that call only: the shared model is
        untouched), keeping the layers the intact capture keeps."""
        intact = self.capture()
        return self.memo(
            "register capture", register, spinner="Running the model with a test-time register ...",
            compute=lambda: register_capture(
                self.model, self.model_input(), register, layers=intact.layers, attention_dtype=intact.attentions.dtype,
            ),
        )

    def register_attention(self, layer: int, register: TestTimeRegister) -> torch.Tensor:
        """(heads, N + 1, N + 1) float16: :meth:`attention` of the pass with ``register``."""
        captured = self.register_capture(register)
        if layer in captured.layers:
            return captured.attentions[0, captured.layers.index(layer)]
        return self.memo(
            "register attention", layer, register, spinner=f"Computing the attention of layer {layer} ...",
            compute=lambda: layer_attention(self.model, captured.tokens[:, layer], layer, captured.grid_size, torch.float16)[0],
        )

    def head_sweep(self, mode: str) -> HeadSweep:
        """Every head knocked out alone on this image (vit_explorer.model.ablation.head_sweep), with a
        progress bar while it runs, once for everybody: for a model whose sweep is quick (else
        app.jobs.head_sweep, under the same key)."""
        key = (*self.key, "head sweep", mode)

        def compute() -> HeadSweep:
            bar = st.progress(0.0, text="Knocking out each head alone ...")
            result = head_sweep(self.model, self.model_input(), mode, progress=lambda share: bar.progress(
                share, text=f"Knocking out each head alone: {share:.0%}"
            ))
            bar.empty()
            return result

        return memo(key, compute)


@dataclass(frozen=True)
class ImageSet:
    """Several images read together by the selected model (the Several images page): each image's
    tokens memoised for everybody by model, sizes and image key, so that a set with one more image
    runs that one alone; what the page reads of them is memoised by the set's image keys."""

    selection: Selection  # the model at its patch size and input size, and the sidebar's image
    image_keys: tuple[str, ...]  # cache keys (shapes include their render size)
    images: tuple[Image.Image, ...]  # as given, before resizing

    @property
    def key(self) -> tuple:
        selection = self.selection
        return (selection.model_id, selection.patch_size, selection.config.img_size, "image set", self.image_keys)

    @classmethod
    def of(cls, selection: Selection, image_keys: Sequence[str]) -> ImageSet:
        """The images behind ``image_keys`` for the selected model; ValueError with the sentence
        to show for too few or too many, or for an image that can no longer be read."""
        if not MIN_IMAGES <= len(image_keys) <= MAX_IMAGES:
            raise ValueError(
                f"Pick between {MIN_IMAGES} and {MAX_IMAGES} images"
                f" ({len(image_keys)} chosen)."
            )
        resolved = []
        for image_key in image_keys:
            try:
                resolved.append(resolve_image(image_key, selection.config.img_size))
            except (ValueError, OSError) as error:
                raise ValueError(f"One of the images cannot be read: {error}.") from error
        return cls(selection, tuple(key for key, _ in resolved), tuple(image for _, image in resolved))

    def memo(self, *key, compute: Callable[[], T], spinner: str | None = None) -> T:
        return memo((*self.key, *key), compute, spinner)

    def model_input(self) -> torch.Tensor:
        """(B, C, H, W): every image at the model's input size as the selection reads it (cropped as
        its publisher does, or whole), whatever its own size;
        once per set (the pass and the pictures shown both read it)."""
        return self.memo("model input", compute=lambda: torch.cat([
            self.selection.preprocess(image) for image in self.images
        ]))

    def image_tokens(self) -> list[torch.Tensor]:
        """(depth + 1, N, D) per image: the tokens entering the first block, then leaving each
        (the page reads tokens only). The sidebar's image is read from its capture, which every
        page shares (made now if no page has yet), and so is any image that a page has captured
        already; the others go through the model together in one batch, and each one's tokens are
        kept by themselves, so that a set with one more image runs that one alone."""
        selection = self.selection
        found = [
            None if captured is None else captured.tokens[0]
            for captured in (
                selection.capture() if image_key == selection.image_key
                else replace(selection, image_key=image_key, image=image).cached_capture()
                for image_key, image in zip(self.image_keys, self.images)
            )
        ]
        missing = [index for index, tokens in enumerate(found) if tokens is None]
        ran: dict[int, torch.Tensor] = {}

        def run(indices: list[int]) -> torch.Tensor:
            """One pass of the images ``indices``; the first one's tokens (the others' are kept
            before this returns, so that a session waiting for the first one finds them too)."""
            x = self.model_input()[indices]
            batch = capture(selection.model, x, layers=()).tokens
            ran.update({index: tokens.clone() for index, tokens in zip(indices, batch)})  # own storage each
            for index in indices[1:]:
                memo(self.tokens_key(index), lambda index=index: ran[index])
            return ran[indices[0]]

        spinner = f"Running the model on {len(missing)} image{'s' if len(missing) > 1 else ''} ..."
        for index in missing:  # the first one missing runs every one still missing
            found[index] = memo(self.tokens_key(index), lambda index=index: ran[index] if index in ran else run([
                index, *(later for later in missing if later > index and self.tokens_key(later) not in shared_results())
            ]), spinner=spinner)
        return found

    def tokens_key(self, index: int) -> tuple:
        """The memo key of image ``index``'s tokens (by model, sizes and image: any set shares them)."""
        selection = self.selection
        return (selection.model_id, selection.patch_size, selection.config.img_size, "set image tokens", self.image_keys[index])

    def unread(self) -> list[int]:
        """The images :meth:`image_tokens` would run (the sidebar's aside: its capture is every
        page's): no page has captured them and no set has read them."""
        selection = self.selection
        return [
            index for index, (image_key, image) in enumerate(zip(self.image_keys, self.images))
            if image_key != selection.image_key and self.tokens_key(index) not in shared_results()
            and replace(selection, image_key=image_key, image=image).cached_capture() is None
        ]

    def tokens(self, index: int) -> torch.Tensor:
        """(B, N, D) every image's tokens at ``index`` of :meth:`image_tokens` (0: entering the
        first block, -1: leaving the last)."""
        return self.memo("tokens", index, compute=lambda: torch.stack([tokens[index] for tokens in self.image_tokens()]))

    def keys(self, layer: int) -> torch.Tensor:
        """(B, P, nh * hd) the patches' keys in ``layer``: that layer's norm and qkv projection
        run again on the batch's captured tokens (a quarter of one block)."""
        return self.memo(
            "keys", layer, compute=lambda: layer_keys(self.selection.model, self.tokens(layer), layer),
            spinner=f"Computing the keys of layer {layer} ...",
        )

    def first_component(self) -> tuple[torch.Tensor, float]:
        """The joint first principal component of the last layer's patch features (image_set.
        first_component): once per image set, whatever the threshold."""
        return self.memo("first component", compute=lambda: first_component(self.last_layer_features()))

    def last_layer_features(self) -> torch.Tensor:
        """(B, P, D) the last layer's patch tokens after the final norm (DINOv2's figure's features)."""
        return self.memo("last layer features", compute=lambda: last_layer_features(self.selection.model, self.tokens(-1)))

    def head_types(self) -> HeadTypes:
        """Every head's measures and label over these images (head_types), from their tokens
        (:meth:`image_tokens`), each layer's attention computed again a few images at a time; once
        per set for everybody (app.jobs.head_types computes it as a job, under the same key)."""
        return self.memo("head types", spinner="Measuring every head on every image ...", compute=lambda: (
            classify_heads_from_tokens(self.selection.model, torch.stack(self.image_tokens()))
        ))

    def cached_head_types(self) -> HeadTypes | None:
        """:meth:`head_types` if anybody has measured them (here or in a job), else None: nothing runs."""
        return shared_results().get((*self.key, "head types"))

    def head_attention(self, layer: int, head: int) -> torch.Tensor:
        """(B, N, N) float16: head ``head`` of ``layer`` on each image, from the layer's attention
        computed again from each image's tokens entering it (the attention part of one block, an
        image at a time); once for everybody, whatever the query."""
        def compute() -> torch.Tensor:
            tokens = self.tokens(layer)  # (B, N, D)
            return torch.cat([
                layer_attention(self.selection.model, tokens[index:index + 1], layer, dtype=torch.float16)[:, head]
                for index in range(tokens.shape[0])
            ])

        return self.memo("head attention", layer, head, compute=compute, spinner=f"Computing layer {layer}'s attention ...")

    def head_maps(self, layer: int, head: int, query: int | None) -> torch.Tensor:
        """(B, gh, gw) :meth:`head_attention` of ``query`` (a patch index; None: the class token, or
        without one the mean of the patch queries) over the patches of each image."""
        config = self.selection.config
        return self.memo("head maps", layer, head, query, compute=lambda: query_map(
            self.head_attention(layer, head), config.grid_size, config.num_prefix_tokens, query,
            class_token=config.class_token,
        ))

    def display_images(self) -> list[np.ndarray]:
        """(H, W, 3) uint8 per image: each picture as the model sees it."""
        return self.memo("display images", compute=lambda: [
            display_image(x, self.selection.config) for x in self.model_input()
        ])


def unreadable_photo_reason(selection: Selection) -> str | None:
    """One sentence on why the model cannot make sense of the chosen photo, or None if it can."""
    if selection.image_key.startswith("shapes:"):
        return None
    config = selection.config
    height, width = config.img_size
    if config.class_names == SHAPE_CLASSES:
        if selection.image.size == (width, height):
            return None  # a shapes picture saved at the model's size and uploaded again, most likely
        return (
            f"This model was trained on synthetic shapes at {height}x{width} pixels, so a photo"
            " means nothing to it."
        )
    given = min(selection.image.size)
    if min(height, width) < 64 and given >= 4 * min(height, width):
        return (
            f"This model reads {height}x{width} pixels, far fewer than the {selection.image.size[0]}"
            f"x{selection.image.size[1]} photo, so it sees a blur."
        )
    return None


def uniform_attention_caveat(selection: Selection) -> str | None:
    """One sentence when the model's heads spread their attention almost evenly over all tokens
    on this image (their mean entropy near the uniform log N), as an untrained model's do; else None.
    The entropies are read where the page's capture holds every layer's attention, or taken where
    another page or a job measured them; a side note never computes every layer's attention again
    (for a DINOv3-shaped ViT-S/16 at 768 px that alone took the Pipeline's first view past 3 passes)."""
    statistics = selection.cached_head_statistics()
    if statistics is None and models.keeps_every_layer(selection.config):
        statistics = selection.head_statistics()
    if statistics is None:
        return None
    evenness = entropy_evenness(statistics[1], selection.capture().num_tokens)
    if not near_uniform(evenness):
        return None
    return (
        f"This model's heads spread their attention almost evenly over all tokens (mean entropy {evenness:.0%}"
        " of the uniform log N), as an untrained model's do: its layers mix the tokens without picking any out."
    )


def prediction_caveats(selection: Selection, probabilities: torch.Tensor) -> list[str]:
    """Why the prediction (C,) shown for ``selection`` says little, one sentence each (none: it
    can be read as it is): a picture the model cannot read, a top class no likelier than a guess."""
    caveats = []
    reason = unreadable_photo_reason(selection)
    if reason is not None:
        caveats.append(f"Read nothing into this prediction: {reason[0].lower()}{reason[1:]}")
    if near_chance(probabilities):
        classes = probabilities.shape[-1]
        caveats.append(
            f"The top probability, {float(probabilities.max()):.1%}, is close to chance ({1 / classes:.1%}"
            f" for {classes} classes): the model does not recognise anything here, as when its weights"
            " are random or untrained."
        )
    return caveats

