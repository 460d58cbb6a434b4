"""orpo-pipeline: a reproducible data-to-eval pipeline for ORPO preference fine-tuning on MLX."""

__version__ = "0.1.0"
