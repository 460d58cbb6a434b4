"""Stage code versions follow the import graph: an edit changes exactly the stages that import it."""

import shutil

import pytest

import orpo.versions as versions


def test_closure_follows_imports():
    train = versions.module_closure("orpo.train.trainer")
    assert {"orpo.train.step", "orpo.engine.head", "orpo.train.lora", "orpo.io", "orpo.optim"} <= set(train)
    assert not any(m.startswith("orpo.eval") for m in train)
    ifeval = versions.module_closure("orpo.eval.ifeval.compare")
    assert "orpo.eval.ifeval.instructions" in ifeval
    assert not any(m.startswith("orpo.train") for m in ifeval)


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    root = tmp_path / "orpo"
    shutil.copytree(versions.PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(versions, "PACKAGE_ROOT", root)
    versions.module_closure.cache_clear()
    yield root
    versions.module_closure.cache_clear()


def test_edit_changes_only_the_importing_stages(package_copy):
    before = {s: versions.code_version(s) for s in ("orpo.train.trainer", "orpo.eval.ifeval.compare")}
    loss = package_copy / "train" / "step.py"
    loss.write_text(loss.read_text() + "\n# an edit\n")
    versions.module_closure.cache_clear()
    assert versions.code_version("orpo.train.trainer") != before["orpo.train.trainer"]
    assert versions.code_version("orpo.eval.ifeval.compare") == before["orpo.eval.ifeval.compare"]


def test_touching_files_changes_nothing(package_copy):
    before = versions.code_version("orpo.train.trainer")
    for path in package_copy.rglob("*.py"):
        path.touch()
    versions.module_closure.cache_clear()
    assert versions.code_version("orpo.train.trainer") == before
