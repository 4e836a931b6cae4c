"""A prediction in words: class embeddings as open_clip's zero-shot classifier builds them, kept
on disk for exactly their classes and templates, and the image scored as the model was trained."""
import torch

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text import zero_shot

from textmodels import SMALL_CLIP, open_clip_folder, open_clip_tokenizer, siglip_folder

CLASSES = ("cat", "dog", "rocket", "tench", "goldfish")


def test_class_embeddings_equal_open_clips_zero_shot_classifier(tmp_path):
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    reference = open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    model = load_image_text_model(tmp_path / "clip")
    templates = zero_shot.imagenet_templates()
    done = []
    ours = zero_shot.class_embeddings(model, CLASSES, templates, progress=lambda *step: done.append(step))
    with torch.no_grad():
        theirs = build_zero_shot_classifier(reference, open_clip_tokenizer(tmp_path / "clip"), CLASSES, templates)
    torch.testing.assert_close(ours, theirs.t(), atol=1e-5, rtol=0)
    assert done[-1] == (len(CLASSES) * len(templates),) * 2


def test_class_embeddings_are_kept_for_exactly_their_classes_and_templates(tmp_path):
    embeddings = torch.nn.functional.normalize(torch.randn(len(CLASSES), 32), dim=-1)
    path = tmp_path / "classes.safetensors"
    templates = zero_shot.imagenet_templates()
    zero_shot.save_class_embeddings(path, embeddings, CLASSES, templates)
    assert torch.equal(zero_shot.load_class_embeddings(path, CLASSES, templates, 32), embeddings)
    assert zero_shot.load_class_embeddings(path, CLASSES[:-1], templates, 32) is None
    assert zero_shot.load_class_embeddings(path, CLASSES, templates[:1], 32) is None
    assert zero_shot.load_class_embeddings(path, CLASSES, templates, 64) is None
    path.write_bytes(b"half a file")
    assert zero_shot.load_class_embeddings(path, CLASSES, templates, 32) is None
    assert [item.name for item in tmp_path.iterdir()] == ["classes.safetensors"]  # no temporary left


def test_siglip_scores_each_label_with_its_sigmoid_and_bias(tmp_path):
    model = load_image_text_model(siglip_folder(tmp_path / "siglip"))
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    pooled = vx.capture(model.image, image, layers=()).logits
    labels = ("a cat", "a dog", "a rocket")
    texts = model.embed_texts(zero_shot.label_prompts(list(labels)))
    prediction = zero_shot.predict(model, pooled, labels, texts)
    cosines = model.project_image(pooled)[0] @ texts.t()
    torch.testing.assert_close(prediction.scores, torch.sigmoid(model.logit_scale * cosines + model.logit_bias))
    assert prediction.scoring == "sigmoid" and "sigmoid" in model.scoring_sentence()
    assert [label for label, _ in prediction.top(2)] == [labels[int(index)] for index in prediction.scores.argsort(descending=True)[:2]]


def test_imagenet_has_its_thousand_classes_and_seven_templates():
    assert len(zero_shot.imagenet_classes()) == 1000 and len(zero_shot.imagenet_templates()) == 7
    assert all("{}" in template for template in zero_shot.imagenet_templates())
