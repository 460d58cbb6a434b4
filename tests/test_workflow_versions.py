"""Stage code versions on the real workflow, after the micro run (in its repository copy, see test_workflow.py).

(a) nothing to do; (d) touching every file of the copy (as a fresh checkout or a branch switch does) reruns
nothing; (b) an edit of the trainer's source reruns exactly train, replay, generate_orpo and ifeval, and
undoing it reruns nothing whatever the file times; (c) an edit of the IFEval scorer reruns exactly the
scoring rule, and the rule's shell ran the copy's edited code. Tests run in file order and share the run.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_workflow import _REPO_OF, micro_workflow, planned_rules, snakemake

# one worker under pytest-xdist: these share the session's workflow runs
pytestmark = pytest.mark.xdist_group("workflow")

TARGET = "results/ifeval.json"
MARKER = "orpo-test-marker: the copy's edited IFEval scorer ran"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return micro_workflow(tmp_path_factory)


def planned(workdir: Path) -> set[str]:
    result = snakemake(workdir, "-n", TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    return planned_rules(result)


def reasons(result) -> dict[str, str]:
    """Rule -> the reason line of its job in a dry run's job listing."""
    out, rule = {}, None
    for line in (result.stdout + result.stderr).splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):", line):
            rule = m.group(1)
        elif rule and line.strip().startswith("reason:"):
            out[rule] = line.strip()
    return out


def copy_code_version(workdir: Path, entry: str, *dists: str) -> str:
    """The code version of a stage computed from the repository copy's package, in a fresh process."""
    code = f"from orpo.versions import code_version; print(code_version({entry!r}, dists={dists!r}))"
    env = {**os.environ, "PYTHONPATH": str(_REPO_OF[workdir])}
    return subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_a_finished_run_has_nothing_to_do(run):
    assert planned(run) == set()


def test_d_touching_every_file_of_the_repository_reruns_nothing(run):
    repo = _REPO_OF[run]
    later = time.time() + 5
    files = [p for p in repo.rglob("*") if p.is_file()]
    for path in files:
        os.utime(path, (later, later))
    # Not vacuous: the eval prompts (an input of curate, generate and ifeval) are now newer than every output.
    prompts = repo / "data" / "eval" / "ifeval_prompts.jsonl"
    assert prompts in files and prompts.stat().st_mtime > (run / TARGET).stat().st_mtime
    assert len(files) > 50
    assert planned(run) == set()


def test_b_a_trainer_edit_reruns_train_to_ifeval_and_undoing_it_nothing(run):
    trainer = _REPO_OF[run] / "orpo" / "train" / "trainer.py"
    original = trainer.read_bytes()
    trainer.write_bytes(original + b"\n# an edit of the trainer's source\n")
    try:
        result = snakemake(run, "-n", TARGET)
        assert planned_rules(result) == {"train", "replay", "generate_orpo", "ifeval"}
        # Why: train's code param is now the hash of the copy's edited trainer; the rest follow from train.
        why = reasons(result)
        assert f"now: '{copy_code_version(run, 'orpo.train.trainer', 'mlx', 'mlx-lm')}'" in why["train"]
        assert "Params have changed" in why["train"]
        assert all("Params have changed" not in why[r] for r in ("replay", "generate_orpo", "ifeval"))
    finally:
        trainer.write_bytes(original)  # same content, a new mtime
    assert planned(run) == set()


def test_c_a_scorer_edit_reruns_only_scoring_with_the_copys_code(run):
    score = _REPO_OF[run] / "orpo" / "eval" / "ifeval" / "score.py"
    score.write_text(score.read_text() + f"\nimport sys as _sys\n\n_sys.stderr.write({MARKER!r} + '\\n')\n")
    before = (run / TARGET).read_bytes()
    assert planned(run) == {"ifeval"}
    result = snakemake(run, TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert MARKER in (run / "logs" / "ifeval.log").read_text()  # the rule's `orpo` imported the copy
    assert (run / TARGET).read_bytes() == before  # the edit changed no scoring: same scores, same bytes
    assert planned(run) == set()
