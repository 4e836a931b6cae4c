"""ProxyCLIP's proxy on the pages (text.proxyclip): another model of the app (a DINO of the
catalogue, a run, an upload) captured on the very pixels the text model reads, once for
everybody per text model, sizes, image and proxy (``Selection.memo``).

The proxy runs at the text model's input size (its positions resampled, models.model_at: a
shared copy, the proxy itself unchanged), so that both see the same crop and, with the same patch
size, the same grid; its input is the text model's, normalised as the proxy was trained
(proxyclip.proxy_input). Its cost: one forward of the proxy per picture.
"""
from __future__ import annotations

from ..model.capture import capture
from ..text import proxyclip
from . import models
from .selection import Selection


def proxy(selection: Selection, proxy_key: str) -> proxyclip.Proxy:
    """The proxy ``proxy_key`` (a model key of models.model_options) and its capture of the
    selection's picture; a ValueError (one sentence) when it cannot read that input size."""
    base = models.base_model(proxy_key)
    size = selection.config.img_size
    problem = models.image_size_problem(base.config, size)
    if problem is not None:
        raise ValueError(f"the proxy cannot read the picture at {size[0]}x{size[1]} px: {problem[0].lower()}{problem[1:].rstrip('.')}")
    model = models.model_at(proxy_key, base.config.patch_size, size)
    captured = selection.memo("proxy capture", proxy_key, spinner="Running the proxy ...", compute=lambda: capture(
        model, proxyclip.proxy_input(selection.model_input(), selection.config, model.config), layers=(),
    ))
    return proxyclip.Proxy(model, captured)
