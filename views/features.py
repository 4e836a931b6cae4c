"""Features: what a layer represents, through a sparse autoencoder trained on its tokens: a patch's
latents, a latent's map and its top patches over the training images, the latents that matter for
this prediction, and the model run again with one latent steered (the change shown as a difference)."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.app import features, models, session
from vit_explorer.features.effects import points_text, score_change
from vit_explorer.features.sae import SAEError
from vit_explorer.model import ablation

selection = session.selection()
config = selection.config
image = selection.display_image()
state = st.session_state

st.title("Features")
st.write(
    "Attention says where a token looks; a sparse autoencoder (SAE) says what a token *holds*. Trained on"
    " the tokens leaving one layer over many images, it rewrites each token as a few directions out of"
    " thousands (its latents), each ideally one thing the model represents. Click a patch to see its"
    " latents, a latent to see where it fires and what it fired on while training, and steer it to see"
    " what the model does without it."
)

choices, skipped = features.choices(selection)
for sentence in skipped[:3]:  # a folder of many broken files says so in a few lines
    st.warning(sentence)
if len(skipped) > 3:
    st.caption(f"{len(skipped) - 3:,} more files in the dictionaries' folders were skipped too.")
if not choices:
    st.info(
        "No dictionary fits this model yet. Train one with `python -m vit_explorer sae --weights FILE --layer L`"
        " (it writes it into the runs folder, where this page finds it), or pick the shipped shapes model,"
        " which comes with one."
    )
    st.stop()
label = st.selectbox(
    "Dictionary", list(choices), help="The SAEs trained on this model's tokens: shipped beside it, or trained since.",
    **session.keep("features_dictionary", next(iter(choices)), lambda value: value in choices),
)
try:
    chosen = features.dictionary(choices[label], selection)
except SAEError as error:
    st.error(str(error))
    st.stop()
layer, card, sae_config = chosen.layer, chosen.card, chosen.sae.config
metrics = card.get("metrics", {})
trained_on = card.get("images", {})
st.caption(
    f"Layer {layer}'s output tokens ({'every token' if chosen.prefix_tokens else 'the patch tokens'}),"
    f" {sae_config.width:,} latents, {sae_config.k} active per token; trained on"
    f" {trained_on.get('count', '?'):,} {trained_on.get('dataset', '')} images: it explains"
    f" {100 * metrics.get('explained_variance', float('nan')):.1f}% of their tokens' variance,"
    f" {metrics.get('l0', float('nan')):.1f} latents fire per token, {100 * metrics.get('dead_share', float('nan')):.1f}%"
    " of the latents never fired."
)

view = features.image_features(selection, chosen)
st.subheader("How much of this image it explains")
st.write(
    f"On this image the dictionary explains **{100 * view.explained_overall:.1f}%** of the variance of the"
    f" tokens it reads (on its training images: {100 * metrics.get('explained_variance', float('nan')):.1f}%)."
    " Where a patch is blue, the latents describe it badly: do not read much into them there."
)
st.plotly_chart(selection.memo("sae explained map", chosen.key, compute=lambda: figures.explained_map(
    image, view.explained, f"Share of each patch's token the dictionary explains (layer {layer})",
)))


TOP_EFFECTS = 8  # the latents listed as mattering most


def effect_clicked() -> None:
    points = state["features_effects_click"].selection.points
    if points:
        session.set_kept("features_latent", int(points[0]["customdata"]))


def latents_that_matter():
    """The latents whose removal would change this prediction most: estimated for every latent,
    the top few really removed. Returns the effects (their order starts the steering)."""
    found = features.latent_effects(selection, chosen)
    st.subheader("Latents that matter for this prediction")
    if found.target is None:
        what = "the pooled output's length along its own direction (the model has no classifier)"
    elif found.label is not None:
        what = f"the score of the label **{found.label}** ({100 * found.probability:.2f}%, the best of the labels)"
    else:
        names = selection.class_names()
        what = f"the probability of **{names[found.target]}** ({100 * found.probability:.2f}%)"
    st.write(
        f"Each latent's effect on {what} if it were removed from layer {layer}'s tokens: estimated for every"
        " latent at once (its activation times the gradient of the prediction, with what the dictionary does not"
        f" explain kept in the tokens), and for the top {len(found.real)} measured by really removing it."
        " Click a bar to steer that latent."
    )
    top = found.top(TOP_EFFECTS)
    if not top:
        st.info("No latent fires on this image's tokens: the dictionary writes them as its bias alone.")
        return found
    estimated = [found.points(float(found.estimates[latent])) for latent in top]
    real = [found.points(found.real[latent]) if latent in found.real else float("nan") for latent in top]
    st.plotly_chart(
        figures.latent_effect_bars(estimated, real, top, found.unit,
                                   f"The latents that matter most for this prediction (layer {layer})",
                                   state.get("features_latent")),
        key="features_effects_click", on_select=effect_clicked, selection_mode="points",
    )
    rows = [{
        "latent": latent,
        "activation (summed over tokens)": f"{float(found.activations[latent]):.3g}",
        "estimated if removed": points_text(value, found.unit),
        "real if removed": "not measured" if latent not in found.real else points_text(measured, found.unit),
        **({} if found.target is not None else {"cosine removed vs intact": (
            f"{found.cosines[latent]:.6f}" if latent in found.cosines else "")}),
    } for latent, value, measured in zip(top, estimated, real)]
    st.table(rows)
    return found


effects = latents_that_matter()



def patch_clicked() -> None:
    """A new patch: its own strongest latent is shown next, not the one chosen for the last patch."""
    session.patch_picked("features_patch_click", "features_patch")()
    for key in ("features_latent", session.kept_key("features_latent")):
        state.pop(key, None)


def latent_clicked() -> None:
    points = state["features_bars_click"].selection.points
    if points:
        session.set_kept("features_latent", int(points[0]["customdata"]))


st.subheader("A patch and its latents")
grid = selection.capture().grid_size
patches = grid[0] * grid[1]
patch = state.get("features_patch", patches // 2 + grid[1] // 2)
patch = patch if 0 <= patch < patches else 0
picker_column, bars_column = st.columns(2)
with picker_column:
    st.plotly_chart(
        selection.memo("features picker", patch, compute=lambda: figures.patch_picker(image, grid, patch)),
        key="features_patch_click", on_select=patch_clicked,
        selection_mode="points",
    )
latents, values = view.top(patch)
strongest = view.strongest()
# Until a patch is clicked, steering starts from the latent that matters most for the prediction.
patch_chosen = "features_patch" in state or session.kept("features_patch", None) is not None
default_latent = (latents[0] if latents and patch_chosen else effects.order[0] if effects.order
                  else latents[0] if latents else strongest[0] if strongest else 0)
with bars_column:
    if latents:
        st.plotly_chart(
            figures.latent_bars(values, latents, f"Patch {patch}'s strongest latents (click one)", state.get("features_latent")),
            key="features_bars_click", on_select=latent_clicked, selection_mode="points",
        )
    else:
        st.info(f"No latent fires on patch {patch}: the dictionary writes it as its bias alone.")

latent = st.number_input(
    "Latent", 0, sae_config.width - 1, step=1,
    help="Any latent of the dictionary; the page starts on the one that matters most for the prediction, then on"
    " a clicked patch's strongest.",
    **session.keep("features_latent", default_latent, lambda value: 0 <= value < sae_config.width),
)
st.subheader(f"Latent {latent}")
map_column, gallery_column = st.columns(2)
with map_column:
    st.plotly_chart(selection.memo("latent map", chosen.key, latent, patch, compute=lambda: figures.latent_map(
        image, view.latent_map(latent, grid), f"Latent {latent} on this image", query_patch=patch,
    )))
with gallery_column:
    if chosen.index_problem is not None:
        st.info(f"Its index file was skipped, so its top patches are not known: {chosen.index_problem}.")
    elif chosen.index is None:
        st.info("This dictionary has no index beside it, so its top patches are not known.")
    else:
        try:
            pictures, top_patches, top_values = features.gallery(chosen, latent)
        except SAEError as error:
            st.info(f"This dictionary's index is read, but {error}.")
        else:
            st.plotly_chart(figures.latent_gallery(
                pictures, top_patches, top_values, tuple(chosen.index.grid_size),
                f"Latent {latent}'s top patches over its training images",
            ))
if chosen.index is not None:
    st.plotly_chart(figures.latent_histogram(
        chosen.index.histogram[latent], float(chosen.index.maxima[latent]), float(chosen.index.frequency[latent]),
        f"Latent {latent}'s activations",
    ))

st.subheader(f"Steer latent {latent}")
st.write(
    f"Scale what latent {latent} adds to every token leaving layer {layer} (its activation times its"
    " direction), in this pass only: 0 removes it, 2 doubles it. What the dictionary does not explain stays"
    " in the tokens, and the shared model is never changed."
)
factor = st.slider(
    "Factor", 0.0, 5.0, step=0.25, help="0 removes the latent; 1 leaves the pass as it was; more amplifies it.",
    **session.keep("features_factor", 0.0, lambda value: 0.0 <= value <= 5.0),
)
knock_out = session.kept_knock_out(config)
if knock_out is not None and not st.toggle(
    f"Together with the knock-out chosen on the Knock-out page ({knock_out.describe()})", value=False,
    help="Steering and knock-outs compose: the same pass without those heads or branches.",
):
    knock_out = None
intact = selection.capture()
steered = features.steered_capture(selection, chosen, latent, factor, knock_out)
what = f"latent {latent} x {factor:g}" + ("" if knock_out is None else f" and {knock_out.describe()}")
if config.num_classes == 0:
    cosine = ablation.pooled_cosine(intact.logits[0], steered.logits[0])
    st.metric("Cosine between the pooled features, intact and steered", f"{cosine:.6f}")
    st.caption(f"{models.NO_CLASSIFIER.format(what='A class prediction')} 1: the steering left it pointing the same way.")
else:
    st.plotly_chart(selection.memo("steered top-k", chosen.key, latent, factor, knock_out, compute=lambda: figures.knockout_topk(
        intact.logits[0].softmax(-1), steered.logits[0].softmax(-1), selection.class_names(), what=what, changed="steered",
    )))


def prediction_change(before, after, names, kind: str) -> None:
    """The best class's (or label's) ``kind`` ("probability", "score") with the latent steered, from
    log-scores ``before`` and ``after`` (T,); its change with enough decimals to see it, and a
    sentence when the prediction is saturated."""
    target, probability, change = score_change(before, after)
    st.metric(f"{kind.capitalize()} of {names[target]} with {what}", f"{100 * probability + change:.4f}%",
              points_text(change), help="The change in percentage points.")
    if int(after.argmax()) != target:
        st.write(f"The best is now **{names[int(after.argmax())]}** ({100 * float(after.max().exp()):.2f}%).")
    if probability > features.SATURATED:
        other = features.less_certain_sample(selection)
        st.info(
            f"The prediction is saturated: {names[target]} at {100 * probability:.2f}%, so steering one latent moves"
            " it by small fractions of a point here. A less certain picture"
            + (f", such as {other} in the sidebar's samples," if other else " (one the model is less than"
               f" {100 * features.SATURATED:g}% sure of)") + " would show more."
        )


if config.num_classes:
    prediction_change(intact.logits[0].float().log_softmax(-1), steered.logits[0].float().log_softmax(-1),
                      selection.class_names(), "probability")
elif effects.label is not None:
    labels = features.label_scores(selection)[0]
    prediction_change(labels.log_scores(intact.logits)[0], labels.log_scores(steered.logits)[0], labels.names, "score")


def attention_change(shown: int) -> None:
    """Layer ``shown``'s attention with the latent steered minus intact (one diverging scale centred at
    0), then the two grids themselves."""
    prefix = intact.num_prefix_tokens
    query = "class token" if config.class_token else "mean over the patch queries"

    def maps():
        return (analysis.query_map(selection.attention(shown), grid, prefix, class_token=config.class_token),
                analysis.query_map(features.steered_attention(selection, chosen, latent, factor, shown, knock_out), grid,
                                   prefix, class_token=config.class_token))

    difference = selection.memo("steered attention difference", chosen.key, latent, factor, knock_out, compute=lambda: (
        figures.attention_difference_grid(image, *maps(), layer=shown, query=query, what=what)))
    st.caption(f"Layer {shown}, the first to read the steered tokens: where each head looks more (red) or less (blue)"
               " with the latent steered than intact.")
    st.plotly_chart(difference)
    with st.expander("The attention itself, steered and intact"):
        intact_grid, steered_grid = selection.memo(
            "steered head grids", chosen.key, latent, factor, knock_out, compute=lambda: figures.intact_and_knocked_heads(
                image, *maps(), layer=shown, query=query, what=what,
            ),
        )
        st.plotly_chart(steered_grid)
        st.plotly_chart(intact_grid)


if layer + 1 < config.depth:
    attention_change(layer + 1)
