"""Inside a layer: how one head decides where to look and what the layer does to one token,
step by step, with this model's own numbers on this image."""
import math

import streamlit as st
import torch

from vit_explorer import figures
from vit_explorer.model import rope
from vit_explorer.model import internals as inside
from vit_explorer.app import session

selection = session.selection()
config = selection.config
result = selection.capture()
image = selection.display_image()
depth, heads = config.depth, config.num_heads
grid_h, grid_w = result.grid_size
prefix, num_patches = result.num_prefix_tokens, grid_h * grid_w
labels = figures.token_labels(result.num_tokens, prefix, config.class_token, config.dist_token)

CLASS_QUERY = -1  # the class token, as on the Attention page (which shares layer, head and query)
queries = ([CLASS_QUERY] if config.class_token else []) + list(range(num_patches))
centre = (grid_h // 2) * grid_w + grid_w // 2
rotary, gated = config.rope_type is not None, config.swiglu_mlp


def query_label(query: int) -> str:
    if query == CLASS_QUERY:
        return "class token"
    row, col = divmod(query, grid_w)
    return f"patch {query} (row {row}, col {col})"


st.title("Inside a layer")
st.write(
    "The Attention page shows where each head looks; this page shows how it decides. Pick a layer,"
    " a head and a query token, then read down: every step is the formula the model computes, and"
    " every number is this model's own, recorded while it read this image."
)

layer = st.slider("Layer", 0, depth - 1, **session.keep("layer", depth - 1, lambda layer: 0 <= layer < depth))
controls, picker = st.columns([2, 1])
with controls:
    head = st.selectbox("Head", list(range(heads)), **session.keep("head", 0, lambda h: 0 <= h < heads))
    query = st.selectbox(
        "Query token", queries, format_func=query_label,
        **session.keep("query", queries[0] if queries[0] < 0 else centre, lambda q: q in queries),
    )
    st.caption(
        f"{result.num_tokens} tokens enter every layer: "
        + (f"{prefix} prefix token{'s' if prefix > 1 else ''} ({', '.join(labels[:prefix])}) and " if prefix else "")
        + f"{num_patches} patches. Click a patch to make it the query."
    )
with picker:
    st.plotly_chart(
        selection.memo("patch picker", query, compute=lambda: figures.patch_picker(
            image, result.grid_size, None if query < 0 else query
        )),
        key="inside_patch_click", on_select=session.patch_picked("inside_patch_click", "query"), selection_mode="points",
        config={"displayModeBar": False},
    )

token = 0 if query == CLASS_QUERY else prefix + query
steps = selection.internals(layer, token)
row = steps.row(token)
name = labels[token]
dim, head_dim, hidden = config.embed_dim, steps.head_dim, steps.mlp_hidden.shape[-1]
query_patch = None if query == CLASS_QUERY else query
activation = inside.activation_name(config)
figs = selection.memo("inside figures", layer, head, query, compute=lambda: figures.inside_layer_figures(
    image, steps, result.grid_size, labels, head, token, query_patch, activation,
    "RMSNorm" if config.norm_layer == "rmsnorm" else "LayerNorm",
))

rms_norm = config.norm_layer == "rmsnorm"  # Qwen-VL: RMSNorm, no centring and no shift
with st.expander(f"1. {name} enters layer {layer}, and {'RMSNorm' if rms_norm else 'LayerNorm'}", expanded=True):
    entering = (
        f"x is the token's vector of {dim} numbers as it leaves "
        + (f"layer {layer - 1}" if layer else "the embedding (patch projection plus position)" if config.abs_pos_embed
           else "the embedding (the patch projection: this model adds no position to it)")
    )
    if rms_norm:
        st.latex(r"\mathrm{RMSNorm}(x) = \gamma \odot \frac{x}{\sqrt{\overline{x^2} + \epsilon}}")
        st.write(
            entering + ". RMSNorm divides it by its root mean square (it subtracts no mean, unlike"
            " LayerNorm), so that every token reaches attention on the same scale whatever its size; the"
            " learned γ then stretches each of the numbers (there is no shift β). Hover over the strips for every number."
        )
        rms = selection.memo("inside rms", layer, token, compute=lambda: inside.rms_statistics(steps.input[0, row], steps.norm_eps))
        st.metric("root mean square sqrt(mean(x²) + ε)", f"{rms:.4g}")
    else:
        st.latex(r"\mathrm{LN}(x) = \gamma \odot \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta")
        st.write(
            entering + ". LayerNorm subtracts its mean μ and divides by its standard deviation σ, so that every"
            " token reaches attention on the same scale whatever its size; the learned γ and β then"
            " stretch and shift each of the numbers. Hover over the strips for every number."
        )
        mean, std = selection.memo("inside norm", layer, token, compute=lambda: inside.layer_norm_statistics(
            steps.input[0, row], steps.norm_eps
        ))
        left, right = st.columns(2)
        left.metric("mean μ", f"{mean:.4g}")
        right.metric("standard deviation sqrt(σ² + ε)", f"{std:.4g}")
    st.plotly_chart(figs["layernorm"])

with st.expander(f"2. Head {head}'s query, keys and values", expanded=True):
    st.latex(
        r"q = W_q\,\mathrm{LN}(x) + b_q \in \mathbb{R}^{" + str(head_dim) + r"},\qquad "
        r"K = \mathrm{LN}(X)\,W_k^\top + b_k,\quad V = \mathrm{LN}(X)\,W_v^\top + b_v \in \mathbb{R}^{"
        + f"{steps.num_tokens}" + r"\times" + f"{head_dim}" + "}"
    )
    st.write(
        f"Each of the {heads} heads has its own three matrices. The query q says what this token is"
        " looking for; every token's key k_j says what it offers to be found by, and its value v_j"
        f" what it hands over when found. With {heads} heads of {head_dim} numbers, q, k and v together"
        f" take the {dim} numbers of LN(x) to {3 * dim}."
    )
    if rotary:
        st.latex(
            r"\tilde q = R_{p}\,q,\qquad \tilde k_j = R_{p_j}\,k_j,\qquad "
            r"R_p: \text{each pair of numbers turned by its angle } \theta_i(p)"
        )
        st.write(
            f"This model's positions enter here. Each patch's q and k are cut into {head_dim // 2} pairs of"
            " numbers, and each pair is turned by an angle that grows with the patch's row or column (the"
            " Pipeline page draws the angles); the prefix tokens have no position and are not turned. Below:"
            f" {name}'s q and k before and after the rotation. The scores in step 3 use the rotated ones,"
            " and so do the keys shown under it."
        )
    st.plotly_chart(figs["query"])
    st.plotly_chart(figs["keys_values"])

with st.expander("3. Scores and the softmax", expanded=True):
    st.latex(
        r"s_j = \frac{q \cdot k_j}{\sqrt{d_{head}}} = \frac{q \cdot k_j}{\sqrt{" + str(head_dim) + r"}},\qquad "
        r"a_j = \frac{e^{s_j}}{\sum_{j'} e^{s_{j'}}}"
    )
    st.write(
        "The dot product of q with every key says how well each token matches what the query looks"
        f" for. It is divided by sqrt({head_dim}) = {head_dim ** 0.5:.3g}: a dot product of"
        f" {head_dim} numbers grows with their count, and without the scaling the softmax would put"
        " nearly all the weight on one token. The softmax turns the scores into weights that are"
        " positive and sum to 1: the attention row, the same numbers the Attention page draws for"
        " this layer, head and query."
    )
    st.plotly_chart(figs["scores"])
    if steps.window is not None:  # window attention (Qwen2.5-VL)
        inside_window = int(steps.window[row].sum())
        st.caption(
            f"This layer attends within windows: the softmax runs over the {inside_window} tokens of this"
            f" token's window only; the other {steps.num_tokens - inside_window} keys' scores are drawn above"
            " but not used, and their weights are exactly 0."
        )
    st.plotly_chart(figs["attention"])
    entropy, largest = selection.memo("inside softmax", layer, head, token, compute=lambda: inside.softmax_statistics(
        steps.attention[0, head, row]
    ))
    left, right = st.columns(2)
    left.metric("entropy", f"{entropy:.3f} nats", help=(
        f"0 when all the weight is on one token; ln {steps.num_tokens} = {math.log(steps.num_tokens):.3f}"
        " when it is spread evenly over all of them."
    ))
    right.metric("largest weight", f"{largest:.3f}")

    if rotary:
        placed = centre if query_patch is None else query_patch  # a prefix token's: the centre
        positions = [placed, rope.farthest_corner(placed, result.grid_size)]
        st.markdown(
            "**Why rotate: the score sees only the offset.** Take this token's q and its own k as they were"
            " before the rotation and keep those numbers fixed; put the query on one patch and a copy of the"
            " key on every patch in turn, rotate each where it stands and score it, q·k/sqrt(d_head). The"
            " contents never change, so everything that varies across the map is the positions' part. Move"
            " the query (right panel) and the whole pattern moves with it: the score depends only on where"
            " the key is relative to the query, so what a head learns about 'the patch just above me' holds"
            " anywhere in the image."
            + (f" ({name} itself is never rotated: its q and k are placed on the grid here only to show"
               " the rule.)" if query_patch is None else "")
        )
        st.plotly_chart(selection.memo("inside rope offsets", layer, head, query, compute=lambda: figures.offset_scores_figure(
            torch.stack([rope.offset_scores(
                selection.model.rope_spec, steps.q_unrotated[0, head, row], steps.k_unrotated[0, head, token],
                result.grid_size, position, steps.scale,
            ) for position in positions]),
            positions, result.grid_size,
            f"The same q and k of {name} (layer {layer}, head {head}), the key at every patch: score by position",
            own_position=query_patch,
        )))

    st.markdown("**What the scaling does.** Try another scale for this query's softmax: only the two"
                " charts below change; the model and everybody else's view keep 1/sqrt(d_head).")
    factor = st.select_slider(
        "Softmax scale, as a multiple of 1/sqrt(d_head)", inside.SCALE_FACTORS,
        format_func=lambda factor: f"x{factor:g} ({factor * steps.scale:.3g})",
        **session.keep("softmax_scale", 1.0, lambda factor: factor in inside.SCALE_FACTORS),
    )
    scaled = selection.memo(
        "inside scale figures", layer, head, query, factor,
        compute=lambda: figures.softmax_scale_figures(
            image, steps, result.grid_size, labels, head, token, factor, query_patch
        ),
    )
    st.plotly_chart(scaled["scale_sweep"])
    st.plotly_chart(scaled["rescaled_attention"])

with st.expander("4. The head's output, all heads together, and the residual add", expanded=True):
    st.latex(
        r"o = \sum_j a_j\, v_j,\qquad \mathrm{MSA}(x) = W_o\,[\,o^{(1)}; \dots; o^{(" + str(heads) + r")}\,] + b_o,"
        r"\qquad x' = x + " + (r"\gamma_1 \odot " if steps.layer_scale1 is not None else "") + r"\mathrm{MSA}(x)"
    )
    st.write(
        f"The head hands back the weighted sum of the values: {head_dim} numbers, mostly those of the"
        " tokens it weighs most. A token's share is how much of the output points its way (the"
        " shares of all tokens sum to 1; a value pointing against the output counts negative)."
    )
    st.plotly_chart(figs["head_sources"])
    st.write(
        f"The {heads} heads' outputs are put side by side ({heads} x {head_dim} = {dim} numbers; the"
        " lines separate the heads) and the output projection W_o mixes them into one vector of"
        f" {dim} numbers, which is added to the token: the residual stream keeps x and adds what"
        " attention found."
        + (" This model first scales the branch by a learned LayerScale γ₁." if steps.layer_scale1 is not None
           else "")
    )
    st.plotly_chart(figs["heads_projection"])
    attention_change = selection.memo("inside attention add", layer, token, compute=lambda: inside.residual_change(
        steps.input[0, row], steps.attention_branch[0, row], steps.middle[0, row]
    ))
    for column, (label, value) in zip(st.columns(4), attention_change.items()):
        column.metric(label, f"{value:.4g}")
    st.plotly_chart(figs["attention_residual"])

with st.expander(f"5. The MLP, and {name} leaving layer {layer}", expanded=True):
    hidden_formula = (
        r"\mathrm{SiLU}\big(W_g\,\mathrm{LN}(x') + b_g\big) \odot \big(W_x\,\mathrm{LN}(x') + b_x\big)" if gated
        else r"\mathrm{" + activation.split(" ")[0] + r"}\big(W_1\,\mathrm{LN}(x') + b_1\big)"
    )
    if config.scale_mlp:
        hidden_formula = r"\mathrm{LN}_h\Big(" + hidden_formula + r"\Big)"
    st.latex(
        r"h = " + hidden_formula + r" \in \mathbb{R}^{"
        + str(hidden) + r"},\qquad y = x' + " + (r"\gamma_2 \odot " if steps.layer_scale2 is not None else "")
        + r"(W_2\,h + b_2)"
    )
    st.write(
        "Attention mixed the tokens; the MLP now works on each token alone. A second LayerNorm,"
        + (f" then {hidden} hidden units, each a gate times a value (SwiGLU): one learned projection,"
           " through SiLU, decides how much of another passes, so a unit opens when the token matches its"
           " gate and stays nearly shut when not."
           if gated else
           f" then {hidden} hidden units: each one is a learned pattern, and {activation} lets it through"
           " when the token matches it and nearly silences it when not.")
        + (" A LayerNorm over the hidden units then rescales them." if config.scale_mlp else "")
        + f" The second layer turns the units back into {dim} numbers, added to the token as before."
        + (" LayerScale γ₂ scales them first." if steps.layer_scale2 is not None else "")
    )
    activity = selection.memo(
        "inside mlp", layer, token, compute=lambda: inside.mlp_activity(steps.mlp_hidden[0, row])
    )
    units = activity["units"]
    columns = st.columns(3)
    columns[0].metric("hidden units", f"{units}")
    firing, silent = activity["firing"], activity["near zero"]
    columns[1].metric(f"{'positive' if gated else 'firing'} (≥ {inside.NEAR_ZERO:g})", f"{firing} ({firing / units:.0%})")
    columns[2].metric(f"near zero (|h| < {inside.NEAR_ZERO:g})", f"{silent} ({silent / units:.0%})")
    st.caption(
        f"The other {units - firing - silent} units are negative: the value a gate lets through can have"
        " either sign, so an open unit pushes one way or the other"
        + (", and the LayerNorm over the units centres them on 0." if config.scale_mlp else ".")
        if gated else
        f"The other {units - firing - silent} units are below zero: {activation} does not cut negative inputs"
        " to exactly 0 but lets a little through (at most about -0.17), so they pull back slightly."
    )
    st.plotly_chart(figs["mlp_units"])
    mlp_change = selection.memo("inside mlp add", layer, token, compute=lambda: inside.residual_change(
        steps.middle[0, row], steps.mlp_branch[0, row], steps.output[0, row]
    ))
    for column, (label, value) in zip(st.columns(4), mlp_change.items()):
        column.metric(label, f"{value:.4g}")
    st.plotly_chart(figs["mlp_residual"])
    st.write(
        f"y is what layer {layer + 1} receives." if layer + 1 < depth
        else "y goes to the final LayerNorm and the head (the Pipeline page, step 8)."
    )
