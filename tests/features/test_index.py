"""The index's streaming parts: the running top, the histogram whose range grows as values come,
and two ranks' parts merged, against the same numbers computed at once."""
import numpy as np
import torch

from vit_explorer.features.index import _Partial


def streamed(latents: torch.Tensor, batches: int, top: int = 3, bins: int = 5) -> _Partial:
    """latents (T, F) of T tokens (token t: image t // 4, position t % 4) added in ``batches`` parts."""
    partial = _Partial(latents.shape[1], top, bins, torch.device("cpu"))
    tokens = torch.arange(latents.shape[0])
    for rows in tokens.chunk(batches):
        values, indices = latents[rows].topk(latents.shape[1], dim=1)  # as TopK leaves them, k = F here
        partial.add(values, indices, rows // 4, rows % 4)
    return partial


def growing_latents() -> torch.Tensor:
    """(24, 3): latent 0 grows from 1 to 10 (its range widens twice), latent 1 fires once, latent 2 never."""
    latents = torch.zeros(24, 3)
    latents[:, 0] = torch.tensor([1.0, 0.5, 0, 1, 3, 0, 2.5, 3, 5, 7, 9, 0, 10, 9.5, 7, 0, 5, 3, 1, 0, 1, 8.5, 0, 0])
    latents[13, 1] = 0.75
    return latents


def test_streamed_histogram_and_top_equal_the_whole_at_once():
    latents = growing_latents()
    index = streamed(latents, batches=6).finish((2, 2), 0)
    values = latents[:, 0][latents[:, 0] > 0].numpy()
    expected, _ = np.histogram(values, bins=5, range=(0, 10))  # the values sit well inside their bins
    assert index.histogram[0].tolist() == expected.tolist()
    assert index.histogram[1].tolist() == [0, 0, 0, 0, 1] and index.histogram[2].tolist() == [0] * 5
    assert index.maxima.tolist() == [10, 0.75, 0] and index.tokens_seen == 24
    assert np.allclose(index.frequency, [len(values) / 24, 1 / 24, 0])
    assert index.top(0) == [(3, 0, 10.0), (3, 1, 9.5), (2, 2, 9.0)]
    assert index.top(1) == [(3, 1, 0.75)] and index.top(2) == []
    assert index.images[1].tolist() == [3, -1, -1] and index.values[2].tolist() == [0, 0, 0]


def test_two_ranks_parts_merge_into_the_whole():
    latents = torch.relu(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))) * torch.arange(1, 9)
    whole = streamed(latents, batches=1).finish((4, 4), 0)
    first, second = streamed(latents[:40], batches=3), streamed(latents[40:], batches=2)
    second.images = torch.where(second.images >= 0, second.images + 10, -1)  # its images are 10 onwards
    first.merge(second)
    merged = first.finish((4, 4), 0)
    assert np.array_equal(merged.histogram, whole.histogram) and np.array_equal(merged.frequency, whole.frequency)
    assert np.array_equal(merged.values, whole.values) and merged.tokens_seen == 64
    assert np.array_equal(merged.patches, whole.patches)
    assert np.array_equal(merged.images, whole.images)
