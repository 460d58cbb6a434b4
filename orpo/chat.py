"""`orpo chat`: talk to a base model or a trained run, through the chat template and render settings it was
trained with, so what it sees is what training showed it.

A run folder gives everything: its base model and dtype (settings.json), its adapter (final or any kept
checkpoint) and, from the rendered folder it trained on, the render settings (template override, template
variables, the date `strftime_now` prints). Interactive on a terminal; `--prompt` answers once; piped
input is one user turn per line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

from orpo.config import section_defaults
from orpo.render.settings import PromptSettings, prompt_settings

GENERATE_DEFAULTS = section_defaults("generate")
PROMPT_KEYS = tuple(f.name for f in dataclasses.fields(PromptSettings))  # what a render manifest gives a chat


class ChatError(ValueError):
    """The run or model to chat with cannot be set up (names the file and what is missing)."""


@dataclass
class Target:
    """What to load: the base model, the adapter (None: the base alone), render settings and dtype."""

    model: str
    adapter: str | None
    render: PromptSettings
    dtype: str
    origin: list[str] = field(default_factory=list)  # where each part came from, said when the chat starts


def run_adapter(run: Path, checkpoint: str | int) -> Path:
    """The adapter folder of a run's checkpoint: the run itself for final, else its kept checkpoint folder."""
    from orpo.train.checkpoint import checkpoint_folder

    try:
        return checkpoint_folder(run, checkpoint, "chat with")
    except ValueError as e:
        raise ChatError(str(e)) from None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ChatError(f"{path}: missing ({what})") from None
    except (OSError, ValueError) as e:
        raise ChatError(f"{path}: cannot read {what}: {e}") from None


def target(run: str | Path | None = None, model: str | None = None, checkpoint: str | int = "final",
           base: bool = False, dtype: str | None = None, render: PromptSettings | None = None) -> Target:
    """Resolve what to chat with. With `run`: its base model (unless `model` is given), its adapter at
    `checkpoint` (none with `base`), its render settings and the dtype it trained in; `render`/`dtype` override."""
    if run is None:
        if model is None:
            raise ChatError("chat: give --run RUN_FOLDER (a trained run) or --model MODEL (a base model)")
        given = " + --render-settings" if render else ""
        return Target(model, None, render or prompt_settings(None), dtype or "auto",
                      [f"model {model}", f"render settings: the schema's defaults{given}"])
    run = Path(run)
    record = _read_json(run / "settings.json", "the run's record; is this a training run folder?")
    base_model = model or record.get("base")
    if not base_model:
        raise ChatError(f"{run / 'settings.json'}: names no base model; pass --model")
    rendered = Path(record.get("rendered") or "")
    manifest = _read_json(rendered / "manifest.json", f"the render manifest of the data {run} trained on (run from "
                          "the folder the run was made in, or pass --render-settings)") if not render else {}
    recorded = manifest.get("settings", {})
    rendering = render or prompt_settings({k: recorded[k] for k in PROMPT_KEYS if k in recorded})
    trained = (record.get("precision") or {}).get("dtype", "auto")
    adapter = None if base else str(run_adapter(run, checkpoint))
    origin = [f"model {base_model}" + (" (the run's base)" if not model else ""),
              f"adapter {adapter}" if adapter else "no adapter (--base)",
              f"render settings of {rendered}" if not render else "render settings from --render-settings",
              f"dtype {dtype or trained}" + ("" if dtype else " (as trained)")]
    return Target(str(base_model), adapter, rendering, dtype or trained, origin)


class Chat:
    """A conversation with a loaded model: each user turn is rendered with the whole history, answered greedily
    (or sampled, per the generate settings) up to max_tokens or the model's context."""

    def __init__(self, t: Target, settings: dict[str, Any] | None = None, system: str | None = None):
        import mlx.core as mx

        from orpo.generation import load_generator

        self.settings = {**GENERATE_DEFAULTS, **(settings or {})}
        self.gen = load_generator(t.model, t.adapter, t.render, t.dtype)
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()
        mx.random.seed(self.settings["seed"])

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_text(self, user: str) -> str:
        """The text the model is shown for the next turn (the rendered conversation with the generation prompt)."""
        chat = self.messages + [{"role": "user", "content": user}]
        return self.gen.chat.render(chat, add_generation_prompt=True, **self.gen.template_kwargs)

    def stream(self, user: str) -> Iterator[str]:
        """The reply to `user`, piece by piece; the turn and the reply are added to the conversation."""
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_sampler

        from orpo.generation import truncate_at_stop

        turn = {"role": "user", "content": user}
        ids = self.gen.prompt_ids(self.messages + [turn])
        budget = self.gen.budget(len(ids), self.settings["max_tokens"])
        if budget <= 0:
            raise ChatError(f"the conversation fills the model's context ({self.gen.context} positions, "
                            f"{self.gen.context_source}): /reset to start over")
        sampler = make_sampler(temp=self.settings["temperature"], top_p=self.settings["top_p"])
        stops = [x for x in self.settings.get("stop") or [] if x]
        text = ""
        for r in stream_generate(self.gen.model, self.gen.wrapper, ids, max_tokens=budget, sampler=sampler):
            text += r.text
            if not stops:
                yield r.text
        if stops:  # cut after the fact, as generation does, then shown whole
            text = truncate_at_stop(text, stops)
            yield text
        self.messages += [turn, {"role": "assistant", "content": text}]

    def reply(self, user: str) -> str:
        """The whole reply to `user`."""
        return "".join(self.stream(user))


HELP = "/reset starts over, /exit (or Ctrl-D) quits"


def interactive(chat: Chat, stdin: TextIO, stdout: TextIO, show_prompt: bool = False) -> None:
    """Turns from the keyboard until /exit or end of input; replies stream as they are generated."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"chat: {HELP}", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            print(file=stdout)
            return
        if user.strip() in ("/exit", "/quit"):
            return
        if user.strip() == "/reset":
            chat.reset()
            continue
        if not user.strip():
            continue
        try:
            answer(chat, user, stdout, show_prompt, prefix="model> ")
        except ChatError as e:
            print(f"chat: {e}", file=sys.stderr)


def piped(chat: Chat, stdin: TextIO, stdout: TextIO, show_prompt: bool = False) -> None:
    """Input that is not a terminal: each non-blank line is a user turn of one conversation, each reply a block."""
    for line in stdin:
        if line.strip():
            answer(chat, line.rstrip("\n"), stdout, show_prompt)


def answer(chat: Chat, user: str, stdout: TextIO, show_prompt: bool = False, prefix: str = "") -> None:
    """Stream the reply to one user turn to `stdout` (the rendered prompt first on stderr with `show_prompt`)."""
    if show_prompt:
        print(f"--- prompt ---\n{chat.prompt_text(user)}\n--- reply ---", file=sys.stderr, flush=True)
    stdout.write(prefix)
    for piece in chat.stream(user):
        stdout.write(piece)
        stdout.flush()
    stdout.write("\n")
    stdout.flush()
