"""What the model says in words: CLIP's and SigLIP's text towers beside our image tower.

    tokenizers.py   CLIP's BPE (inside open_clip) or a folder's Hugging Face tokenizer, checked
    tokenizer_check.py  a tokenizer.json counted, built and tried in a capped child process
    towers.py       ImageTextModel: both towers, the image and text embeddings, the score
    files.py        both towers from an open_clip folder or a Hugging Face CLIP / SigLIP folder,
                    checked before anything is allocated
    zero_shot.py    a prediction in words: ImageNet's classes with templates, or typed labels
    maps.py         where each text is: dense similarity, relevance, each patch's best prompt
    open_vocabulary.py  the map methods (MaskCLIP, SCLIP, ClearCLIP, NACLIP): the last block
                    changed for one call, re-run from the captured tokens
    segmentation.py a picture segmented by words as SCLIP and NACLIP do it (windows, the
                    papers' background rule, PAMR)
    heads.py        heads in words (TextSpan): what each late head writes, in descriptions
    descriptions.py the pool of short descriptions heads are described from
"""
from .files import is_image_text_folder, load_image_text_model
from .towers import ImageTextModel, LabelError, parse_labels

__all__ = ["ImageTextModel", "LabelError", "is_image_text_folder", "load_image_text_model", "parse_labels"]
