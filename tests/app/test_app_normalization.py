"""A checkpoint whose normalisation nothing tells: the sidebar says which was assumed and lets a
person choose another, for their own session only (the shared model is never changed)."""
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from vit_explorer.app import images, memo, models
from vit_explorer.app.selection import Selection
from apptest import errors, open_app, tiny_default, widget  # noqa: F401 (tiny_default: autouse)
from helpers import randomize

HALF, IMAGENET = "0.5 (Inception, SigLIP)", "ImageNet"


def _lone_timm_file(tmp_path, monkeypatch, **changes):
    """A plain timm ViT file (augreg, DeiT and DINO all have this shape) as the app's default model."""
    reference = randomize(VisionTransformer(**{
        **dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5), **changes,
    }))
    path = tmp_path / "lone_timm.safetensors"
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, path)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(path))


def _normalised_with(app) -> str:
    """What the Pipeline page says the pixels were normalised with."""
    (text,) = [markdown.value for markdown in app.markdown if "normalised with mean" in markdown.value]
    return text.split("normalised with ")[1].split(", the statistics")[0]


def test_an_assumed_normalisation_is_said_and_a_choice_changes_that_sessions_preprocessing_only(tmp_path, monkeypatch):
    _lone_timm_file(tmp_path, monkeypatch)
    alice = open_app("views/pipeline.py")
    captions = [caption.value for caption in alice.sidebar.caption]
    assert f"Normalisation assumed: {HALF}, timm's default for a ViT of this shape; nothing in the checkpoint says which." in captions
    assert widget(alice.sidebar.selectbox, "Normalisation").value == HALF
    assert _normalised_with(alice) == "mean (0.5, 0.5, 0.5) and std (0.5, 0.5, 0.5)"

    widget(alice.sidebar.selectbox, "Normalisation").set_value(IMAGENET).run()
    assert not alice.exception and errors(alice) == []
    assert _normalised_with(alice) == "mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225)"
    assert widget(alice.sidebar.selectbox, "Normalisation").value == IMAGENET

    bob = open_app("views/pipeline.py")  # another session: the model's own, as assumed
    assert widget(bob.sidebar.selectbox, "Normalisation").value == HALF
    assert _normalised_with(bob) == "mean (0.5, 0.5, 0.5) and std (0.5, 0.5, 0.5)"
    alice.run()
    assert _normalised_with(alice).startswith("mean (0.485")

    # One shared model, never changed; the chosen one shares its tensors; the results never mix.
    shared = models.base_model(models.DEFAULT_MODEL)
    assert shared.config.normalization_assumed and shared.config.normalization_name == HALF
    chosen = models.model_at(models.DEFAULT_MODEL, 4, (32, 32), IMAGENET)
    assert chosen.config.normalization_name == IMAGENET and chosen.config.normalization_source == "chosen"
    assert chosen.patch_embed.proj.weight.data_ptr() == shared.patch_embed.proj.weight.data_ptr()
    image_key = images.resolve_image(images.DEFAULT_IMAGE, (32, 32))[0]
    for model_id in (models.DEFAULT_MODEL, (models.DEFAULT_MODEL, IMAGENET)):
        assert (model_id, 4, (32, 32), image_key, "capture") in memo.shared_results()


def test_a_choice_of_the_models_own_normalisation_or_for_a_model_that_tells_its_own_changes_nothing(tmp_path, monkeypatch):
    config = models.base_model(models.DEFAULT_MODEL).config  # the tiny shapes model: its file says
    assert models.normalization_choice(config, IMAGENET) is None
    assert models.assumed_normalization(config) is None
    _lone_timm_file(tmp_path, monkeypatch)
    models.shared_models().clear()
    assumed = models.base_model(models.DEFAULT_MODEL).config
    assert models.normalization_choice(assumed, HALF) is None  # its own: the shared results
    assert models.normalization_choice(assumed, "nonsense") is None
    assert models.normalization_choice(assumed, IMAGENET) == IMAGENET


def test_a_structure_that_tells_its_normalisation_offers_no_choice(tmp_path, monkeypatch):
    _lone_timm_file(tmp_path, monkeypatch, pre_norm=True)  # CLIP's image tower: OpenAI CLIP's
    app = open_app("views/pipeline.py")
    assert not any(caption.value.startswith("Normalisation assumed") for caption in app.sidebar.caption)
    assert "Normalisation" not in [box.label for box in app.sidebar.selectbox]
    assert _normalised_with(app).startswith("mean (0.48145466")


def test_a_job_carries_the_chosen_normalisation_and_its_worker_reads_the_model_with_it(tmp_path, monkeypatch):
    from vit_explorer.app import jobs
    from vit_explorer.serving.jobs import _load

    _lone_timm_file(tmp_path, monkeypatch)
    model = models.model_at(models.DEFAULT_MODEL, 4, (32, 32), IMAGENET)
    chosen = Selection(models.DEFAULT_MODEL, 4, "shapes:4@32x32", model, None, IMAGENET)
    own = Selection(models.DEFAULT_MODEL, 4, "shapes:4@32x32", models.base_model(models.DEFAULT_MODEL), None)
    spec, own_spec = jobs.job_spec(chosen, "head sweep", mode="zero"), jobs.job_spec(own, "head sweep", mode="zero")
    assert spec.key != own_spec.key and "mean" not in own_spec.model
    worker = _load({"model": spec.model, "patch_size": 4, "image_size": [32, 32]})
    assert worker.config.normalization_name == IMAGENET
