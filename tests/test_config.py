"""Config validation: defaults filled from the schema, and one clear error naming the key or path."""

import copy

import pytest
import yaml

from orpo.config import PROJECT_ROOT, ConfigError, load_schema, validate_config


def _default():
    return yaml.safe_load((PROJECT_ROOT / "config" / "config.yaml").read_text())


def test_embedded_default_validates_and_gets_every_schema_default():
    config = validate_config(_default(), PROJECT_ROOT)
    schema = load_schema()

    def walk(node, sch, path):
        for key, sub in sch.get("properties", {}).items():
            assert key in node, f"{path}{key} has no value after defaults"
            assert "description" in sub, f"{path}{key} has no description"
            if sub.get("type") == "object":
                walk(node[key], sub, f"{path}{key}.")
            else:
                assert "default" in sub, f"{path}{key} has no default"

    walk(config, schema, "")
    assert config["eval"]["prompts"].endswith("data/eval/ifeval_prompts.jsonl")
    assert config["train"]["lora"]["target_modules"][0] == "q_proj"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"train": {"lrr": 1.0}}, "unknown key train.lrr"),
        ({"bogus": 1}, "unknown key bogus"),
        ({"train": {"lr": "fast"}}, "train.lr: 'fast' is not of type 'number'"),
        ({"train": {"lora": {"rank": 0}}}, "train.lora.rank"),
        ({"curate": {"recipe": "mine"}}, "curate.recipe"),
        ({"model": {"path": "/no/such/model"}}, "model.path: /no/such/model does not exist"),
        ({"data": {"raw": "missing.jsonl"}}, "data.raw: missing.jsonl does not exist"),
        ({"render": {"max_length": 64, "max_prompt_length": 64}}, "render.max_prompt_length"),
    ],
)
def test_bad_config_names_the_key(change, message, tmp_path):
    config = _default()
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    with pytest.raises(ConfigError) as e:
        validate_config(copy.deepcopy(config), tmp_path)
    assert message in str(e.value)


def test_model_folder_must_look_like_a_model(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="model.path: m has no config.json"):
        validate_config({"model": {"path": "m"}}, tmp_path)
    (tmp_path / "m" / "config.json").write_text("{}")
    assert validate_config({"model": {"path": "m"}}, tmp_path)["model"]["path"] == str(tmp_path / "m")
