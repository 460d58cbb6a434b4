"""IFEval scoring (Zhou et al. 2023) that agrees with Google's reference scorer instruction by instruction."""

from .args import ArgumentError
from .bootstrap import METRICS, bootstrap_ci, bootstrap_diff
from .instructions import REGISTRY, build_checker
from .score import (
    MissingResponseError,
    evaluate,
    loose_variants,
    read_inputs,
    read_responses,
    score_files,
    summarize,
)

__all__ = [
    "METRICS",
    "REGISTRY",
    "ArgumentError",
    "MissingResponseError",
    "bootstrap_ci",
    "bootstrap_diff",
    "build_checker",
    "evaluate",
    "loose_variants",
    "read_inputs",
    "read_responses",
    "score_files",
    "summarize",
]
