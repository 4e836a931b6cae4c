"""Training: loss, accuracy and learning-rate curves of a run; its accuracy at each input size; a sparse
autoencoder run's curves."""
from __future__ import annotations

import math
from collections.abc import Mapping

import plotly.graph_objects as go

from ._base import MARGIN, _on_axes, _subplots, _title, figure


def _epoch_steps(history: Mapping) -> list[float]:
    """x position (a step) of each epoch summary: where that epoch ended.

    Epochs (1-based, as ``vit_explorer.training.train`` counts them) have equal step counts, so epoch e of
    E ends at step e * total_steps / E; without step records, the epoch number itself.
    """
    steps = history.get("steps", [])
    if not steps:
        return [record["epoch"] for record in history.get("epochs", [])]
    total_steps = steps[-1]["total_steps"]
    return [
        record["epoch"] * total_steps / record["epochs"] for record in history.get("epochs", [])
    ]


def training_curves(history: Mapping | None) -> go.Figure:
    """Loss, accuracy and learning rate of a training run (``TrainingRun.history``): per-step
    training values as lines, per-epoch test values as markers. Empty history: empty axes."""
    history = history or {}
    steps = history.get("steps", [])
    epochs = history.get("epochs", [])
    grid, cells = _subplots(1, 3, ("loss", "accuracy", "learning rate"), horizontal_spacing=0.08)
    step_x = [record["step"] for record in steps]
    epoch_x = _epoch_steps(history)
    train = dict(type="scatter", mode="lines", line=dict(color="#4c78a8"), legendgroup="train")
    test = dict(type="scatter", mode="lines+markers", line=dict(color="#e45756"), legendgroup="test")
    loss, accuracy, rate = cells[1, 1], cells[1, 2], cells[1, 3]
    traces = [
        _on_axes(dict(x=step_x, y=[r["loss"] for r in steps], name="train (per step)", **train), loss),
        _on_axes(dict(x=step_x, y=[r["accuracy"] for r in steps], showlegend=False, name="train (per step)",
                      **train), accuracy),
        _on_axes(dict(x=step_x, y=[r["lr"] for r in steps], showlegend=False, name="learning rate", **train), rate),
        _on_axes(dict(x=epoch_x, y=[r["test_loss"] for r in epochs], name="test (per epoch)", **test), loss),
        _on_axes(dict(x=epoch_x, y=[r["test_accuracy"] for r in epochs], showlegend=False, name="test (per epoch)",
                      **test), accuracy),
    ]
    for suffix in cells.values():
        grid[f"xaxis{suffix}"]["title"] = dict(text="step")
    grid[f"yaxis{accuracy}"]["range"] = [0, 1]
    grid[f"yaxis{rate}"]["exponentformat"] = "e"
    if steps:
        latest = steps[-1]
        title = (
            f"Training: step {latest['step']} of {latest['total_steps']},"
            f" loss {latest['loss']:.3f}, accuracy {latest['accuracy']:.1%}"
        )
        if epochs:
            title += f"; test accuracy {epochs[-1]['test_accuracy']:.1%}"
    else:
        title = "Training curves (nothing logged yet)"
    grid.update(title=_title(title), margin=MARGIN, legend=dict(orientation="h", y=-0.2))
    return figure(traces, grid)


def accuracy_by_image_size_figure(series: Mapping[str, Mapping[tuple[int, int], float]], trained_size: tuple[int, int]) -> go.Figure:
    """Test accuracy against input size, a line per model (``evaluation.accuracy_by_image_size`` of
    each, by label), the sizes in pixel order: how well each model's positions carry to grids
    larger than ``trained_size``, the one it learned at."""
    sizes = sorted({size for accuracies in series.values() for size in accuracies}, key=lambda size: size[0] * size[1])

    def label(size: tuple[int, int]) -> str:
        return f"{size[0]}x{size[1]}" + (" (trained)" if tuple(size) == tuple(trained_size) else "")

    traces = [
        dict(
            type="scatter", mode="lines+markers", name=name, x=[label(size) for size in accuracies],
            y=list(accuracies.values()), hovertemplate=f"{name}<br>%{{x}} px: %{{y:.1%}}<extra></extra>",
        )
        for name, accuracies in series.items()
    ]
    height, width = trained_size
    layout = dict(
        title=_title(f"Test accuracy at each input size (trained at {height}x{width})"),
        xaxis=dict(type="category", title=dict(text="input size (px)"),
                   categoryorder="array", categoryarray=[label(size) for size in sizes]),
        yaxis=dict(range=[0, 1.1], title=dict(text="test accuracy"), tickformat=".0%"),
        margin={**MARGIN, "l": 60}, legend=dict(orientation="h", y=-0.25), height=360,
    )
    return figure(traces, layout)


def sae_curves(history: Mapping | None) -> go.Figure:
    """A sparse autoencoder run's curves (``TrainingRun.history``'s steps): the share of the tokens'
    variance it explains (the last steps' training tokens as a line, the held-out tokens at each
    pass's end as markers: the number the run ends on) and its reconstruction error, the latents
    active per token (L0) and the share of latents that have stopped firing. The explained
    variance's axis spans its values, below 0 too (a new dictionary starts far below)."""
    steps = (history or {}).get("steps", [])
    grid, cells = _subplots(
        1, 4, ("explained variance", "reconstruction error (MSE)", "L0: active latents per token", "dead latents"),
        horizontal_spacing=0.07,
    )
    x = [record["step"] for record in steps]
    line = dict(type="scatter", mode="lines", line=dict(color="#4c78a8"))
    traces = [
        _on_axes(dict(x=x, y=[record[name] for record in steps], name="training tokens (last steps)",
                      showlegend=column == 1, legendgroup="train", **line), cells[1, column])
        for column, name in enumerate(("explained_variance", "mse", "l0", "dead_share"), start=1)
    ]
    measured = [record for record in steps if record.get("held_out_explained_variance") is not None]
    traces.append(_on_axes(dict(
        type="scatter", mode="markers", marker=dict(color="#e45756", size=9), name="held-out tokens (each pass's end)",
        x=[record["step"] for record in measured], y=[record["held_out_explained_variance"] for record in measured],
    ), cells[1, 1]))
    for suffix in cells.values():
        grid[f"xaxis{suffix}"]["title"] = dict(text="step")
    values = [record["explained_variance"] for record in steps]
    values += [record["held_out_explained_variance"] for record in measured]
    lowest = min([value for value in values if math.isfinite(value)], default=0.0)
    grid[f"yaxis{cells[1, 1]}"].update(range=[min(0.0, lowest) - 0.05, 1.05], tickformat=".0%")
    grid[f"yaxis{cells[1, 4]}"].update(range=[0, 1], tickformat=".0%")
    if steps:
        latest = steps[-1]
        if measured:
            explains = f"explains {measured[-1]['held_out_explained_variance']:.1%} of held-out tokens' variance"
        else:
            explains = f"explains {latest['explained_variance']:.1%} of the last steps' training tokens"
        title = (
            f"Sparse autoencoder: step {latest['step']} of {latest['total_steps']}, {explains},"
            f" L0 {latest['l0']:.1f}, {latest['dead_share']:.1%} of the latents dead"
        )
    else:
        title = "Sparse autoencoder curves (nothing logged yet)"
    grid.update(title=_title(title), margin=MARGIN, legend=dict(orientation="h", y=-0.25))
    return figure(traces, grid)
