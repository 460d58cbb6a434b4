"""`pip install .` (not editable) into a fresh venv gives a working `orpo`: the schema and data travel inside."""

from __future__ import annotations

import json
import os
import site
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_non_editable_install_runs_a_stage(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    fresh_site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies come from this venv's site-packages as a plain path: a path line in a .pth is not
    # scanned for .pth files, so this checkout's editable hook stays out and `orpo` can only be the installed copy.
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # pip builds the wheel in its own isolated environment (setuptools from the registry, as a user's pip would).
    subprocess.run([py, "-m", "pip", "install", "--no-deps", "--quiet", "--no-warn-script-location", str(ROOT)],
                   check=True, cwd=tmp_path)
    # Nothing of this checkout on the path (PYTHONPATH would put it before the installed copy).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run([py, "-c", "import orpo; print(orpo.__file__)"], check=True, capture_output=True,
                           text=True, cwd=work, env=env).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where
    orpo = env_dir / "bin" / "orpo"
    for args in (["data", "rows", "--out", "raw.jsonl", "--n", "60"],
                 ["curate", "--inputs", "raw.jsonl", "--out", "curated", "--settings",
                  json.dumps({"validation_fraction": 0.1})]):
        done = subprocess.run([orpo, *args], cwd=work, capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"orpo {args[0]}: {done.stderr}"
    manifest = json.loads((work / "curated" / "manifest.json").read_text())
    assert manifest["output_rows"]["train"] > 0 and manifest["settings"]["recipe"] == "h4", done.stdout
