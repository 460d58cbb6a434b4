"""Config validation: defaults filled from the schema, and one clear error naming the key or path."""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from orpo.config import PROJECT_ROOT, ConfigError, load_config_file, load_schema, validate_config
from orpo.experiments import stage_keys


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
    assert validate_config({"model": {"path": "m"}}, tmp_path)["model"]["path"] == "m"


def test_strings_read_as_numbers_where_the_schema_wants_numbers():
    # PyYAML (YAML 1.1) needs a dot in 1.0e-3; Snakemake's --config 'train={...}' gives nested values as strings.
    config = yaml.safe_load("train:\n  lr: 1e-3\n  lambda: .5\n")
    assert config["train"]["lr"] == "1e-3"
    config["train"].update({"epochs": "4", "max_steps": "1e2", "group_by_length": "true",
                            "lora": {"rank": "8", "alpha": "16", "rslora": "false"},
                            "engine": {"cache_limit_gb": "2.5", "compile": "false", "prefix_sharing": "auto"}})
    config["replay"] = {"checkpoint": "12"}
    config["paper"] = {"name": "p", "models": [{"experiment": "a", "label": "A", "published": {"inst_strict": "0.5"}}]}
    train = validate_config(config, PROJECT_ROOT)["train"]
    assert (train["lr"], train["lambda"], train["epochs"], train["max_steps"]) == (0.001, 0.5, 4, 100)
    assert type(train["epochs"]) is int and type(train["max_steps"]) is int and train["group_by_length"] is True
    assert (train["lora"]["rank"], train["lora"]["alpha"], train["lora"]["rslora"]) == (8, 16, False)
    assert train["engine"]["cache_limit_gb"] == 2.5 and train["engine"]["compile"] is False
    assert train["engine"]["prefix_sharing"] == "auto"
    assert config["replay"]["checkpoint"] == "12"  # a string is one of the values it takes
    assert config["paper"]["models"][0]["published"]["inst_strict"] == 0.5


def test_render_date_defaults_pinned_and_reads_an_unquoted_yaml_date():
    assert validate_config({}, PROJECT_ROOT)["render"]["date"] == "2024-07-26"
    config = yaml.safe_load("render:\n  date: 2031-03-05\n")  # PyYAML gives a datetime.date
    assert validate_config(config, PROJECT_ROOT)["render"]["date"] == "2031-03-05"
    assert validate_config({"render": {"date": None}}, PROJECT_ROOT)["render"]["date"] is None
    with pytest.raises(ConfigError, match="render.date: '5 Mar 2031' does not match"):
        validate_config({"render": {"date": "5 Mar 2031"}}, PROJECT_ROOT)


@pytest.mark.parametrize(
    "train, message",
    [
        ({"lr": "abc"}, "train.lr: 'abc' is not of type 'number'"),
        ({"epochs": "4.5"}, "train.epochs: '4.5' is not of type 'integer'"),
        ({"lr": "1e-3x"}, "train.lr: '1e-3x' is not of type 'number'"),
        ({"lr": "nan"}, "train.lr: 'nan' is not of type 'number'"),
        ({"lora": {"rank": "0"}}, "train.lora.rank: 0 is less than the minimum of 1"),
    ],
)
def test_strings_that_are_no_number_still_fail_naming_the_key(train, message):
    with pytest.raises(ConfigError) as e:
        validate_config({"train": train}, PROJECT_ROOT)
    assert message in str(e.value)


def _snakemake_dry_run(workdir, *args):
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(PROJECT_ROOT / "Snakefile"), "--directory",
           str(workdir), "--cores", "1", "-n", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=workdir, check=False)


def test_nested_command_line_config_reaches_the_schema_as_numbers(tmp_path):
    (tmp_path / "exp.yaml").write_text("train:\n  lr: 1e-3\n")
    result = _snakemake_dry_run(tmp_path, "results/ifeval.json", "--configfile", str(tmp_path / "exp.yaml"),
                                "--config", 'train={"lr": 0.002, "epochs": 2, "lora": {"rank": 4}}')
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "train" in result.stdout


def test_config_file_syntax_error_names_file_line_and_column(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: 0.1\n   epochs: 2\n")
    with pytest.raises(ConfigError, match=f"{broken}:3:10: not valid YAML: mapping values are not allowed here"):
        load_config_file(broken)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping"):
        load_config_file(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config_file(tmp_path / "empty.yaml") == {}


def _checkout(root):
    """A working directory with a user's inputs at the same relative places."""
    (root / "models" / "m").mkdir(parents=True)
    (root / "models" / "m" / "config.json").write_text("{}")
    (root / "inputs").mkdir()
    for name in ("raw.jsonl", "prompts.jsonl", "questions.jsonl", "chat.jinja"):
        (root / "inputs" / name).write_text("{}\n")
    return root


def test_paths_are_recorded_relative_to_the_working_directory(tmp_path, monkeypatch):
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("{}\n")
    config = {"model": {"path": "models/m"}, "data": {"raw": "./inputs/raw.jsonl"},
              "eval": {"prompts": "inputs/prompts.jsonl"}, "render": {"template": "inputs/chat.jinja"},
              "judge": {"prompt_set": "mt_bench", "questions": "inputs/questions.jsonl"},
              "curate": {"truthfulqa_questions": str(outside)}}
    seen = []
    for where in ("checkout", "moved/checkout"):
        root = _checkout(tmp_path / where)
        monkeypatch.chdir(root)
        seen.append(validate_config(copy.deepcopy(config)))
    first, moved = seen
    assert first == moved
    assert (first["model"]["path"], first["data"]["raw"], first["eval"]["prompts"]) == \
        ("models/m", "inputs/raw.jsonl", "inputs/prompts.jsonl")
    assert first["render"]["template"] == "inputs/chat.jinja"
    assert first["judge"]["questions"] == "inputs/questions.jsonl"
    assert first["curate"]["truthfulqa_questions"] == str(outside)  # outside the working directory: absolute
    assert stage_keys(first) == stage_keys(moved)  # results/shared/<key>/ folders keep their names
    assert validate_config(copy.deepcopy(first)) == first  # validating again (each experiment) changes nothing


def test_a_moved_checkout_validates_to_the_same_config(tmp_path):
    # Two clones of the package at different places, each run from its own root: the embedded eval prompts too.
    code = "import json; from orpo.config import validate_config; print(json.dumps(validate_config({})))"
    seen = []
    for where in ("clone", "moved/clone"):
        root = tmp_path / where
        for rel in ("orpo", "data/eval"):
            shutil.copytree(PROJECT_ROOT / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                             check=True)
        seen.append(yaml.safe_load(out.stdout))
    assert seen[0] == seen[1]
    assert seen[0]["eval"]["prompts"] == "data/eval/ifeval_prompts.jsonl"
    assert os.path.isabs(validate_config({}, tmp_path)["eval"]["prompts"])  # run from elsewhere: the package's own


def test_raw_rows_no_stage_can_read_are_refused_at_start(tmp_path):
    """data.raw is read by base, curate and spin alike (orpo.rows): a folder without data files or a file of
    another kind stops the workflow before any job runs (and before any finished output is touched)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "rows.txt").write_text("{}\n")
    for raw, message in (("empty", "folder holds no .jsonl/.json/.parquet files"),
                         ("rows.txt", "unsupported file type '.txt'")):
        with pytest.raises(ConfigError, match=f"config error: data.raw: .*{raw}: {message}"):
            validate_config({"data": {"raw": raw}}, tmp_path)
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text("{}\n")
    assert validate_config({"data": {"raw": "rows"}}, tmp_path)["data"]["raw"] == "rows"
