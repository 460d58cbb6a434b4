"""The render stage's settings (config section `render`), typed, and one model's prompt rendering with its
`auto` values decided.

`RenderSettings` is the whole section, what the render stage reads. `PromptSettings` is its part that shapes a
prompt's text (the section less RENDER_STAGE_KEYS), what generation reads so that its prompts are rendered as
training's were. `resolve_prompting` decides add_bos and a null date once the model's tokenizer is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from orpo.render.template import ChatTemplate, calls_strftime_now, leading_ids, load_template, load_tokenizer, pin_date
from orpo.settings import typed


@dataclass(frozen=True)
class PromptSettings:
    """The `render` keys that shape a prompt's text (the schema describes each key)."""

    add_bos: bool | str
    template: str | None
    date: str | None
    template_kwargs: dict[str, Any]


@dataclass(frozen=True)
class RenderSettings:
    """The `render` section (the schema describes each key)."""

    max_length: int
    max_prompt_length: int
    over_length: str
    add_bos: bool | str
    template: str | None
    samples: int
    date: str | None
    template_kwargs: dict[str, Any]

    @property
    def prompt(self) -> PromptSettings:
        """The keys that shape a prompt's text."""
        return PromptSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PromptSettings)})


def resolve_settings(settings: RenderSettings | Mapping[str, Any] | None) -> RenderSettings:
    """RenderSettings, built from a mapping as the command line builds them (checked, the schema's defaults)."""
    return typed(RenderSettings, "render", settings)


def prompt_settings(settings: PromptSettings | RenderSettings | Mapping[str, Any] | None) -> PromptSettings:
    """PromptSettings, as given, as a RenderSettings' part, or from a mapping of the whole section (as a render
    manifest records it) or of its prompt keys, checked as the command line checks them."""
    if isinstance(settings, PromptSettings):
        return settings
    return resolve_settings(settings).prompt


@dataclass(frozen=True)
class Prompting:
    """How one model's prompts are rendered, every `auto` decided."""

    template: ChatTemplate  # strftime_now pinned to `date`
    tokenizer: Tokenizer
    template_kwargs: dict[str, Any]
    lead: tuple[int, ...]  # the ids every prompt starts with (add_bos)
    date: str | None  # what the template's strftime_now prints; None: it prints no date of ours

    def record(self) -> dict[str, Any]:
        """What was decided, as a manifest keeps it."""
        return {"leading_ids": list(self.lead), "date": self.date}


def resolve_prompting(model_dir: str | Path, s: PromptSettings) -> Prompting:
    """The model folder's template and tokenizer under `s`: add_bos read from the tokenizer, a null date read
    from the clock, once, so every prompt of a run shows the same day."""
    template = load_template(model_dir, s.template)
    date = s.date if s.date is not None else f"{datetime.now():%Y-%m-%d}"
    dated = calls_strftime_now(template) and "date_string" not in s.template_kwargs
    template = pin_date(template, date)
    tokenizer = load_tokenizer(model_dir)
    lead = tuple(leading_ids(tokenizer, template, s.add_bos))
    return Prompting(template, tokenizer, dict(s.template_kwargs), lead, date if dated else None)
