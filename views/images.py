"""Several images: what the model treats as the same across two to six pictures, each read in
one forward pass kept for the next set (DINOv2's foreground PCA, DINOv3's, correspondences, high-norm
tokens)."""
import streamlit as st

from vit_explorer.analysis import dense_pca as dense
from vit_explorer import figures
from vit_explorer.analysis import image_set as sets
from vit_explorer.app import costs, images, jobs, models, probe, segment_scores, session, word_maps
from vit_explorer.app.selection import ImageSet
from vit_explorer.text import LabelError

selection = session.selection()
config = selection.config
state = st.session_state
depth = config.depth

options = images.sample_image_options(config.img_size)
options.update(images.uploaded_image_options())


st.title("Several images")
st.write(
    "Read two to six pictures together: one PCA over all of them splits foreground from background"
    " and colours matching parts alike, a clicked patch finds its counterparts in the other"
    " pictures, and the token norms show the high-norm artefacts that registers remove. Every image"
    f" is resized to the model's input ({config.img_size[0]}x{config.img_size[1]} px) and goes through"
    " the model once: adding a picture runs that one alone."
)
chosen = st.multiselect(
    "Images", list(options), format_func=options.get,
    help="Two to six of the sidebar's pictures (shapes, photos, your uploads) to read together.",
    **session.keep("image_set", images.default_set(state["image_key"], options), lambda keys: all(key in options for key in keys)),
)
try:
    image_set = ImageSet.of(selection, chosen)
except ValueError as error:
    st.info(str(error))
    st.stop()
if not jobs.read_set(image_set):  # in the server where light, else a job
    st.stop()
display = image_set.display_images()
labels = [f"{index + 1}. {options[key].split(': ')[-1]}" for index, key in enumerate(chosen)]
grid_size = config.grid_size
grid_h, grid_w = grid_size
prefix, count = config.num_prefix_tokens, len(chosen)

st.subheader("Foreground and parts (DINOv2's figure)")
st.write(
    "One PCA over the last layer's patch tokens of all the images at once, so that a colour means"
    " the same in every picture. Its first component usually separates the object from the"
    " background: patches above the threshold count as foreground. A second PCA with three"
    " components over the foreground patches alone colours the parts (red, green, blue); the"
    " background is black. The sign of a principal component is arbitrary, so if the background"
    " lights up instead of the object, switch the side."
)
threshold_column, side_column = st.columns([2, 1], vertical_alignment="bottom")
threshold = threshold_column.slider(
    "Foreground threshold (standard deviations)", -2.0, 2.0, step=0.1,
    help="Patches whose first component lies above this many standard deviations count as foreground.",
    **session.keep("set_threshold", 0.0),
)
flip = side_column.toggle(
    "Foreground below the threshold", help="Take the other side of the first component as the foreground.",
    **session.keep("set_flip", False),
)
pca = image_set.memo("foreground pca", threshold, flip, compute=lambda: sets.joint_pca_foreground(
    image_set.last_layer_features(), grid_size, threshold, flip, first=image_set.first_component(),
))
if not pca.foreground.any():
    st.info("No patch lies above the threshold: lower it or switch the side.")
st.plotly_chart(image_set.memo("foreground figure", threshold, flip, compute=lambda: figures.foreground_pca_grid(
    display, pca.first_component, pca.colours, threshold, labels, pca.explained, flip,
)))

st.subheader("DINOv3-style PCA")
st.write(
    "The same question as the DINOv3 authors ask it (their notebook pca.ipynb): the last layer's patch"
    " tokens after the final norm, a PCA with three whitened components (each of unit variance over"
    " the foreground) fitted on the foreground patches of all the images together, every patch"
    " coloured sigmoid(2x) of its components, the background black. Their foreground comes from a"
    " classifier trained on their data; here it is the side of the joint first principal component"
    " away from the pictures' borders, median-filtered 3 x 3 as theirs, or your own classifier once you"
    " label a few patches of these pictures on the Probe page. They read each picture 768 px"
    " high at its own aspect ratio, which shows far more patches than a model's usual input."
)
probed = probe.current(image_set)  # this session's probe of these pictures, or None
patch_size = config.patch_size
sizes = [dense.aspect_size(image.size, patch_size) for image in image_set.images]
resolutions = {"input": f"the model's input ({config.img_size[0]}x{config.img_size[1]} px)"}
# A model whose preprocessing sizes each picture (NaFlexViT, Qwen-VL): each read alone at its own grid,
# as timm's padded batch with patch_valid reads it (tests/weights/test_naflex.py).
own_sizes = [models.picture_input_size(config, image.size) for image in image_set.images]
if models.follows_picture(config) and all(size is not None and dense.within_limit(size, patch_size) for size in own_sizes):
    resolutions["own"] = "each picture as the model's preprocessing sizes it (its own grid)"
if all(dense.within_limit(size, patch_size) for size in sizes):
    resolutions["768"] = "768 px high, each picture at its aspect ratio"
else:
    st.caption(
        f"At 768 px high this model (patch {patch_size}) would read more than {dense.MAX_PATCHES} patches"
        " of a picture, more than this page reads, so the pictures are shown at the model's input only."
    )
resolution_column, flip_column = st.columns([2, 1], vertical_alignment="bottom")
resolution = resolution_column.radio(
    "Resolution", list(resolutions), format_func=resolutions.get, horizontal=True,
    help="768 px high is the authors' setting: one more forward pass of the model per picture, at its size.",
    **session.keep("dense_resolution", "input", lambda option: option in resolutions),
)
dense_flip = flip_column.toggle(
    "Switch foreground and background", help="Take the other side of the joint first principal component as the foreground.",
    **session.keep("set_dense_flip", False),
)
read = None  # (features, pictures, grids) at the chosen resolution, once computed
if resolution == "input":
    read = (list(image_set.last_layer_features()), display, [grid_size] * count)
else:
    if resolution == "own":
        sizes, at = own_sizes, "at their own sizes"
    else:
        at = "at 768 px high"
    passes = costs.dense_forwards(config, sizes)
    # A real-size model at 768 px costs dozens of passes per picture: asked for, not unasked.
    if costs.is_quick(config, forwards=passes) or st.toggle(
        f"Read the {count} pictures {at} (about {passes:.0f} forward passes)",
        help="One forward pass of the model per picture at its size, learned position embeddings resampled to its grid.",
        **session.keep("set_dense_high_on", False),
    ):
        each = [
            selection.dense_features(image_key, image, size)
            for size, image_key, image in zip(sizes, image_set.image_keys, image_set.images)
        ]
        read = ([features for features, _ in each], [picture for _, picture in each],
                [(height // patch_size, width // patch_size) for height, width in sizes])
    else:
        st.caption(
            f"{at.capitalize()} the {count} pictures cost about {passes:.0f} passes of this model at its input"
            " size, so they are read when you ask: switch it on above."
        )
if read is not None:
    features, pictures, grids = read
    parts = image_set.memo("dense pca", resolution, dense_flip, None if probed is None else probed.key, compute=lambda: (
        dense.dense_pca(features, grids, (
            dense.foreground_masks(features, grids, dense_flip) if probed is None else probe.foreground_masks(probed.probe, grids)
        ))
    ))
    where = {"input": "at the model's input", "own": "each at its own size"}.get(resolution, "768 px high")
    probe_key = None if probed is None else probed.key
    st.plotly_chart(image_set.memo("dense pca figure", resolution, dense_flip, probe_key, compute=lambda: figures.dense_pca_grid(
        pictures, parts.colours, labels, f"of {count} images {where}: 3 whitened components of their foreground, sigmoid(2x)",
    )))
    foreground_source = (
        "the joint first principal component's side away from the borders, median-filtered 3 x 3" if probed is None else
        f"where your probe (the Probe page, on the tokens after {probed.layer} layers) finds '{probed.probe.names[0]}'"
        + ("" if resolution == "input" else ", its probabilities stretched to each picture's grid")
    )
    st.caption(
        f"{sum(int(mask.sum()) for mask in parts.foreground)} of the {sum(h * w for h, w in grids)} patches are"
        f" foreground ({foreground_source}): one PCA is fitted on those and every patch projected; the background is black."
    )

st.subheader("Correspondence: the same part in the other pictures")
st.write(
    "Click a patch of the source image: every patch of every image is coloured by the cosine of its"
    " features with that patch, and each image's most similar patch is outlined. Tokens compare"
    " what the layer outputs; keys compare what the layer's attention matches on (dino-vit-features"
    " found keys the better descriptor for matching parts across objects)."
)
layer = st.slider(
    "Layer", 0, depth - 1, help="The layer whose tokens or keys are compared, and whose norms are shown below.",
    **session.keep("layer", depth - 1, lambda layer: 0 <= layer < depth),
)
controls, picker = st.columns([2, 1])
with controls:
    source = st.selectbox(
        "Source image", list(range(count)), format_func=lambda index: labels[index],
        help="The image whose patch you click.", **session.keep("set_source", 0, lambda index: 0 <= index < count),
    )
    facet = st.radio(
        "Compare", ["tokens", "keys"], horizontal=True,
        help="Tokens: the layer's output for each patch. Keys: the layer's attention keys, all heads side by side.",
        **session.keep("set_facet", "tokens", lambda option: option in ("tokens", "keys")),
    )
    patch = st.selectbox(
        "Patch", list(range(grid_h * grid_w)), format_func=lambda p: f"patch {p} (row {p // grid_w}, col {p % grid_w})",
        help="The patch of the source image to find elsewhere; clicking the picture chooses it too.",
        **session.keep("set_patch", (grid_h // 2) * grid_w + grid_w // 2, lambda p: 0 <= p < grid_h * grid_w),
    )
with picker:
    st.plotly_chart(
        image_set.memo("patch picker", source, patch, compute=lambda: figures.patch_picker(
            display[source], grid_size, patch
        )),
        key="set_patch_click", on_select=session.patch_picked("set_patch_click", "set_patch"), selection_mode="points",
        config={"displayModeBar": False},
    )
layer_tokens = sets.patch_features(image_set.tokens(layer + 1), prefix)
features = layer_tokens if facet == "tokens" else image_set.keys(layer)
cosines, best = image_set.memo(
    "correspondence", facet, layer, source, patch, compute=lambda: sets.correspondence(features, source, patch)
)
what = f"layer {layer}'s {'output tokens' if facet == 'tokens' else 'keys'}"
st.plotly_chart(image_set.memo("correspondence figure", facet, layer, source, patch, compute=lambda: figures.correspondence_grid(
    display, cosines.reshape(count, grid_h, grid_w), best, source, patch, labels, what,
)))

st.subheader("High-norm tokens")
st.write(
    "Large ViTs trained long (DINOv2, CLIP, DeiT-III) reuse a few background patches as scratch"
    " space: their tokens get norms far above the rest and their attention goes wild. A model with"
    " registers gives that job to extra tokens instead (Darcet et al. 2023). A patch counts as an"
    " outlier when its norm exceeds the median of all the images' patch norms plus k times their"
    " median absolute deviation (MAD); both are robust, so the outliers themselves barely move them."
)
k = st.slider(
    "k (MADs above the median)", 1.0, 20.0, step=0.5,
    help="How far above the median norm, in median absolute deviations, a patch must lie to count as an outlier.",
    **session.keep("set_mad_k", 6.0),
)
outliers = image_set.memo("norm outliers", layer, k, compute=lambda: sets.norm_outliers(layer_tokens, k))
rule = f"median {outliers.median:.3g} + {k:g} x MAD {outliers.mad:.3g}"
st.caption(
    f"Threshold after layer {layer}: {rule} = {outliers.threshold:.3g}, over the {outliers.norms.numel()} patches of"
    f" the {count} images; {int(outliers.outliers.sum())} outliers."
)
st.plotly_chart(image_set.memo("norms figure", layer, k, compute=lambda: figures.norm_outliers_grid(
    outliers.norms.reshape(count, grid_h, grid_w), outliers.outliers.reshape(count, grid_h, grid_w),
    outliers.threshold, rule, labels, display[0].shape, layer,
)))

in_words = word_maps.model_for(selection)  # both towers (CLIP, SigLIP), or None
if in_words is not None:
    st.subheader("Where a word is in each image")
    st.write(
        "This model has a text tower: type a prompt, and every patch of every picture is coloured by its cosine"
        " with it, on one scale, so that the pictures compare (the Attention page's \"Ask in words\" for one"
        " picture and several prompts)."
    )
    prompt_text = st.text_input(
        "Prompt", help=f"Read as \"{word_maps.READ_AS}\", as the sidebar's labels are.",
        **session.keep("word_set_prompt", word_maps.DEFAULT_PROMPTS.split(",")[0]),
    )
    method = st.selectbox(
        "Map method", list(word_maps.SET_METHODS), format_func=word_maps.method_label,
        help=word_maps.methods_help() + "  \nCLIP Surgery and ProxyCLIP need each picture itself: the Attention page maps one.",
        **session.keep("word_method", word_maps.DEFAULT_METHOD, lambda option: option in word_maps.SET_METHODS),
    )
    try:
        (prompt,) = word_maps.read_prompts(prompt_text.replace(",", " "), selection.model_key)[0]  # one prompt, commas and all
    except LabelError as error:
        st.warning(f"That prompt cannot be mapped: {error}.")
    else:
        prompt_maps = word_maps.set_similarities(image_set, prompt, method)
        how = word_maps.how(in_words, method=method)
        st.plotly_chart(image_set.memo("words prompt figure", prompt, method, compute=lambda: figures.prompt_over_images(
            display, prompt_maps, prompt, labels, how,
        )))
        st.caption(
            f"How each map is made: {word_maps.how(in_words, detail=True, method=method)}; the patches meet the"
            " prompt's text embedding in a cosine: one small product per picture once the set has been read."
        )

    with st.expander("Score a labelled set (mIoU)"):
        st.write(
            "How well each method segments your own labelled pictures: name a folder on the server holding"
            f" images/, masks/ (a PNG of class indices per picture, same name, 255 unlabelled) and"
            f" {segment_scores.CLASS_FILE} (line i names class i, synonyms separated by commas, as the papers'"
            " class files). Every pixel is labelled by its best class, and the IoU of each class is summed over the"
            f" folder, as `python -m bench.segment` does; at most {segment_scores.MAX_PICTURES} pictures are scored"
            " here (the whole folder: bench.segment)."
        )
        folder_text = st.text_input(
            "Labelled folder", help="Inside the data folder, the app's weights folder or the runs folder;"
            " a relative name is read in the data folder.", **session.keep("set_score_folder", ""),
        )
        scored_methods = st.multiselect(
            "Methods", list(segment_scores.METHODS), format_func=word_maps.method_label,
            help="Compared side by side. ProxyCLIP needs a second model: bench.segment --proxy measures it.",
            **session.keep("set_score_methods", [word_maps.DEFAULT_METHOD],
                           lambda chosen: all(method in segment_scores.METHODS for method in chosen)),
        )
        threshold_column, limit_column, templates_column = st.columns(3)
        background = threshold_column.number_input(
            "Background threshold", 0.0, 1.0, step=0.05,
            help="Class 0 where the best class's probability is below this (the papers: 0.1 on VOC21).",
            **session.keep("set_score_threshold", 0.0),
        )
        limit = limit_column.number_input(
            "Pictures at most", 1, segment_scores.MAX_PICTURES, help="The folder's first pictures, by name.",
            **session.keep("set_score_limit", segment_scores.MAX_PICTURES),
        )
        template_set = templates_column.selectbox(
            "Templates", list(segment_scores.TEMPLATES), format_func=segment_scores.TEMPLATES.get,
            help="Each name is embedded with these templates, averaged.",
            **session.keep("set_score_templates", "openai", lambda option: option in segment_scores.TEMPLATES),
        )
        if st.button("Score the set", icon=":material/play_arrow:", disabled=not scored_methods):
            try:
                path, labelled = segment_scores.labelled_folder(folder_text, int(limit))
                asked = (tuple(scored_methods), float(background), template_set)
                key = segment_scores.scores_key(selection, path, labelled, *asked)
                segment_scores.scores(key, in_words, labelled, *asked)
            except ValueError as error:  # every refusal is a sentence (the folder's, a picture too large, a name)
                st.error(f"That set cannot be scored: {error}.")
            except OSError:  # its words would name the server's path
                st.error("That set cannot be scored: a file of the folder could not be read (changed while it was read?).")
            else:
                state["set_scores_shown"] = (key, labelled.classes, len(labelled), asked)
        shown = state.get("set_scores_shown")
        if shown is not None and shown[0][:3] == (selection.model_id, selection.patch_size, config.img_size):
            key, classes, pictures, (methods, background, template_set) = shown
            results = segment_scores.kept(key)
            if results is None:
                st.info("These scores are no longer kept: score the set again.")
            else:
                st.dataframe(segment_scores.table(results, classes), hide_index=True)
                protocols = "; ".join(result.protocol.describe(tuple(config.img_size)) for result in results)
                st.caption(
                    f"IoU (%) of each class over {pictures} pictures, {len(classes)} classes ({len(classes.names)} names),"
                    f" each name embedded with {segment_scores.TEMPLATES[template_set]}; a class in neither truth nor"
                    f" prediction left out of the mean (mmseg's IoUMetric). Passes: windows of the image tower a picture."
                    f" Protocol: {protocols}."
                )
