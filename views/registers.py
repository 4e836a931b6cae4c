"""Registers at test time: this image's high-norm outlier tokens, the MLP units that write them,
and the model run again with one extra token that takes their activations (Jiang et al. 2025),
before and after side by side."""
import streamlit as st
import torch

from vit_explorer import analysis, figures
from vit_explorer.analysis import image_set as sets
from vit_explorer.analysis import test_time_registers as registers
from vit_explorer.app import costs, jobs, models, session
from vit_explorer.model.capture import layer_attentions

selection = session.selection()
config = selection.config
image = selection.display_image()
depth = config.depth

st.title("Registers at test time")
st.write(
    "Large ViTs trained long (DINOv2, CLIP, DeiT III) reuse a few low-information patches, plain"
    " background mostly, as scratch space: their tokens get norms far above the rest and draw much of"
    " the attention, which spoils the attention maps. Darcet et al. (2023) retrained models with extra"
    " \"register\" tokens to take that job. Jiang et al. (2025, \"Vision Transformers Don't Need Trained"
    " Registers\") found that a few MLP units, the register neurons, write those outliers, and that"
    " moving their activation into one extra token appended at test time, untrained and zero, takes the"
    " outliers out of the image with no training at all. Here with their recipe, on this image; the"
    " shared model is never changed."
)
st.caption(
    "A random or small model has no real outliers: the rule below may still flag a few patches a little"
    " above the rest (as on the shipped shapes model), and moving the units found for them changes little."
    " The case to try is a large model that has them: CLIP ViT-B/16 (OpenAI) or DeiT III-S from the"
    " catalogue in the sidebar when a network is there, or a DINOv2 without registers uploaded as a"
    " checkpoint (timm's vit_small_patch14_dinov2.lvd142m); DINOv2 with registers has none left to move."
)

intact = selection.capture()
prefix = intact.num_prefix_tokens
grid_h, grid_w = intact.grid_size

st.subheader("This image's outlier tokens")
st.write(
    "A patch is an outlier when its token's norm after the chosen layer exceeds the median norm of"
    " the image's patches plus k median absolute deviations (the rule of the Several images page)."
    " Jiang et al. look after the last layer (CLIP) or the one before (DINOv2), above a norm fixed per model."
)
layer_column, k_column = st.columns(2)
found_after = layer_column.slider(
    "Find the outliers after layer", 0, depth - 1,
    help="The layer whose output tokens' norms pick the outliers: late layers, where they have grown.",
    **session.keep("registers_layer", depth - 1, lambda layer: 0 <= layer < depth),
)
k = k_column.slider(
    "k (MADs above the median)", 1.0, 20.0, step=0.5,
    help="How far above the median norm, in median absolute deviations, a patch must lie to count as an outlier.",
    **session.keep("registers_mad_k", 6.0),
)
outliers = selection.memo(
    "register outliers", found_after, k, compute=lambda: sets.norm_outliers(intact.tokens[:, found_after + 1, prefix:], k),
)
rule = f"median {outliers.median:.3g} + {k:g} x MAD {outliers.mad:.3g}"
st.plotly_chart(selection.memo("register outliers grid", found_after, k, compute=lambda: figures.norm_outliers_grid(
    outliers.norms.reshape(1, grid_h, grid_w), outliers.outliers.reshape(1, grid_h, grid_w), outliers.threshold, rule,
    ["this image"], image.shape, found_after,
)))
count = int(outliers.outliers.sum())
if count == 0:
    st.info(
        f"No patch token stands out after layer {found_after} (none above {outliers.threshold:.3g}): there are no"
        " outliers here for register neurons to have written, so nothing to move. Lower k or pick another layer,"
        " or try a model that has them (above)."
    )
    st.stop()

st.subheader("The register neurons")
photos = len(selection.with_photos())
SOURCES = {False: "this image", True: f"this image and the bundled photos ({photos} pictures)"}
with_photos = st.radio(
    "Find them on", list(SOURCES), format_func=SOURCES.get, horizontal=True,
    help="Jiang et al. average over many images: units that write the outliers of every picture, not"
    " only of this one. On the photos too, the register found elsewhere is tried on this image.",
    **session.keep("registers_with_photos", False, lambda value: value in SOURCES),
)


def search(last: int | None) -> registers.RegisterNeurons:
    """The register neurons of layers 0 to ``last`` (default: where the outliers appear), found on
    what the radio says; on the photos a job when heavy (the page stops until it is done)."""
    cost = costs.register_search_forwards(config, photos)
    if with_photos and costs.is_heavy(config, forwards=cost):
        st.write(
            f"Reading the {photos} pictures and searching them costs about {cost:.0f}"
            " forward passes: it runs when you ask, beside the server, so that the pages stay quick for everybody,"
            " and then serves everyone."
        )
        found = jobs.register_neurons(selection, found_after, k, last, "Search the photos")
        if found is None:
            st.stop()
        return found
    try:
        return selection.register_neurons(found_after, k, with_photos, last)
    except analysis.AnalysisError as error:  # over the photos, this image's outliers may not stand out
        st.info(str(error))
        st.stop()


neurons = search(None)
where = (
    f"on the {count} outlier{'s' if count > 1 else ''} of this image" if not with_photos else
    f"on the {neurons.images} of the {photos} pictures with outliers (the threshold taken over all their patches)"
)
st.write(
    f"Every unit of every MLP is scored {where}: its mean absolute activation on them, kept only if"
    " the unit is quiet elsewhere (below 0.5 on at least half of the tokens), averaged over the pictures, as"
    " their find_register_neurons does; the blocks run once more from the captured tokens to read the"
    f" activations. The outliers stand out already after layer {neurons.appears_at}: the units that write"
    " them are in that layer or before, so the search keeps to those layers unless you widen them (their"
    " highest_layer), and takes the best units (their top_k: 10 for CLIP ViT-B/16)."
)
count_column, range_column = st.columns(2)
chosen = count_column.slider(
    "Register neurons", 1, 50,
    help="How many of the best-scoring units feed the register; the fewer that remove the outliers, the better.",
    **session.keep("registers_count", registers.DEFAULT_COUNT),
)
first, last = range_column.slider(
    "From the layers", 0, depth - 1,
    help="The layers whose units may be register neurons. Units after the outliers appear only respond to them.",
    **session.keep(
        f"registers_layers_{neurons.appears_at}", (0, neurons.appears_at),
        lambda value: len(value) == 2 and 0 <= value[0] <= value[1] < depth,
    ),
)
if last >= len(neurons.scores):  # widened past where the outliers appear: those layers searched too
    neurons = search(last)
ranked = neurons.top(max(chosen, 20), first, last)
if not ranked:
    st.info(f"No unit of layers {first} to {last} is both quiet elsewhere and active on the outliers: widen the layers.")
    st.stop()
register = neurons.register(chosen, first, last)
st.plotly_chart(selection.memo(
    "register neurons figure", found_after, k, with_photos, len(neurons.scores), chosen, first, last,
    compute=lambda: figures.register_neurons_figure(
        neurons.scores.max(dim=1).values, ranked, min(chosen, len(ranked)), first, last, neurons.appears_at,
    ),
))
st.caption(f"Feeding the register, {register.count} neuron{'s' if register.count > 1 else ''}: " + "; ".join(
    f"layer {layer}: unit{'s' if len(units) > 1 else ''} {', '.join(map(str, units))}" for layer, units in register.neurons
) + ".")

st.subheader("Before and after")
st.write(
    "The model runs again with one more token after the prefix tokens: zeros, with no position. In each"
    " layer with register neurons their activation is set to 0 on every patch, and the register's to the"
    " largest (in magnitude) of the image's tokens, as their activate_on_registers does. Nothing else"
    " changes: if these units write the outliers, the outliers leave the image for the register."
)
moved = selection.register_capture(register)
index = moved.register_token


def patch_norms(captured):
    return captured.tokens[0, :, captured.num_prefix_tokens:].norm(dim=-1)  # (depth + 1, P)


def norm_figures():
    before, after = patch_norms(intact), patch_norms(moved)
    register_norms = moved.tokens[0, :, index].norm(dim=-1)
    return (
        figures.register_norms_figure(
            before[found_after + 1].reshape(grid_h, grid_w), after[found_after + 1].reshape(grid_h, grid_w),
            outliers.outliers.reshape(grid_h, grid_w), float(register_norms[found_after + 1]), image.shape, found_after,
        ),
        figures.norms_by_layer_figure(
            before[1:].max(dim=1).values, after[1:].max(dim=1).values, before[1:].median(dim=1).values, register_norms[1:],
        ),
    )


maps_figure, lines_figure = selection.memo("register norm figures", found_after, k, register, compute=norm_figures)
st.plotly_chart(maps_figure)
st.plotly_chart(lines_figure)

query = "class token" if config.class_token else "mean over the patch queries"


def drawn_figure():
    """The query's share of attention on the outliers without the register, and with it on the
    same patches and on the register, in every layer."""
    before = torch.zeros(1, intact.num_tokens, dtype=torch.bool)
    before[:, prefix:] = outliers.outliers
    after = torch.zeros(2, moved.num_tokens, dtype=torch.bool)
    after[0, moved.num_prefix_tokens:] = outliers.outliers[0]
    after[1, index] = True
    intact_shares = registers.attention_drawn(
        layer_attentions(selection.model, intact, torch.float16), before, prefix, config.class_token,
    )
    moved_shares = registers.attention_drawn(
        layer_attentions(selection.model, moved, torch.float16), after, moved.num_prefix_tokens, config.class_token,
    )
    before, after, taken = intact_shares[:, 0, 0], moved_shares[:, 0, 0], moved_shares[:, 0, 1]
    return figures.attention_drawn_figure(before, after, taken, query), (float(before[-1]), float(after[-1]), float(taken[-1]))


st.write(
    f"Where the {query} looks. The outliers of large ViTs draw much of the attention in the later layers;"
    " with the register, that attention should go to the register instead, and the maps of the heads"
    " should show the image."
)
drawn, (was, stays, taken) = selection.memo("register attention drawn", found_after, k, register, compute=drawn_figure)
st.plotly_chart(drawn)
st.caption(
    f"In the last layer the {count} outlier{'s' if count > 1 else ''} drew {was:.1%} of the {query}'s attention"
    f" ({count / (grid_h * grid_w):.1%} of the patches); with the register, those patches draw {stays:.1%}"
    f" and the register {taken:.1%}."
)
shown_layer = st.slider(
    "Layer", 0, depth - 1, help="The layer whose heads are drawn, without and with the register.",
    **session.keep("registers_shown_layer", depth - 1, lambda layer: 0 <= layer < depth),
)
intact_grid, moved_grid = selection.memo(
    "register head grids", register, shown_layer, compute=lambda: figures.intact_and_knocked_heads(
        image, analysis.query_map(selection.attention(shown_layer), intact.grid_size, prefix, class_token=config.class_token),
        analysis.query_map(
            selection.register_attention(shown_layer, register), moved.grid_size, moved.num_prefix_tokens,
            class_token=config.class_token,
        ),
        layer=shown_layer, query=query, what="the register",
    ),
)
st.plotly_chart(intact_grid)
st.plotly_chart(moved_grid)

st.subheader("The prediction")
if config.num_classes == 0:
    cosine = selection.memo("register cosine", register, compute=lambda: float(torch.cosine_similarity(
        intact.logits[0], moved.logits[0], dim=-1,
    )))
    st.metric("Cosine between the pooled features, without and with the register", f"{cosine:.6f}")
    st.caption(
        f"{models.NO_CLASSIFIER.format(what='A class prediction')} The pooled feature is what this model outputs:"
        " 1 means the register left it pointing the same way, as a model's downstream use needs."
    )
else:
    st.plotly_chart(selection.memo("register top-k", register, compute=lambda: figures.knockout_topk(
        intact.logits[0].softmax(-1), moved.logits[0].softmax(-1), selection.class_names(), what="the register",
        changed="with the register",
    )))
