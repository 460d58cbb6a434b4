"""The render stage: chat-template rendering and tokenization that match Hugging Face transformers."""

from orpo.render.pairs import EncodedPair, PairEncoder, Response, fit_length, render_pairs
from orpo.render.settings import (
    Prompting,
    PromptSettings,
    RenderSettings,
    prompt_settings,
    resolve_prompting,
    resolve_settings,
)
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
    "ChatTemplate", "ChatTemplateError", "EncodedPair", "ModelSourceError", "PairEncoder", "PromptSettings",
    "Prompting", "RenderSettings", "Response", "TemplateRaised", "encode", "encode_generation_prompt",
    "find_templates", "fit_length", "load_template", "load_tokenizer", "prompt_settings", "render_generation_prompt",
    "render_pairs", "resolve_model_dir", "resolve_prompting", "resolve_settings", "special_tokens_from_config",
]
