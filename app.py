"""ViT Explorer: `streamlit run app.py`.

The entry page: page config, the sidebar every page shares (which model, which image) and the
navigation. The views/ draw, vit_explorer computes, vit_explorer.app caches. The folder is not
called pages/: Streamlit would take that for a legacy multipage app and could run a page
without this script, that is without the sidebar and the session state it sets up.
"""
from pathlib import Path

import streamlit as st

from vit_explorer.app import images, lesson, models, runs, session, uploads, words
from vit_explorer.app.selection import unreadable_photo_reason
from vit_explorer.data import transforms
from vit_explorer.training.pace import time_left

# The icon is served by the app itself: a :material/...: or emoji icon is fetched from a font
# server, which a classroom without internet cannot reach.
st.set_page_config(page_title="ViT Explorer", page_icon=str(Path(__file__).parent / "assets" / "icon.png"), layout="wide")
session.init_state()
state = st.session_state

# The Lesson first: a path through the pages for a first visit. Pipeline stays the root address
# (and offers the Lesson at its top), so that links to the app keep opening what they opened.
pages = {"Learn": [
    st.Page(lesson.PAGE, title="Lesson", icon=":material/school:", url_path=lesson.URL_PATH),
], "Explore": [
    st.Page("views/pipeline.py", title="Pipeline", icon=":material/route:", default=True),
    st.Page("views/patches.py", title="Patches", icon=":material/grid_on:"),
    st.Page("views/attention.py", title="Attention", icon=":material/visibility:"),
    st.Page("views/inside.py", title="Inside a layer", icon=":material/calculate:", url_path="inside"),
    st.Page("views/train.py", title="Train", icon=":material/model_training:"),
], "Experiments": [
    st.Page("views/images.py", title="Several images", icon=":material/photo_library:", url_path="images"),
    st.Page("views/probe.py", title="Probe", icon=":material/ads_click:", url_path="probe"),
    st.Page("views/head_types.py", title="Head types", icon=":material/category:", url_path="heads"),
    st.Page("views/knockout.py", title="Knock-out", icon=":material/block:", url_path="knockout"),
    st.Page("views/patching.py", title="Patching", icon=":material/swap_horiz:", url_path="patching"),
    st.Page("views/registers.py", title="Registers", icon=":material/move_down:", url_path="registers"),
    st.Page("views/features.py", title="Features", icon=":material/scatter_plot:", url_path="features"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare:"),
]}
page = st.navigation(pages)
# Offered when a photo meets a model that cannot read it: self-supervised, supervised, language.
PHOTO_MODELS = ("pretrained:dino_vits16", "pretrained:deit_s", "pretrained:clip_vitb16")
model_error = models.apply_requested_model()


def _on_model_picked() -> None:
    models.request_model(state["model_picker"])


def _on_image_picked() -> None:
    state["image_key"] = state["image_picker"]


def _checkpoint_uploader() -> None:
    """The checkpoint uploader; a handled upload is released and the run starts again."""
    files = st.file_uploader(
        "Checkpoint: this project's .safetensors, a timm or torchvision state dict, a"
        " Hugging Face ViT (config.json plus its weights), or a CLIP or SigLIP as open_clip"
        " saves it (open_clip_config.json, open_clip_model.safetensors and its tokenizer's files)",
        type=["safetensors", "pth", "pt", "bin", "json"],
        accept_multiple_files=True,
        key=uploads.upload_key("checkpoint_upload"),
    )
    if files:
        with st.spinner("Reading the checkpoint ..."):
            state["checkpoint_error"] = uploads.add_checkpoint_upload(files)
        uploads.release_upload("checkpoint_upload", files)
    if "checkpoint_error" in state:
        error = state.pop("checkpoint_error")
        if error:
            st.error(error)


def _image_uploader() -> None:
    """The image uploader: an image's own size limit and types; released like checkpoints."""
    file = st.file_uploader(
        "Upload an image", type=uploads.IMAGE_TYPES, max_upload_size=uploads.IMAGE_UPLOAD_MB,
        key=uploads.upload_key("image_upload"),
        help=f"A picture PIL can read (PNG, JPEG, WebP, GIF: first frame, TIFF, BMP), up to"
        f" {uploads.IMAGE_UPLOAD_MB} MB.",
    )
    if file is not None:
        state["image_error"] = uploads.add_image_upload(file)
        uploads.release_upload("image_upload", [file])
    if "image_error" in state:
        error = state.pop("image_error")
        if error:
            st.error(error)


with st.sidebar:
    st.header("Model")
    model_slot = st.container()
    with st.expander("Load a checkpoint"):
        _checkpoint_uploader()
    if "model_notice" in state:
        st.warning(state.pop("model_notice"))

    with model_slot:
        options = models.model_options()
        state["model_picker"] = state["model_key"]
        st.selectbox(
            "Model", list(options), format_func=options.get, key="model_picker",
            on_change=_on_model_picked,
            help="The shipped model works offline; each pretrained model downloads once from its"
            " publisher. What each one is: below, under \"The pretrained models\".",
        )
        card = models.model_card(state["model_key"])
        whole = models.model_options(whole=True).get(state["model_key"])
        if card:
            st.caption(card)  # it begins with the model's whole title
        elif whole and whole != options.get(state["model_key"]):
            st.caption(whole)  # the picker had to shorten it
        with st.expander("The pretrained models"):
            st.markdown(models.model_cards())
        pending = state.get("licence_to_accept")
        notice = models.licence_to_accept(pending) if pending else None
        if notice:
            st.warning(notice)
            accept, cancel = st.columns(2)
            accept.button("Accept and download", on_click=models.accept_licence, args=(pending,), width="stretch")
            cancel.button("Cancel", on_click=state.pop, args=("licence_to_accept", None), width="stretch")
        if model_error:
            st.error(model_error)
        try:
            selection = session.selection()
        except (ValueError, OSError) as error:
            selection = None
            st.error(f"The model could not be loaded: {error}")
        if selection is not None:
            base = selection.base_model.config
            resized = (
                f" (resized from patch {base.patch_size})"
                if base.patch_size != selection.patch_size else ""
            )
            st.caption(f"{models.describe(selection.config)}{resized}.")
            st.caption(f"{models.parameter_count(selection.model):,} parameters.")
            words.labels_box(state["model_key"])  # a model with a text tower: what to choose between
            native = models.base_model(state["model_key"]).config
            assumed = models.assumed_normalization(native)
            if assumed:
                st.caption(assumed)
                if native.normalization_name and native.in_chans == 3:
                    st.selectbox(
                        "Normalisation", list(models.NORMALIZATIONS),
                        help="The mean and std the pixels are normalised with before the model reads them"
                        " (for you only: the model is shared, unchanged).",
                        **session.keep(session.NORMALIZATION_WIDGET, native.normalization_name, lambda name: name in models.NORMALIZATIONS),
                    )
            # One label whatever the size (the caption above gives it): a new label would be a new
            # expander, drawn closed after every edit.
            with st.expander("Input size"):
                if native.rope_type is None:
                    resampled = "interpolates the position embeddings to the new grid"
                elif native.abs_pos_embed:
                    resampled = "interpolates the position embeddings; the rotary positions follow the new grid"
                else:
                    resampled = "needs nothing resampled: the rotary positions follow the new grid"
                follows = models.preprocessing_note(native)  # Qwen-VL, NaFlexViT: the size follows the picture
                in_use = selection.config.img_size if follows else native.img_size
                if follows:
                    st.caption(f"{follows} This picture: {in_use[0]}x{in_use[1]} px (height x width).")
                    for key in ("input_height", "input_width"):  # not typed: show the picture's size
                        if session.kept_key(key) not in state:
                            state.pop(key, None)
                else:
                    st.caption(
                        f"Trained at {native.img_size[0]}x{native.img_size[1]} px. Another size (not"
                        f" necessarily square) {resampled}."
                    )
                height_column, width_column = st.columns(2)
                step = native.patch_size * native.spatial_merge_size
                height = height_column.number_input(
                    "Height (px)", min_value=step, step=step, **session.keep("input_height", in_use[0])
                )
                width = width_column.number_input(
                    "Width (px)", min_value=step, step=step, **session.keep("input_width", in_use[1])
                )
                problem = models.image_size_problem(native, (int(height), int(width)))
                if problem:
                    st.error(f"{problem} Showing {in_use[0]}x{in_use[1]} px.")
            with st.expander("Full config"):
                st.json(selection.config.to_dict(), expanded=False)

    st.header("Image")
    image_slot = st.container()
    _image_uploader()

    if "image_notice" in state:
        st.warning(state.pop("image_notice"))
    if selection is not None:
        with image_slot:
            image_options = images.sample_image_options(selection.config.img_size)
            image_options.update(images.uploaded_image_options())
            state["image_picker"] = state["image_key"]
            st.selectbox(
                "Image", list(image_options), format_func=image_options.get, key="image_picker",
                on_change=_on_image_picked,
            )
            selection = session.selection()
            width, height = selection.image.size
            reshaped = transforms.reshapes(selection.config)
            shown = None if selection.whole or not reshaped else transforms.visible_box(selection.image.size, selection.config)
            st.image(
                images.sidebar_image(selection.image_key, selection.image, shown), caption=f"{width}x{height} px as given",
                width=160,
            )
            st.caption(f"The model reads {selection.input_described()}.")
            if reshaped:
                st.radio(
                    "Input", [False, True], horizontal=True,
                    format_func={False: "Publisher's crop", True: "Whole picture"}.get,
                    help="The publisher's crop is how the model was evaluated (its predictions are theirs);"
                    " the whole picture squeezes all of it to the input size, nothing left out (for you only).",
                    **session.keep(session.WHOLE_PICTURE_WIDGET, False, lambda value: isinstance(value, bool)),
                )
            reason = unreadable_photo_reason(selection)
            if reason:
                # Only models that can be had: downloaded, or their publisher answers.
                offered = [model_key for model_key in PHOTO_MODELS if models.obtainable(model_key)]
                st.warning(f"{reason} A pretrained model below reads photos." if offered else reason)
                for model_key in offered:
                    st.button(
                        f"Explore with {models.model_title(model_key)}", key=f"try:{model_key}",
                        on_click=models.request_model, args=(model_key,), width="stretch",
                    )
                if not offered:
                    st.info(models.CATALOGUE_OFFLINE)

    def my_runs() -> tuple[dict, list[str]]:
        """This person's training and waiting runs: only they poll, so that a class browsing
        beside one run does not rerun every session's sidebar every two seconds."""
        running = {run_id: run for run_id, run in runs.active_runs().items() if runs.owns_run(run_id)}
        return running, [run_id for run_id in runs.run_manager().queued() if runs.owns_run(run_id)]

    active, waiting = my_runs()

    @st.fragment(run_every=2.0 if active or waiting else None)
    def training_status() -> None:
        running, queued = my_runs()
        if set(running) != set(active) or queued != waiting:
            st.rerun()  # a run has ended or started: the model picker can offer it now
        for run_id, run in running.items():
            st.progress(run.progress, text=f"Training {run_id}: {run.progress:.0%}{time_left(run.eta_seconds)} ({run.doing})")
        if queued:
            st.caption(f"Waiting for a free slot: {', '.join(queued)}.")

    training_status()

session.keep_in_address()
if selection is None and page.title != "Train":
    st.info("Choose another model in the sidebar, or train one on the Train page.")
    st.stop()
page.run()
