"""Compare: two models side by side on one image, layer for layer at the same relative depth."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.app import costs, jobs, models, session, words
from vit_explorer.app.selection import Selection, prediction_caveats

selection = session.selection()  # model A: the sidebar's
state = st.session_state
model_labels = models.model_options()
native = selection.base_model.config
patch_options = models.patch_size_options(native)
b_options = {session.SAME_MODEL: "The sidebar's model at another patch size", **model_labels}
CLASS_QUERY, POINT_QUERY = "class token", "image point"

st.title("Compare")
st.write(
    "Model A is the sidebar's model; choose model B here. Both read the same picture, each resized"
    " and normalised its own way, and every view below shows A on the left and B on the right."
)
model_column, patch_column = st.columns(2)
b_key = model_column.selectbox(
    "Model B", list(b_options), format_func=b_options.get,
    help="Any model the sidebar offers, or the sidebar's model again at another patch size.",
    **session.keep("compare_model", session.SAME_MODEL, lambda key: key in b_options),
)
b_patch = None
if b_key == session.SAME_MODEL:
    b_patch = patch_column.select_slider(
        "B's patch size", options=patch_options, format_func=lambda patch: f"{patch} px",
        help="The same weights, their patch and position embeddings resampled to this patch size (FlexiViT).",
        **session.keep("compare_patch", session.other_patch_size(patch_options, selection.patch_size),
                  lambda patch: patch in patch_options),
    )

pending = models.undownloaded_entry(b_key)
if pending is not None:
    name, entry = pending
    st.info(
        f"{entry.title} is not on this server yet: it downloads once ({entry.size_bytes / 1e6:.0f} MB)"
        f" and then serves everybody ({models.memory_note(name)}). Its weights' licence: {entry.licence}."
    )
    accepting = " and accept its licence" if entry.terms_to_accept else ""
    if not st.button(f"Download {entry.title}{accepting}", help="Fetch the model from its publisher, under a progress bar."):
        st.stop()
try:
    if pending is not None:
        models.download_with_progress(pending[0])
    if b_patch is None:
        other = session.compared_selection(b_key)
    else:
        other = session.compared_selection(selection.model_key, b_patch, selection.config.img_size)
except (ValueError, OSError) as error:
    st.error(f"Could not load model B, model A stays as it is: {error}")
    st.stop()
if other.key == selection.key:
    st.info("Model B is model A itself: choose another model or another patch size.")
    st.stop()

cost = costs.selections_forwards(selection, other)
if costs.is_heavy(selection.config, forwards=cost):
    st.write(
        f"A's and B's views here cost about {cost:.1f} forward passes of A: B runs when you ask, beside the"
        " server, so that the pages stay quick for everybody, and then serves everyone who compares the same."
    )
    # The layer drawn first: A's last meets B's last.
    if jobs.views(other, other.config.depth - 1, "Run model B") is None:
        st.stop()
sides = {"A": selection, "B": other}
results = {side: chosen.capture() for side, chosen in sides.items()}
images = {side: chosen.display_image() for side, chosen in sides.items()}


def label(chosen: Selection) -> str:
    name = model_labels.get(chosen.model_key, chosen.model_key).split(" (")[0]
    own_patch = models.base_model(chosen.model_key).config.patch_size
    return name + (f" at patch {chosen.patch_size}" if chosen.patch_size != own_patch else "")


for column, (side, chosen) in zip(st.columns(2), sides.items()):
    column.subheader(f"{side}: {label(chosen)}")
    column.caption(f"{models.describe(chosen.config)}.")

st.subheader("Predictions")
waiting = set()  # models whose ImageNet class embeddings are being computed: their button is drawn once
for column, (side, chosen) in zip(st.columns(2), sides.items()):
    with column:
        if chosen.config.num_classes == 0 and words.words_model(chosen.model_key) is not None:
            said = None if chosen.model_key in waiting else words.prediction(chosen)
            if said is None:
                waiting.add(chosen.model_key)
                continue
            for caveat in words.caveats(chosen, said):
                st.warning(caveat)
            labels_id = words.labels_id(words.session_labels())
            st.plotly_chart(chosen.memo("compare words top-5", side, labels_id, compute=lambda: figures.side_topk(
                said.scores, said.labels, side,
            )), key=f"compare_top5_{side}")
            st.caption(words.about(chosen.model_key))
            continue
        if chosen.config.num_classes == 0:
            st.info(models.NO_CLASSIFIER.format(what=f"{side}'s prediction"))
            continue
        probabilities = results[side].logits[0].softmax(dim=-1)
        for caveat in prediction_caveats(chosen, probabilities):
            st.warning(caveat)
        st.plotly_chart(chosen.memo("compare top-5", side, compute=lambda: figures.side_topk(
            probabilities, chosen.class_names(), side,
        )), key=f"compare_top5_{side}")

st.subheader("Attention at the same relative depth")
depths = {side: chosen.config.depth for side, chosen in sides.items()}
st.write(
    f"A has {depths['A']} layers and B {depths['B']}: layer l of A is shown beside layer"
    " round(l x (B's depth - 1) / (A's depth - 1)) of B, so that first meets first and last meets last."
)
layer_column, query_column = st.columns(2)
layer = layer_column.slider(
    "A's layer", 0, depths["A"] - 1, help="B shows its layer at the same relative depth.",
    **session.keep("compare_layer", depths["A"] - 1, lambda layer: 0 <= layer < depths["A"]),
)
layers = {"A": layer, "B": analysis.matching_layer(layer, depths["A"], depths["B"])}
layer_column.caption(f"B's matching layer: {layers['B']} (of 0..{depths['B'] - 1}).")
query_kind = query_column.radio(
    "Query", (CLASS_QUERY, POINT_QUERY), horizontal=True,
    help="Whose attention to show: the class token's (for a model without one, the mean over its"
    " patches), or that of the patch under one point of the picture in each model's own grid.",
    **session.keep("compare_query", CLASS_QUERY, lambda kind: kind in (CLASS_QUERY, POINT_QUERY)),
)


def place_point(side: str, grid_size: tuple[int, int]) -> None:
    """A click on one side's picker puts the point at the centre of the clicked patch."""
    points = state[f"compare_picker_{side}"].selection.points
    if points:
        down, across = analysis.patch_point(int(points[0]["point_index"]), grid_size)
        session.set_kept("compare_down", round(100 * down, 1))
        session.set_kept("compare_across", round(100 * across, 1))


query_patches = {side: None for side in sides}
if query_kind == POINT_QUERY:
    across_column, down_column = st.columns(2)
    across = across_column.slider(
        "Point across (% of the width)", 0.0, 100.0, step=0.1, format="%.1f",
        help="From the left edge; or click a picture below.",
        **session.keep("compare_across", 50.0),
    )
    down = down_column.slider(
        "Point down (% of the height)", 0.0, 100.0, step=0.1, format="%.1f",
        help="From the top edge; or click a picture below.",
        **session.keep("compare_down", 50.0),
    )
    st.caption("The same point falls in a different patch of each grid: each model's patch under it is outlined.")
    for column, side in zip(st.columns(2), sides):
        grid = results[side].grid_size
        query_patches[side] = analysis.point_patch((down / 100, across / 100), grid)
        column.plotly_chart(sides[side].memo(
            "compare picker", side, query_patches[side],
            compute=lambda: figures.side_point_picker(images[side], grid, query_patches[side], side),
        ), key=f"compare_picker_{side}", on_select=lambda side=side, grid=grid: place_point(side, grid),
            selection_mode="points", config={"displayModeBar": False})


def query_text(side: str) -> str:
    patch = query_patches[side]
    if patch is not None:
        row, col = divmod(patch, results[side].grid_size[1])
        return f"patch under the point (row {row}, col {col})"
    return "class token" if sides[side].config.class_token else "mean of the patch queries (no class token)"


for column, (side, chosen) in zip(st.columns(2), sides.items()):
    result, patch, own_layer = results[side], query_patches[side], layers[side]
    # The Attention page's keys, so that either page reuses what the other computed.
    evenness = chosen.memo("attention evenness", own_layer, compute=lambda: analysis.attention_evenness(
        chosen.attention(own_layer)
    ))
    if analysis.near_uniform(evenness):
        column.info(
            f"{side}'s heads spread their attention almost evenly here (mean entropy {evenness:.0%} of the"
            " uniform log N), as an untrained model's do: the differences in its maps are noise."
        )
    maps = chosen.memo("head maps", own_layer, -1 if patch is None else patch, compute=lambda: analysis.query_map(
        chosen.attention(own_layer), result.grid_size, result.num_prefix_tokens, patch, class_token=chosen.config.class_token,
    ))  # (H, gh, gw)
    column.plotly_chart(chosen.memo("compare heads", side, own_layer, patch, compute=lambda: figures.side_heads_grid(
        images[side], maps, side, f"layer {own_layer} (of {depths[side]})", query_text(side), patch,
        columns=2 if len(maps) <= 4 else 3,  # half a page: head titles side by side must not overlap
    )), key=f"compare_heads_{side}")

st.subheader("Rollout through all layers")
st.write(
    "Each model's attention multiplied through all its layers, the residual connection counted in"
    " (heads averaged): how much each input patch reaches the query at the end."
)
for column, (side, chosen) in zip(st.columns(2), sides.items()):
    result, patch = results[side], query_patches[side]
    prefix = result.num_prefix_tokens
    rollout = chosen.rollout()  # (1, N, N); the Attention page's at its default settings
    column.plotly_chart(chosen.memo("compare rollout", side, patch, compute=lambda: figures.attention_overlay(
        images[side], analysis.query_map(rollout[0], result.grid_size, prefix, patch, class_token=chosen.config.class_token),
        title=f"{side}: rollout through all {depths[side]} layers<br>query: {query_text(side)}", value_name="rollout",
        query_patch=patch, weights=True,
    )), key=f"compare_rollout_{side}")

st.subheader("Token PCA at the same relative depth")
st.write(
    "Each model's patch tokens after the matched layers, projected on their own three main"
    " directions and read as red, green and blue: patches of one colour are ones the model treats"
    " alike. Colours are fitted per model, so compare which patches group together, not the hues."
)
for column, (side, chosen) in zip(st.columns(2), sides.items()):
    result, own_layer = results[side], layers[side]
    tokens = result.tokens[0, own_layer + 1, result.num_prefix_tokens:]  # (gh*gw, D) output of the layer
    column.plotly_chart(chosen.memo("compare pca", side, own_layer, compute=lambda: figures.side_token_pca(
        analysis.token_pca(tokens, result.grid_size), images[side], side,
        f"after layer {own_layer} (of {depths[side]})",
    )), key=f"compare_pca_{side}")
