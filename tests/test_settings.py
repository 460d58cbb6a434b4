"""Typed stage settings (orpo.settings): each stage's dataclass holds exactly its schema section's keys, with
no defaults of its own, and the schema's nodes use only JSON-schema keywords (a misquoted description is not
silently a key)."""

import dataclasses

import pytest

from orpo.base.model import BaseSettings
from orpo.config import RENDER_STAGE_KEYS, SPIN_DAG_KEYS, ConfigError, load_schema, section_defaults
from orpo.curate.settings import CurateSettings
from orpo.eval.generate import GenerateSettings
from orpo.eval.judge.settings import JudgeSettings
from orpo.render.settings import PromptSettings, RenderSettings
from orpo.settings import as_dict, build, field_keys, schema_keys, typed
from orpo.spin.settings import SpinSettings
from orpo.train.settings import TrainSettings

STAGES = [(TrainSettings, "train", ()), (CurateSettings, "curate", ()), (BaseSettings, "base", ()),
          (GenerateSettings, "generate", ()), (SpinSettings, "spin", SPIN_DAG_KEYS), (JudgeSettings, "judge", ()),
          (RenderSettings, "render", ()), (PromptSettings, "render", RENDER_STAGE_KEYS)]


@pytest.mark.parametrize(("cls", "section", "drop"), STAGES, ids=[c.__name__ for c, _, _ in STAGES])
def test_each_stage_dataclass_is_its_schema_section(cls, section, drop):
    assert field_keys(cls) == schema_keys(section, drop)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(cls))
    s = build(cls, section, {}, drop)
    defaults = {k: v for k, v in section_defaults(section).items() if k not in drop}
    assert as_dict(s) == defaults  # every default is the schema's, none the dataclass's
    assert typed(cls, section, s, drop) is s  # built once: a typed value passes through
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(s, dataclasses.fields(cls)[0].name, None)
    with pytest.raises(ConfigError, match=rf"unknown key {section}\.bogus \(allowed here: "):
        build(cls, section, {"bogus": 1}, drop)


def test_types_are_read_as_the_fields_say():
    s = build(GenerateSettings, "generate", {"temperature": 1, "stop": ["x"]})
    assert s.temperature == 1.0 and isinstance(s.temperature, float) and s.stop == ("x",)
    assert as_dict(s)["stop"] == ["x"]  # JSON-ready again
    with pytest.raises(ConfigError, match=r"generate.top_p: 0 is less than or equal to the minimum of 0"):
        build(GenerateSettings, "generate", {"top_p": 0})


KEYWORDS = {"type", "default", "description", "enum", "const", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "properties", "additionalProperties", "items", "anyOf", "oneOf", "allOf", "not",
            "pattern", "required", "minItems", "maxItems", "minLength", "maxLength", "uniqueItems", "title",
            "$schema", "$defs", "$ref", "format", "examples", "patternProperties", "propertyNames"}


def test_the_schema_uses_only_json_schema_keywords():
    bad = []

    def walk(node, path, names):
        if isinstance(node, dict):
            for key, value in node.items():
                if not names and key not in KEYWORDS:
                    bad.append(f"{path}: {key!r}")
                walk(value, f"{path}.{key}", key in ("properties", "$defs", "patternProperties") and not names)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]", False)

    walk(load_schema(), "", False)
    assert bad == []
