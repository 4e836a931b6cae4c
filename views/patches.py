"""Patches: how the image becomes a sequence, and what the embedding layers learned."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.analysis import dense_pca as dense
from vit_explorer.analysis import image_set as sets
from vit_explorer.app import costs, jobs, models, probe, session
from vit_explorer.app.memo import memo

base = session.selection().base_model.config
options = models.patch_size_options(base)
rotary, added = base.rope_type is not None, base.abs_pos_embed
# How this model's positions follow another grid, and what remembers the grid layout.
resized_positions = " and ".join(
    (["the position embeddings interpolated"] if added else [])
    + (["the rotary coordinates simply follow the new grid" + ("" if added else " (no position embedding to resample)")]
       if rotary else [])
) or "it has no positions to adapt"
remembered = " and ".join(
    (["the position embeddings"] if added else []) + (["the rotations of queries and keys in attention"] if rotary else [])
)

st.title("Patches")
st.write(
    "A ViT never sees pixels one by one: it sees patches. The patch size sets how many tokens the"
    " transformer handles (and attention costs grow with their square) and how fine the details"
    " it can tell apart are. The same weights can run at another patch size: the patch"
    f" embedding is resampled (FlexiViT's PI-resize) and {resized_positions}."
)
st.select_slider(
    "Patch size", options=options, format_func=lambda patch: f"{patch} px",
    help=f"This model was trained with {base.patch_size} px patches; other sizes resample its weights.",
    **session.keep("patch_size", base.patch_size, lambda patch: patch in options),
)
selection = session.selection()
config = selection.config
result = selection.capture()
image = selection.display_image()
grid_h, grid_w = result.grid_size

st.plotly_chart(selection.memo("image with grid", compute=lambda: figures.image_with_grid(image, result.grid_size)))
st.caption(
    f"{grid_h} x {grid_w} = {grid_h * grid_w} patches of {config.patch_size} x"
    f" {config.patch_size} pixels, plus {config.num_prefix_tokens} prefix token(s):"
    f" {config.num_tokens} tokens in all."
)

st.subheader("Smaller patches: more tokens, more detail, more cost")
st.write(
    "The same weights at every patch size, side by side: how many tokens the transformer handles,"
    " how long one forward pass takes (measured once per model on this server: the time depends on"
    " the input's size, not on what the image shows) and, for a model with classes, how well it"
    " does, on this image and, where the model comes with a dataset, on held-out images it never"
    " trained on."
)
# Every patch size is a pass of this image, the first time for this model a warm-up and a few
# timed passes (plus the held-out batch): for a real-size model that is dozens of forward passes'
# worth, a job beside the server when asked for. Counted in multiply-adds, not in timed passes:
# most of a small model's comparison is its held-out batches, and a batch of 128 shares the fixed
# costs that make up most of one image's pass (the shipped model's: 0.3 s, 483 single passes' worth).
cost = costs.comparison_cost(selection)
if costs.is_heavy(base, forwards=cost, timed=False):
    rows = costs.compare_patch_sizes(selection, run=False)
    if rows is None:
        wait = costs.duration(cost * costs.forward_seconds(selection))
        st.caption(
            f"Running this image at all {len(options)} patch sizes costs about {cost:.0f} forward passes of"
            f" this model (the first time, a warm-up pass then up to {costs.TIMED_PASSES} timed passes each),"
            f" about {wait} of this server's time, so it runs when you ask, beside the server, and then"
            " serves everyone who looks at this image."
        )
        rows = jobs.patch_size_job(selection, f"Compare all {len(options)} patch sizes (about {wait})")
else:
    rows = costs.compare_patch_sizes(selection)
if rows is not None:
    if config.num_classes == 0:
        st.info(models.NO_CLASSIFIER.format(what="The prediction at each patch size"))
    st.plotly_chart(selection.memo("patch size tradeoff", compute=lambda: figures.patch_size_tradeoff(rows, config.patch_size)))
    st.dataframe(
        rows, hide_index=True,
        column_config={
            "forward ms": st.column_config.NumberColumn("forward (ms, median)", format="%.2f"),
            "probability": st.column_config.NumberColumn(format="%.3f"),
            "held-out accuracy": st.column_config.NumberColumn(
                f"accuracy on {costs.HELD_OUT_IMAGES} held-out images", format="percent"
            ),
        },
    )
    st.caption(costs.patch_size_summary(rows, base.patch_size))

st.subheader("The patch sequence")
st.write(
    "The transformer reads the patches in this order, row by row. Each becomes one token; the grid"
    + (f" layout is only remembered through {remembered}." if remembered else " layout is forgotten: this model has no positions.")
)
st.plotly_chart(selection.memo("patch sequence", compute=lambda: figures.patch_sequence(
    analysis.denormalize(result.patches[0], config)
)))

st.subheader("Token PCA")
st.write(
    "Each patch token is a long vector; projecting all of them on their three main directions"
    " and reading those as red, green and blue shows which patches the model considers alike."
    " Early on colours follow the pixels; deeper they follow what the patches are part of."
)
depth = config.depth
stage = st.slider(
    "Tokens after this many layers (0: the patch embeddings)", 0, depth,
    **session.keep("pca_stage", depth, lambda stage: 0 <= stage <= depth),
)
tokens = (
    result.patch_embeddings[0]
    if stage == 0
    else result.tokens[0, stage, result.num_prefix_tokens :]  # (gh*gw, D) output of block stage-1
)
st.plotly_chart(selection.memo("token pca", stage, compute=lambda: figures.token_pca_image(
    analysis.token_pca(tokens, result.grid_size), image
)))

st.subheader("DINOv3-style PCA")
st.write(
    "The picture of dense features as the DINOv3 authors make it (their notebook pca.ipynb): the last"
    " layer's patch tokens after the final norm, a PCA with three whitened components (each of unit"
    " variance over the foreground) fitted on the foreground patches only, every patch coloured"
    " sigmoid(2x) of its components, the background black. Their foreground comes from a classifier"
    " trained on their data; here it is your own once you label this picture on the Probe page, else"
    " the side of the tokens' first principal component away from the picture's border,"
    " median-filtered 3 x 3 as theirs. They read the picture 768 px high at its own aspect ratio,"
    " which shows far more patches than a model's usual input."
)
input_h, input_w = config.img_size
high = dense.aspect_size(selection.image.size, config.patch_size)
resolutions = {"input": f"the model's input ({input_h}x{input_w} px)"}
if dense.within_limit(high, config.patch_size):
    resolutions["768"] = f"{high[0]}x{high[1]} px (768 px high, the picture's aspect ratio)"
else:
    st.caption(
        f"At 768 px high this model (patch {config.patch_size}) would read"
        f" {(high[0] // config.patch_size) * (high[1] // config.patch_size)} patches, more than the"
        f" {dense.MAX_PATCHES} this page reads, so it is shown at the model's input only."
    )
resolution_column, flip_column = st.columns([2, 1], vertical_alignment="bottom")
resolution = resolution_column.radio(
    "Resolution", list(resolutions), format_func=resolutions.get, horizontal=True,
    help="768 px high is the authors' setting: one more forward pass of the model, at that size.",
    **session.keep("dense_resolution", "input", lambda option: option in resolutions),
)
flip = flip_column.toggle(
    "Switch foreground and background", help="Take the other side of the first principal component as the foreground.",
    **session.keep("dense_flip", False),
)
read = None  # (features, picture, grid) at the chosen resolution, once computed
if resolution == "input":
    features = selection.memo("last layer features", compute=lambda: sets.last_layer_features(
        selection.model, result.tokens[:, -1]
    )[0])
    read = (features, image, result.grid_size)
else:
    high_config = config.replace(image_size=high)
    passes = costs.dense_forwards(config, [high])
    # A real-size model at 768 px costs dozens of passes: asked for, not unasked.
    if costs.is_quick(config, forwards=passes) or st.toggle(
        f"Read the picture at {high[0]}x{high[1]} px (about {passes:.0f} forward passes)",
        help="One forward pass of the model at that size, learned position embeddings resampled to its grid.",
        **session.keep("dense_high_on", False),
    ):
        features, picture = selection.dense_features(selection.image_key, selection.image, high)
        read = (features, picture, high_config.grid_size)
    else:
        st.caption(
            f"At {high[0]}x{high[1]} px a pass of this model costs about {passes:.0f} passes at its input"
            " size, so it runs when you ask: switch it on above."
        )
if read is not None:
    features, picture, grid = read
    size = f"{picture.shape[0]}x{picture.shape[1]} px"
    probed = probe.of_the_picture(selection)  # where this picture has labels of its own (the Probe page)
    probe_key = None if probed is None else probed.key
    pca = selection.memo("dense pca", resolution, flip, probe_key, compute=lambda: dense.dense_pca(
        [features], [grid],
        dense.foreground_masks([features], [grid], flip) if probed is None else probe.foreground_masks(probed.probe, [grid]),
    ))
    st.plotly_chart(selection.memo("dense pca figure", resolution, flip, probe_key, compute=lambda: figures.dense_pca_grid(
        [picture], pca.colours, [f"input, {size}"], f"at {size}: 3 whitened components of the foreground, sigmoid(2x)",
    )))
    foreground_source = (
        "the first principal component's side away from the border, median-filtered 3 x 3" if probed is None else
        f"where your probe (the Probe page, on the tokens after {probed.layer} layers) finds '{probed.probe.names[0]}'"
        + ("" if resolution == "input" else ", its probabilities stretched to this grid")
    )
    st.caption(
        f"{grid[0]} x {grid[1]} patches, {int(pca.foreground[0].sum())} of them foreground ({foreground_source}):"
        " the PCA is fitted on those and every patch projected; the background is black."
    )

left, right = st.columns(2)
with left:
    st.subheader("Position embeddings" if added else "Positions")
    if added:
        st.write(
            "Tile (row, col) shows how similar that patch's position embedding is to every other"
            " patch's. Trained models learn the grid on their own: nearby patches, and patches in"
            " the same row or column, get similar embeddings."
            + (" This model rotates its queries and keys by position as well (the Pipeline page draws their angles, step 6)."
               if rotary else "")
        )
        st.plotly_chart(memo(
            (*selection.key[:3], "position similarity"),  # the model at this patch and input size, any image
            lambda: figures.position_similarity_grid(analysis.position_embedding_similarity(selection.model)),
        ))
    elif rotary:
        st.write(
            "This model learned no position embeddings: nothing is added to the tokens. Its positions"
            " are rotations: in every attention layer each patch's query and key are turned by angles"
            " computed from the patch's row and column, so a score sees where two patches are relative"
            " to each other. Nothing is learned and nothing is resampled: at any patch size the angles"
            f" are simply those of the new grid ({grid_h} x {grid_w} here)."
        )
        st.page_link("views/pipeline.py", label="The rotation angles, drawn: Pipeline, step 6", icon=":material/route:")
    else:
        st.write("This model has no position information at all: it sees the patches as a bag, in no order.")
with right:
    st.subheader("Patch embedding filters")
    st.write(
        "The main directions of the linear projection's weights, drawn as image patches: the"
        " basic patterns (colour blobs, edges, gradients) every patch is measured against."
    )
    st.plotly_chart(memo(
        (selection.model_key, selection.patch_size, "embedding filters"),
        lambda: figures.embedding_filters_figure(  # from the model's own kernels: at a large patch size, 5x quicker
            analysis.embedding_filters(models.base_model(selection.model_key), patch_size=selection.patch_size)
        ),
    ))
