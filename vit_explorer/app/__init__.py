"""Streamlit glue for the explorer app, the only streamlit-aware code of the package: one module
per concern, which a page imports by name, so that its imports say what it touches.

In dependency order (each module imports only ones before it): memo (results shared by every
session), runs (training runs and their owners), models (the shared models, the picker,
the catalogue), uploads (the private uploads folder), images (the pictures to explore), costs
(what each view costs in passes of its model, the passes timed here, inline or a job, the
patch-size comparison), selection (``Selection``, ``ImageSet``), features (the Features page's
dictionaries), jobs (heavy computations as jobs beside the server), session (session state, the address, kept widget values,
the current ``Selection``), lesson (the Lesson's step, the learner's answers, the teacher's link),
words (a prediction in words for a model with a text tower: the session's labels, their embeddings),
word_maps (where each word is), faithfulness (is this map true? the maps' deletion and insertion
curves), probe (the patches a person labels and the probe of a set).

Importing the package imports every module, then freezes what the imports made (below).
"""
import gc

# Imported here, once, before any session runs: plotly's validators and Streamlit's elements
# import pandas lazily on whichever thread needs it first, and a second session's thread then
# finds it half-initialised ("module 'pandas' has no attribute 'Series'", seen on the Attention
# page's first view in Chromium). Frozen below with the other imports.
import pandas  # noqa: F401
import plotly.graph_objects as go
import plotly.io as pio
from PIL import Image

from .. import figures  # noqa: F401 (frozen below with plotly)
from . import (  # noqa: F401 (frozen below)
    costs, faithfulness, features, images, jobs, lesson, memo, models, probe, runs, selection, session, uploads, word_maps,
    words,
)


def _import_what_runs_import_lazily() -> None:
    """Imports and builds once what the first runs would: plotly's classes for each trace and
    layout part (imported on first use), its JSON and Streamlit's plotly modules, PIL's format
    plugins, pyarrow's pandas bridge. Made before the freeze below, they are frozen with the rest;
    made by a run, they stayed in every collection for the life of the process (half the objects
    a warm server's collection walked)."""
    import plotly.tools  # noqa: F401 (st.plotly_chart's)
    import pyarrow.pandas_compat  # noqa: F401 (st.dataframe's)
    from plotly.subplots import make_subplots

    Image.init()
    axis = dict(title=dict(text=""), tickfont=dict(size=9))
    colorbar = dict(title=dict(text=""), tickfont=dict(size=9))
    figure = go.Figure(
        data=[
            go.Heatmap(z=[[0.0]], colorbar=colorbar, textfont=dict(size=9)), go.Bar(x=[0], y=[0], marker=dict(color="red")),
            go.Histogram(x=[0], marker=dict(color="red")), go.Image(z=[[[0, 0, 0]]]),
            go.Scatter(x=[0], y=[0], line=dict(color="red"), selected=dict(marker=dict(color="red")),
                       unselected=dict(marker=dict(opacity=0.5))),
        ],
        layout=dict(
            xaxis=axis, yaxis=axis, coloraxis=dict(colorbar=colorbar), margin=dict(t=0),
            title=dict(text=""), font=dict(size=9), annotations=[dict(text="", font=dict(size=9))],
            shapes=[dict(type="line", line=dict(color="red"))], legend=dict(x=0), hoverlabel=dict(font_size=9),
        ),
    )
    pio.to_json(figure, validate=False)
    make_subplots(rows=1, cols=2, subplot_titles=("", ""))


# Streamlit collects every generation after every script run (runner.postScriptGC, on by
# default): a full collection walks every object the process holds, and the modules of torch,
# plotly, streamlit and this package are about 250k of them that are never garbage, so each run
# paid 0.1-1 s of the server's one interpreter (39% of its CPU under a class's load). Frozen once
# here, after the imports (this package is imported once per process), they are left out of every
# collection, and the one after a run walks only what the runs made since. The collection first
# drops what is already garbage, since anything frozen is never collected. Turning the post-run
# collection off instead (runner.postScriptGC=false) saves about as much CPU, but leaves cyclic
# garbage (a run's frames, figures, tensors) to Python's own full collections: rarer (3 in 36
# page views), each as long as before (0.4-0.7 s) and run on whichever thread allocates, the
# event loop's included, where they stall every session. (Slower pages once seen with it off
# did not reproduce: three A/B pairs on the shared 2-core machine went both ways.)
_import_what_runs_import_lazily()
gc.collect()
gc.freeze()
