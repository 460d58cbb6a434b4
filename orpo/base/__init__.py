"""The embedded default model: a BPE tokenizer and a tiny llama trained here, saved as an HF-style folder."""
