"""The project's own preference data: synthetic UltraFeedback-style rows and held-out IFEval prompts."""

from orpo.data.synth import (
    LabeledRow,
    generate_eval_prompts,
    generate_labeled_rows,
    generate_rows,
    write_eval_prompts,
    write_rows,
)

__all__ = [
    "LabeledRow",
    "generate_eval_prompts",
    "generate_labeled_rows",
    "generate_rows",
    "write_eval_prompts",
    "write_rows",
]
