"""The `orpo` command's checks before any work, and its errors: settings against the schema, config and
settings files by file:line:column, and failed writes naming the file and the cause."""

import copy
import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orpo.cli import CHECKED, build_parser, check_settings
from orpo.config import PROJECT_ROOT, ConfigError, validate_config
from orpo.experiments import prompt_rendering
from orpo.settings import as_dict


def file_size_limit(size):
    """A preexec_fn that sets the soft file size limit (ulimit -f) to `size` bytes: writes past it fail (EFBIG)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def orpo(*args, cwd=None, limit_file_size=None):
    """Run `python -m orpo.cli ARGS`, optionally under a file size limit in bytes."""
    limit = file_size_limit(limit_file_size) if limit_file_size else None
    return subprocess.run([sys.executable, "-m", "orpo.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, preexec_fn=limit, check=False)


def parsed(*argv):
    args = build_parser().parse_args([str(a) for a in argv])
    check_settings(args)
    return args


def mapping(value):
    """A checked argument as a mapping: a typed section (orpo.settings) as its keys, defaults filled in."""
    return as_dict(value) if dataclasses.is_dataclass(value) else value


COMMANDS = {  # the arguments each command needs besides its settings
    "data": ["data", "rows", "--out", "o"],
    "curate": ["curate", "--inputs", "i", "--out", "o"],
    "base": ["base", "--raw", "r", "--out", "o"],
    "quantize": ["quantize", "--model", "m", "--out", "o"],
    "render": ["render", "--model", "m", "--curated", "c", "--out", "o"],
    "train": ["train", "--model", "m", "--rendered", "r", "--out", "o"],
    "generate": ["generate", "--model", "m", "--prompts", "p", "--out", "o"],
    "spin": ["spin", "--sft", "s", "--model", "m", "--iteration", "1", "--out", "o"],
    "judge run": ["judge", "run", "--questions", "q", "--a", "a=x", "--b", "b=y", "--out", "o"],
    "report paper-table": ["report", "paper-table", "--results", "a=x", "--out", "o"],
    "report paper-judge": ["report", "paper-judge", "--results", "a=x", "--out", "o"],
}


def rule_settings(config):
    """Command -> {option: JSON} as the workflow's rules pass them (workflow/rules/*.smk, common.smk)."""
    spin = {k: v for k, v in config["spin"].items() if k not in ("iterations", "sft", "adapter")}
    render = prompt_rendering(config)
    return {
        "data": {"--settings": config["data"]}, "curate": {"--settings": config["curate"]},
        "base": {"--settings": config["base"]}, "quantize": {"--settings": config["quantize"]},
        "render": {"--settings": config["render"]},
        "train": {"--settings": {**config["train"], "init_adapter": "results/spin/iter1/run"}},
        "generate": {"--settings": config["generate"], "--render-settings": render},
        "spin": {"--settings": spin, "--render-settings": render},
        "judge run": {"--settings": config["judge"]}, "report paper-table": {"--spec": config["paper"]},
        "report paper-judge": {"--spec": config["paper"]},
    }


def test_every_command_with_settings_is_checked():
    assert set(CHECKED) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_what_the_rules_pass_is_accepted_and_an_unknown_key_named(command):
    config = validate_config(yaml.safe_load((PROJECT_ROOT / "config" / "config.yaml").read_text()), PROJECT_ROOT)
    config["paper"] = {**config["paper"], "name": "p", "models": [{"experiment": "a", "label": "A", "published": {}}]}
    given = rule_settings(config)[command]
    argv = COMMANDS[command] + [x for option, value in given.items() for x in (option, json.dumps(value))]
    args = parsed(*argv)
    assert [mapping(getattr(args, attr)) for attr, *_ in CHECKED[command]] == list(given.values())
    for option, value in given.items():
        bad = {**copy.deepcopy(value), "bogus_key": 1}
        argv = COMMANDS[command] + [x for o, v in given.items() for x in (o, json.dumps(bad if o == option else v))]
        with pytest.raises(ConfigError, match=rf"^{option}: unknown key \w+\.bogus_key \(allowed here: "):
            parsed(*argv)


def test_settings_wrong_types_named_by_dotted_key_and_numeric_strings_read():
    with pytest.raises(ConfigError) as e:
        parsed(*COMMANDS["train"], "--settings", json.dumps({"lr": "fast", "lora": {"rank": "x"}}))
    assert str(e.value) == ("--settings: train.lora.rank: 'x' is not of type 'integer'; "
                            "train.lr: 'fast' is not of type 'number'")
    args = parsed(*COMMANDS["train"], "--settings", json.dumps({"lr": "1e-3", "lora": {"rank": "4"}}))
    assert args.settings.lr == 0.001 and args.settings.lora.rank == 4 and args.settings.lora.alpha == 32.0
    with pytest.raises(ConfigError, match="unknown key spin.iterations"):  # the DAG's keys stay in the workflow
        parsed(*COMMANDS["spin"], "--settings", json.dumps({"iterations": 2}))


def test_unknown_setting_stops_the_command_before_any_work(tmp_path):
    result = orpo("train", "--model", tmp_path / "none", "--rendered", tmp_path / "none", "--out", tmp_path / "run",
                  "--settings", json.dumps({"lr_decay": 0.5}))
    assert result.returncode == 1
    assert result.stderr.startswith("orpo train: error: --settings: unknown key train.lr_decay (allowed here: ")
    assert "lora" in result.stderr and not (tmp_path / "run").exists()


def test_settings_file_that_is_no_json_names_file_line_and_column(tmp_path):
    bad = tmp_path / "settings.json"
    bad.write_text('{"lr": 1,\n "epochs" 2}\n')
    result = orpo(*COMMANDS["train"], "--settings", f"@{bad}", cwd=tmp_path)
    assert result.returncode == 2
    assert f"argument --settings: {bad}:2:11: not valid JSON: Expecting ':' delimiter" in result.stderr
    result = orpo(*COMMANDS["train"], "--settings", f"@{tmp_path / 'none.json'}", cwd=tmp_path)
    assert f"cannot read {tmp_path / 'none.json'}: No such file or directory" in result.stderr


def test_orpo_config_names_file_line_and_column_of_a_yaml_error(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: 0.1\n   epochs: 2\n")
    result = orpo("config", broken, cwd=tmp_path)
    assert result.returncode == 1
    assert f"orpo config: error: config error: {broken}:3:10: not valid YAML: mapping values" in result.stderr
    (tmp_path / "ok.yaml").write_text("train:\n  lr: 1e-3\n")
    result = orpo("config", tmp_path / "ok.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["train"]["lr"] == 0.001


# -- failed writes -----------------------------------------------------------------------------------------

SAVE_ARRAYS = """
import sys
import mlx.core as mx
from orpo.io import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "adapters.safetensors"), {"w": mx.zeros(100_000)})
"""


def test_a_write_past_the_file_size_limit_names_the_file_and_the_cause(tmp_path):
    out = tmp_path / "rows.jsonl"
    result = orpo("data", "rows", "--out", out, "--n", 400, limit_file_size=16384)
    assert result.returncode == 1
    assert result.stderr.strip() == f"orpo data: error: cannot write {out}: File too large (EFBIG)"
    assert list(tmp_path.iterdir()) == []  # no temporary sibling left behind
    # MLX's own message ("[write] Unable to write N bytes to file.") names neither.
    run = tmp_path / "checkpoint"
    result = subprocess.run([sys.executable, "-c", SAVE_ARRAYS, str(run)], capture_output=True, text=True,
                            preexec_fn=file_size_limit(16384), timeout=300, check=False)
    assert result.returncode == 1
    assert f"orpo.io.WriteError: cannot write {run / 'adapters.safetensors'}: File too large (EFBIG)" in result.stderr
    assert "Unable to write" in result.stderr  # the writer's own error stays attached as the cause


def _tiny_filesystem_runs(mount: Path) -> bool:
    mount.mkdir()
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k none {mount}"],
                               capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def test_disk_full_names_the_file_and_no_space_left(tmp_path):
    mount = tmp_path / "full"
    if not _tiny_filesystem_runs(mount):
        pytest.skip("mounting a 64 KiB tmpfs in a private mount namespace needs CAP_SYS_ADMIN")
    script = (f"mount -t tmpfs -o size=64k none {mount} && "
              f"{sys.executable} -m orpo.cli data rows --out {mount}/rows.jsonl --n 400; "
              f"{sys.executable} -c '{SAVE_ARRAYS}' {mount}/checkpoint")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, check=False)
    assert f"orpo data: error: cannot write {mount}/rows.jsonl: No space left on device (ENOSPC)" in result.stderr
    assert f"cannot write {mount}/checkpoint/adapters.safetensors: No space left on device (ENOSPC)" in result.stderr
