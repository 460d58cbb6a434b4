"""MT-Bench's pairwise judge prompts (FastChat's judge_prompts.jsonl format) and its verdict parsing."""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

from orpo.io import InputError, read_jsonl

# The single-turn pairwise templates take exactly these fields (the math ones also need a reference answer).
FIELDS = frozenset({"question", "answer_a", "answer_b"})


@dataclass(frozen=True)
class JudgePrompt:
    """A pairwise judge template: its name, system prompt and user-prompt template."""

    name: str
    system_prompt: str
    prompt_template: str

    def messages(self, question: str, answer_a: str, answer_b: str) -> list[dict[str, str]]:
        """The chat sent to the judge: system prompt, then the filled template as the user turn (as FastChat)."""
        user = self.prompt_template.format(question=question, answer_a=answer_a, answer_b=answer_b)
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]


def load_judge_prompt(path: str | Path, name: str) -> JudgePrompt:
    """The named template from a FastChat-format judge_prompts.jsonl; only single-turn pairwise `[[A]]` ones."""
    for lineno, row in read_jsonl(path):
        if row.get("name") != name:
            continue
        if row.get("type") != "pairwise" or row.get("output_format") != "[[A]]":
            raise InputError(path, lineno, "type", f"template {name!r} is not a pairwise [[A]]/[[B]]/[[C]] template")
        template, system = row.get("prompt_template"), row.get("system_prompt")
        if not isinstance(template, str) or not isinstance(system, str):
            raise InputError(path, lineno, "prompt_template", "missing or not a string")
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        if fields != FIELDS:
            raise InputError(path, lineno, "prompt_template",
                             f"template {name!r} takes {sorted(fields)}; only single-turn templates without a "
                             f"reference answer ({sorted(FIELDS)}) are supported")
        return JudgePrompt(name, system, template)
    raise InputError(path, None, "name", f"no template named {name!r}")


def parse_verdict(judgment: str) -> str | None:
    """'A', 'B' or 'tie' by FastChat's rule (first of [[A]], [[B]], [[C]] present, in that precedence); else None."""
    if "[[A]]" in judgment:
        return "A"
    if "[[B]]" in judgment:
        return "B"
    if "[[C]]" in judgment:
        return "tie"
    return None
