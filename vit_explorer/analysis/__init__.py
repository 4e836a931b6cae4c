"""What the captured numbers say: pure functions from a capture's tensors (or a model and images)
to numbers, one question a module. None of them draw or import streamlit.

Shapes: B batch, L layers, H heads, N tokens (prefix tokens first, then the gh x gw patches in
row-major order), D embed dim. Functions take and return torch tensors (float32, CPU) unless they
say otherwise.

    checks.py               AnalysisError and the checks every analysis makes of its inputs
    pixels.py               a model's input back to pixels (denormalize, display_image)
    rollout.py              attention rollout (streamed a layer at a time) and class attribution
    maps.py                 one query's attention over the patch grid; points on other grids
    head_statistics.py      attention distance, entropy, evenness; near uniform, near chance
    tokens.py               logit lens, position similarity, filters, token PCA and norms, top-k
    head_types.py           what kind each head is over several images (classify_heads)
    image_set.py            several images: joint PCA, correspondences, high-norm outliers
    dense_pca.py            DINOv3's dense-feature PCA at high resolution
    test_time_registers.py  registers added at test time (find_register_neurons, register_capture)
    patch_sizes.py          the same weights at every patch size: rows and held-out accuracy
    answers.py              the Lesson's questions answered from the model's numbers
    faithfulness.py         is this map true? deletion and insertion curves of any maps
    probe.py                a probe a person labels: a logistic regression segmenting every patch
    patching.py             activation patching between a clean and a corrupted picture: exact,
                            attribution (the gradient estimate) and path patching
    segmentation.py         each pixel's class from its names' cosines (the papers' rule), mIoU
    pamr.py                 PAMR: class scores refined along the picture's edges

The functions of the first six are importable from the package itself (``analysis.rollout``'s
``attention_rollout`` as ``vit_explorer.analysis.attention_rollout``), as they were when this was
one module; the others are imported by their module's name.
"""
from .checks import AnalysisError
from .head_statistics import (
    CHANCE_CLOSENESS,
    NEAR_UNIFORM,
    attention_entropy,
    attention_evenness,
    captured_head_statistics,
    entropy_evenness,
    head_distances,
    head_entropies,
    mean_attention_distance,
    near_chance,
    near_uniform,
    patch_centres,
)
from .maps import (
    attention_map,
    attention_mask_by_mass,
    head_maps,
    matching_layer,
    patch_index,
    patch_point,
    point_patch,
    pool_maps,
    map_query,
    pool_rollout_map,
    query_map,
    streamed_query_maps,
)
from .pixels import denormalize, display_image
from .rollout import HEAD_FUSIONS, attention_rollout, attribution, rollout_rows, streamed_rollout
from .tokens import (
    embedding_filters,
    logit_lens,
    position_embedding_similarity,
    token_norms,
    token_pca,
    top_k,
)

__all__ = [
    "AnalysisError", "CHANCE_CLOSENESS", "NEAR_UNIFORM", "attention_entropy", "attention_evenness",
    "captured_head_statistics", "entropy_evenness", "head_distances", "head_entropies", "mean_attention_distance", "near_chance",
    "near_uniform", "patch_centres", "attention_map", "attention_mask_by_mass",
    "head_maps", "matching_layer", "patch_index", "patch_point", "point_patch", "pool_maps", "map_query", "pool_rollout_map", "query_map",
    "streamed_query_maps", "denormalize", "display_image", "HEAD_FUSIONS", "attention_rollout", "attribution",
    "streamed_rollout", "rollout_rows", "embedding_filters", "logit_lens", "position_embedding_similarity", "token_norms",
    "token_pca", "top_k",
]
