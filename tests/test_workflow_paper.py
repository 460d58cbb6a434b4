"""Paper tables: the ORPO paper's IFEval experiment dry-runs as published (7B) and runs end to end scaled down."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY_BASE
from test_workflow import _SESSION, MICRO, job_counts, session_repo, snakemake, workspace

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")

PAPER = yaml.safe_load((ROOT / "config" / "paper" / "orpo-ifeval.yaml").read_text())
COLUMNS = ("prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_strict_acc", "inst_level_loose_acc")
KEYS = ("prompt_strict", "prompt_loose", "inst_strict", "inst_loose")
# The tiny config on the micro scale: a few steps everywhere; the pipeline, not the scores, is under test.
MICRO_PAPER = {**MICRO, "base": {**TINY_BASE, "steps": 24}, "eval": {"limit": 4},
               "train": {**MICRO["train"], "max_steps": 4, "checkpoint_every": 2},
               "generate": {"max_tokens": 16, "batch_size": 8}}


# The authors' recipe, line by line (xfactlab/orpo scripts/run_mistral_orpo_beta.sh, main.py, src/orpo_trainer.py),
# as each experiment's merged, validated config holds it.
RECIPE = {
    "model.hub_id": "mistralai/Mistral-7B-v0.1",   # --model_name; bf16 is its weights' dtype, trained in it
    "train.method": "full",                        # no --enable_lora: every weight trains
    "train.lambda": 0.1,                           # --alpha 0.1
    "train.lr": 5e-6,                              # --lr 5e-6
    "train.schedule": "inverse_sqrt",              # --lr_scheduler_type inverse_sqrt
    "train.warmup": 200,                           # --warmup_steps 200 (a step count, not a fraction)
    "train.epochs": 5,                             # --num_train_epochs 5
    "pairs per step": 32,                          # 8 per device x 4 GPUs
    "render.max_prompt_length": 1792,              # --prompt_max_length 1792
    "render.max_length": 2048,                     # --response_max_length 2048 (prompt + response)
    "render.over_length": "truncate",              # their filter of long prompts, then truncation=True
    "render.add_bos": True,                        # tokenizer(text) adds <s>
    "curate.validation_fraction": 0,               # the whole train split
    "train.nll_span": "prompt_and_response",       # their NLL, without --disable_prompt_loss
    "train.bias_correction": True,                 # the HF Trainer's torch AdamW corrects the moments' bias
}


def recipe_values(cfg: dict) -> dict:
    """RECIPE's keys read from a merged config."""
    out = {}
    for key in RECIPE:
        if key == "pairs per step":
            t = cfg["train"]
            out[key] = t["batch_size"] * t["grad_accum"] * t["distributed"]["processes"]
        else:
            section, name = key.split(".")
            out[key] = cfg[section][name]
    return out


def merged(name: str) -> dict[str, dict]:
    """Each experiment's config as the workflow sees it: config/config.yaml with the paper file merged on."""
    from orpo.config import load_config_file
    from orpo.experiments import deep_merge, expand

    config = deep_merge(load_config_file(ROOT / "config" / "config.yaml"),
                        load_config_file(ROOT / "config" / "paper" / name))
    return expand(config)


def test_the_7b_config_is_the_authors_recipe_line_by_line(monkeypatch):
    monkeypatch.chdir(ROOT)  # the template path is relative to the checkout
    experiments = merged("orpo-ifeval.yaml")
    assert sorted(experiments) == ["alpha", "beta"]
    for name, cfg in experiments.items():
        got = recipe_values(cfg)
        for key, want in RECIPE.items():
            assert got[key] == want and type(got[key]) is type(want), (name, key, got[key], want)
        # Curate filters no pair by length: render applies the authors' limits on the templated tokens.
        assert min(cfg["curate"]["max_prompt_tokens"], cfg["curate"]["max_pair_tokens"]) >= 100 * 2048
        assert cfg["render"]["template"] == "config/paper/mistral-orpo.jinja"
        assert cfg["replay"]["checkpoint"] == "final" and cfg["generate"]["adapter"] == "final"
    assert experiments["alpha"]["data"]["raw"] == "HuggingFaceH4/ultrafeedback_binarized:train_prefs"
    assert experiments["beta"]["data"]["raw"] == "argilla/ultrafeedback-binarized-preferences-cleaned:train"
    published = {m["experiment"]: [m["published"][k] for k in KEYS] for m in PAPER["paper"]["models"]}
    assert published == {"alpha": [0.5009, 0.5083, 0.5995, 0.6163], "beta": [0.5287, 0.5564, 0.6355, 0.6619]}


def test_the_lora_config_differs_only_in_the_method_and_its_own_rate(monkeypatch):
    monkeypatch.chdir(ROOT)
    full, lora = merged("orpo-ifeval.yaml"), merged("orpo-ifeval-lora.yaml")
    for name in ("alpha", "beta"):
        differ = {k for k in RECIPE if recipe_values(full[name])[k] != recipe_values(lora[name])[k]}
        assert differ == {"train.method", "train.lr"}
        assert lora[name]["train"]["method"] == "lora" and lora[name]["train"]["lr"] == 5e-5
        assert (lora[name]["train"]["lora"]["rank"], lora[name]["train"]["lora"]["alpha"]) == (16, 32)
    # Its rate is justified where it is set, in one line.
    line = next(x for x in (ROOT / "config" / "paper" / "orpo-ifeval-lora.yaml").read_text().splitlines()
                if x.strip().startswith("lr:"))
    assert "#" in line and "10x" in line and "LoRA Without Regret" in line
    assert yaml.safe_load((ROOT / "config" / "paper" / "orpo-ifeval-lora.yaml").read_text())["paper"]["name"] \
        == "orpo-ifeval-lora"


def test_the_7b_config_dry_runs_its_whole_dag(tmp_path):
    (tmp_path / "config").symlink_to(ROOT / "config")  # the chat template path is relative to the workdir
    result = snakemake(tmp_path, "-n", "-p", "results/paper/orpo-ifeval/table.md", "results/paper/orpo-ifeval/judge.md",
                       config=(str(ROOT / "config" / "paper" / "orpo-ifeval.yaml"),))
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result)
    # Hub model and hub datasets: no data or base stage; two datasets: curate and render twice.
    assert "data" not in counts and "base" not in counts
    assert {r: counts[r] for r in ("curate", "render", "train", "replay", "ifeval", "judge", "paper_table",
                                   "paper_judge", "generate_orpo", "generate_base")} == {
        "curate": 2, "render": 2, "train": 2, "replay": 2, "ifeval": 2, "judge": 2, "paper_table": 1,
        "paper_judge": 1, "generate_orpo": 4, "generate_base": 2}
    text = result.stdout + result.stderr
    assert text.count("orpo train --model mistralai/Mistral-7B-v0.1") == 2
    for raw in ("HuggingFaceH4/ultrafeedback_binarized:train_prefs", "argilla/ultrafeedback-binarized-preferences-cleaned:train"):
        assert f"orpo curate --inputs {raw} " in text
    train = [json.loads((tmp_path / s).read_text()) for s in re.findall(r"orpo train .*--settings @(\S+)", text)]
    assert [(t["lr"], t["lambda"], t["epochs"]) for t in train] == [(5e-6, 0.1, 5)] * 2


def tiny_paper_workflow(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, tuple[str, str]]:
    """The tiny paper table built in the session's repository copy, once per session: (workdir, that run's
    result, its config files). Its two trained experiments are also the grid test_workflow_grid.py summarises."""
    if "paper" not in _SESSION:
        repo = session_repo(tmp_path_factory)
        workdir = workspace(repo, tmp_path_factory.mktemp("paper"))
        (workdir / "micro.yaml").write_text(yaml.safe_dump(MICRO_PAPER))
        config = (str(repo / "config" / "paper" / "orpo-ifeval-tiny.yaml"), "micro.yaml")
        result = snakemake(workdir, "results/paper/orpo-ifeval-tiny/table.md", config=config)
        assert result.returncode == 0, result.stderr[-4000:]
        _SESSION["paper"] = (workdir, result, config)
    return _SESSION["paper"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir, result, _ = tiny_paper_workflow(tmp_path_factory)
    return workdir, result


def test_the_tiny_config_runs_end_to_end_sharing_data_and_model(tiny_run):
    _, result = tiny_run
    # alpha (h4) and beta (argilla_clean) binarize the same rows with the same model: data and base once.
    assert job_counts(result) == {"data": 1, "base": 1, "curate": 2, "render": 2, "train": 2, "replay": 2,
                                  "generate_base": 1, "generate_orpo": 2, "ifeval": 2, "paper_table": 1}


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_the_tiny_table_puts_ours_beside_the_published_numbers(tiny_run):
    workdir, _ = tiny_run
    rows = table_rows((workdir / "results" / "paper" / "orpo-ifeval-tiny" / "table.md").read_text())
    assert rows[0] == ["Model", "", "Prompt-Strict", "Prompt-Loose", "Inst-Strict", "Inst-Loose"]
    models = yaml.safe_load((ROOT / "config" / "paper" / "orpo-ifeval-tiny.yaml").read_text())["paper"]["models"]
    body = rows[1:]
    assert len(body) == 4 * len(models)
    for i, model in enumerate(models):
        published, ours, ci, diff = body[4 * i: 4 * i + 4]
        assert published[0] == model["label"] and published[1] == "published"
        assert [float(v) for v in published[2:]] == [model["published"][k] for k in KEYS]
        result = json.loads((workdir / "results" / model["experiment"] / "ifeval.json").read_text())
        trained = result["models"]["orpo"]
        assert ours[1].startswith(f"ours (`{model['experiment']}`, 4 prompts")
        assert [float(v) for v in ours[2:]] == [round(trained[c], 4) for c in COLUMNS]
        assert all(re.fullmatch(r"\[\d\.\d{4}, \d\.\d{4}\]", v) for v in ci[2:])
        expected = [trained[c] - model["published"][k] for c, k in zip(COLUMNS, KEYS)]
        assert [float(v.replace("−", "-")) for v in diff[2:]] == pytest.approx(expected, abs=5e-5)


def test_the_judge_table_reads_each_experiments_summary(tmp_path):
    from orpo.eval.judge.summary import summarize

    outcomes = {"alpha": ["win"] * 5 + ["loss"] * 2 + ["tie", "inconsistent", "error"],
                "beta": ["win", "loss", "loss", "tie"]}
    args = []
    for exp, out in outcomes.items():
        (tmp_path / f"{exp}.json").write_text(json.dumps(summarize(out, n_resamples=200, seed=0)))
        args.append(f"{exp}={tmp_path / f'{exp}.json'}")
    spec = json.dumps(PAPER["paper"])
    subprocess.run([sys.executable, "-m", "orpo.cli", "report", "paper-judge", "--spec", spec, "--results", *args,
                    "--out", str(tmp_path / "judge.md")], check=True, capture_output=True)
    rows = table_rows((tmp_path / "judge.md").read_text())[1:]
    for row, (exp, out) in zip(rows, outcomes.items()):
        judged = [o for o in out if o != "error"]
        assert row[0].endswith(f"(`{exp}`)")
        assert [int(v) for v in row[1:7]] == [len(judged)] + [out.count(k) for k in ("win", "tie", "loss", "inconsistent", "error")]
        assert float(row[7].split()[0]) == pytest.approx(out.count("win") / len(judged), abs=5e-5)
        adjusted = (out.count("win") + 0.5 * (out.count("tie") + out.count("inconsistent"))) / len(judged)
        assert float(row[8].split()[0]) == pytest.approx(adjusted, abs=5e-5)
