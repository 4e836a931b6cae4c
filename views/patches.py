"""Patches: how the image becomes a sequence, and what the embedding layers learned."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.app import costs, models, session
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
# worth, so it runs when asked.
cost = costs.comparison_cost(selection)
rows = costs.compare_patch_sizes(selection, run=costs.is_quick(base, forwards=cost))
if rows is None:
    wait = costs.duration(cost * costs.forward_seconds(selection))
    if st.session_state.get("stop_comparison"):
        st.caption("Stopped: nothing of that comparison was kept.")
    controls = st.empty()  # the buttons go once the comparison is there
    if controls.container().button(
        f"Compare all {len(options)} patch sizes (about {wait})",
        help=f"About {cost:.0f} forward passes of this model at its own patch size.",
    ):
        with controls.container():
            st.button("Stop", key="stop_comparison", help="Stops the comparison; you can start it again.")
        rows = costs.compare_patch_sizes(selection)
        controls.empty()
    else:
        st.caption(
            f"Running this image at all {len(options)} patch sizes costs about {cost:.0f} forward"
            f" passes of this model (the first time, a warm-up pass then up to {costs.TIMED_PASSES}"
            f" timed passes each), about {wait} on this server now, so it runs when you press the button."
        )
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
            (selection.model_key, selection.patch_size, "position similarity"),
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
        lambda: figures.embedding_filters_figure(analysis.embedding_filters(selection.model)),
    ))
