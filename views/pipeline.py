"""Pipeline: the chosen image through the whole ViT, one step at a time, with the tensor shapes."""
import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.model import rope
from vit_explorer.app import models, session, words
from vit_explorer.app.selection import prediction_caveats, uniform_attention_caveat
from vit_explorer.model.internals import activation_name

selection = session.selection()
config = selection.config
result = selection.capture()
image = selection.display_image()
names = selection.class_names()

height, width = config.img_size
grid_h, grid_w = result.grid_size
channels, patch, dim = config.in_chans, config.patch_size, config.embed_dim
patches, tokens = grid_h * grid_w, result.num_tokens
prefix = config.num_prefix_tokens
given_width, given_height = selection.image.size
headless = config.num_classes == 0
in_words = words.words_model(selection.model_key) if headless else None  # CLIP, SigLIP: its text tower
rotary = config.rope_type is not None
added = config.abs_pos_embed
head_dim, gated = config.head_dim, config.swiglu_mlp
reads = models.language_model_reads(config, (grid_h, grid_w))  # a VLM's tower: what its language model reads

st.title("Pipeline")
st.page_link(
    "views/lesson.py", icon=":material/school:",
    label="New to Vision Transformers? The Lesson walks your picture through the model in eleven steps, asking before it shows",
)
st.write(
    "A Vision Transformer reads an image the way a language model reads a sentence: it cuts the"
    " picture into patches, turns every patch into a vector (a token) and lets the tokens exchange"
    " information in a stack of attention layers. Follow the chosen image through every step;"
    " the shapes are the real ones of this model."
)

prefix_names = (
    (["class token"] if config.class_token else [])
    + (["distillation token"] if config.dist_token else [])
    + ([f"{config.reg_tokens} register tokens"] if config.reg_tokens else [])
)
steps = [
    ("Resize and normalise", f"({channels}, {height}, {width})"),
    ("Cut into patches", f"({grid_h}, {grid_w}, {channels}, {patch}, {patch})"),
    ("Flatten each patch", f"({patches}, {channels * patch * patch})"),
    ("Linear projection", f"({patches}, {dim})"),
    ("Prepend " + (" and ".join(prefix_names) or "nothing (no class token)"), f"({tokens}, {dim})"),
    ("Add position embeddings" if added else "Positions: nothing added (rotations in attention)"
     if rotary else "Positions: none", f"({tokens}, {dim})"),
    (f"{config.depth} encoder layers", f"({tokens}, {dim}); attention ({config.num_heads}, {tokens}, {tokens}) each"),
    *([("What the language model reads", reads[1])] if reads else [
        ("Pool, norm and projection: the image among the texts", f"({dim},) -> ({in_words.embed_dim},)")
        if in_words else ("Pool and norm: the image's feature vector", f"({dim},)")
        if headless else ("Pool, norm and classification head", f"({dim},) -> ({config.num_classes},)"),
        ("Top-5 prediction in words", "5 labels") if in_words else
        ("Top-5 prediction", "none: no classifier" if headless else "5 classes"),
    ]),
]
st.dataframe(
    {"step": [f"{i}. {name}" for i, (name, _) in enumerate(steps, 1)], "shape": [s for _, s in steps]},
    hide_index=True,
)

st.subheader("1. Resize and normalise")
st.write(
    f"The picture is {given_width} px wide and {given_height} px high; the model reads {selection.input_described()}"
    f" (the {width} x {height} pixels, width x height, it was built for), normalised with mean {config.mean} and std"
    f" {config.std}, the statistics it was trained with. This is exactly what the model sees:"
)
st.code(f"({given_height}, {given_width}, 3) picture -> (1, {channels}, {height}, {width}) tensor")
st.plotly_chart(selection.memo("input image", compute=lambda: figures.input_image(image, f"Model input: {width} px wide, {height} px high")))

st.subheader("2. Cut into patches")
st.write(
    f"The input is cut into a {grid_h}x{grid_w} grid of non-overlapping {patch}x{patch} patches."
    " Nothing overlaps and nothing is thrown away; every pixel belongs to exactly one patch."
)
st.code(f"(1, {channels}, {height}, {width}) -> ({grid_h}, {grid_w}, {channels}, {patch}, {patch})")
st.plotly_chart(selection.memo("image with grid", compute=lambda: figures.image_with_grid(image, result.grid_size)))

st.subheader("3. Flatten each patch")
st.write(
    f"Each patch is unrolled into one vector of {channels}x{patch}x{patch} = {channels * patch * patch}"
    " numbers, and the patches are read row by row, like words in a sentence."
)
st.code(f"({grid_h}, {grid_w}, {channels}, {patch}, {patch}) -> ({patches}, {channels * patch * patch})")
st.plotly_chart(selection.memo("patch sequence", compute=lambda: figures.patch_sequence(
    analysis.denormalize(result.patches[0], config)
)))

st.subheader("4. Linear projection (patch embedding)")
st.write(
    f"One learned matrix maps every flattened patch to a {dim}-dimensional token. It is the same"
    " matrix for every patch (in code: a convolution whose kernel and stride are the patch size)."
)
st.code(f"({patches}, {channels * patch * patch}) @ ({channels * patch * patch}, {dim}) -> ({patches}, {dim})")
st.plotly_chart(selection.memo("patch embeddings", compute=lambda: figures.token_matrix(result.patch_embeddings[0], 0, "Patch embeddings")))

st.subheader("5. Prepend the class token" if config.class_token else "5. Prefix tokens")
if prefix:
    parts = []
    if config.class_token:
        parts.append(
            "A learned class token is put in front of the patch tokens. It belongs to no patch;"
            " through the layers it gathers what the classifier needs."
        )
    if config.dist_token:
        parts.append(
            "A distillation token follows (DeiT): trained to agree with a teacher network, it has"
            " a head of its own, and the prediction averages the two heads."
        )
    if config.reg_tokens:
        parts.append(
            f"{config.reg_tokens} register tokens follow: scratch space that keeps the patch"
            " tokens free of artefacts (Darcet et al. 2023)."
        )
    st.write(" ".join(parts))
else:
    st.write(
        "This model has no class token: it classifies the mean of the patch tokens, so the"
        " sequence is just the patches."
    )
st.code(f"({patches}, {dim}) -> ({tokens}, {dim})")

layer_0 = "Tokens entering layer 0"
if added:
    st.subheader("6. Add position embeddings")
    st.write(
        "Attention itself ignores order, so a learned vector per position is added to each token;"
        " without it the model would see a bag of patches. The Patches page shows what these"
        " vectors learned."
        + (" This model also rotates its queries and keys by their positions in every layer (below)." if rotary else "")
    )
    positions = patches if config.no_embed_class else tokens
    st.code(f"({tokens}, {dim}) + ({positions}, {dim}) position embeddings -> ({tokens}, {dim})")
else:
    st.subheader("6. Positions: nothing is added" if rotary else "6. Positions: none")
    st.write(
        "Attention itself ignores order, but this model adds nothing to the tokens here: the tokens"
        " entering layer 0 are the patch embeddings"
        + (" and the prefix tokens, " if prefix else ", ")
        + "as they are."
        + (" Its positions enter inside every layer instead (below)." if rotary
           else " It has no position information at all: it sees a bag of patches.")
    )
    st.code(f"({tokens}, {dim}) -> ({tokens}, {dim}): nothing added")
    layer_0 += ": patch embeddings" + (" and prefix tokens" if prefix else "") + ", no positions added"
st.plotly_chart(selection.memo("layer 0 tokens", compute=lambda: figures.token_matrix(
    result.tokens[0, 0], prefix, layer_0, class_token=config.class_token, dist_token=config.dist_token,
)))
if rotary:
    st.markdown("**Where positions enter: rotations of the queries and keys (RoPE)**")
    st.write(
        f"In every attention layer, just before the scores are computed, each head cuts the {head_dim}"
        f" numbers of a patch's query and of its key into {head_dim // 2} pairs and turns each pair, like"
        " the hand of a clock, by an angle that grows with the patch's position: half of the pairs turn"
        " as you go down the image, the other half as you go across, each at its own speed. Two rotated"
        " vectors' dot product depends only on the difference of their angles, so the score of two"
        " patches sees where one is relative to the other, not where they are in the image (Inside a"
        " layer shows it with this model's numbers). The prefix tokens have no position: they are not"
        " rotated. Nothing here is learned: the angles come from the grid alone, so they follow any"
        " image size or patch size."
    )
    st.write(
        "DINOv3 measures each patch's position from the image centre, scaled to run from -1 to 1"
        " whatever the grid, so a pair makes the same number of turns across the image at any resolution."
        if config.rope_type == "dinov3" else
        "Qwen-VL counts patches from the top-left corner (0, 1, 2, ...), the same way in every layer."
        if config.rope_type == "axial" else
        "EVA-02 counts patches from the top-left corner (0, 1, 2, ...)"
        + (f", rescaled to the {config.ref_feat_shape[0]}x{config.ref_feat_shape[1]} grid it was trained on."
           if config.ref_feat_shape else ".")
    )
    st.code(f"each layer: q, k ({config.num_heads}, {tokens}, {head_dim}) -> patches' rotated by ({patches}, {head_dim // 2}) angles")
    st.plotly_chart(selection.memo("rotation angles", compute=lambda: figures.rotation_angles_figure(
        rope.angles(selection.model.rope_spec, result.grid_size), result.grid_size,
        rope.angle_pairs(selection.model.rope_spec, result.grid_size),
        f"Each patch's rotation angle, for 8 of its {head_dim // 2} pairs: slowest to fastest, down and across",
    )))

st.subheader(f"7. {config.depth} encoder layers")
st.write(
    f"Each layer lets every token look at every other one with {config.num_heads} attention heads"
    " (LayerNorm, attention" + (" with rotated queries and keys" if rotary else "") + ", residual add),"
    " then transforms each token on its own with an MLP"
    + (" whose hidden units are gated (SwiGLU: one projection, through SiLU, multiplies another)" if gated else "")
    + " (LayerNorm, MLP, residual add). The shape never changes. Reading the prediction out after"
    " every layer (the logit lens) shows when the answer forms; the Attention page shows where each"
    " head looks."
)
st.code(
    f"{config.depth} x [ ({tokens}, {dim}) -> attention ({config.num_heads}, {tokens}, {tokens})"
    f" -> {activation_name(config)} MLP {dim}->{f'2x{config.mlp_hidden}' if gated else config.mlp_hidden}->{dim} ]"
    f" -> ({tokens}, {dim})"
)
if config.attn_window:  # Qwen2.5-VL: most layers attend within windows
    window = config.attn_window
    full = ", ".join(str(block) for block in config.full_attention_blocks) or "none"
    st.write(
        f"Not every token sees every other one here: this model's layers attend within windows of {window} x"
        f" {window} patches ({window * patch} px a side, tiled from the top-left corner), which keeps the cost"
        f" linear in the picture's size; only layers {full} attend to the whole picture. The Attention page"
        " draws each patch's map zero outside its window."
    )
st.page_link(
    "views/inside.py", icon=":material/calculate:",
    label="Open one layer: its LayerNorm, queries, keys, values, softmax and MLP with this image's numbers",
)
# From each head's mean entropy (shared with the Attention page): the layers are not held at once.
caveat = uniform_attention_caveat(selection)
if caveat:
    st.info(caveat)
if headless:
    st.info(models.NO_CLASSIFIER.format(what="The logit lens"))
else:
    st.plotly_chart(selection.memo("logit lens", compute=lambda: figures.logit_lens_figure(selection.logit_lens(), names)))

pooled = models.pooled_output(config)
if reads is not None:
    st.subheader("8. What the language model reads")
    st.write(reads[0])
    st.code(reads[1])
elif in_words:
    st.subheader("8. Pool, norm and projection: the image among the texts")
    st.write(
        f"The model keeps one vector, {pooled}, normalised, and carries it into the {in_words.embed_dim}"
        " numbers its text tower writes a sentence as: it was trained so that a picture and a caption of it"
        " land close together. So it has no list of classes; it scores any words you give it: each label"
        " goes through the text tower, and the image's cosine with each is its score."
    )
    st.code(f"({tokens}, {dim}) -> ({dim},) -> ({in_words.embed_dim},); each label -> ({in_words.embed_dim},)")
    st.subheader("9. Top-5 prediction in words")
    st.caption(words.about(selection.model_key))
    predicted = words.prediction(selection)
    if predicted is not None:
        (best, score), *_ = predicted.top(1)
        if words.chooses(predicted):
            st.write(f"The model says **{best}** with {score:.1%}.")
        for caveat in words.caveats(selection, predicted):
            st.warning(caveat)
        st.plotly_chart(words.top_labels_figure(selection, predicted))
elif headless:
    st.subheader("8. Pool and norm: the feature vector")
    st.write(
        f"The model keeps one vector, {pooled}, normalised. It has no classification head: it was"
        " trained to produce features (for similarity, retrieval or a probe trained later), not"
        " scores for a list of classes."
    )
    st.code(f"({tokens}, {dim}) -> ({dim},)")
    st.subheader("9. Top-5 prediction")
    st.info(models.NO_CLASSIFIER.format(what="A prediction"))
else:
    st.subheader("8. Pool, norm and classification head")
    st.write(
        f"The model keeps one vector, {pooled}, normalises it and maps it with one linear layer to a"
        f" score (logit) per class; softmax turns the {config.num_classes} scores into probabilities."
    )
    st.code(f"({tokens}, {dim}) -> ({dim},) -> ({config.num_classes},)")

    st.subheader("9. Top-5 prediction")
    probabilities = result.logits[0].softmax(dim=-1)
    best = int(probabilities.argmax())
    st.write(f"The model says **{names[best]}** with probability {float(probabilities[best]):.1%}.")
    for caveat in prediction_caveats(selection, probabilities):
        st.warning(caveat)
    st.plotly_chart(selection.memo("top-5 figure", compute=lambda: figures.topk_bar(probabilities, names, k=5)))
