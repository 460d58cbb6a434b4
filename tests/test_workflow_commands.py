"""The rules' shell commands stay short: settings travel as `@results/settings/<kind>-<hash>.json` files, never
as JSON on the command line, and model.dtype reaches every command that loads the model (dry runs)."""

import json
import re

import yaml
from conftest import ROOT
from test_workflow import MICRO, snakemake

from orpo.config import load_config_file, validate_config
from orpo.experiments import deep_merge

SETTINGS_OPTIONS = ("--settings", "--render-settings", "--experiments", "--spec")
# Commands that load the model for computation, by their start.
LOADS_MODEL = ("orpo train", "orpo generate", "orpo spin", "orpo judge run")


def dry_run_commands(workdir, config: dict, *targets: str) -> list[str]:
    (workdir / "micro.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "-n", "-p", *targets)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout + result.stderr
    return [c for c in re.findall(r"^Shell command: (.*)$", text, re.MULTILINE) if c != "None"]


def test_commands_take_settings_from_files_and_dtype_from_the_model_section(tmp_path):
    config = {**MICRO, "model": {"dtype": "bfloat16"}, "judge": {"kind": "mlx", "model": "org/judge"},
              "spin": {"iterations": 2}}
    commands = dry_run_commands(tmp_path, config, "all", "spin")
    stages = {" ".join(c.split()[:2]) for c in commands}
    assert {"orpo train", "orpo generate", "orpo spin", "orpo judge", "orpo render", "orpo report"} <= stages
    for command in commands:
        assert "{" not in command and '"' not in command, command  # no JSON blob
        for option in SETTINGS_OPTIONS:
            for value in re.findall(rf"{option} (\S+)", command):
                assert re.fullmatch(r"@results/settings/[a-z-]+-[0-9a-f]{16}\.json", value), command
                json.loads((tmp_path / value[1:]).read_text())
        if command.startswith(LOADS_MODEL):
            assert "--dtype bfloat16" in command, command

    # A file holds exactly the config section the stage used to get inline.
    merged = validate_config(deep_merge(load_config_file(ROOT / "config" / "config.yaml"), config), tmp_path)
    main_run = "orpo train --model results/base/model --rendered results/rendered "
    train = next(c for c in commands if c.startswith(main_run))
    path = re.search(r"--settings @(\S+)", train).group(1)
    assert json.loads((tmp_path / path).read_text()) == merged["train"]
    # Short whatever the checkout's or the work folder's absolute path (they appear in the commands as given).
    lengths = [len(c.replace(str(tmp_path), "W").replace(str(ROOT), "R")) for c in commands if c.startswith(LOADS_MODEL)]
    assert max(lengths) < 400


def test_a_changed_setting_is_a_new_settings_file(tmp_path):
    first = dry_run_commands(tmp_path, MICRO, "results/train/run/complete.json")
    changed = dry_run_commands(tmp_path, {**MICRO, "train": {**MICRO["train"], "lr": 0.002}},
                               "results/train/run/complete.json")
    path = [re.search(r"orpo train .*--settings @(\S+)", c) for c in (first + changed)]
    old, new = [m.group(1) for m in path if m]
    assert old != new  # the param changes with the settings: Snakemake reruns the job
    assert json.loads((tmp_path / old).read_text())["lr"] == 0.003
    assert json.loads((tmp_path / new).read_text())["lr"] == 0.002
