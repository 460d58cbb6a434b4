"""The lower layer of training: arrays and layouts in, hidden states and per-token log-probs out.

It knows nothing of pairs, ORPO or LoRA: the training package builds the step on it (docs/architecture.md).
"""
