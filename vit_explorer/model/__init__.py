"""The model: the bottom floor of the package, importing nothing above it.

    config.py      ViTConfig, TrainConfig: frozen dataclasses, validated, JSON round-trip
    vit.py         the ViT with timm's parameter names (timm's Eva's for its variants), FlexiViT at
                   any patch size per call, and the per-call context variables (ACTIVE_RECORDER,
                   ACTIVE_KNOCKOUT, ACTIVE_REGISTER, ACTIVE_PATCH, ...) that let one shared model serve every session
    rope.py        rotary positions (DINOv3's, EVA-02's): angles, sin/cos tables, apply_rope
    recorder.py    what one pass records (Recorder, recording) and eval_mode
    capture.py     capture(model, x) -> Capture; one layer again from its tokens (layer_internals,
                   layer_attention, layer_attentions)
    internals.py   LayerInternals: one layer's every step, and the small analyses of one layer
    ablation.py    KnockOut (heads, branches; zero or mean) for one call, and head_sweep
    patching.py    Patch: activations at named sites replaced, added to or recorded, for one call
    cost.py        what a pass costs in multiply-adds (linear in the tokens, attention in their square)
                   and the work on attention weights outside it: app.costs' cost model
    packing.py     several sequences of different lengths run as one pass (attention kept inside
                   each): the faithfulness curves' many short passes
    devices.py     the device a name means; the process group of a run under torchrun

Nothing here changes a model for a call: what a call records, knocks out or adds rides in a
context variable set for that call only (see vit.py).
"""
