"""Evaluation of generated responses (IFEval)."""
