"""Patching: which layer, which token and which head carry the difference between a clean and a
corrupted picture (activation patching: exact, its attribution estimate, and path patching)."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.analysis import AnalysisError
from vit_explorer.text import LabelError
from vit_explorer.analysis.patching import DIRECTIONS, SITES, agreement, ATTRIBUTION_FORWARDS
from vit_explorer.app import costs, images, patching, session, words

selection = session.selection()
config = selection.config
state = st.session_state
depth, heads = config.depth, config.num_heads
grid_h, grid_w = selection.model.grid_size(selection.patch_size)
prefix = config.num_prefix_tokens
DIRECTION_LABELS = {
    "denoising": "denoising: clean into corrupted (is this enough to bring the answer back?)",
    "noising": "noising: corrupted into clean (is this needed for the answer?)",
}
KINDS = {"paint": "this picture with a region painted", "picture": "another picture"}

st.title("Patching")
st.write(
    "Run the model on a clean and a corrupted picture, copy one activation of one run into the other,"
    " and measure how much of the difference between their answers comes back: 0 is the corrupted run, 1"
    " the clean one. Where a single token, layer or head brings it all back, that is where the model holds"
    " what tells the two pictures apart. The shared model is never changed: each patched run sets its patch"
    " for its own pass."
)

problem = patching.size_problem(config)
if problem:
    st.error(problem)
    st.stop()
kind = st.radio(
    "Corrupted picture", list(KINDS), format_func=KINDS.get, horizontal=True,
    help="The clean picture is the sidebar's; the corrupted one differs where you say.",
    **session.keep("patching_kind", "paint", lambda value: value in KINDS),
)
if kind == "paint":
    rows_column, columns_column = st.columns(2)
    rows = rows_column.slider(
        "Painted patch rows", 0, grid_h, help="The rows of the patch grid painted in the mean colour.",
        **session.keep("patching_rows", (grid_h // 4, max(grid_h // 4 + 1, 3 * grid_h // 4)),
                       lambda value: 0 <= value[0] < value[1] <= grid_h),
    )
    columns = columns_column.slider(
        "Painted patch columns", 0, grid_w, help="The columns of the patch grid painted in the mean colour.",
        **session.keep("patching_columns", (grid_w // 4, max(grid_w // 4 + 1, 3 * grid_w // 4)),
                       lambda value: 0 <= value[0] < value[1] <= grid_w),
    )
    corruption = patching.Corruption(cells=(rows[0], rows[1], columns[0], columns[1]))
else:
    options = {**images.sample_image_options(config.img_size), **images.uploaded_image_options()}
    others = [key for key in options if key != selection.image_key.partition("@")[0]]
    corrupted_key = st.selectbox(
        "The corrupted picture", others, format_func=options.get,
        help="Any other picture: a bundled one, or one you uploaded in the sidebar.",
        **session.keep("patching_picture", others[0], lambda value: value in others),
    )
    corruption = patching.Corruption(image_key=corrupted_key)

try:
    corrupted_x, size_note = patching.corrupted_input(selection, corruption)
    runs = patching.runs(selection, corruption)
except AnalysisError as problem:
    st.error(str(problem))
    st.stop()
if size_note:
    st.info(size_note)
clean_column, corrupted_column = st.columns(2)
clean_column.image(selection.display_image(), caption="clean", width="stretch")
corrupted_column.image(analysis.display_image(corrupted_x, config), caption="corrupted", width="stretch")

names = selection.class_names()
if config.num_classes:
    clean_top, corrupted_top = (int(output.argmax()) for output in runs.outputs)
    second = int(runs.outputs[0].topk(2).indices[1]) if config.num_classes > 1 else clean_top
    # Kept per pair of answers: another corrupted picture's answer starts the metric again from it.
    answers = f"{clean_top}-{corrupted_top}"
    a_column, b_column = st.columns(2)
    a = a_column.selectbox(
        "Metric: the logit of", range(config.num_classes), format_func=lambda index: names[index],
        help="The class the clean picture should win (default: the clean run's prediction).",
        **session.keep(f"patching_class_a:{answers}", clean_top, lambda value: 0 <= value < config.num_classes),
    )
    b = b_column.selectbox(
        "minus the logit of", range(config.num_classes), format_func=lambda index: names[index],
        help="The class it is told apart from (default: the corrupted run's prediction).",
        **session.keep(f"patching_class_b:{answers}", corrupted_top if corrupted_top != clean_top else second,
                       lambda value: 0 <= value < config.num_classes),
    )
    spec = ("classes", a, b)
elif words.words_model(selection.model_key) is not None:
    a_column, b_column = st.columns(2)
    first = a_column.text_input(
        "Metric: the score of", help="A label the clean picture should match better (read as 'a photo of ...').",
        **session.keep("patching_word_a", "a cat"),
    ).strip()
    second = b_column.text_input(
        "minus the score of", help="The label it is told apart from.", **session.keep("patching_word_b", "a dog"),
    ).strip()
    if not first or not second or first == second:
        st.error("Type two different labels: the metric is the first one's score minus the second's.")
        st.stop()
    spec = ("words", first, second)
else:
    st.caption(
        "This model has no classification head: the metric is the cosine of the pooled feature to the clean"
        " picture's."
    )
    spec = ("cosine",)
direction = st.radio(
    "Direction", DIRECTIONS, format_func=DIRECTION_LABELS.get, horizontal=True,
    help="Denoising finds what is sufficient, noising what is necessary; they can disagree (backup heads).",
    **session.keep("patching_direction", "denoising", lambda value: value in DIRECTIONS),
)
try:
    metric = patching.metric(selection, spec, runs)
    runs.normaliser(metric)
except (AnalysisError, LabelError) as problem:
    st.error(str(problem))
    st.stop()
st.caption(f"Metric: the {metric.name}, normalised so that 0 is the corrupted run and 1 the clean one.")

token_names = [f"prefix {index}" for index in range(prefix)] + [str(index) for index in range(grid_h * grid_w)]
if config.class_token:
    token_names[0] = "class"
CELL_NAMES = {site: ("head", [str(h) for h in range(heads)]) if site == "head" else ("token", token_names) for site in SITES}


def heat_map(values, site: str, how: str, chart_key: str):
    cell, cell_labels = CELL_NAMES[site]
    st.plotly_chart(
        selection.memo("patching heat map", corruption.identity, spec, direction, site, how, compute=lambda: (
            figures.patching_heatmap(values, cell, f"{how}: {SITES[site]} per layer x {cell} ({direction})", cell_labels)
        )),
        key=chart_key, on_select=session.cell_picked(chart_key, "patching_layer", "patching_cell"),
        selection_mode="points", config={"displayModeBar": False},
    )


st.subheader("Attribution patching: every cell at once")
st.write(
    f"The gradient's estimate (Nanda 2023): (source - patched) . d metric / d activation, from one forward"
    f" and one backward of the patched run, about {ATTRIBUTION_FORWARDS:.0f} passes of the model for every layer,"
    " token and head. It is exact for a straight line and can miss where the model saturates."
)
estimates = patching.attribution(selection, corruption, spec, direction)
site = st.radio(
    "Site", list(SITES), format_func=SITES.get, horizontal=True,
    help="Residual stream: the tokens entering each layer; attention and MLP outputs: what each layer's"
    " branches write, per token; head output: each head's output at every token.",
    **session.keep("patching_site", "resid", lambda value: value in SITES),
)
if estimates is not None:
    heat_map(estimates[site], site, "Attribution", "patching_attribution_click")

st.subheader("Exact patching: each cell its own pass")
forwards = patching.exact_forwards(selection, corruption, site)
seconds = costs.pass_times().seconds(config)
st.write(
    f"Each cell of the {SITES[site]} patched alone, its pass run from the patched layer on (the layers below are"
    f" the cached runs'), in batches: about {forwards:.0f} passes of this model rather than"
    f" {depth * len(CELL_NAMES[site][1]) + 2}" + ("" if seconds is None else f", about {costs.duration(forwards * seconds)}")
    + "; cells where the two runs agree need none."
)
exact = patching.exact(selection, corruption, spec, site, direction)
if exact is not None:
    heat_map(exact, site, "Exact", "patching_exact_click")
    if estimates is not None:
        correlation = agreement(exact, estimates[site])
        st.write(
            f"Attribution patching and exact patching of the {SITES[site]} correlate at {correlation:.2f} over its"
            f" {exact.numel()} cells: " + (
                "the estimate ranks the cells as exact patching does." if correlation >= 0.9 else
                "the estimate misses some of them; trust the exact map where the two disagree (points off the diagonal)."
            )
        )
        st.plotly_chart(selection.memo("patching agreement", corruption.identity, spec, direction, site, compute=lambda: (
            figures.patching_agreement(exact, estimates[site], SITES[site], correlation)
        )))

if site == "resid" and (exact is not None or estimates is not None):
    how, values = ("Exact", exact) if exact is not None else ("Attribution", estimates["resid"])
    shown = st.slider(
        "Layer on the picture", 0, depth - 1, help="The residual stream entering this layer, on the patch grid.",
        **session.keep("patching_grid_layer", 0, lambda value: 0 <= value < depth),
    )
    st.plotly_chart(selection.memo("patching grid", corruption.identity, spec, direction, how, shown, compute=lambda: (
        figures.token_values_on_grid(
            selection.display_image(), values[shown], (grid_h, grid_w), prefix, token_names[:prefix],
            title=f"{how}: residual stream entering layer {shown}, on the picture", value_name="restored", centred=True,
        )
    )))

st.subheader("The patched run of one cell")
cells = len(CELL_NAMES[site][1])
layer_column, cell_column = st.columns(2)
layer = layer_column.number_input(
    "Layer", 0, depth - 1, help="The layer patched; click a heat map's cell to choose it.",
    **session.keep("patching_layer", 0, lambda value: 0 <= value < depth),
)
cell = cell_column.number_input(
    CELL_NAMES[site][0].capitalize(), 0, cells - 1, help="The token or head patched; click a heat map's cell.",
    **session.keep("patching_cell", 0, lambda value: 0 <= value < cells),
)
captured = patching.patched_capture(selection, corruption, site, int(layer), int(cell), direction)
what = f"layer {layer} {CELL_NAMES[site][0]} {CELL_NAMES[site][1][int(cell)]} ({SITES[site]}) patched"
if config.num_classes:
    st.plotly_chart(selection.memo("patched top-k", corruption.identity, site, layer, cell, direction, compute=lambda: (
        figures.patched_topk(*(output.softmax(-1) for output in (runs.outputs[0], runs.outputs[1], captured.logits[0])), names, what=what)
    )))
score = float(runs.normaliser(metric)(metric.score(captured.logits.to(runs.outputs.dtype)))[0])
st.metric(f"Restored with {what}", f"{score:.3f}")
query = "class token" if config.class_token else "mean over the patch queries"
st.plotly_chart(selection.memo("patched attention", corruption.identity, site, layer, cell, direction, compute=lambda: (
    figures.attention_overlay(
        selection.display_image(),
        analysis.query_map(captured.attentions[0, -1].float().mean(0), captured.grid_size, prefix, class_token=config.class_token),
        title=f"With {what}: the last layer's attention of the {query}, mean of the heads", weights=True,
    )
)))

st.subheader("Path patching: one head through one path")
head_map = exact if exact is not None and site == "head" else (estimates or {}).get("head")
if head_map is None:
    st.info("Path patching starts from the head the head-output map picks: compute that map first.")
else:
    untouched = 0.0 if direction == "denoising" else 1.0  # a head that does nothing scores this
    picked = int((head_map - untouched).abs().argmax())
    sender = (picked // heads, picked % heads)
    later = [(receiving_layer, receiving) for receiving_layer in range(sender[0] + 1, depth) for receiving in range(heads)]
    receivers = [None, *later]
    receiver = st.selectbox(  # a pass of its own: run when a path is chosen
        f"Head {sender[1]} of layer {sender[0]} (the largest on the head map) reaches the output through",
        range(len(receivers)), index=None, placeholder="choose a path",
        format_func=lambda index: "the MLPs only" if receivers[index] is None else f"head {receivers[index][1]} of layer {receivers[index][0]} only",
        help="Only that path gets the patched head's change; the residual stream and every other component keep the patched run's.",
        key=f"patching_receiver_{sender}",
    )
    if receiver is not None:
        value = patching.path(selection, corruption, spec, sender, receivers[receiver], direction)
        st.metric("Restored through that path alone", f"{value:.3f}")
