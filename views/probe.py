"""Probe: click patches of one image or several as "object" and "background" (or labels of your
own); a logistic regression on one layer's tokens segments every image of the set at once, with
its held-out accuracy, and the same labels on every layer say which layer knows them best."""
import streamlit as st

from vit_explorer import figures
from vit_explorer.analysis import AnalysisError
from vit_explorer.app import images, jobs, probe, session

selection = session.selection()
config = selection.config
state = st.session_state
depth, grid_size = config.depth, config.grid_size

options = images.sample_image_options(config.img_size)
options.update(images.uploaded_image_options())

st.title("Probe")
st.write(
    "Does the model know where the object is? Click a few patches of the object and a few of the background (or"
    " up to four labels of your own), in one picture or several. A logistic regression reads one layer's token of"
    " each clicked patch and learns to tell your labels apart; then it labels every patch of every picture, and"
    " a few of your clicks, held out of its fit, say how often it is right. DINOv3's authors find the foreground"
    " this way, from a few labelled images."
)
chosen = st.multiselect(
    "Images", list(options), format_func=options.get,
    help="One to six of the sidebar's pictures (the Several images page reads the same set).",
    **session.keep("image_set", images.default_set(state["image_key"], options), lambda keys: all(key in options for key in keys)),
)
try:
    image_set = probe.probe_set(selection, chosen)
except ValueError as error:
    st.info(str(error))
    st.stop()
if not jobs.read_set(image_set):  # in the server where light, else a job
    st.stop()
display = image_set.display_images()
count = len(image_set.image_keys)
titles = [f"{index + 1}. {options[key].split(': ')[-1]}" for index, key in enumerate(chosen)]

typed = st.text_input(
    "Labels (comma-separated, two to four; the first is the foreground)",
    help="Renaming a label keeps its patches aside until the name is back.",
    **session.keep("probe_names_text", ", ".join(probe.names())),
)
try:
    probe.set_names(probe.read_names(typed))
except ValueError as error:
    st.warning(f"{error} The labels stay {', '.join(probe.names())}.")
label_names = probe.names()

controls, picker = st.columns([1, 2])
with controls:
    shown = st.selectbox(
        "Picture to click", list(range(count)), format_func=lambda index: titles[index],
        **session.keep("probe_image", 0, lambda index: 0 <= index < count),
    )
    label = st.radio(
        "A click labels a patch", label_names, help="Click a labelled patch again with its own label to unlabel it.",
        **session.keep("probe_label", label_names[0], lambda name: name in label_names),
    )
    image_key = image_set.image_keys[shown]
    st.button("Clear this picture's labels", on_click=probe.clear, args=(grid_size, image_key), icon=":material/ink_eraser:")
    st.button("Clear every label", on_click=probe.clear, args=(grid_size,), icon=":material/delete:")
labels = probe.labels_for(image_set, label_names)
pairs = probe.per_image(labels, image_set, label_names)
with picker:
    chart_key = probe.click_key()
    st.plotly_chart(
        figures.probe_picker(display[shown], grid_size, pairs[shown], label_names, label_names.index(label),
                             title=f"{titles[shown]}: click patches to label them '{label}'"),
        key=chart_key, on_select=probe.clicked(chart_key, image_key, grid_size, label), selection_mode="points",
        config={"displayModeBar": False},
    )
for sentence in labels.aside:
    st.info(sentence)
st.caption(f"Labelled: {probe.counts(labels, label_names)}, over the {count} picture{'s' if count > 1 else ''}.")

try:
    curve = probe.layers(image_set, labels, label_names)
    curve_problem = None
except AnalysisError as error:
    curve, curve_problem = None, str(error)
if session.kept_key(probe.LAYER) not in state:  # until the person picks a layer, the best one
    state.pop(probe.LAYER, None)
layer = st.slider(
    "Tokens after this many layers", 0, depth,
    help="The layer whose tokens the probe reads (0: the patch embeddings with their positions). Until you pick"
    " one, the layer where the probe does best.",
    **session.keep(probe.LAYER, depth if curve is None else curve.best, lambda value: 0 <= value <= depth),
)
try:
    fitted = probe.fit(image_set, labels, label_names, layer)
except AnalysisError as error:
    st.warning(f"{error} Your labels are kept.")
    st.stop()
st.plotly_chart(image_set.memo("probe figure", layer, labels.digest, label_names, compute=lambda: (
    figures.probe_segmentation_grid(
        display, fitted.segmentation, label_names, titles,
        f"The probe on the tokens after {layer} layers: every patch of {'every picture' if count > 1 else 'the picture'}"
        " labelled (your clicks outlined)", pairs,
    )
)))
if fitted.accuracy is None:
    st.write(fitted.method)
else:
    st.write(f"Held-out accuracy after {layer} layers: **{fitted.accuracy:.0%}** of {fitted.held_out} patches. {fitted.method}")
if curve is None:
    st.caption(curve_problem)
else:
    st.plotly_chart(image_set.memo("probe layers figure", labels.digest, label_names, layer, compute=lambda: (
        figures.probe_layers_figure(curve.layers, curve.accuracies, layer)
    )))
    best = curve.accuracies[curve.layers.index(curve.best)]
    st.caption(
        f"The probe does best on the tokens after {curve.best} layers ({best:.0%}). The same held-out split at every"
        " layer; no forward pass: the tokens are those the set was read with."
    )
st.caption(
    f"The Several images page's DINOv3-style PCA of these pictures takes its foreground from this probe"
    f" ('{label_names[0]}') instead of the side of the first component away from the borders."
)
