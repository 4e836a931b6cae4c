"""Train: launch a run in the background (a ViT from scratch, or a sparse autoencoder on a layer of the
sidebar's model), watch its curves and attention form, then explore it."""
from pathlib import Path

import streamlit as st

from vit_explorer import analysis, figures
from vit_explorer.training.admission import RunRefused
from vit_explorer.app import features, models, runs, session
from vit_explorer.app.memo import memo
from vit_explorer.model.config import POSITIONS, PRESETS, TrainConfig, ViTConfig, parse_patch_sizes
from vit_explorer.data.datasets import SHAPE_CLASSES, native_image_size
from vit_explorer.features.train import SAETrainConfig
from vit_explorer.training.pace import time_left
from vit_explorer.training.runs import ordinal
from vit_explorer.training.evaluation import accuracy_by_image_size, scaled_image_sizes
from vit_explorer.training.train import model_config
from vit_explorer.weights import load_model

DATASETS = {
    "shapes": f"Shapes (built in, {len(SHAPE_CLASSES)} classes, no download)",
    "cifar10": "CIFAR-10 (downloads 170 MB)",
    "mnist": "MNIST (downloads 12 MB)",
    "fashionmnist": "Fashion-MNIST (downloads 30 MB)",
}
CUSTOM = "custom"
SIZE_TEST_IMAGES = 500  # test images per input size when a run is tested at each size
DEFAULTS, DEFAULT_MODEL = TrainConfig(), PRESETS[TrainConfig().model]
state = st.session_state

st.title("Train")
st.write(
    "Train a small ViT from scratch and watch it learn: the loss falls, accuracy climbs and the"
    " attention of a fixed probe image turns from a blur into a look at the object. Training runs"
    " in the background, so you can explore other pages meanwhile; when it ends, one click makes"
    " it the model every page explores."
)
st.caption(
    "Everyone on this server sees every run, but only the person who launched a run can stop it"
    " (once you launch one, the page's address carries your token: keep it to keep control after a"
    " reload). Each run trains in its own process; a run too large for the server is refused, and"
    " when all slots are busy a run waits its turn."
)

# The architecture is the numbers on screen: a preset only fills them in, and any other numbers
# are a custom model (no form, so that choosing a preset shows its numbers at once).
# Field -> (label, lowest, highest, step).
ARCHITECTURE = {
    "patch_size": ("Patch size", 1, 64, 1), "embed_dim": ("Dim", 8, 1024, 8), "depth": ("Depth", 1, 24, 1),
    "num_heads": ("Heads", 1, 16, 1), "mlp_ratio": ("MLP ratio", 0.5, 8.0, 0.5),
}


def fill_in_preset() -> None:
    if state["train_preset"] != CUSTOM:
        for name, value in PRESETS[state["train_preset"]].items():
            session.set_kept(f"train_{name}", value)


left, right = st.columns(2)
dataset = left.selectbox("Dataset", list(DATASETS), format_func=DATASETS.get)
kept = {name: session.keep(f"train_{name}", DEFAULT_MODEL[name]) for name in ARCHITECTURE}
architecture = {name: state[f"train_{name}"] for name in ARCHITECTURE}
state["train_preset"] = next((name for name, numbers in PRESETS.items() if numbers == architecture), CUSTOM)
left.selectbox(
    "Model size", [*PRESETS, CUSTOM], key="train_preset", on_change=fill_in_preset,
    format_func=lambda name: "custom: the numbers below, edited" if name == CUSTOM
    else f"{name}: patch {PRESETS[name]['patch_size']}, dim {PRESETS[name]['embed_dim']},"
    f" depth {PRESETS[name]['depth']}, {PRESETS[name]['num_heads']} heads, MLP ratio {PRESETS[name]['mlp_ratio']:g}",
    help="A preset fills in the numbers below; change any of them for a model of your own.",
)
for column, (name, (label, lowest, highest, step)) in zip(left.columns(len(ARCHITECTURE)), ARCHITECTURE.items()):
    column.number_input(label, lowest, highest, step=step, **kept[name])
threads = runs.run_manager().limits.threads
epochs = right.number_input("Epochs", 1, 200, DEFAULTS.epochs)
batch_size = right.number_input("Batch size", 1, 4096, DEFAULTS.batch_size)
lr = right.number_input("Peak learning rate", 1e-5, 1.0, DEFAULTS.lr, format="%.5f")
train_size = right.number_input(
    "Training images (0: the whole dataset)", 0, 1_000_000, 0, step=500,
    help=f"Shapes renders 16000 new images per epoch. A run here gets {threads} CPU"
    f" thread{'s' if threads > 1 else ''} at low priority, so that the people exploring come first:"
    " with one thread the defaults (10 epochs) took about 2 minutes on an idle core and reached"
    " about 98% test accuracy (91% after 5 epochs), and longer on a busy server; fewer images"
    " make a quicker run.",
)
flexi_sizes = left.text_input(
    "Patch sizes (FlexiViT)", placeholder="e.g. 2,4,8",
    help="Train each step at a patch size drawn from these, one set of weights resized on the"
    " fly (FlexiViT), so that the model works at all of them; empty: only its own patch size.",
)
positions = left.radio(
    "Positions", POSITIONS, horizontal=True, format_func=lambda name: f"{name} ({'DINOv3' if name == 'rotary' else 'ViT'})",
    help="How the model knows where each patch is: learned position embeddings must be resampled for"
    " another image size, rotary positions (angles from each patch's place in [-1, 1]) fit any grid as"
    " they are. Train one of each, then test both at sizes they never saw below.",
)
launched = st.button("Launch training", type="primary")

if launched:
    try:
        preset = state["train_preset"]
        model = (
            ViTConfig(image_size=native_image_size(dataset), **architecture) if preset == CUSTOM else preset
        )
        config = TrainConfig(
            dataset=dataset, model=model, epochs=epochs, batch_size=batch_size, lr=lr,
            train_size=train_size or None, snapshot_every=10, log_every=5,
            patch_sizes=parse_patch_sizes(flexi_sizes), positions=positions,
        )
        model_config(config)  # a patch size that does not tile the images fails here, not later
    except ValueError as error:
        st.error(f"Cannot train that: {error}")
    else:
        try:
            state["watched_run"] = runs.start_run(config)
        except RunRefused as refusal:
            st.error(str(refusal))

SAE_DEFAULTS = SAETrainConfig(weights="default", layer=0)  # the command line's defaults too
SAE_DATASETS = {"shapes": DATASETS["shapes"], "photos": "The bundled photos (4)", **{
    name: label for name, label in DATASETS.items() if name != "shapes"
}}
with st.expander("Or a sparse autoencoder on a layer of the sidebar's model"):
    sidebar = session.selection()
    weights = features.run_weights(sidebar.model_key)
    st.write(
        "A dictionary of the tokens leaving one layer of the model you are exploring, over an image set:"
        " each token rewritten as a few of thousands of directions (latents), so that the Features page"
        " can show what the layer represents. Its curves show how much of the tokens it explains, how many"
        " latents each token uses (L0) and how many never fire (dead)."
    )
    if weights is None:
        st.info("This model is not downloaded yet: a dictionary is trained on a model's file. Open it on any"
                " page first, or choose the shipped model, an upload or a run of yours.")
    else:
        depth, width = sidebar.config.depth, sidebar.config.embed_dim
        sae_left, sae_right = st.columns(2)
        sae_layer = sae_left.slider("Layer", 0, depth - 1, depth // 2, help="The layer whose output tokens it reads.")
        sae_dataset = sae_left.selectbox("Images", list(SAE_DATASETS), format_func=SAE_DATASETS.get, key="sae_dataset")
        sae_images = sae_left.number_input(
            "How many images", 4, 100_000, SAE_DEFAULTS.images, step=500,
            help="The photos are 4; the others as many as asked. A tenth of them (the last) is held out: the"
            " dictionary is measured on their tokens, which it never trains on.",
        )
        expansion = sae_right.number_input("Latents per token dimension", 1, 64, SAE_DEFAULTS.expansion,
                                           help=f"{width} dimensions x this many latents.")
        sae_k = sae_right.number_input("Active latents per token (k)", 1, 256, SAE_DEFAULTS.k)
        sae_epochs = sae_right.number_input("Passes over the tokens", 1, 50, SAE_DEFAULTS.epochs, key="sae_epochs")
        # The dictionary's kind: BatchTopK and Matryoshka beside TopK (features/sae.py)
        sae_activation = sae_left.selectbox(
            "Activation", ["topk", "batchtopk"], key="sae_activation",
            format_func={"topk": "TopK: k latents every token", "batchtopk": "BatchTopK: k a token on average"}.get,
            help="BatchTopK (Bussmann et al. 2024) keeps the k x batch largest over a batch while training, so a"
            " token may use more or fewer, and a threshold learnt while training at inference.",
        )
        sae_matryoshka = sae_right.number_input(
            "Nested dictionaries (Matryoshka)", 1, 8, 1, key="sae_matryoshka",
            help="More than 1: the first latents are a dictionary of their own, trained to reconstruct alone"
            " (widths halving: all, 1/2, 1/4, ...), the most general latents first (Bussmann et al. 2025).",
        )
        if st.button("Launch the sparse autoencoder", type="primary"):
            try:
                sae_config = SAETrainConfig(
                    weights=weights, layer=sae_layer, dataset=sae_dataset, images=sae_images,
                    expansion=expansion, k=sae_k, epochs=sae_epochs, log_every=5,
                    activation=sae_activation, matryoshka=sae_matryoshka,
                )
                sae_config.prefixes(expansion * width)  # too many nested dictionaries: a sentence now, not in the run
                state["watched_run"] = runs.start_run(sae_config)
            except (ValueError, RunRefused) as error:
                st.error(f"Cannot train that: {error}")

listed = runs.training_runs()
if not listed:
    st.info("No runs yet: choose the settings above and launch one.")
    st.stop()

run_ids = list(listed)
if state.get("watched_run") not in listed:
    state["watched_run"] = run_ids[-1]


def run_label(run_id: str, run) -> str:
    config = run.config
    if isinstance(config, SAETrainConfig):
        what = f"sparse autoencoder on layer {config.layer} of {config.weights_path.stem}, {config.dataset}"
    else:
        what = (f"{config.dataset}, {config.model if isinstance(config.model, str) else 'custom'} model"
                + (", rotary positions" if config.positions == "rotary" else ""))
    return f"{run_id}: {what}" + (" (read-only)" if runs.someone_elses_run(run_id) else "")


labels = {run_id: run_label(run_id, run) for run_id, run in listed.items()}
run_id = st.selectbox("Run", run_ids, key="watched_run", format_func=labels.get)
shown_status = listed[run_id].status
live = shown_status in ("pending", "running")


def accuracy_at_each_size(run_id: str) -> None:
    """An ended run tested at its own input size and larger ones, on request; drawn with every
    run this person tested on the same data and size, so that learned and rotary positions compare."""
    run = listed[run_id]
    config = model_config(run.config)
    sizes = scaled_image_sizes(config)
    tested = state.setdefault("tested_at_sizes", [])  # run ids, in the order they were tested
    if run_id not in tested:
        st.button("Test at each image size", icon=":material/aspect_ratio:", on_click=tested.append, args=(run_id,))
        drawn = "draws new test images" if run.config.dataset == "shapes" else "resizes its test images"
        st.caption(
            f"Tests {SIZE_TEST_IMAGES} test images at each of {', '.join(f'{h}x{w}' for h, w in sizes)} px"
            f" ({len(sizes) * SIZE_TEST_IMAGES} forward passes: seconds for a small model) on this server;"
            f" {run.config.dataset} {drawn} at each size."
        )
    series = {}
    for other in [name for name in tested if name in listed]:
        other_run, other_config = listed[other], model_config(listed[other].config)
        if (other_run.config.dataset, other_config.img_size) != (run.config.dataset, config.img_size):
            continue
        other_sizes = scaled_image_sizes(other_config)  # whole patches of its own patch size
        try:
            series[f"{other} ({other_run.config.positions})"] = memo(
                ("accuracy by image size", other_run.checkpoint, tuple(other_sizes), SIZE_TEST_IMAGES),
                lambda: accuracy_by_image_size(
                    load_model(other_run.checkpoint), other_run.config.dataset, other_sizes,
                    test_size=SIZE_TEST_IMAGES, data_root=other_run.config.data_root, batch_size=100,
                ),
                spinner=f"Testing {other} at {len(other_sizes)} sizes",
            )
        except (ValueError, OSError) as error:
            tested.remove(other)
            st.error(f"Cannot test {other} at other sizes: {error}")
    if series:
        st.plotly_chart(memo(
            ("accuracy by image size figure", tuple(series)),
            lambda: figures.accuracy_by_image_size_figure(series, config.img_size),
        ))


def sae_view(run, steps: list[dict]) -> None:
    """A sparse autoencoder run: its numbers and curves (none before its first step: its capture's
    bar says how far it is), then where to look at its latents, and keeping it for everyone."""
    if not steps:
        st.caption("Its curves start with the first step, once the tokens are captured.")
        return
    columns = st.columns(4)
    latest = steps[-1]
    measured = [record["held_out_explained_variance"] for record in steps
                if record.get("held_out_explained_variance") is not None]
    columns[0].metric("Step", f"{latest['step']} / {latest['total_steps']}")
    columns[1].metric(
        "Explained variance (held-out)", f"{measured[-1]:.1%}" if measured else "-",
        help="Of the tokens of images it never trains on, measured at the end of each pass over the tokens:"
        " the number its card and the Features page show.",
    )
    columns[2].metric("L0 (active latents)", f"{latest['l0']:.1f}")
    columns[3].metric("Dead latents", f"{latest['dead_share']:.1%}")
    st.plotly_chart(memo(
        ("sae curves", run_id, len(steps), latest["step"]), lambda: figures.sae_curves(run.history),
    ))
    if run.checkpoint is not None:
        name = Path(run.checkpoint).name
        owner = runs.dictionary_owner(Path(run.checkpoint))
        if owner is not None and owner["mine"] and not owner["kept"]:
            st.success(
                f"Written as {name}, with the index of each latent's top patches. With {run.config.weights_path.stem}"
                " in the sidebar, the Features page offers it to you; others see it once you keep it for everyone."
            )
            st.button("Keep for everyone", icon=":material/group:", on_click=runs.keep_run, args=(run_id,))
        else:
            st.success(
                f"Written as {name}, with the index of each latent's top patches. With {run.config.weights_path.stem}"
                " in the sidebar, the Features page offers it" + (" to everyone." if owner is None or owner["kept"]
                                                                   else " to the person who trained it.")
            )
        label = features.label_of(Path(run.checkpoint))
        if label is not None and (owner is None or owner["mine"] or owner["kept"]):
            if st.button("Open it on the Features page", icon=":material/scatter_plot:"):
                session.open_page("views/features.py", features_dictionary=label)


@st.fragment(run_every=1.0 if live else None)
def live_view() -> None:
    run = runs.training_runs().get(run_id)
    if run is None or run.status != shown_status or "requested_model" in state:
        st.rerun()  # withdrawn, started or ended, or now the model: the page and sidebar must show it
    status, progress, eta = run.status, run.progress, run.eta_seconds
    place = runs.run_manager().place(run_id)
    stopping = place is None and run.stop_requested  # said at once: the run itself may take a minute to end
    if place is not None:
        st.progress(0.0, text=f"{run_id} queued: {ordinal(place)} in line; it starts by itself when a slot frees")
    elif stopping:
        st.progress(progress, text=f"{run_id} stopping at {progress:.0%}: it ends after its current step,"
                    " then measures its test accuracy and writes its checkpoint")
    elif status == "running" and isinstance(run.config, SAETrainConfig) and not run.history["steps"]:
        captured = run.capturing  # before the first step, the capture is what moves (images done of images)
        st.progress(0.0 if captured is None else captured[0] / max(captured[1], 1), text=f"{run_id} running: {run.doing}")
    else:
        doing = f" ({run.doing})" if status == "running" else ""
        st.progress(progress, text=f"{run_id} {status}: {progress:.0%}{time_left(eta) if status == 'running' else ''}{doing}")
    if runs.someone_elses_run(run_id):
        st.caption("Someone else launched this run: you can watch it, only they can stop it.")
    elif status in ("pending", "running") and not stopping and runs.owns_run(run_id):
        st.button(
            "Stop" if place is None else "Withdraw", on_click=runs.stop_run, args=(run_id,),
            icon=":material/stop:",
        )
    if run.error:
        st.error(f"The run failed: {run.error}")
    if run.peak_rss is not None:
        st.caption(f"Its process used at most {run.peak_rss / 2**30:.2f} GB of memory.")

    history = run.history
    steps, epochs_done = history["steps"], history["epochs"]
    if isinstance(run.config, SAETrainConfig):
        sae_view(run, steps)
        return
    columns = st.columns(4)
    columns[0].metric("Step", f"{steps[-1]['step']} / {steps[-1]['total_steps']}" if steps else "0")
    columns[1].metric("Training loss", f"{steps[-1]['loss']:.3f}" if steps else "-")
    columns[2].metric("Training accuracy", f"{steps[-1]['accuracy']:.1%}" if steps else "-")
    columns[3].metric("Test accuracy", f"{epochs_done[-1]['test_accuracy']:.1%}" if epochs_done else "-")
    # A live run redraws every second for every watcher: its figures are shared while nothing new came.
    st.plotly_chart(memo(
        ("training curves", run_id, len(steps), len(epochs_done), steps[-1]["step"] if steps else None),
        lambda: figures.training_curves(history),
    ))

    snapshot = run.latest_snapshot
    if snapshot is not None:
        last = snapshot.attentions.shape[1] - 1
        st.write(
            f"The probe image at step {snapshot.step}: the model says **{snapshot.prediction}**"
            f" ({max(snapshot.probabilities):.0%}). Its last layer's attention:"
        )
        st.plotly_chart(memo(
            ("training snapshot", run_id, snapshot.step),
            lambda: figures.attention_heads_grid(snapshot.image, analysis.query_map(
                snapshot.attentions[0, last], snapshot.grid_size, snapshot.num_prefix_tokens
            ), layer=last),  # (H, gh, gw) maps
        ))

    if run.checkpoint is not None:
        explore, download = st.columns(2)
        explore.button(
            "Explore this model", type="primary", icon=":material/visibility:",
            on_click=models.request_model, args=(f"file:{run.checkpoint}",),
        )
        checkpoint = Path(run.checkpoint)
        download.download_button(
            "Download the checkpoint", checkpoint.read_bytes(), file_name=checkpoint.name,
            icon=":material/download:",
        )
    if status in ("finished", "stopped") and run.checkpoint is not None:
        accuracy_at_each_size(run_id)


live_view()
