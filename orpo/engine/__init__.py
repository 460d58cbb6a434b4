"""The memory-lean ORPO engine: fused log-prob head, segmented backward, prefix sharing."""
