"""The render stage: chat-template rendering and tokenization that match Hugging Face transformers."""

from orpo.render.pairs import DEFAULTS, EncodedPair, PairEncoder, Response, fit_length, render_pairs, resolve_settings
from orpo.render.template import (
    ChatTemplate,
    ChatTemplateError,
    ModelSourceError,
    TemplateRaised,
    encode,
    encode_generation_prompt,
    find_templates,
    load_template,
    load_tokenizer,
    render_generation_prompt,
    resolve_model_dir,
    special_tokens_from_config,
)

__all__ = [
    "DEFAULTS", "ChatTemplate", "ChatTemplateError", "EncodedPair", "ModelSourceError", "PairEncoder", "Response",
    "TemplateRaised", "encode", "encode_generation_prompt", "find_templates", "fit_length", "load_template",
    "load_tokenizer", "render_generation_prompt", "render_pairs", "resolve_model_dir", "resolve_settings",
    "special_tokens_from_config",
]
