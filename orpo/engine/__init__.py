"""The lower layer of training: arrays and layouts in, hidden states and per-token log-probs out.

Our forward through mlx-lm's parts (packed rows included), the log-prob heads, the segmented backward and
the compiled step's bookkeeping; it knows nothing of pairs, ORPO or LoRA (the training package builds the
step on it).
"""
