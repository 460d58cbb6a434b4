"""Token counting for the length filters: a `tokenizers` tokenizer.json, or whitespace words."""

from __future__ import annotations

from orpo.io import InputError, sha256_file

_CHUNK = 1024  # texts per encode_batch call: bounds the memory the encodings hold


class TokenCounter:
    """Counts tokens of plain texts (no chat template, no special tokens; render adds those later)."""

    def __init__(self, tokenizer_path: str | None = None):
        self.path = tokenizer_path
        self._tok = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(tokenizer_path)
            except Exception as e:  # missing file or not a tokenizer.json
                raise InputError(tokenizer_path, None, None, f"cannot load tokenizer ({e})") from None

    def count(self, texts: list[str]) -> list[int]:
        """Token count of each text."""
        if self._tok is None:
            return [len(t.split()) for t in texts]
        out: list[int] = []
        for start in range(0, len(texts), _CHUNK):
            encodings = self._tok.encode_batch(texts[start : start + _CHUNK], add_special_tokens=False)
            out.extend(len(e.ids) for e in encodings)
        return out

    def describe(self) -> dict:
        """The manifest's record of how tokens were counted."""
        if self.path is None:
            return {"kind": "whitespace", "note": "str.split() words; no tokenizer was given"}
        return {"kind": "tokenizer", "path": self.path, "sha256": sha256_file(self.path)}
