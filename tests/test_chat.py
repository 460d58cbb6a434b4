"""`orpo chat` on a real tiny run: the reply is what generation gives for the same prompt (the run's adapter,
template and render settings), --base drops the adapter, piped lines are turns of one conversation, the
render record's template and date reach the prompt, and on a terminal it is interactive."""

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orpo.train.settings import train_settings
from mlx_lm.tuner.lora import LoRALinear as MlxLoRALinear

from orpo.chat import Chat, ChatError, target
from orpo.cli import main
from orpo.eval.generate import generate
from orpo.settings import as_dict

from conftest import ROOT, shortest_pairs

SETTINGS = {"batch_size": 2, "max_steps": 4, "checkpoint_every": 2, "lr": 0.01, "lora": {"rank": 4, "alpha": 8}}
GEN = {"max_tokens": 12}
PROMPT = "Tell me about item 3."


@pytest.fixture(scope="module")
def run(tiny_base, tiny_rendered, tmp_path_factory) -> Path:
    """A trained run whose rendered folder carries its render manifest, as the workflow leaves it."""
    from orpo.train.trainer import train

    root = tmp_path_factory.mktemp("chat")
    rendered = shortest_pairs(tiny_rendered, root / "rendered")
    shutil.copy(tiny_rendered / "manifest.json", rendered / "manifest.json")
    train(tiny_base, rendered, root / "run", train_settings(SETTINGS))
    return root / "run"


def generated(model, prompt: str, out: Path, adapter=None, render=None) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".prompts.jsonl")
    src.write_text(json.dumps({"key": 0, "prompt": prompt}) + "\n")
    generate(model, src, out, GEN, adapter=adapter, label="x", render=render)
    return json.loads(out.read_text())["response"]


def test_one_shot_reply_is_the_runs_generation_for_that_prompt(run, tiny_base, tmp_path, capsys):
    main(["chat", "--run", str(run), "--prompt", PROMPT, "--settings", json.dumps(GEN)])
    out, err = capsys.readouterr()
    render = json.loads((Path(json.loads((run / "settings.json").read_text())["rendered"]) / "manifest.json")
                        .read_text())["settings"]
    expected = generated(tiny_base, PROMPT, tmp_path / "orpo.jsonl", adapter=run, render=render)
    assert expected and out == expected + "\n"
    assert f"adapter {run}" in err and "dtype float32 (as trained)" in err

    main(["chat", "--run", str(run), "--base", "--prompt", PROMPT, "--settings", json.dumps(GEN)])
    out, err = capsys.readouterr()
    assert out == generated(tiny_base, PROMPT, tmp_path / "base.jsonl", render=render) + "\n"
    assert "no adapter (--base)" in err


def test_the_adapter_is_loaded_from_the_checkpoint_asked_for(run, tmp_path):
    with_adapter = Chat(target(run, checkpoint=2), GEN)
    assert any(isinstance(m, MlxLoRALinear) for _, m in with_adapter.gen.model.named_modules())
    assert target(run, checkpoint=2).adapter == str(run / "checkpoints" / "step-000002")
    plain = Chat(target(run, base=True), GEN)
    assert not any(isinstance(m, MlxLoRALinear) for _, m in plain.gen.model.named_modules())
    with pytest.raises(ValueError, match=r"step 3 is not a checkpoint of this run \(have \[2, 4\]\)"):
        target(run, checkpoint=3)


def test_piped_lines_are_turns_of_one_conversation(run, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "orpo.cli", "chat", "--run", str(run), "--settings", json.dumps(GEN)],
                          input="hello\n\nand again\n", capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    chat = Chat(target(run), GEN)
    first = chat.reply("hello")
    second_prompt = chat.prompt_text("and again")
    assert first in second_prompt and second_prompt.count("<|im_start|>user") == 2  # the history is in the prompt
    second = chat.reply("and again")
    assert done.stdout == f"{first}\n{second}\n"


def test_the_render_record_sets_the_template_and_date(run, tmp_path, capsys):
    llama3 = str(ROOT / "tests" / "fixtures" / "templates" / "llama3.jinja")
    record = json.loads((run / "settings.json").read_text())
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    manifest = json.loads((Path(record["rendered"]) / "manifest.json").read_text())
    manifest["settings"].update(template=llama3, date="2031-03-05", template_kwargs={"bos_token": ""})
    (rendered / "manifest.json").write_text(json.dumps(manifest))
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "settings.json").write_text(json.dumps({**record, "rendered": str(rendered)}))
    t = target(copy)
    assert as_dict(t.render) == {"template": llama3, "date": "2031-03-05", "template_kwargs": {"bos_token": ""},
                                 "add_bos": manifest["settings"]["add_bos"]}
    # The tiny model's 96 positions hold no reply after llama3's header (its BPE spells the special tokens out).
    with pytest.raises(SystemExit):
        main(["chat", "--run", str(copy), "--prompt", "hi", "--show-prompt", "--settings", json.dumps(GEN)])
    err = capsys.readouterr().err
    assert "Today Date: 05 Mar 2031" in err and "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" in err
    assert "error: the conversation fills the model's context (96 positions, config.json max_position_embeddings)" in err


def test_bad_targets_name_what_is_missing(tmp_path):
    with pytest.raises(ChatError, match="give --run RUN_FOLDER"):
        target()
    with pytest.raises(ChatError, match=r"settings.json: missing .*training run folder"):
        target(tmp_path)


def test_on_a_terminal_it_is_interactive(run):
    """A real pseudo-terminal: a prompt per turn, the reply streamed, /reset and /exit."""
    expected = Chat(target(run), GEN).reply("hello")
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "orpo.cli", "chat", "--run", str(run), "--settings", json.dumps(GEN)],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, count: int, timeout: float = 240) -> None:
        nonlocal seen
        deadline = time.time() + timeout
        while seen.count(marker) < count and time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert seen.count(marker) >= count, seen.decode(errors="replace")[-2000:]

    try:
        read_until(b"you> ", 1)
        os.write(master, b"hello\n")
        read_until(b"you> ", 2)
        os.write(master, b"/reset\n")
        read_until(b"you> ", 3)
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode(errors="replace").replace("\r\n", "\n")
    assert "/reset starts over, /exit (or Ctrl-D) quits" in text
    assert f"model> {expected}\nyou> " in text


def test_mlx_lm_fuse_takes_the_run_folder_and_exports_gguf(run, tiny_base, tmp_path):
    """README's `mlx_lm.fuse --model BASE --adapter-path RUN --save-path OUT --export-gguf`, as written there."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    out = tmp_path / "fused"
    done = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(tiny_base), "--adapter-path", str(run),
                           "--save-path", str(out), "--export-gguf"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tuned, _ = load(str(tiny_base), adapter_path=str(run))
    fused, _ = load(str(out))
    tokens = mx.array([[1, 5, 9, 20, 33, 7]])
    np.testing.assert_allclose(np.array(fused(tokens)), np.array(tuned(tokens)), rtol=1e-4, atol=1e-4)
    weights, meta = mx.load(str(out / "ggml-model-f16.gguf"), return_metadata=True)
    assert "blk.0.attn_q.weight" in weights and meta["tokenizer.ggml.model"] == "llama"
    assert Chat(target(model=str(out)), GEN).reply(PROMPT) == Chat(target(run), GEN).reply(PROMPT)
