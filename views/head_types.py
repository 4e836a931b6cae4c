"""Head types: what kind each head of the model is, read over several pictures (local, global,
positional, a sink on the prefix tokens or on high-norm patches, or following the content), with
the rules beside the grid, and a clicked head's maps on every picture."""
import streamlit as st

from vit_explorer import figures
from vit_explorer.analysis import head_types
from vit_explorer.app import costs, images, jobs, session, words
from vit_explorer.app.selection import ImageSet
from vit_explorer.text import heads as head_words
from vit_explorer.text.descriptions import DESCRIPTIONS

selection = session.selection()
config = selection.config
state = st.session_state
depth, heads = config.depth, config.num_heads
grid_h, grid_w = config.grid_size

options = images.sample_image_options(config.img_size)
options.update(images.uploaded_image_options())
photos = images.photo_keys()
SOURCES = {"photos": f"the {len(photos)} bundled photos", "set": "the Several images page's pictures"}
# The measures in the grid's hover, by field, with their units.
SHOWN = {
    "distance": "distance (px)", "reach": "reach", "entropy": "entropy (nats)", "evenness": "evenness",
    "prefix_share": "prefix share", "outlier_share": "outlier share", "consistency": "consistency",
}
CLASS_QUERY = -1  # the class token, or without one the mean of the patch queries

st.title("Head types")
st.write(
    "What a head does on one picture says little about what kind of head it is. Read over several"
    " pictures, each head of each layer gets five measures, and from them a plain label by the rules"
    " beside the grid: local or global heads (the ViT paper's attention distance), positional heads,"
    " whose pattern stays the same whatever the picture, sinks that park attention on the class"
    " token and registers or on a few high-norm patches (the artefacts registers absorb), and heads"
    " that follow the content. Click a head to see its maps on every picture."
)
source = st.radio(
    "Images", list(SOURCES), format_func=SOURCES.get, horizontal=True,
    help="The photos shipped with the app, or the pictures chosen on the Several images page (two to six).",
    **session.keep("types_images", "photos", lambda value: value in SOURCES),
)
if source == "photos":
    keys = photos
else:
    keys = session.kept("image_set", images.default_set(state["image_key"], options), lambda chosen: all(
        key in options for key in chosen
    ))
try:
    image_set = ImageSet.of(selection, keys)
except ValueError as error:
    st.info(str(error))
    st.stop()
count = len(image_set.image_keys)
labels = [f"{index + 1}. {options[key].split(': ')[-1]}" for index, key in enumerate(keys)]

types = image_set.cached_head_types()
cost = costs.set_head_types_forwards(image_set)
if types is None and costs.is_heavy(config, forwards=cost):
    st.write(
        f"Measuring every head over these {count} pictures costs about {cost:.0f} forward passes of this model"
        " (one per picture no page has read, then every layer's attention again, measured). It runs when you ask,"
        " beside the server, so that the pages stay quick for everybody, and then serves everyone."
    )
    types = jobs.head_types(image_set, "Measure the heads")
    if types is None:
        st.stop()
if types is None:
    types = image_set.head_types()

layer_widget = session.keep("types_layer", 0, lambda layer: 0 <= layer < depth)
head_widget = session.keep("types_head", 0, lambda head: 0 <= head < heads)
chosen = (state["types_layer"], state["types_head"])
counts = ", ".join(f"{number} {label}" for label, number in types.counts().items() if number)
grid_column, rules_column = st.columns([3, 2])
with grid_column:
    st.plotly_chart(
        image_set.memo("head types figure", chosen, compute=lambda: figures.head_types_grid(
            types.labels, {shown: getattr(types, name) for name, shown in SHOWN.items()}, head_types.LABELS,
            title=f"Every head's type over {count} pictures: {counts}", chosen=chosen,
        )),
        key="types_click", on_select=session.cell_picked("types_click", "types_layer", "types_head"),
        selection_mode="points", config={"displayModeBar": False},
    )
    with st.expander("What each measure is", expanded=True):
        st.markdown("\n".join(f"- **{name}**: {text}." for name, text in types.definitions.items()))
with rules_column:
    st.markdown("**Labels**: each head takes the first rule that holds, in this order.")
    st.markdown("\n".join(
        f"{position}. **{label}**: {rule}." for position, (label, rule) in enumerate(types.rules.items(), start=1)
    ))
found = ", ".join(f"{number}" for number in types.outlier_counts.tolist())
st.caption(
    f"High-norm patches found among the {count} pictures' {count * grid_h * grid_w} patches entering each layer,"
    f" from layer 0: {found}. Outlier sinks need such patches: large models trained long (DINOv2 without"
    " registers, CLIP) grow them, small and random models do not. Where a network is there, try CLIP ViT-B/16 from"
    " the catalogue; the catalogue's DINOv2 has registers, which take that job, so look for prefix sinks there."
)

st.subheader("One head on every picture")
queries = [CLASS_QUERY, *range(grid_h * grid_w)]
centre = (grid_h // 2) * grid_w + grid_w // 2


def query_label(query: int) -> str:
    if query == CLASS_QUERY:
        return "class token" if config.class_token else "mean over the patch queries"
    return f"patch {query} (row {query // grid_w}, col {query % grid_w})"


layer_column, head_column, query_column = st.columns(3)
layer = layer_column.selectbox(
    "Layer", list(range(depth)), help="The head's layer; clicking a cell of the grid chooses it too.", **layer_widget,
)
head = head_column.selectbox(
    "Head", list(range(heads)), help="The head whose maps are drawn; clicking a cell of the grid chooses it too.",
    **head_widget,
)
query = query_column.selectbox(
    "Query", queries, format_func=query_label,
    help="Whose attention the maps show: a patch (the measures are over the patch queries) or the class token.",
    **session.keep("types_query", centre, lambda value: value in queries),
)
query_patch = None if query == CLASS_QUERY else query
maps = image_set.head_maps(layer, head, query_patch)
display = image_set.display_images()
st.plotly_chart(image_set.memo("head maps figure", layer, head, query, compute=lambda: figures.head_maps_grid(
    display, maps, labels, f"Layer {layer}, head {head} ({types.labels[layer][head]}): attention of the"
    f" {query_label(query)} on each picture, one colour scale",
    query_patch=query_patch,
)))
row = types.rows()[layer * heads + head]
numbers = "; ".join(
    f"{SHOWN[name]} {'n/a' if row[column] is None else f'{row[column]:.3g}'}" for name, column in head_types.MEASURES
)
st.caption(
    f"Layer {layer}, head {head} is **{types.labels[layer][head]}**: {numbers}. Attention on the prefix tokens"
    " (class token, registers) is not on the maps, which show the patches only."
)

described_model = words.words_model(selection.model_key)
if described_model is not None:
    st.subheader("Heads in words")
    st.write(
        f"What each head of the last {head_words.LAST_LAYERS} layers writes into the image embedding, described"
        f" by the texts it varies along over these {count} pictures (TextSpan, Gandelsman et al. 2024): the"
        f" description along which its writes vary most is chosen, that direction is taken out, and again;"
        f" the share says how much of the head's variation each explains. The descriptions come from a pool"
        f" of {len(DESCRIPTIONS)} short phrases shipped with the app. More pictures make the descriptions"
        " steadier: with a handful they are a hint, not a finding."
    )
    problem = head_words.describable(described_model)
    if problem is not None:
        st.info(problem)
    elif st.toggle("Describe the heads in words", key="types_words"):
        described_layers, descriptions = words.head_descriptions(image_set)
        st.dataframe(
            [
                {"layer": layer, "head": head, **{
                    f"description {rank + 1}": f"{text} ({share:.0%})" for rank, (text, share) in
                    enumerate(descriptions[position * heads + head])
                }}
                for position, layer in enumerate(described_layers) for head in range(heads)
            ],
            hide_index=True,
        )
