"""Lesson: the sidebar's image through the sidebar's model in eleven steps, from the photo to the
prediction, one experiment and which map to believe; where a step asks a question, the learner
answers first and the model's own numbers for this image answer after (app/lesson.py keeps the
state and says what the steps say of the model)."""
import math

import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.analysis import answers
from vit_explorer.model import ablation, rope
from vit_explorer.app import costs, faithfulness, jobs, lesson, models, session, word_maps, words
from vit_explorer.app.memo import memo
from vit_explorer.app.selection import prediction_caveats, uniform_attention_caveat
from vit_explorer.model.internals import activation_name

selection = session.selection()
config = selection.config
result = selection.capture()
image = selection.display_image()
names = selection.class_names()
depth, heads, dim, head_dim = config.depth, config.num_heads, config.embed_dim, config.head_dim
grid_h, grid_w = result.grid_size
patches, prefix, tokens = grid_h * grid_w, result.num_prefix_tokens, result.num_tokens
headless = config.num_classes == 0
probabilities = None if headless else result.logits[0].softmax(-1)
in_words = words.words_model(selection.model_key) if headless else None  # CLIP, SigLIP: a prediction in words
last, middle = depth - 1, depth // 2
labels = figures.token_labels(tokens, prefix, config.class_token, config.dist_token)

# The token the steps follow, in the Attention and Inside pages' terms (they share layer, head and
# query): the class token, or without one the centre patch.
CLASS_QUERY = -1
centre = (grid_h // 2) * grid_w + grid_w // 2
query = CLASS_QUERY if config.class_token else centre
query_patch = None if query == CLASS_QUERY else query  # analysis.query_map's query, the patch outlined
token = 0 if query == CLASS_QUERY else prefix + query
followed = "class token" if query == CLASS_QUERY else f"centre patch (patch {centre})"


def patch_name(patch: int) -> str:
    row, col = divmod(patch, grid_w)
    return f"patch {patch} (row {row}, col {col})"


def head_name(index: int) -> str:
    return "layer {}, head {}".format(*divmod(index, heads))


def inside_figures(layer: int, head: int) -> dict:
    """The Inside a layer page's figures for the followed token (shared with it)."""
    steps = selection.internals(layer, token)
    return selection.memo("inside figures", layer, head, query, compute=lambda: figures.inside_layer_figures(
        image, steps, result.grid_size, labels, head, token, query_patch, activation_name(config)
    ))


def head_maps(layer: int):
    """(heads, gh, gw) where each head of ``layer`` looks from the followed token (the Attention page's)."""
    return selection.memo("head maps", layer, query, compute=lambda: analysis.query_map(
        selection.attention(layer), result.grid_size, prefix, query_patch, class_token=config.class_token
    ))


def ask_again_button(question: str) -> None:
    st.button("Ask me again", key=f"again_{question}", on_click=lesson.ask_again, args=(question, selection),
              icon=":material/replay:")


# --- the steps -----------------------------------------------------------------------------------

def photo() -> None:
    given_width, given_height = selection.image.size
    height, width = config.img_size
    resized = (
        f"is already the {width} x {height} pixels this model reads" if (given_width, given_height) == (width, height)
        else f"becomes the {width} x {height} pixels this model reads ({selection.input_described()})"
    )
    st.write(
        f"A Vision Transformer does not read a picture pixel by pixel. Your picture, {given_width} x {given_height}"
        f" px, {resized}, and is cut into {grid_h} rows and {grid_w} columns of patches of {config.patch_size} x"
        f" {config.patch_size} pixels: {patches} patches, every pixel in exactly one. From here on each patch"
        " is one word of the sentence the model reads."
    )
    st.caption("Your own photo works too: upload it in the sidebar, and every step shows it.")
    st.plotly_chart(selection.memo("image with grid", compute=lambda: figures.image_with_grid(image, result.grid_size)))
    lesson.explore_button("views/patches.py", "Patches")


def vectors() -> None:
    channels, patch = config.in_chans, config.patch_size
    st.write(
        f"Each patch's {channels} x {patch} x {patch} = {channels * patch * patch} pixel values are"
        " unrolled into one list, and the patches are read row by row, like words. One learned matrix,"
        f" the same for every patch, turns each list into {dim} numbers: the patch's token. From now on"
        f" the model never sees a pixel again, only these {patches} tokens."
    )
    st.plotly_chart(selection.memo("patch sequence", compute=lambda: figures.patch_sequence(
        analysis.denormalize(result.patches[0], config)
    )))
    st.plotly_chart(selection.memo("patch embeddings", compute=lambda: figures.token_matrix(
        result.patch_embeddings[0], 0, "Patch embeddings"
    )))
    lesson.explore_button("views/pipeline.py", "Pipeline")


def positions() -> None:
    st.write(lesson.positions_sentences(config))
    rotary, added = config.rope_type is not None, config.abs_pos_embed
    left, right = st.columns(2) if added else (st.container(), st.container())  # the angles need the width
    left.plotly_chart(selection.memo("lesson layer 0 tokens", compute=lambda: figures.token_matrix(
        result.tokens[0, 0], prefix, "The tokens entering layer 0", class_token=config.class_token,
        dist_token=config.dist_token,
    )))
    left.caption(
        "What the first layer receives, one row per token: "
        + ("the patches, in reading order." if not prefix else f"the first row is {labels[0]}, then the patches."
           if prefix == 1 else f"the first {prefix} rows are {', '.join(labels[:prefix])}, then the patches.")
    )
    if added:
        right.plotly_chart(memo(  # the Patches page's: the model at this patch and input size, any image
            (*selection.key[:3], "position similarity"),
            lambda: figures.position_similarity_grid(analysis.position_embedding_similarity(selection.model)),
        ))
        right.caption(
            "Tile (row, col): how alike that patch's position vector is to every other patch's. Nobody told"
            " the model where the patches are: it learned the grid."
        )
    elif rotary:
        right.plotly_chart(selection.memo("rotation angles", compute=lambda: figures.rotation_angles_figure(
            rope.angles(selection.model.rope_spec, result.grid_size), result.grid_size,
            rope.angle_pairs(selection.model.rope_spec, result.grid_size),
            f"Each patch's rotation angle, for 8 of its {head_dim // 2} pairs: slowest to fastest, down and across",
        )))
        right.caption("Nothing here is learned: the angles come from the grid alone, so they follow any image size.")
    if added:
        lesson.explore_button("views/patches.py", "Patches")
    else:
        lesson.explore_button("views/pipeline.py", "Pipeline")


def where_it_looks() -> None:
    st.write(
        "In every layer each token builds its next version from a mix of all the tokens, weighted by its"
        f" attention: {tokens} weights, positive, summing to 1. Follow the {followed} in the last layer,"
        f" layer {last}"
        + (": what it gathers there is what the classifier reads." if query == CLASS_QUERY else ".")
    )
    st.markdown(
        f"**Before you look:** click the patch you think the {followed} attends to most in layer {last}"
        f" (the mean of its {heads} heads)."
    )
    guess = lesson.answer("patch", selection)
    picker, answer = st.columns(2)
    with picker:
        st.plotly_chart(
            selection.memo("lesson patch picker", guess, compute=lambda: figures.patch_picker(
                image, result.grid_size, guess, title=dict(text="Click your patch", x=0.01, xanchor="left"),
            )),
            key="lesson_patch_click", on_select=lesson.patch_clicked("patch", selection, "lesson_patch_click"),
            selection_mode="points", config={"displayModeBar": False},
        )
        st.selectbox(
            "Or choose it here", list(range(patches)), format_func=patch_name, index=None, placeholder="your patch",
            **lesson.answer_widget("patch", selection),
        )
    if guess is not None:
        reveal_patch(guess, answer)
    lesson.explore_button("views/attention.py", "Attention", layer=last, query=query)


def reveal_patch(guess: int, column) -> None:
    mean_map = selection.memo("lesson mean map", last, query, compute=lambda: head_maps(last).mean(dim=0))
    rank = answers.patch_rank(mean_map, guess)
    with column:
        st.plotly_chart(selection.memo("lesson patch answer", guess, compute=lambda: figures.attention_overlay(
            image, mean_map, query_patch=guess, weights=True,
            title=f"The {followed}'s attention in layer {last}<br>(the mean of {heads} heads; outlined: your patch)",
        )))
    value, best = answers.percents(rank.value, rank.best_value)
    if rank.undecided:
        said = (
            f"**{rank.verdict('patch')}.** Your {patch_name(guess)} gets {value} of the {followed}'s attention, as do"
            f" {rank.tied} others" + ("." if rank.right else f"; the most, {best}, goes to {patch_name(rank.best)}.")
            + " Attention this even picks nothing out."
        )
    else:
        ties = f", tied with {rank.tied} other{'s' if rank.tied > 1 else ''}" if rank.tied else ""
        said = (
            f"**{rank.verdict('patch')}.** Your {patch_name(guess)} gets {value} of the {followed}'s attention"
            f" and ranks {answers.ordinal(rank.rank)} of {rank.total}{ties}"
            + ("." if rank.right else f"; the most goes to {patch_name(rank.best)}, {best}.")
        )
    elsewhere = 1 - float(mean_map.sum())  # what the row gives the prefix tokens
    if elsewhere >= 0.005:
        said += (
            f" The other {elsewhere:.0%} goes to no patch: to the"
            + (" token itself." if prefix == 1 else f" {prefix} prefix tokens.")
        )
    st.write(said)
    ask_again_button("patch")


def how_it_decides() -> None:
    rows = selection.attention(last)[:, token]  # (heads, N)
    sharpest = selection.memo("lesson sharpest head", last, token, compute=lambda: answers.sharpest_head(rows))
    st.write(
        f"How does a head choose its weights? The {followed} asks with a query q, {head_dim} numbers made from"
        f" its token by the head's own matrix; every token offers a key k, {head_dim} numbers made the same way."
        f" Each score is the dot product q·k divided by sqrt({head_dim}) = {math.sqrt(head_dim):.3g}, and the"
        f" softmax turns the {tokens} scores into weights that are positive and sum to 1."
        + (" This model first turns each patch's q and k by the patch's position (the prefix tokens are not turned)."
           if config.rope_type is not None else "")
        + f" One head of layer {last}, with this image's numbers (the one most focused on this token, to begin with):"
    )
    head = st.columns([1, 3])[0].selectbox(
        "Head", list(range(heads)), **session.keep("lesson_head", sharpest, lambda value: 0 <= value < heads),
    )
    figs = inside_figures(last, head)
    st.plotly_chart(figs["query"])
    st.plotly_chart(figs["scores"])
    st.plotly_chart(figs["attention"])
    st.markdown(
        f"**Before you look:** the division by sqrt({head_dim}) sets the softmax's scale. With half that scale,"
        " will this softmax be flatter (its weight spread over more tokens) or sharper (more on the top few)?"
    )
    guess = st.radio(
        "Your answer", ["flatter", "sharper", "unchanged"], index=None, horizontal=True,
        **lesson.answer_widget("scale", selection),
    )
    kept = dict(layer=last, head=head, query=query)
    if guess is not None:
        steps = selection.internals(last, token)
        change, numbers = selection.memo(
            "lesson softmax change", last, head, token, compute=lambda: answers.softmax_change(steps, head, token, 0.5),
        )
        (entropy, halved), (largest, largest_halved) = numbers["entropy"], numbers["largest weight"]
        st.write(
            f"**{'Right' if guess == change else 'Not this time'}: {change}.** At half the scale the entropy goes"
            f" from {entropy:.3f} to {halved:.3f} nats (0 when all the weight is on one token, ln {tokens} ="
            f" {math.log(tokens):.3f} when it is spread evenly) and the largest weight from {largest:.3f} to"
            f" {largest_halved:.3f}. Halving the scale halves the gaps between the scores, and the softmax turns"
            " gaps into ratios exponentially: smaller gaps, more even weights."
        )
        scaled = selection.memo(  # the Inside a layer page's at that scale
            "inside scale figures", last, head, query, 0.5, compute=lambda: figures.softmax_scale_figures(
                image, steps, result.grid_size, labels, head, token, 0.5, query_patch
            ),
        )
        st.plotly_chart(scaled["rescaled_attention"])
        st.plotly_chart(scaled["scale_sweep"])
        ask_again_button("scale")
        kept["softmax_scale"] = 0.5
    lesson.explore_button("views/inside.py", "Inside a layer", **kept)


def many_heads() -> None:
    st.write(
        f"Layer {last} has {heads} heads. Each has its own query, key and value matrices, so each asks its own"
        " question of the same tokens and finds its own answer; their outputs are then put side by side and"
        f" mixed into one vector. Where each head of layer {last} looks from the {followed}:"
    )
    maps = head_maps(last)
    st.plotly_chart(selection.memo("lesson heads grid", last, query, compute=lambda: figures.attention_heads_grid(
        image, maps, layer=last, query=followed, query_patch=query_patch,
    )))
    # Every head measured: read from the capture where it holds every layer, else a job (app.costs).
    statistics = selection.cached_head_statistics()
    if statistics is None and costs.is_heavy(config, forwards=costs.head_statistics_forwards(config)):
        statistics = jobs.head_statistics(selection, "Measure every head")
    elif statistics is None:
        statistics = selection.head_statistics()
    if statistics is None:  # the job's button or progress stands in their place
        lesson.explore_button("views/attention.py", "Attention", layer=last, query=query)
        return
    distances, entropies = statistics  # (depth, heads) each, over every query
    near, far = int(distances[last].argmin()), int(distances[last].argmax())
    focused, spread = int(entropies[last].argmin()), int(entropies[last].argmax())
    st.write(
        f"Measured over every query of this image, the heads of layer {last} differ: head {near} looks nearest"
        f" ({float(distances[last, near]):.0f} px away on average) and head {far} farthest"
        f" ({float(distances[last, far]):.0f} px); head {focused} is the most focused (entropy"
        f" {float(entropies[last, focused]):.2f} nats) and head {spread} the most spread"
        f" ({float(entropies[last, spread]):.2f}, of at most ln {tokens} = {math.log(tokens):.2f}). Every head of"
        " every layer, by how far it looks:"
    )
    st.plotly_chart(selection.memo("distance figure", compute=lambda: figures.layer_head_scatter(
        distances, "Mean attention distance per head", "distance (pixels)",
    )))
    lesson.explore_button("views/attention.py", "Attention", layer=last, query=query)


def mlp() -> None:
    steps = selection.internals(middle, token)
    hidden = steps.mlp_hidden.shape[-1]
    st.write(
        f"After attention has mixed the tokens, a small network, the MLP, works on each token alone: {hidden}"
        f" hidden units, each a learned pattern that lets the token through ({activation_name(config)}) when"
        " it matches. Neither step replaces the token: each adds its result to it. So a token is a running"
        " sum, the residual stream, that every layer reads and writes. The"
        f" {followed} in layer {middle}:"
    )
    figs = inside_figures(middle, 0)
    st.plotly_chart(figs["mlp_units"])
    st.plotly_chart(figs["mlp_residual"])
    said = lesson.predicted(selection)
    if said is None:
        if not in_words:  # in words: the class embeddings' button or progress is drawn instead
            st.info(models.NO_CLASSIFIER.format(what="This step's question (will the prediction survive without the MLP?)"))
    else:
        intact_scores, said_names, figure_key = said
        top = int(intact_scores.argmax())
        (share,) = answers.percents(float(intact_scores[top]))
        st.markdown(
            f"**Before you look:** the model says '{said_names[top]}' ({share}). Remove layer"
            f" {middle}'s MLP (its hidden units set to zero, so the layer adds only its bias): will it still say"
            f" '{said_names[top]}'?"
        )
        guess = st.radio(
            "Your answer", ["yes", "no"], index=None, horizontal=True,
            format_func={
                "yes": f"yes, still '{said_names[top]}'", "no": f"no, another {'label' if in_words else 'class'} wins",
            }.get,
            **lesson.answer_widget("mlp", selection),
        )
        if guess is not None:
            knock_out = ablation.KnockOut(mlp=(middle,))
            knocked = lesson.predicted(selection, knock_out)[0]
            survives = answers.prediction_survives(intact_scores, knocked)
            winner = int(knocked.argmax())
            intact, without = answers.percents(float(intact_scores[top]), float(knocked[top]))
            st.write(
                f"**{'Right' if (guess == 'yes') == survives else 'Not this time'}.** "
                + (f"It survives: still '{said_names[top]}', with {without} instead of {intact}." if survives else
                   f"It does not: '{said_names[top]}' falls from {intact} to {without}, and '{said_names[winner]}' wins with"
                   f" {float(knocked[winner]):.1%}.")
                + " The layers after it read a residual stream that lacks only this one MLP's share."
            )
            st.plotly_chart(selection.memo(*figure_key, knock_out, compute=lambda: figures.knockout_topk(
                intact_scores, knocked, said_names, what=knock_out.describe(),
            )))
            if in_words:
                st.caption(words.about(selection.model_key))
            ask_again_button("mlp")
    lesson.explore_button("views/inside.py", "Inside a layer", layer=middle, query=query)


def layers() -> None:
    st.write(
        f"The {depth} layers repeat the same two steps, attention then MLP, each reading what the layers before it"
        f" wrote. Follow the {followed} through them: where it looks (the mean of the heads) changes with depth"
        + ("" if headless else
           ", and so does what the classifier would say if it read the tokens early: the logit lens applies the"
           " final norm and head after every layer")
        + "."
    )
    maps = selection.query_maps_by_layer(query_patch)
    st.plotly_chart(selection.memo("lesson attention by layer", query, compute=lambda: figures.attention_by_layer(
        image, maps, query=followed, query_patch=query_patch,
    )))
    if headless:
        st.info(models.NO_CLASSIFIER.format(what="The logit lens"))
    else:
        lens = selection.logit_lens()  # (depth + 1, classes)
        top = int(lens[-1].argmax())
        settled = answers.settled_from(lens)
        st.write(
            f"'{names[top]}' is the top class "
            + ("from the embeddings on, before any layer." if settled == 0 else
               f"from layer {settled - 1} on" + (", the last one" if settled == depth else f" ({depth} layers in all)")
               + f"; just before, the read-out said '{names[int(lens[settled - 1].argmax())]}'.")
        )
        st.plotly_chart(selection.memo("logit lens", compute=lambda: figures.logit_lens_figure(lens, names)))
    lesson.explore_button("views/attention.py", "Attention", layer=0, query=query)


def prediction() -> None:
    pooled = models.pooled_output(config)
    if in_words:
        st.write(
            f"At the end the model keeps one vector, {pooled}, normalised, and carries it into the"
            f" {in_words.embed_dim} numbers its text tower writes a sentence as. It has no list of classes: each"
            " label goes through the text tower, and the image's cosine with each label is its score."
        )
        st.caption(words.about(selection.model_key))
        said = words.prediction(selection)
        if said is not None:
            (best, score), *_ = said.top(1)
            if words.chooses(said):
                st.write(f"For your image it says **{best}**, with {answers.percents(score)[0]}.")
            for caveat in words.caveats(selection, said):
                st.warning(caveat)
            st.plotly_chart(words.top_labels_figure(selection, said))
    elif headless:
        st.write(
            f"At the end the model keeps one vector, {pooled}, normalised: {dim} numbers that describe the image."
            " Such features are compared between images (the Several images page) or read by a classifier trained"
            " later."
        )
        st.info(models.NO_CLASSIFIER.format(what="A prediction"))
    else:
        top = int(probabilities.argmax())
        st.write(
            f"At the end the model keeps one vector, {pooled}, normalises it, and one matrix maps it to"
            f" {config.num_classes} scores, one per class; the softmax turns them into probabilities that sum to"
            f" 1. For your image it says **{names[top]}**, with {answers.percents(float(probabilities[top]))[0]}."
        )
        st.plotly_chart(selection.memo("top-5 figure", compute=lambda: figures.topk_bar(probabilities, names, k=5)))
    lesson.explore_button("views/pipeline.py", "Pipeline")


def experiment() -> None:
    cost = ablation.sweep_cost(config)
    top = None if headless else int(probabilities.argmax())
    measure = "the feature the model outputs" if headless else f"the probability of '{names[top]}'"
    st.write(
        "Where a head looks does not say whether it matters. Knock a head out (its output set to zero) and the"
        f" model reads your image without it. Which of the {depth * heads} heads matters most for {measure}?"
        f" While you think, each one is tried alone: about {cost:.0f} forward passes of work."
    )
    st.markdown("**Before you look:** which head will matter most when knocked out?")
    guess = st.selectbox(
        "Your guess", list(range(depth * heads)), format_func=head_name, index=None, placeholder="a layer and a head",
        **lesson.answer_widget("head", selection),
    )
    sweep = jobs.sweep(selection, "zero", ask=True)  # drawn under the question: its place, its progress
    if sweep is None or guess is None:
        if guess is not None:
            st.caption("Your guess is in: the answer shows as soon as every head has been tried.")
        lesson.explore_button("views/knockout.py", "Knock-out")
        return
    layer, head = divmod(guess, heads)
    rank = answers.head_rank(sweep.values, layer, head)
    best_layer, best_head = divmod(rank.best, heads)
    if headless:  # the sweep's values: the cosine of the pooled feature to the intact one, minus 1
        intact = ""
        effect = {index: f"the feature keeps a cosine of {1 + value:.4f} with the intact one"
                  for index, value in ((guess, rank.value), (rank.best, rank.best_value))}
    else:  # the sweep's values: the change of the predicted class's log-probability
        shown = answers.percents(*(
            float(probabilities[top]) * math.exp(change) for change in (0.0, rank.value, rank.best_value)
        ))
        intact = f" The intact model gives '{names[top]}' {shown[0]}."
        effect = {guess: f"'{names[top]}' gets {shown[1]}", rank.best: f"'{names[top]}' gets {shown[2]}"}
    st.write(
        f"**{rank.verdict('head')}.**{intact} Without layer {layer}, head {head} {effect[guess]}: that head ranks"
        f" {answers.ordinal(rank.rank)} of {rank.total}"
        + ("." if rank.right else
           f". The head that matters most is layer {best_layer}, head {best_head}: without it {effect[rank.best]}.")
    )
    st.plotly_chart(selection.memo("lesson sweep grid", guess, compute=lambda: figures.head_sweep_grid(
        sweep.values, sweep.measure, knocked=ablation.KnockOut(heads={layer: (head,)}).head_mask(config),
        title=f"Each head knocked out alone: {sweep.measure}; outlined: your guess",
    )))
    st.write(f"The experiment: the model without layer {best_layer}, head {best_head}, against the intact model.")
    knock_out = ablation.KnockOut(heads={best_layer: (best_head,)})
    knocked = selection.knock_out_capture(knock_out)
    if headless:
        cosine = selection.memo("knock-out cosine", knock_out, compute=lambda: ablation.pooled_cosine(
            result.logits[0], knocked.logits[0]
        ))
        st.metric("Cosine between the pooled features, intact and knocked out", f"{cosine:.6f}")
        said = lesson.predicted(selection)
        if said is not None:  # in words: what the model says without that head
            intact_scores, said_names, figure_key = said
            st.plotly_chart(selection.memo(*figure_key, knock_out, compute=lambda: figures.knockout_topk(
                intact_scores, lesson.predicted(selection, knock_out)[0], said_names, what=knock_out.describe(),
            )))
            st.caption(words.about(selection.model_key))
    else:
        after = knocked.logits[0].softmax(-1)
        winner = int(after.argmax())
        if winner != top:
            st.write(f"It now says '{names[winner]}' ({float(after[winner]):.1%}).")
        st.plotly_chart(selection.memo("knock-out top-k", knock_out, compute=lambda: figures.knockout_topk(
            probabilities, after, names, what=knock_out.describe(),
        )))
    ask_again_button("head")
    knocked_heads = {
        session.knockout_heads_key(index): [best_head] if index == best_layer else [] for index in range(depth)
    }
    lesson.explore_button(
        "views/knockout.py", "Knock-out", **knocked_heads, knockout_attention=[], knockout_mlp=[], knockout_mode="zero",
    )


def where_is_the_word() -> None:
    """For a model with a text tower, after the experiment: where in the image its top label is."""
    labels = words.session_labels()
    # ImageNet's class embeddings not there yet: the prediction step offers them, and this part waits.
    said = words.prediction(selection) if in_words is not None and words.embeddings_kept(selection.model_key, labels) else None
    if said is None:
        return
    best = int(said.scores.argmax())
    similarity = word_maps.label_similarity(selection, labels, best)
    if similarity is None:
        return
    name = said.labels[best]
    st.markdown("**Where is the word?**")
    st.write(
        f"The model said '{name}'. A model that reads words can also say where: every patch is carried into the"
        " space where it compares images with texts, along the path its pooling would take if it read that patch"
        f" alone, and coloured by its cosine with '{name}'."
    )
    st.plotly_chart(selection.memo("lesson word map", words.labels_id(labels), best, compute=lambda: (
        figures.similarity_grid(image, similarity[None], [name], word_maps.how(word_maps.model_for(selection)))
    )))
    st.page_link("views/attention.py", icon=":material/translate:", label="Ask about your own words: Attention, Ask in words")


def last_step() -> None:
    experiment()
    where_is_the_word()


def which_map() -> None:
    """The honest end: the maps of the steps before, tested by this image's deletion curves."""
    # The attribution is one forward and one backward pass: within a view's budget, so always tested here.
    attributed = not costs.is_heavy(config, forwards=costs.attribution_forwards(config))
    tested = faithfulness.page_maps(selection, attribution=attributed)
    choices = list(tested.maps)
    score = tested.what or ("the cosine of the feature with the intact one" if headless else f"the probability of '{names[int(probabilities.argmax())]}'")
    st.write(
        "The steps above drew where the model looks in several ways: one layer's attention, rollout through every"
        " layer, " + ("the attribution that follows the gradient, " if faithfulness.has_attribution(tested) else "")
        + "one head's mask. They disagree, and attention is not explanation. A map claims that its brightest patches"
        f" matter, so test the claim: take those patches out first (their tokens dropped, nothing painted over) and"
        f" watch {score} fall. The map that makes it fall fastest shows best what the model used; a random order is"
        " the floor any map should beat. Then the other way round: keep only those patches and watch it rise."
    )
    st.markdown("**Before you look:** which map will make the score fall fastest?")
    guess = st.selectbox(
        "Your guess", choices, index=None, placeholder="a map",
        **lesson.answer_widget("map", selection),
    )
    curves = faithfulness.curves(selection, tested, "drop", faithfulness.CURVES, label="Test the maps", ask=True)
    if curves is None or guess is None:
        if guess is not None:
            st.caption("Your guess is in: the answer shows as soon as every map has been tested.")
        lesson.explore_button("views/attention.py", "Attention")
        return
    st.write(faithfulness.lesson_answer(curves, guess))
    st.plotly_chart(selection.memo("lesson faithfulness", *tested.key, compute=lambda: figures.faithfulness_figure(
        curves.fractions, curves.curves, curves.names, curves.what, curves.percent,
    )))
    st.dataframe(faithfulness.areas_table(curves), hide_index=True)
    st.caption(
        "The area under each curve is the score's mean as the patches go, 0 to 1: for deletion the smaller, for"
        f" insertion the larger, the truer the map. {faithfulness.RANDOM_FLOOR} One image says little: try another,"
        " or the mean-colour comparison on the Attention page."
    )
    ask_again_button("map")
    lesson.explore_button("views/attention.py", "Attention")
    st.success(
        "That is the whole path, from your photo to the prediction, back into the model and back to the maps. Every"
        " page in the sidebar takes one of these steps further, on any image and any model."
    )


STEPS = (
    photo, vectors, positions, where_it_looks, how_it_decides, many_heads, mlp, layers, prediction, last_step, which_map,
)

# --- the page ------------------------------------------------------------------------------------

number = lesson.step()
count = len(lesson.STEPS)
st.title("Lesson")
st.write(
    "Eleven steps from your picture to what the model makes of it, with this model's own numbers. Where a step"
    " asks a question, answer before you look: the answer is checked against the model."
)
caveats = ([] if headless else prediction_caveats(selection, probabilities)) + [uniform_attention_caveat(selection)]
for caveat in filter(None, caveats):
    st.warning(caveat)

back, picker, following = st.columns([1.4, 7, 1.4], vertical_alignment="bottom")
back.button("Back", on_click=lesson.go_to, args=(number - 1,), disabled=number == 1,
            icon=":material/chevron_left:", width="stretch")
picker.selectbox(
    "Step", list(range(1, count + 1)), format_func=lambda index: f"{index}. {lesson.STEPS[index - 1]}",
    **lesson.step_picker(),
)
following.button("Next", on_click=lesson.go_to, args=(number + 1,), disabled=number == count,
                 icon=":material/chevron_right:", width="stretch")
st.progress(number / count)
st.subheader(f"{number}. {lesson.STEPS[number - 1]}")
STEPS[number - 1]()

if number < count:
    st.button(f"Next: {lesson.STEPS[number]}", key="lesson_next_below", on_click=lesson.go_to, args=(number + 1,),
              icon=":material/chevron_right:", type="primary")
with st.expander("For teachers: a link to this step"):
    link, names_model = lesson.teacher_link()
    st.code(link, language=None)
    st.caption(
        "It opens this step on this picture and model for anyone on this server"
        + (", and carries nothing of yours (no owner token)." if names_model else
           "; this model cannot be named in a link (a file the server was started with), so it opens the default"
           " model.")
    )
lesson.keep_step_in_address()
