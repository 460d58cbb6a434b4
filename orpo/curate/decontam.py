"""Decontamination against eval prompts by word n-gram overlap.

Words are lowercase runs of \\w characters. A training prompt with at least n words is contaminated
when, for some single eval prompt, the share of its distinct n-grams that also occur in that eval
prompt is >= threshold. A prompt shorter than n words has no n-gram; it is contaminated only when
its word sequence equals an eval prompt's whole word sequence (so short prompts are not dropped for
sharing a common phrase).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from orpo.io import InputError, read_jsonl, sha256_file

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lowercase word tokens of a text."""
    return _WORD.findall(text.lower())


def ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    """The distinct n-grams of a word list (empty when shorter than n)."""
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


class Decontaminator:
    """An index of eval prompts' n-grams that answers whether a training prompt overlaps one."""

    def __init__(self, eval_texts: list[str], n: int, threshold: float):
        self.n, self.threshold, self.eval_count = n, threshold, len(eval_texts)
        self.path: str | None = None
        self.sha256: str | None = None
        self._index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self._whole: set[tuple[str, ...]] = set()
        for k, text in enumerate(eval_texts):
            ws = words(text)
            self._whole.add(tuple(ws))
            for g in ngrams(ws, n):
                self._index[g].append(k)

    @classmethod
    def from_file(cls, path: str, n: int, threshold: float) -> Decontaminator:
        """Load eval prompts from JSONL objects with a `prompt` string (IFEval's input format)."""
        texts = []
        for line, obj in read_jsonl(path):
            prompt = obj.get("prompt")
            if not isinstance(prompt, str):
                raise InputError(path, line, "prompt", "missing" if prompt is None else "expected a string")
            texts.append(prompt)
        made = cls(texts, n, threshold)
        made.path, made.sha256 = path, sha256_file(path)
        return made

    def overlap(self, text: str) -> float:
        """The largest share of the text's n-grams found in one eval prompt (short texts: 1.0 on an
        exact word-sequence match, else 0.0)."""
        ws = words(text)
        if len(ws) < self.n:
            return 1.0 if ws and tuple(ws) in self._whole else 0.0
        grams = ngrams(ws, self.n)
        hits: Counter[int] = Counter()
        for g in grams:
            for k in self._index.get(g, ()):
                hits[k] += 1
        return max(hits.values(), default=0) / len(grams)

    def contaminated(self, text: str) -> bool:
        """True when the overlap reaches the threshold."""
        return self.overlap(text) >= self.threshold
