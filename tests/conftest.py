"""Settings for the whole test suite, made before the package is imported."""
import os

# Every figure the tests make (in-process and in the app servers they start) is also built with
# plotly's validation and must give the same JSON (vit_explorer.figures._base.figure).
os.environ["VIT_EXPLORER_CHECK_FIGURES"] = "1"
