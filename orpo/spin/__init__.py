"""spin stage: SPIN preference pairs from an SFT set (chosen = the gold answer, rejected = the model's own answer).

Entry point: `spin_pairs(sft_inputs, model, adapter, out_dir, settings, iteration) -> manifest`.
Iteration k generates with iteration k-1's adapter; the output is the curated-pairs artifact, so
render and train take it unchanged. Input forms in orpo.spin.schema, drop reasons in orpo.spin.drops.
"""

from orpo.spin.core import spin_pairs
from orpo.spin.settings import DEFAULTS

__all__ = ["DEFAULTS", "spin_pairs"]
