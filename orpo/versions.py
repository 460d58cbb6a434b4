"""Stage code versions: a hash of the source of every `orpo` module a stage's entry module imports.

Snakemake reruns a job when a param changes, not when an imported module changes; each rule carries
this hash as a param so editing a stage's code reruns that stage and what follows, and editing nothing
(or only touching files) reruns nothing.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
from functools import lru_cache
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent


def _module_file(name: str) -> Path | None:
    parts = name.split(".")[1:]
    base = PACKAGE_ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(name: str, path: Path) -> set[str]:
    """`orpo.*` modules imported anywhere in the file (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import module`
    out = set()
    for mod in found:
        if mod == "orpo" or mod.startswith("orpo."):
            parts = mod.split(".")
            # importing orpo.a.b also runs orpo/__init__ and orpo/a/__init__
            out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return out


@lru_cache(maxsize=None)
def module_closure(entry: str) -> tuple[str, ...]:
    """Every `orpo` module reachable by imports from `entry`, sorted."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen.add(name)
        todo.extend(_imports(name, path) - seen)
    return tuple(sorted(seen))


def code_version(*entries: str, dists: tuple[str, ...] = ()) -> str:
    """A short hash of the sources reachable from `entries` plus the versions of the named distributions."""
    h = hashlib.sha256()
    modules = sorted({m for e in entries for m in module_closure(e)})
    if not modules:
        raise ValueError(f"no orpo modules found from {entries}")
    for name in modules:
        h.update(name.encode() + b"\0" + _module_file(name).read_bytes() + b"\0")
    for dist in dists:
        try:
            h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}==absent".encode())
    return h.hexdigest()[:16]
