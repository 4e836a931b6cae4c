"""Knock-out: switch heads and whole branches off and see what the model does without them, and
the importance sweep of every head alone."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.model import ablation
from vit_explorer.app import jobs, models, session, words

selection = session.selection()
config = selection.config
image = selection.display_image()
state = st.session_state
depth, heads = config.depth, config.num_heads
layers = list(range(depth))
MODE_LABELS = {
    "zero": "zero: their outputs set to 0",
    "mean": "mean: their outputs replaced by their mean over this image's tokens",
}


def clear_knock_out() -> None:
    for key in [session.knockout_heads_key(layer) for layer in layers] + ["knockout_attention", "knockout_mlp"]:
        session.set_kept(key, [])


def knock_out_clicked_head() -> None:
    points = state["knockout_sweep_click"].selection.points
    if points:
        layer, head = int(points[0]["y"]), int(points[0]["x"])
        key = session.knockout_heads_key(layer)
        session.set_kept(key, sorted({*state.get(key, []), head}))


st.title("Knock-out")
st.write(
    "Where a head looks does not say whether it matters. Switch heads off, or the whole attention or"
    " MLP branch of a layer, and see what the model makes of this image without them. The knocked-out"
    " outputs are replaced before the layer's output projection, so a removed branch adds only its"
    " bias (zero) or its own average output (mean); the shared model itself is never changed."
)

mode = st.radio(
    "Ablation", ablation.MODES, format_func=MODE_LABELS.get, horizontal=True,
    help="Zero removes what the heads write; mean keeps their average and removes only what is"
    " specific to each token.",
    **session.keep("knockout_mode", "zero", lambda value: value in ablation.MODES),
)
with st.expander("Heads to knock out", expanded=True):
    columns = st.columns(4)
    for layer in layers:
        columns[layer % 4].multiselect(
            f"Layer {layer}", list(range(heads)), placeholder="no head",
            help=f"The heads of layer {layer} whose outputs are removed before its output projection.",
            **session.keep(session.knockout_heads_key(layer), [], lambda chosen: all(0 <= head < heads for head in chosen)),
        )
attention_column, mlp_column, clear_column = st.columns([3, 3, 1], vertical_alignment="bottom")
removed_attention = attention_column.multiselect(
    "Remove the attention branch of layers", layers, placeholder="none",
    help="Every head of these layers knocked out: the layer's tokens no longer read one another.",
    **session.keep("knockout_attention", [], lambda chosen: all(layer in layers for layer in chosen)),
)
removed_mlp = mlp_column.multiselect(
    "Remove the MLP branch of layers", layers, placeholder="none",
    help="The hidden units of these layers' MLPs removed before their second linear layer.",
    **session.keep("knockout_mlp", [], lambda chosen: all(layer in layers for layer in chosen)),
)
clear_column.button("Clear", on_click=clear_knock_out, help="Knock nothing out.", width="stretch")

knock_out = ablation.KnockOut(
    heads={layer: state[session.knockout_heads_key(layer)] for layer in layers}, attention=removed_attention, mlp=removed_mlp,
    mode=mode,
)
problem = knock_out.problem(config)
if problem:
    st.error(problem)
elif knock_out.is_empty:
    st.info("Nothing is knocked out: choose heads or branches above, or click a cell of the sweep below.")
else:
    intact, knocked = selection.capture(), selection.knock_out_capture(knock_out)
    prefix = intact.num_prefix_tokens
    what = knock_out.describe()
    st.subheader("The prediction without them")
    if config.num_classes == 0:
        cosine = selection.memo("knock-out cosine", knock_out, compute=lambda: ablation.pooled_cosine(
            intact.logits[0], knocked.logits[0]
        ))
        st.metric("Cosine between the pooled features, intact and knocked out", f"{cosine:.6f}")
        in_words = words.words_model(selection.model_key)
        if in_words is None:
            st.caption(
                f"{models.NO_CLASSIFIER.format(what='A class prediction')} The pooled feature is what this model"
                " outputs: 1 means the knock-out left it pointing the same way."
            )
        else:
            st.caption("The pooled feature is what this model outputs: 1 means the knock-out left it pointing the same way.")
            said = words.prediction(selection)
            if said is not None:
                knocked_said = words.prediction(selection, knock_out)
                labels_id = words.labels_id(words.session_labels())
                st.plotly_chart(selection.memo("words knock-out top-k", labels_id, knock_out, compute=lambda: (
                    figures.knockout_topk(said.scores, knocked_said.scores, said.labels, what=what)
                )))
                st.caption(words.about(selection.model_key))
    else:
        names = selection.class_names()
        st.plotly_chart(selection.memo("knock-out top-k", knock_out, compute=lambda: figures.knockout_topk(
            intact.logits[0].softmax(-1), knocked.logits[0].softmax(-1), names, what=what,
        )))

    st.subheader("Attention after the knock-out")
    first = knock_out.first_layer()
    st.write(
        f"A knock-out changes what the layer writes, not where its own heads look: attention up to layer"
        f" {first} is as before, the layers after it read the changed tokens."
    )
    query = "class token" if config.class_token else "mean over the patch queries"
    shown_layer = st.slider(
        "Layer", 0, depth - 1, help="The layer whose attention is drawn, intact and knocked out.",
        **session.keep("knockout_layer", min(first + 1, depth - 1), lambda layer: 0 <= layer < depth),
    )
    intact_grid, knocked_grid = selection.memo(
        "knock-out head grids", knock_out, shown_layer, compute=lambda: figures.intact_and_knocked_heads(
            image, analysis.query_map(selection.attention(shown_layer), intact.grid_size, prefix, class_token=config.class_token),
            analysis.query_map(
                selection.attention(shown_layer, knock_out), intact.grid_size, prefix, class_token=config.class_token,
            ),
            layer=shown_layer, query=query, what=what,
        ),
    )
    st.plotly_chart(knocked_grid)
    st.plotly_chart(intact_grid)

    st.write(
        "Rollout (Abnar & Zuidema 2020) multiplies the layers' attention, residual counted in: how much"
        f" each patch reaches the {query} at the end, intact and knocked out."
    )

    def rollout_map(rollout):
        return analysis.query_map(rollout[0], intact.grid_size, prefix, class_token=config.class_token)

    # The intact one is the Attention and Compare pages' too.
    intact_figure, knocked_figure = selection.memo(
        "knock-out rollouts", knock_out, compute=lambda: figures.intact_and_knocked_rollouts(
            image, rollout_map(selection.rollout()), rollout_map(selection.rollout(knock_out=knock_out)),
            query=query, what=what,
        ),
    )
    intact_column, knocked_column = st.columns(2)
    intact_column.plotly_chart(intact_figure)
    knocked_column.plotly_chart(knocked_figure)

st.subheader("Which heads matter: knock out each one alone")
cost = ablation.sweep_cost(config)
st.write(
    f"The sweep knocks out each of the {depth * heads} heads alone ({mode}-ablation) and measures"
    + (" how the log-probability of the class the intact model predicts changes" if config.num_classes
       else " how far the pooled feature turns away from the intact one (cosine minus 1)")
    + f". The copies of the image run in batches from each layer's intact input, so it costs about"
    f" {cost:.0f} forward passes of this model rather than {depth * heads + 1}. Click a cell to knock"
    " that head out above."
)
sweep = jobs.sweep(selection, mode)  # unless quick, a job beside the server, in turn: one person's does not slow the class
if sweep is not None:
    measure = f"{sweep.measure} of {selection.class_names()[sweep.target]!r}" if sweep.target is not None else sweep.measure
    st.plotly_chart(
        selection.memo("sweep grid", mode, knock_out, compute=lambda: figures.head_sweep_grid(
            sweep.values, sweep.measure, knocked=knock_out.head_mask(config),
            title=f"Each head knocked out alone ({mode}): {measure}; outlined: knocked out above",
        )),
        key="knockout_sweep_click", on_select=knock_out_clicked_head, selection_mode="points",
        config={"displayModeBar": False},
    )
