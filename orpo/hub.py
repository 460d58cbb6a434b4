"""Hugging Face Hub access shared by the stages that load hub datasets: is it offline, and why a load failed."""

from __future__ import annotations

import os
import re
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")


def is_hub_dataset(spec: str, base: str | os.PathLike = ".") -> bool:
    """True for 'owner/name' or 'owner/name:split' that is no local path (under `base`) and no data file name."""
    return (not (Path(base) / spec).exists() and not spec.endswith(DATA_SUFFIXES)
            and bool(_DATASET_ID.match(spec)))


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (or huggingface_hub's own setting) forbid the network."""
    if any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
           for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_failure_reason(e: Exception) -> str:
    """Why loading a hub dataset failed, in words a user can act on (offline, unreachable, unknown id)."""
    if hub_offline():
        return "offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and it is not in the local cache"
    if isinstance(e, ConnectionError) or "reach" in str(e):
        return "the Hub cannot be reached (no network?) and it is not in the local cache"
    if type(e).__name__ in ("DatasetNotFoundError", "FileNotFoundError", "RepositoryNotFoundError"):
        return "no such dataset on the Hub (or it is gated/private: log in or set HF_TOKEN)"
    return "loading failed"
