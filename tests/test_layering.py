"""The package's layering, read from the source: orpo.engine imports nothing from orpo.train, and no two
parts of orpo (its subpackages and top-level modules) import each other, directly or around a cycle."""

import ast
from pathlib import Path

import orpo

ROOT = Path(orpo.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (function-level imports included), made absolute."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module)
    return found


def part(module: str) -> str:
    """orpo.train.session -> orpo.train: the subpackage or top-level module a module belongs to."""
    return ".".join(module.split(".")[:2])


def test_engine_imports_nothing_from_train():
    bad = {f"{path.name}: {m}" for path in (ROOT / "engine").rglob("*.py") for m in imports(path)
           if m == "orpo.train" or m.startswith("orpo.train.")}
    assert not bad


def test_no_import_cycle_between_the_parts_of_orpo():
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        me = part(module_name(path))
        for m in imports(path):
            if m.startswith("orpo.") and part(m) != me:
                edges.setdefault(me, set()).add(part(m))
    assert "orpo.engine" in edges.get("orpo.train", set())  # the walk sees the imports it should

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(edges)) if c]
    assert not cycles, " | ".join(" -> ".join(c) for c in cycles)
