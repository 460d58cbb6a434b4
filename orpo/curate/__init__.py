"""curate stage: UltraFeedback rows -> filtered, split preference pairs (train/validation parquet + manifest).

Entry point: `curate(inputs, out_dir, settings, tokenizer=None, eval_prompts=None) -> manifest`.
Recipes are documented in orpo.curate.recipes, drop reasons in orpo.curate.drops.
"""

from orpo.curate.core import curate
from orpo.curate.settings import DEFAULTS, RECIPES

__all__ = ["DEFAULTS", "RECIPES", "curate"]
