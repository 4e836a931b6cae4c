"""Attention: where every head of every layer looks, from the class token or a clicked patch."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.app import costs, faithfulness, jobs, models, session, word_maps, word_segments, words
from vit_explorer.app.selection import prediction_caveats
from vit_explorer.text import LabelError

selection = session.selection()
config = selection.config
result = selection.capture()
image = selection.display_image()
state = st.session_state
depth, heads = config.depth, config.num_heads
grid_h, grid_w = result.grid_size
num_patches, prefix = grid_h * grid_w, result.num_prefix_tokens
in_words = word_maps.model_for(selection)  # both towers (CLIP, SigLIP), or None

CLASS_QUERY = -1  # the class token
POOL_QUERY = -2  # the attention-pool head's probe query (SigLIP's MAP head), after the last layer
has_pool = result.pool_attentions is not None
queries = (
    ([CLASS_QUERY] if config.class_token else []) + ([POOL_QUERY] if has_pool else [])
    + list(range(num_patches))
)
centre = (grid_h // 2) * grid_w + grid_w // 2


def query_label(query: int) -> str:
    if query == CLASS_QUERY:
        return "class token"
    if query == POOL_QUERY:
        return "attention-pool probe"
    row, col = divmod(query, grid_w)
    return f"patch {query} (row {row}, col {col})"


def segment_by_words(prompts: tuple[str, ...], method: str, proxy_key: str | None) -> None:
    """The Segment view of "Ask in words": every pixel labelled by its best prompt, the mask to download."""
    st.markdown("**Segment by words**")
    st.write(
        "Every pixel of the picture takes the prompt its patch is most like, the maps up-sampled to the picture as"
        " the training-free segmentation papers do (SCLIP, NACLIP): the cosines times 40 through a softmax over the"
        " prompts, and a pixel whose best prompt's probability is below the threshold left to the background."
    )
    threshold_column, pamr_column = st.columns(2)
    threshold = threshold_column.slider(
        "Background below this probability", 0.0, 1.0, step=0.05,
        help="0: every pixel takes a prompt. The papers use 0.1 on VOC, with the background named by a list of words.",
        **session.keep("segment_threshold", 0.0, lambda value: 0.0 <= value <= 1.0),
    )
    pamr = pamr_column.toggle(
        "Refine along the picture's edges (PAMR)",
        help="Each pixel's scores replaced, ten times over, by its neighbours' of a like colour (Araslanov & Roth 2020).",
        **session.keep("segment_pamr", False),
    )
    labels = word_segments.segmentation(selection, prompts, threshold, pamr, method, proxy_key)
    st.plotly_chart(selection.memo("words segmentation map", words.labels_id(prompts), method, proxy_key, threshold, pamr, compute=lambda: (
        figures.segmentation_map(word_segments.picture(selection, labels.shape), labels, (word_segments.BACKGROUND, *prompts))
    )))
    mask_column, classes_column = st.columns(2)
    mask_column.download_button(
        "Download the mask", lambda: word_segments.mask_png(labels, selection.image.size, prompts), file_name="mask.png",
        mime="image/png", icon=":material/download:", on_click="ignore",
        help="A PNG as large as the picture whose pixels are class indices: 0 the background, 1 the first prompt, ...",
    )
    classes_column.download_button(
        "Download the class list", word_segments.class_list(prompts), file_name="classes.txt", mime="text/plain",
        icon=":material/download:", on_click="ignore", help="One class a line: its index in the mask, a tab, its name.",
    )


def step_layer(delta: int) -> None:
    session.set_kept("layer", min(max(state["layer"] + delta, 0), depth - 1))


st.title("Attention")
st.write(
    "In every layer each token builds its next version from a weighted mix of all tokens; the"
    " weights are its attention, one set per head. Pick a query token (the class token, or click"
    " any patch) and step through the layers: early heads look near the query, later heads"
    " gather from the whole object."
)

layer_widget = session.keep("layer", depth - 1, lambda layer: 0 <= layer < depth)
query_widget = session.keep("query", queries[0] if queries[0] < 0 else centre, lambda q: q in queries)
previous, slider, following = st.columns([1.4, 7, 1.4], vertical_alignment="bottom")
previous.button("Previous", on_click=step_layer, args=(-1,), disabled=state["layer"] == 0,
                icon=":material/chevron_left:", width="stretch")
layer = slider.slider("Layer", 0, depth - 1, **layer_widget)
following.button("Next", on_click=step_layer, args=(1,), disabled=state["layer"] == depth - 1,
                 icon=":material/chevron_right:", width="stretch")
read_note = models.language_model_layer_note(config, layer)  # a VLM's tower: the layer its language model reads
if read_note:
    st.caption(read_note)

controls, picker = st.columns([2, 1])
with controls:
    query = st.selectbox("Query token", queries, format_func=query_label, **query_widget)
    opacity = st.slider(
        "Overlay opacity", 0.0, 1.0, help="How opaque the strongest cell is; zero attention is always clear.",
        **session.keep("opacity", 0.85),
    )
    scale = st.radio(
        "Scale", figures.HEAD_SCALES, horizontal=True,
        format_func=lambda option: {"shared": "shared across heads", "per head": "per head"}[option],
        help="Shared: one colour means one weight in every head, so heads compare. Per head: each head"
        " from 0 to its own largest weight, which shows the pattern of a faint head.",
        **session.keep("head_scale", "shared", lambda option: option in figures.HEAD_SCALES),
    )
    if config.class_token:
        st.caption(
            "The class token has no patch of its own; what it attends to is what the classifier"
            " reads. A patch query shows which patches that patch draws information from."
        )
    elif has_pool:
        st.caption(
            "This model has no class token: an attention-pool head's learned probe query reads the"
            " last layer's patch tokens instead, so its map is the same whatever the layer."
        )
    else:
        st.caption("This model has no class token, so the query is always a patch.")
with picker:
    st.plotly_chart(
        selection.memo(
            "patch picker", query,
            compute=lambda: figures.patch_picker(image, result.grid_size, None if query < 0 else query),
        ),
        key="patch_click", on_select=session.patch_picked("patch_click", "query"), selection_mode="points",
        config={"displayModeBar": False},
    )

query_arg = None if query < 0 else query
if query == POOL_QUERY:
    maps = selection.memo("pool maps", compute=lambda: analysis.pool_maps(result))  # (H, gh, gw)
    where = "the pooling head"  # the probe reads the last layer's tokens
    shown_rows = result.pool_attentions[0]  # (H, 1, P)
else:
    shown_rows = selection.attention(layer)  # (H, N, N)
    maps = selection.memo("head maps", layer, query, compute=lambda: analysis.query_map(
        shown_rows, result.grid_size, prefix, query_arg, class_token=config.class_token
    ))  # (H, gh, gw)
    where = layer
evenness = selection.memo("attention evenness", where, compute=lambda: analysis.attention_evenness(shown_rows))
if analysis.near_uniform(evenness):
    st.info(
        f"These heads spread their attention almost evenly over all tokens (mean entropy {evenness:.0%} of"
        " the uniform log N), as an untrained model's do, so the differences in the maps below are noise."
    )
window = None if query == POOL_QUERY else models.query_window(config, layer, query_arg, result.grid_size)
st.plotly_chart(selection.memo("heads grid", where, query, opacity, scale, compute=lambda: figures.attention_heads_grid(
    image, maps, opacity=opacity, layer=where, query=query_label(query), query_patch=query_arg, scale=scale, window=window,
)))
window_note = None if query == POOL_QUERY else models.window_note(config, layer, query_arg, result.grid_size)
if window_note:  # window attention (Qwen2.5-VL)
    st.caption(window_note)
if query != POOL_QUERY:  # the pool's probe is no token of a layer: nothing to open inside one
    st.caption(f"How one of these heads computes its map, step by step, in layer {layer}:")
    head_columns = st.columns(min(heads, 12))
    for inside_head in range(heads):
        if head_columns[inside_head % len(head_columns)].button(f"head {inside_head}", key=f"inside_head_{inside_head}", width="stretch",
                         help=f"Open Inside a layer on layer {layer}, head {inside_head}, this query."):
            session.set_kept("head", inside_head)  # layer and query are kept already: the page shares them
            st.switch_page("views/inside.py")

st.subheader("The patches that hold most of the attention")
st.write(
    "DINO's view (Caron et al. 2021): for each head, keep the fewest patches that together hold a"
    " chosen share of the attention above. For self-supervised models the class token's masks"
    " cut the object out of the background without ever having seen a label."
)
mass = st.slider("Share of the attention kept", 0.1, 1.0, step=0.05, **session.keep("mass", 0.6))
st.plotly_chart(selection.memo("masks grid", where, query, mass, compute=lambda: figures.attention_masks_grid(
    image, analysis.attention_mask_by_mass(maps, mass), mass, layer=where, query=query_label(query),
    query_patch=query_arg,
)))

st.subheader("One head's full attention matrix")
block = figures.matrix_block(result.num_tokens, prefix)
rows_note = "each row sums to 1" if block == 1 else (
    f"each row sums to 1; the {result.num_tokens} tokens are too many to draw one by one, so the"
    f" drawing shows the patches in blocks of {block} x {block}, each cell the largest weight in its"
    " block, and its rows do not sum to 1"
)
st.write(
    f"All queries at once: row i is how token i spreads its attention over the keys ({rows_note})."
    " Bright columns are tokens that everyone reads; a bright diagonal is a head that mostly keeps"
    " each token to itself. The query's row is outlined."
)
head = st.selectbox("Head", list(range(heads)), **session.keep("head", 0, lambda h: 0 <= h < heads))
query_token = None if query == POOL_QUERY else 0 if query == CLASS_QUERY else prefix + query
st.plotly_chart(selection.memo("attention matrix", layer, head, query_token, compute=lambda: figures.attention_matrix(
    selection.attention(layer)[head], prefix,
    title=f"Layer {layer}, head {head}: {result.num_tokens} x {result.num_tokens} attention",
    class_token=config.class_token, dist_token=config.dist_token, query_token=query_token,
)))
if query_token is not None:
    st.page_link(
        "views/inside.py", icon=":material/calculate:",
        label=f"How head {head} computes the outlined row ({query_label(query)}), step by step",
    )

st.subheader("Attention rollout")
st.write(
    "One layer's attention only says what mixes in that layer. Rollout (Abnar & Zuidema 2020)"
    " multiplies the layers' attention, with the residual connection counted in, to estimate how"
    " much each input patch reaches the query at the end. Discarding the weakest weights sharpens"
    " the map."
)
fusion_column, discard_column = st.columns(2)
fusion = fusion_column.selectbox(
    "Combine heads by", analysis.HEAD_FUSIONS, **session.keep("fusion", "mean", lambda f: f in analysis.HEAD_FUSIONS)
)
discard = discard_column.slider("Discard the weakest share of weights", 0.0, 0.95, step=0.05, **session.keep("discard", 0.0))
# What the view costs decides what runs here: every head's distance and entropy are a job where the view
# with them is heavy, the rollout too where it is heavy without them (app.costs).
rollout = selection.cached_rollout(fusion, discard)  # (1, N, N)
with_rollout = costs.attention_view_forwards(config)
if rollout is None and costs.is_heavy(config, forwards=with_rollout):
    st.write(
        f"With the rollout, this page's view of this model costs about {with_rollout:.1f} forward passes (every"
        " layer's attention computed again and multiplied through): it runs when you ask, beside the server, so"
        " that the pages stay quick for everybody, and then serves everyone who rolls this picture out with these"
        " settings."
    )
    rollout = jobs.rollout(selection, fusion, discard, "Roll the attention out")
elif rollout is None:
    rollout = selection.rollout(fusion, discard)


def rollout_overlay():
    if query == POOL_QUERY:
        rollout_map = analysis.pool_rollout_map(result.pool_attentions, rollout, result.grid_size, prefix)[0]
    else:
        rollout_map = analysis.query_map(rollout[0], result.grid_size, prefix, query_arg, class_token=config.class_token)
    return figures.attention_overlay(
        image, rollout_map, opacity=opacity,
        title=f"Rollout through all {depth} layers, query: {query_label(query)}", value_name="rollout",
        query_patch=query_arg, weights=True,
    )


if rollout is not None:
    st.plotly_chart(selection.memo("rollout overlay", fusion, discard, query, opacity, compute=rollout_overlay))

st.subheader("Which patches made it say this class")
st.write(
    "Attention alone does not say what mattered for one class. Class attribution (Chefer et al."
    " 2021) weights each layer's attention by its gradient for the chosen class, keeps the"
    " positive part and rolls it out through the layers: bright patches pushed the model towards"
    " that class."
)
if config.num_classes == 0 and in_words is not None:
    # No classes, but labels in words: the target is a label, the score the image's cosine with it.
    st.caption(words.about(selection.model_key))
    said = words.prediction(selection)  # None while ImageNet's class embeddings are made (their button drawn)
    if said is not None:
        for caveat in words.caveats(selection, said):
            st.warning(caveat)
        said_labels = words.session_labels()
        ranked = said.scores.argsort(descending=True).tolist()
        shares = said.scores.tolist()
        target = st.selectbox(
            "Label", ranked, format_func=lambda index: f"{said.labels[index]} ({shares[index]:.1%})",
            help="The label whose score is traced back: the image's cosine with its text embedding.",
            **session.keep("attribution_label", ranked[0], lambda index: index in ranked),
        )
        if costs.is_quick(config, forwards=costs.attribution_forwards(config)) or st.toggle(
            "Compute the attribution", help="One forward and one backward pass per label.",
            **session.keep("attribution_on", False),
        ):
            st.plotly_chart(selection.memo(
                "words attribution overlay", words.labels_id(said_labels), target, opacity,
                compute=lambda: figures.attention_overlay(
                    image, word_maps.relevance(selection, said_labels, target), opacity=opacity,
                    title=f"Attribution for '{said.labels[target]}' (in words)", value_name="relevance",
                ),
            ))
            st.caption(
                "The same attribution with the image's cosine with the label's text embedding as the score whose"
                " gradient is followed: this model has no classifier, and its labels are words."
            )
        else:
            st.caption(
                "For this model the attribution costs a forward and a backward pass (about three forward"
                " passes) per label, so it is computed when you ask: switch it on above."
            )
elif config.num_classes == 0:
    st.info(models.NO_CLASSIFIER.format(what="Class attribution"))
else:
    names = selection.class_names()
    probabilities = result.logits[0].softmax(-1)
    for caveat in prediction_caveats(selection, probabilities):
        st.warning(caveat)
    ranked = result.logits[0].argsort(descending=True).tolist()
    shares = probabilities.tolist()  # one softmax, not one per option (1000 of them for ImageNet)
    target = st.selectbox(
        "Class", ranked, format_func=lambda index: f"{names[index]} ({shares[index]:.1%})",
        **session.keep("attribution_class", ranked[0], lambda index: index in ranked),
    )
    # A backward pass through a real-size model costs several forward passes: asked for, not unasked.
    if costs.is_quick(config, forwards=costs.attribution_forwards(config)) or st.toggle(
        "Compute the attribution", help="One forward and one backward pass per class.",
        **session.keep("attribution_on", False),
    ):
        st.plotly_chart(selection.memo("attribution overlay", target, opacity, compute=lambda: figures.attention_overlay(
            image, selection.attribution(target), opacity=opacity,
            title=f"Attribution for '{names[target]}'", value_name="relevance",
        )))
    else:
        st.caption(
            "For this model the attribution costs a forward and a backward pass (about three forward"
            " passes) per class, so it is computed when you ask: switch it on above."
        )

if in_words is not None:
    st.subheader("Ask in words")
    st.write(
        "This model has a text tower: type what to look for, and see where in the image each prompt is."
        " Every patch is carried into the space where the model compares images with texts, and"
        " coloured by its cosine with each prompt, by the open-vocabulary method chosen below (each changes"
        " the model's last block for this map only); each patch then takes the colour of the prompt it is most"
        " like, and the attribution traces one prompt's score back to the patches through every layer."
    )
    prompts_text = st.text_input(
        "Prompts (comma-separated)", placeholder=word_maps.DEFAULT_PROMPTS,
        help=f"Each is read as \"{word_maps.READ_AS}\", as the sidebar's labels are; the first {word_maps.MAX_PROMPTS} are mapped.",
        **session.keep("word_prompts", word_maps.DEFAULT_PROMPTS),
    )
    try:
        prompts, left_out = word_maps.read_prompts(prompts_text, selection.model_key)
    except LabelError as error:
        st.warning(f"Those prompts cannot be mapped: {error}.")
        prompts, left_out = (), None
    method = st.selectbox(
        "Map method", list(word_maps.METHODS), format_func=word_maps.method_label, help=word_maps.methods_help(),
        **session.keep("word_method", word_maps.DEFAULT_METHOD, lambda option: option in word_maps.METHODS),
    )
    proxy_key = None
    if word_maps.METHODS[method].needs_proxy:
        proxies = word_maps.proxy_options(selection)
        proxy_key = st.selectbox(
            "Proxy model (whose attention CLIP's last block borrows)", list(proxies), format_func=proxies.get,
            help="ProxyCLIP's proxy: a model without words, a DINO as its authors use, run once on the same pixels.",
            **session.keep("word_proxy", next(iter(proxies), None), lambda option: option in proxies),
        )
    similarities = None
    if prompts:
        try:
            similarities = word_maps.similarities(selection, prompts, method, proxy_key)
        except (ValueError, OSError) as error:  # a method not defined for this tower, a proxy that does not load
            st.warning(f"{word_maps.METHODS[method].label} cannot map these prompts here: {error}.")
    if similarities is not None:
        if left_out:
            st.caption(left_out)
        how = word_maps.how(in_words, method=method)
        prompt_scale = st.radio(
            "Colour scale of the prompts", figures.PROMPT_SCALES, horizontal=True,
            help="Shared: one colour means one cosine for every prompt, so prompts compare. Per prompt: each from"
            " its own lowest cosine to its highest, which shows where a faint prompt is.",
            **session.keep("word_scale", "shared", lambda option: option in figures.PROMPT_SCALES),
        )
        prompts_id = words.labels_id(prompts)
        st.plotly_chart(selection.memo("words similarity grid", prompts_id, method, prompt_scale, opacity, compute=lambda: (
            figures.similarity_grid(image, similarities, prompts, how, scale=prompt_scale, opacity=opacity)
        )))
        st.caption(
            f"How each map is made: {word_maps.how(in_words, detail=True, method=method)}. The map is its cosine with"
            " the prompt's text embedding, one small product once the image has been through the model."
        )
        if len(prompts) > 1:
            st.plotly_chart(selection.memo("words best prompt", prompts_id, method, compute=lambda: figures.best_prompt_map(
                image, similarities, prompts, how=how,
            )))
            st.caption(
                "Each patch takes the colour of the prompt whose cosine with it is the largest of the maps above"
                f" ({word_maps.METHODS[method].label}'s)."
            )
            for caveat in word_maps.best_prompt_caveats(selection, similarities, prompts):
                st.warning(caveat)
        segment_by_words(prompts, method, proxy_key)
        traced = st.selectbox(
            "Prompt to trace back to the patches", list(range(len(prompts))), format_func=lambda index: prompts[index],
            **session.keep("word_traced", 0, lambda index: 0 <= index < len(prompts)),
        )
        relevance_method = st.radio(
            "Relevance", list(word_maps.RELEVANCE_METHODS), format_func=word_maps.RELEVANCE_METHODS.get, horizontal=True,
            help="Chefer et al.: every layer's attention weighted by its gradient, rolled out. LeGrad: the gradient of"
            " the score read at each of the last layers with respect to that layer's attention (SigLIP's pool too).",
            **session.keep("word_relevance_method", "chefer", lambda option: option in word_maps.RELEVANCE_METHODS),
        )
        if relevance_method == "legrad":
            try:
                legrad_map = word_maps.legrad(selection, prompts, traced)
            except ValueError as error:
                st.warning(f"LeGrad cannot map this model: {error}.")
            else:
                st.plotly_chart(selection.memo("words legrad overlay", prompts_id, traced, opacity, compute=lambda: (
                    figures.attention_overlay(
                        image, legrad_map, opacity=opacity, value_name="relevance",
                        title=f"Which patches made the image match '{prompts[traced]}' (LeGrad)",
                    )
                )))
                st.caption(
                    "LeGrad (Bousselham et al. 2024): the image's cosine with the prompt read at each of the last two"
                    " layers, the positive part of its gradient with respect to that layer's attention map (SigLIP: its"
                    " attention pool's, less what an empty prompt lights up), averaged over heads and queries, summed."
                    " It costs the last two blocks forward and backward, from the pass the page has made."
                )
        elif costs.is_quick(config, forwards=costs.attribution_forwards(config)) or st.toggle(
            "Compute the relevance of the prompt", help="One forward and one backward pass per prompt.",
            **session.keep("word_relevance_on", False),
        ):
            st.plotly_chart(selection.memo("words relevance overlay", prompts_id, traced, opacity, compute=lambda: (
                figures.relevance_overlay(image, word_maps.relevance(selection, prompts, traced), prompts[traced], opacity)
            )))
            st.caption(
                "The relevance (Chefer et al. 2021): each layer's attention weighted by its gradient of the image's"
                " cosine with the prompt, its positive part rolled out through the layers. Unlike the maps above it"
                " follows every layer, not only the last one's values."
            )
        else:
            st.caption(
                "For this model the relevance costs a forward and a backward pass (about three forward passes) per"
                " prompt, so it is computed when you ask: switch it on above."
            )

st.subheader("Is this map true?")
st.write(
    "The maps above disagree: which one shows what the model used? Remove the patches a map ranks highest and"
    " watch the score fall (deletion), or keep only those and watch it rise (insertion). The truer the map, the"
    " faster it moves, and a random order is the floor (Petsiuk et al. 2018; Chefer et al. 2021 rank rollout,"
    " raw attention and their attribution this way). Tested here: the maps of what the prediction reads, rollout"
    " and the head masks as set above."
)
if rollout is None:
    st.caption("The rollout is one of the maps tested here: the curves come once it is computed above.")
else:
    mode_column, curves_column = st.columns(2)
    removal = mode_column.radio(
        "Remove a patch by", faithfulness.MODES, format_func=faithfulness.MODE_NAMES.get, horizontal=True,
        help="A ViT runs on any subset of its patch tokens: dropping them adds nothing the model never saw."
        " Painting with the mean is how CNNs are tested, and a grey patch is itself something to look at.",
        **session.keep("faith_mode", "drop", lambda option: option in faithfulness.MODES),
    )
    curve_options = {"both": "deletion and insertion", "deletion": "deletion", "insertion": "insertion"}
    asked = curves_column.radio(
        "Curves", list(curve_options), format_func=curve_options.get, horizontal=True,
        help="Each costs about as much as the other; one alone costs about half as much.",
        **session.keep("faith_curves", "both", lambda option: option in curve_options),
    )
    asked = faithfulness.CURVES if asked == "both" else (asked,)
    st.caption(faithfulness.MODE_SENTENCES[removal])
    tested = faithfulness.page_maps(selection, fusion, discard, mass, faithfulness.attribution_drawn(selection))
    for sentence in tested.left_out:
        st.caption(sentence)
    if faithfulness.is_heavy(selection, len(tested.maps), removal, asked):
        st.write(
            f"For this model the curves of these {len(tested.maps)} maps and a random order cost about"
            f" {faithfulness.planned(selection, len(tested.maps), removal, asked):.0f} forward passes, so they are computed"
            " beside the server when you ask, once for everybody."
        )
    tested_curves = faithfulness.curves(selection, tested, removal, asked)
    if tested_curves is not None:
        st.plotly_chart(selection.memo("faithfulness figure", *tested.key, removal, asked, compute=lambda: (
            figures.faithfulness_figure(
                tested_curves.fractions, tested_curves.curves, tested_curves.names, tested_curves.what, tested_curves.percent,
            )
        )))
        st.write(faithfulness.reading(tested_curves))
        st.dataframe(faithfulness.areas_table(tested_curves), hide_index=True)
        st.caption(
            f"{faithfulness.verdict(tested_curves)} The area is the curve's mean height over the share of patches"
            f" removed or kept, 0 to 1; {len(tested_curves.fractions) - 1} steps; rollout: {fusion} of the heads"
            + (f", the weakest {discard:.0%} discarded" if discard else "")
            + f"; the mask: the patches holding {mass:.0%} of the sharpest head's attention. {faithfulness.RANDOM_FLOOR}"
        )

st.subheader("How far and how focused each head looks")
st.write(
    "Mean attention distance (ViT paper, Fig. 7): the average pixel distance between a patch and"
    " the patches it attends to. Entropy: near 0 when a head looks at one token, log N when it"
    " spreads evenly. Early layers mix local and global heads; late layers are mostly global."
)
statistics = selection.cached_head_statistics()
with_statistics = costs.attention_view_forwards(config, statistics=True)
if statistics is None and costs.is_heavy(config, forwards=with_statistics):
    st.write(
        f"With every head measured, this page's view of this model costs about {with_statistics:.1f} forward passes"
        " (every layer's attention computed again and read): the measures run when you ask, beside the server, so"
        " that the pages stay quick for everybody, and then serve everyone who looks at this picture."
    )
    statistics = jobs.head_statistics(selection, "Measure every head")
elif statistics is None:
    statistics = selection.head_statistics()
if statistics is not None:
    distances, entropies = statistics  # (L, H) each
    distance_column, entropy_column = st.columns(2)
    distance_column.plotly_chart(selection.memo("distance figure", compute=lambda: figures.layer_head_scatter(
        distances, "Mean attention distance per head", "distance (pixels)",
    )))
    entropy_column.plotly_chart(selection.memo("entropy figure", compute=lambda: figures.layer_head_heatmap(
        entropies, "Attention entropy per head", "entropy (nats)",
    )))

st.subheader("Token norms through the layers")
st.write(
    "The length of every token after a chosen layer. Large ViTs trained long (DINOv2, CLIP,"
    " DeiT III) recycle a few background patches as scratch space: from the middle layers on, they"
    " stand out with norms many times the others' and draw the attention of everyone. Register"
    " tokens (Darcet et al. 2023) were added to absorb exactly that, leaving the patches clean."
)
stage = st.slider(
    "Tokens after this many layers", 0, depth,
    **session.keep("norm_stage", depth, lambda stage: 0 <= stage <= depth),
)
st.plotly_chart(selection.memo("token norms", stage, compute=lambda: figures.token_norms_figure(
    analysis.token_norms(result.tokens[0, stage]), result.grid_size, prefix,
    layer=stage - 1 if stage else None, class_token=config.class_token, dist_token=config.dist_token,
)))
