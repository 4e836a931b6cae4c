"""Plotly figure builders shared by the app and ``python -m vit_explorer inspect``.

Builders are pure: arrays in (numpy or torch), a ``go.Figure`` out, nothing drawn or saved.
Images are (H, W, 3) uint8 (floats in [0, 1] are accepted); maps over the patch grid are
(gh, gw) and are drawn one cell per patch on top of the image, so non-square grids and images
of any size line up. One module per topic; every public builder is importable from here.
:func:`write_figures` turns figures into files.
"""
from ._base import ATTENTION_SCALE, SIMILARITY_SCALE, VALUE_SCALE, colour_mapped, image_data_uri, token_labels
from .attention import (
    HEAD_SCALES, attention_by_layer, attention_heads_grid, attention_masks_grid, attention_matrix, attention_overlay,
    layer_head_heatmap, layer_head_scatter, matrix_block,
)
from .compare import side_heads_grid, side_point_picker, side_token_pca, side_topk
from .embeddings import (
    embedding_filters_figure, position_similarity_grid, token_matrix, token_norms_figure, token_pca_image,
)
from .faithfulness import faithfulness_figure
from .features import (
    attention_difference_grid, explained_map, latent_bars, latent_effect_bars, latent_gallery, latent_histogram,
    latent_map,
)
from .files import FigureExportError, PngWriter, find_browser, write_figures
from .head_types import LABEL_STYLES, head_maps_grid, head_types_grid
from .image_set import correspondence_grid, dense_pca_grid, foreground_pca_grid, norm_outliers_grid
from .internals import (
    head_sources_figure, inside_layer_figures, key_value_matrices, mlp_activations_figure, softmax_scale_figure,
    softmax_scale_figures, token_values_on_grid, vector_strips,
)
from .knockout import head_sweep_grid, intact_and_knocked_heads, intact_and_knocked_rollouts, knockout_topk
from .patching import patched_topk, patching_agreement, patching_heatmap
from .patches import image_with_grid, input_image, patch_picker, patch_sequence, patch_size_tradeoff
from .predictions import logit_lens_figure, topk_bar
from .probe import LABEL_COLOURS, probe_layers_figure, probe_picker, probe_segmentation_grid
from .registers import attention_drawn_figure, norms_by_layer_figure, register_neurons_figure, register_norms_figure
from .rope import offset_scores_figure, rotation_angles_figure
from .training import accuracy_by_image_size_figure, sae_curves, training_curves
from .words import (
    PROMPT_SCALES, best_prompt_map, prompt_over_images, relevance_overlay, segmentation_map, similarity_grid,
    zero_shot_bar,
)

__all__ = [
    "ATTENTION_SCALE", "SIMILARITY_SCALE", "VALUE_SCALE", "colour_mapped", "image_data_uri", "token_labels",
    "HEAD_SCALES", "attention_by_layer", "attention_heads_grid", "attention_masks_grid", "attention_matrix",
    "attention_overlay", "layer_head_heatmap", "layer_head_scatter", "matrix_block",
    "side_heads_grid", "side_point_picker", "side_token_pca", "side_topk",
    "embedding_filters_figure", "position_similarity_grid", "token_matrix", "token_norms_figure",
    "token_pca_image",
    "faithfulness_figure",
    "attention_difference_grid", "explained_map", "latent_bars", "latent_effect_bars", "latent_gallery",
    "latent_histogram", "latent_map",
    "FigureExportError", "PngWriter", "find_browser", "write_figures",
    "LABEL_STYLES", "head_maps_grid", "head_types_grid",
    "correspondence_grid", "dense_pca_grid", "foreground_pca_grid", "norm_outliers_grid",
    "head_sources_figure", "inside_layer_figures", "key_value_matrices", "mlp_activations_figure",
    "softmax_scale_figure", "softmax_scale_figures", "token_values_on_grid", "vector_strips",
    "head_sweep_grid", "intact_and_knocked_heads", "intact_and_knocked_rollouts", "knockout_topk",
    "patched_topk", "patching_agreement", "patching_heatmap",
    "image_with_grid", "input_image", "patch_picker", "patch_sequence", "patch_size_tradeoff",
    "logit_lens_figure", "topk_bar",
    "LABEL_COLOURS", "probe_layers_figure", "probe_picker", "probe_segmentation_grid",
    "attention_drawn_figure", "norms_by_layer_figure", "register_neurons_figure", "register_norms_figure",
    "offset_scores_figure", "rotation_angles_figure",
    "accuracy_by_image_size_figure", "sae_curves", "training_curves",
    "PROMPT_SCALES", "best_prompt_map", "prompt_over_images", "relevance_overlay", "segmentation_map", "similarity_grid",
    "zero_shot_bar",
]
