"""Inside one layer: a token's vectors as strips of numbers, keys and values as matrices, one
query's scores and softmax on the image grid, the softmax scale, where a head's output comes
from and the MLP's hidden units (the "Inside a layer" page and ``inspect --head --query``)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import (
    _scale,
    MARGIN, SIMILARITY_SCALE, _float_array, _image_trace, _patch_heatmap, _rgb_uint8, _title,
    attention_scale, attention_top, figure,
)
from .attention import QUERY_COLOUR, _query_outline


def _symmetric_limit(values: np.ndarray) -> float:
    return float(np.abs(values).max()) or 1.0


def _panel_title(text: str, x: float) -> dict:
    """A subplot title as make_subplots writes it, centred above the panel at paper ``x``."""
    return dict(text=text, x=x, y=1.0, xref="paper", yref="paper", xanchor="center", yanchor="bottom",
                showarrow=False, font=dict(size=14))


def vector_strips(
    vectors: Mapping[str, object], title: str, group: int | None = None, value_name: str = "value"
) -> go.Figure:
    """Vectors of one length D as strips of numbers, one row each (named by the keys), on one
    colour scale centred on 0 (red positive, blue negative); hover gives each number. ``group``
    draws a line every ``group`` numbers (the heads inside a concatenated vector)."""
    names = list(vectors)
    rows = np.stack([_float_array(vectors[name]).reshape(-1) for name in names])  # (R, D)
    limit = _symmetric_limit(rows)
    line = dict(color="black", width=1)
    shapes = [
        dict(type="line", x0=edge - 0.5, x1=edge - 0.5, y0=-0.5, y1=len(names) - 0.5, line=line)
        for edge in range(group, rows.shape[1], group)
    ] if group else []
    return figure(
        [dict(
            type="heatmap", z=rows.astype(np.float32), y=names, colorscale=_scale(SIMILARITY_SCALE), zmin=-limit, zmax=limit,
            hovertemplate=f"%{{y}}, number %{{x}}<br>{value_name} %{{z:.4g}}<extra></extra>",
            # A strip's plot area is a few dozen pixels tall: more ticks than three overlap.
            colorbar=dict(title=dict(text=value_name), thickness=12, nticks=3),
        )],
        dict(
            title=_title(title), margin=MARGIN, height=140 + 36 * len(names), shapes=shapes,
            xaxis=dict(title=dict(text=f"{rows.shape[1]} numbers"), showgrid=False),
            yaxis=dict(autorange="reversed", type="category", showgrid=False),
        ),
    )


def key_value_matrices(keys, values, query_token: int, labels: Sequence[str], title: str) -> go.Figure:
    """This head's keys K and values V (N, hd) side by side, one row per token, the query's
    row outlined (its key is what other queries compare against; it attends with q)."""
    keys, values = _float_array(keys), _float_array(values)
    if keys.ndim != 2 or keys.shape != values.shape or keys.shape[0] != len(labels):
        raise ValueError(f"keys {keys.shape} and values {values.shape} must be (N, hd) for {len(labels)} tokens")
    traces, shapes, layout = [], [], {}
    panels = ((keys, "k", "K", (0.0, 0.4), 0.43), (values, "v", "V", (0.56, 0.96), 0.99))
    for index, (matrix, name, symbol, domain, bar_x) in enumerate(panels, start=1):
        suffix = "" if index == 1 else str(index)
        limit = _symmetric_limit(matrix)
        traces.append(dict(
            type="heatmap", z=matrix.astype(np.float32), y=list(labels), colorscale=_scale(SIMILARITY_SCALE),
            zmin=-limit, zmax=limit, colorbar=dict(title=dict(text=name), x=bar_x, thickness=10), xaxis=f"x{suffix}", yaxis=f"y{suffix}",
            hovertemplate=f"%{{y}}, number %{{x}}<br>{name} %{{z:.4g}}<extra></extra>",
        ))
        shapes.append(dict(
            type="rect", xref=f"x{suffix}", yref=f"y{suffix}", x0=-0.5, x1=matrix.shape[1] - 0.5,
            y0=query_token - 0.5, y1=query_token + 0.5, line=dict(color=QUERY_COLOUR, width=2),
        ))
        layout[f"xaxis{suffix}"] = dict(domain=domain, anchor=f"y{suffix}", title=dict(text="head dimension"),
                                         showgrid=False)
        layout[f"yaxis{suffix}"] = dict(
            anchor=f"x{suffix}", autorange="reversed", type="category", showgrid=False,
            showticklabels=len(labels) <= 40,
        )
    panel_titles = [
        _panel_title(f"{symbol}: {matrix.shape[0]} x {matrix.shape[1]}", sum(domain) / 2)
        for matrix, _, symbol, domain, _ in panels
    ]
    return figure(traces, dict(
        title=_title(f"{title} (the query's row outlined)"), margin=MARGIN, shapes=shapes,
        annotations=panel_titles, height=min(900, 240 + 6 * len(labels)), **layout,
    ))


def token_values_on_grid(
    image, values, grid_size: tuple[int, int], num_prefix_tokens: int, prefix_labels: Sequence[str],
    title: str, value_name: str, query_patch: int | None = None, centred: bool = False,
) -> go.Figure:
    """One value per key token (N,): the patches' drawn on the image grid, the prefix tokens'
    (class, distillation, registers) as bars beside it. ``centred`` colours around 0 (scores
    before the softmax); otherwise from 0 (clear) up, as the Attention page draws attention
    weights (at least a few times the uniform weight at the top). The query patch is outlined."""
    image = _rgb_uint8(image)
    values = _float_array(values).reshape(-1)
    grid_h, grid_w = grid_size
    if values.shape[0] != num_prefix_tokens + grid_h * grid_w or len(prefix_labels) != num_prefix_tokens:
        raise ValueError(
            f"{values.shape[0]} values do not fit {num_prefix_tokens} prefix tokens and a {grid_h}x{grid_w} grid"
        )
    patches = values[num_prefix_tokens:].reshape(grid_h, grid_w)
    # The bars share the colour bar's range, so that a prefix token's bar compares with the patches'
    # colours (a class token at 0.009 filled its panel when the bars had a range of their own).
    if centred:
        limit = _symmetric_limit(values)
        colours = dict(colorscale=_scale(SIMILARITY_SCALE), zmin=-limit, zmax=limit, opacity=0.85)
        colour_title, bar_range, bar_colour = value_name, [-limit, limit], "#e45756"
    else:
        top = attention_top(values, 1 / values.shape[0])
        scale = attention_scale(image, patches)
        colours = dict(colorscale=scale, zmin=0.0, zmax=top)
        colour_title, bar_range, bar_colour = f"{value_name}<br>(0 = clear)", [0.0, top], scale[-1][1]
    height, width = image.shape[:2]
    grid_domain = (0.0, 0.62) if num_prefix_tokens else (0.0, 1.0)
    traces = [
        _image_trace(image, hover=False),
        _patch_heatmap(
            patches, (height, width), value_name,
            colorbar=dict(title=dict(text=colour_title), thickness=12, x=grid_domain[1] + 0.01, len=1.0), **colours,
        ),
    ]
    layout = dict(
        xaxis=dict(domain=grid_domain, visible=False, constrain="domain"),
        yaxis=dict(visible=False, autorange="reversed", scaleanchor="x", constrain="domain"),
    )
    shapes = _query_outline(query_patch, grid_size, (height, width))
    annotations = []
    if num_prefix_tokens:
        traces.append(dict(
            type="bar", x=list(prefix_labels), y=values[:num_prefix_tokens], marker=dict(color=bar_colour),
            showlegend=False,
            xaxis="x2", yaxis="y2", hovertemplate=f"%{{x}}<br>{value_name} %{{y:.4g}}<extra></extra>",
        ))
        layout.update(
            xaxis2=dict(domain=(0.8, 1.0), anchor="y2"),
            yaxis2=dict(anchor="x2", title=dict(text=value_name), side="right", range=bar_range, automargin=True),
        )
        annotations = [_panel_title("patch tokens", 0.31), _panel_title("prefix tokens", 0.9)]
    return figure(traces, dict(
        title=_title(title), margin=MARGIN, shapes=shapes, annotations=annotations, **layout,
    ))


def softmax_scale_figure(sweep: Mapping[str, Sequence[float]], chosen: float, title: str) -> go.Figure:
    """Entropy and largest weight of one attention row against the softmax scale, as multiples
    of the model's 1/sqrt(hd) (``sweep`` from vit_explorer.model.internals.scale_sweep); the chosen
    multiple and the model's own (1) are marked."""
    factors = list(sweep["factor"])
    # Powers of two: plotly's own log ticks (2, 5, 1, 2, 5) read as nonsense on a range this narrow.
    ticks = [2.0**power for power in range(math.ceil(math.log2(min(factors))), math.floor(math.log2(max(factors))) + 1)]
    marks = [(1.0, "the model's 1/sqrt(hd)", dict(color="grey", dash="dot"))]
    if chosen != 1.0:
        marks.append((chosen, "chosen", dict(color=QUERY_COLOUR, width=2)))
    return figure(
        [
            dict(
                type="scatter", x=factors, y=list(sweep["entropy"]), name="entropy (nats)", mode="lines",
                hovertemplate="scale x%{x:.3g}<br>entropy %{y:.3f} nats<extra></extra>",
            ),
            dict(
                type="scatter", x=factors, y=list(sweep["largest weight"]), name="largest weight", mode="lines",
                yaxis="y2", hovertemplate="scale x%{x:.3g}<br>largest weight %{y:.3f}<extra></extra>",
            ),
        ],
        dict(
            title=_title(title), margin=MARGIN, legend=dict(orientation="h", y=-0.25),
            xaxis=dict(
                type="log", title=dict(text="scale, as a multiple of 1/sqrt(hd)"), tickvals=ticks,
                ticktext=[f"x{tick:g}" if tick >= 1 else f"x1/{1 / tick:g}" for tick in ticks],
            ),
            yaxis=dict(title=dict(text="entropy (nats)"), rangemode="tozero"),
            yaxis2=dict(
                title=dict(text="largest weight"), range=[0, 1.05], overlaying="y", side="right", showgrid=False,
                tickmode="linear", tick0=0, dtick=0.2,
            ),
            shapes=[
                dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1, line=line)
                for x, _, line in marks
            ],
            annotations=[
                dict(text=text, x=math.log10(x), xref="x", y=1.0, yref="paper", yanchor="bottom", showarrow=False)
                for x, text, _ in marks
            ],
        ),
    )


def head_sources_figure(sources: Sequence[Mapping], labels: Sequence[str], title: str) -> go.Figure:
    """The keys that make most of a head's output (vit_explorer.model.internals.head_output_sources):
    each one's attention weight beside its share of the output."""
    names = [labels[source["token"]] for source in sources]
    return figure(
        [
            dict(
                type="bar", y=names, x=[source["weight"] for source in sources], orientation="h",
                name="attention weight a_j", hovertemplate="%{y}<br>weight %{x:.4f}<extra></extra>",
            ),
            dict(
                type="bar", y=names, x=[source["share"] for source in sources], orientation="h", name="share of the output",
                hovertemplate="%{y}<br>share %{x:.1%}<extra></extra>",
            ),
        ],
        dict(
            title=_title(title), margin=MARGIN, barmode="group", height=160 + 44 * len(names),
            legend=dict(orientation="h", y=-0.2), xaxis=dict(title=dict(text="weight, share")),
            yaxis=dict(autorange="reversed", type="category"),
        ),
    )


def mlp_activations_figure(sorted_values, units, near_zero: float, title: str) -> go.Figure:
    """One token's MLP hidden units after the nonlinearity, sorted from the largest (``units``:
    which unit each value is, for the hover); the band of near-zero values is shaded."""
    values = _float_array(sorted_values).reshape(-1)
    return figure(
        [dict(
            type="scatter", x=np.arange(values.shape[0]), y=values.astype(np.float32), mode="lines", fill="tozeroy",
            customdata=_float_array(units).reshape(-1).astype(np.int64), showlegend=False,
            hovertemplate="unit %{customdata} (rank %{x})<br>activation %{y:.4g}<extra></extra>",
        )],
        dict(
            title=_title(title), margin=MARGIN,
            xaxis=dict(title=dict(text=f"hidden unit, sorted ({values.shape[0]} units)")),
            yaxis=dict(title=dict(text="activation")),
            shapes=[dict(
                type="rect", xref="paper", yref="y", x0=0, x1=1, y0=-near_zero, y1=near_zero,
                fillcolor="grey", opacity=0.25, line=dict(width=0),
            )],
            annotations=[dict(
                text=f"near zero (|h| < {near_zero:g})", xref="paper", x=1.0, xanchor="right", yref="y",
                y=near_zero, yanchor="bottom", showarrow=False,
            )],
        ),
    )


def inside_layer_figures(
    image, steps, grid_size: tuple[int, int], labels: Sequence[str], head: int, token: int,
    query_patch: int | None = None, activation: str = "the activation", norm: str = "LayerNorm",
) -> dict[str, go.Figure]:
    """The "Inside a layer" page's figures for one head and query token, by step, from a
    vit_explorer.model.internals.LayerInternals (image 0): what the page shows and ``inspect --head
    --query`` writes; ``steps`` holds ``token``'s rows. ``labels`` name the N tokens (figures.token_labels); ``query_patch`` is
    outlined on the image; ``activation`` names the MLP's nonlinearity, ``norm`` the block's
    ("RMSNorm" for Qwen2.5-VL's). With rotary positions the
    query's strips are its q and k before and after the rotation."""
    from ..model import internals as inside  # the per-token analyses the page shows  # the per-token analyses the page shows

    name, layer, prefix = labels[token], steps.layer, len(labels) - grid_size[0] * grid_size[1]
    where, dim, heads = f"layer {layer}, head {head}", steps.input.shape[-1], steps.num_heads
    prefix_labels = list(labels[:prefix])
    row = steps.row(token)
    hidden = steps.mlp_hidden.shape[-1]
    activity = inside.mlp_activity(steps.mlp_hidden[0, row])
    return {
        "layernorm": vector_strips(
            {"x": steps.input[0, row], f"{'RMSNorm' if norm == 'RMSNorm' else 'LN'}(x)": steps.norm1[0, row]},
            f"{name} before and after {norm} ({dim} numbers each)",
        ),
        "query": vector_strips(
            {"q": steps.q[0, head, row]}, f"Query q of {name}, {where} ({steps.head_dim} numbers)"
        ) if steps.q_unrotated is None else vector_strips(
            {"q before the rotation": steps.q_unrotated[0, head, row], "q rotated": steps.q[0, head, row],
             "k before the rotation": steps.k_unrotated[0, head, token], "k rotated": steps.k[0, head, token]},
            f"Query q and key k of {name}, {where}, before and after the rotation ({steps.head_dim} numbers each)"
            + (": a prefix token is not rotated" if token < prefix else ""),
        ),
        "keys_values": key_value_matrices(
            steps.k[0, head], steps.v[0, head], token, labels,
            f"Keys and values of all {steps.num_tokens} tokens, {where}",
        ),
        "scores": token_values_on_grid(
            image, steps.scores[0, head, row], grid_size, prefix, prefix_labels,
            f"Scores of {name} for every key, {where}, before the softmax", "score", query_patch, centred=True,
        ),
        "attention": token_values_on_grid(
            image, steps.attention[0, head, row], grid_size, prefix, prefix_labels,
            f"Attention of {name}, {where}: the softmax of the scores", "attention", query_patch,
        ),
        "head_sources": head_sources_figure(
            inside.head_output_sources(steps, head, token), labels, f"Where head {head}'s output for {name} comes from"
        ),
        "heads_projection": vector_strips(
            {"heads side by side": steps.concatenated[0, row], "W_o [...] + b_o": steps.attn_out[0, row]},
            f"All {heads} heads of {name} and the output projection, layer {layer}", group=steps.head_dim,
        ),
        "attention_residual": vector_strips(
            {"x": steps.input[0, row], "added by attention": steps.attention_branch[0, row],
             "x'": steps.middle[0, row]},
            f"The first residual add for {name}, layer {layer}",
        ),
        "mlp_units": mlp_activations_figure(
            activity["sorted"], activity["units by activation"], inside.NEAR_ZERO,
            f"The {hidden} hidden units of {name}, layer {layer}, after {activation}",
        ),
        "mlp_residual": vector_strips(
            {"x'": steps.middle[0, row], "added by the MLP": steps.mlp_branch[0, row], "y": steps.output[0, row]},
            f"The second residual add: {name} leaving layer {layer}",
        ),
    }


def softmax_scale_figures(
    image, steps, grid_size: tuple[int, int], labels: Sequence[str], head: int, token: int, factor: float,
    query_patch: int | None = None,
) -> dict[str, go.Figure]:
    """The scale control's figures: the entropy and largest weight of the query's softmax at
    multiple of 1/sqrt(hd) from 1/8 to 8 (vit_explorer.model.internals.SWEEP_FACTORS), and its attention at
    ``factor`` times the model's scale; the model and its recorded numbers are not changed."""
    from ..model import internals as inside

    name, where = labels[token], f"layer {steps.layer}, head {head}"
    prefix = len(labels) - grid_size[0] * grid_size[1]
    own = " (its own)" if factor == 1 else " (not the model's)"
    return {
        "scale_sweep": softmax_scale_figure(
            inside.scale_sweep(steps, head, token, inside.SWEEP_FACTORS), factor,
            f"How the scale sharpens the softmax of {name}, {where}",
        ),
        "rescaled_attention": token_values_on_grid(
            image, inside.rescaled_attention(steps, head, token, factor * steps.scale), grid_size, prefix,
            list(labels[:prefix]), f"Attention of {name} at x{factor:g} the model's scale{own}", "attention",
            query_patch,
        ),
    }
