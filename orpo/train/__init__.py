"""ORPO training: the loss, the log-prob head, LoRA, checkpoints, the loop and deterministic replay."""
