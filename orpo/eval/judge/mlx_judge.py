"""A judge that is a local MLX model, run in-process through orpo.generation's batched generation."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from orpo.eval.judge.settings import JudgeSettings


class MlxJudge:
    """Judgments from a local model folder (or hub id), rendered through its own chat template."""

    def __init__(self, s: JudgeSettings, dtype: str = "auto"):
        self.model, self.dtype = s.model, dtype
        self._gen: Any = None  # loaded on first use: a fully cached rerun never loads the model
        self.chunk_size = s.batch_size
        self.gen_settings = {"temperature": s.temperature, "top_p": 1.0, "seed": s.seed,
                             "batch_size": s.batch_size, "max_tokens": s.max_tokens}
        self.identity = {"kind": "mlx", "model": str(s.model), "weights": _weights_fingerprint(s.model),
                         "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.temperature > 0:
            self.identity["seed"] = s.seed
        cast = _cast_dtype(s.model, dtype)
        if cast:  # verdicts of the checkpoint's own dtype keep their cache keys
            self.identity["dtype"] = cast

    def complete(self, chats: list[list[dict[str, str]]], attempt: int = 0) -> list[str]:
        """One judgment text per chat (greedy at temperature 0; a retry reseeds only when sampling)."""
        # Imported here so the HTTP judge (and its tests) never pay for importing MLX.
        from orpo.generation import generate_batched, load_generator

        if self._gen is None:
            self._gen = load_generator(self.model, dtype=self.dtype)
        ids = [self._prompt_ids(c) for c in chats]
        texts, _ = generate_batched(self._gen, ids, {**self.gen_settings, "seed": self.gen_settings["seed"] + attempt})
        return texts

    def _prompt_ids(self, chat: list[dict[str, str]]) -> list[int]:
        from orpo.render.template import ChatTemplateError

        try:
            return self._gen.prompt_ids(chat)
        except ChatTemplateError:
            # Templates without a system role: FastChat folds the system prompt into the user turn this way.
            system, user = chat[0]["content"], chat[1]["content"]
            return self._gen.prompt_ids([{"role": "user", "content": f"[Instruction]\n{system}\n\n{user}"}])


def _cast_dtype(model: str | Path, dtype: str) -> str | None:
    """The dtype the judge's weights are cast to, None when it computes in the checkpoint's own (no model load).

    A hub id's checkpoint is not read here: auto counts as a cast on the CPU (float32) and as none on a GPU.
    """
    import mlx.core as mx

    from orpo.precision import resolve

    if Path(model).is_dir():
        p = resolve(dtype, model)
        return p.dtype if p.dtype != p.checkpoint else None
    if dtype == "auto":
        return "float32" if mx.default_device().type == mx.cpu else None
    return dtype


def _weights_fingerprint(model: str | Path) -> str:
    """Cheap identity of a local model folder (config bytes, weight file names, sizes, mtimes); the name for a hub id.

    The mtime tells retrained weights of the same shapes apart; a copied folder merely misses the cache.
    """
    root = Path(model)
    if not root.is_dir():
        return str(model)
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer_config.json"):
        if (root / name).exists():
            h.update((root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
