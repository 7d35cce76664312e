"""The folders keep their promise (docs/architecture.md, "Package layout"): the folder says which
process runs a line, so the rank side imports nothing of the progress process's engine or
collectives, and transports reach the engine only through their contract (transports/base.py's
TransportContext), never by importing its internals. Imports only a type checker reads (under
``if TYPE_CHECKING:``) are the contract's types and do not count."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RANK_SIDE = ["proxy/rank", "proxy/mpi", "proxy/torch", "proxy/util", "proxy/futures"]
RULES = [(folder, ("shmproxy.engine", "shmproxy.coll")) for folder in RANK_SIDE] + \
        [("transports", ("shmproxy.engine",))]


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import the module executes, at any depth, but not those under
    ``if TYPE_CHECKING:``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.lineno, child.module))
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


@pytest.mark.parametrize("folder,forbidden", RULES, ids=[f for f, _ in RULES])
def test_folder_imports_nothing_of_the_other_process(folder: str, forbidden: tuple[str, ...]) -> None:
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder} has no Python files: the rule checks nothing"
    bad = [f"{p.relative_to(REPO)}:{line}: {mod}" for p in files for line, mod in _runtime_imports(p)
           if any(mod == f or mod.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{folder} imports {' or '.join(forbidden)}:\n" + "\n".join(bad)


def test_the_check_sees_nested_imports_and_skips_type_checking_ones(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shmproxy.engine.args import Args\n"
                   "def f():\n    from shmproxy.coll import sched\n    import shmproxy.engine.typed\n")
    mods = [m for _line, m in _runtime_imports(src)]
    assert "shmproxy.coll" in mods and "shmproxy.engine.typed" in mods
    assert not any(m.startswith("shmproxy.engine.args") for m in mods)


# The progress engine's components take the loop's state and the siblings they call (engine/progress.py's
# header), never the engine: only these name it (the driver, the dump that reads all of it, and the control
# plane that fills its tables on the loop thread).
TAKES_THE_ENGINE = {"proxy/engine/progress.py", "proxy/engine/introspect.py", "proxy/control/handler.py"}


def test_engine_components_do_not_take_the_engine() -> None:
    files = sorted((REPO / "proxy/engine").rglob("*.py")) + sorted((REPO / "proxy/coll").rglob("*.py"))
    bad = []
    for p in files:
        rel = str(p.relative_to(REPO))
        if rel in TAKES_THE_ENGINE:
            continue
        tree = ast.parse(p.read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "shmproxy.engine.progress":
                bad.append(f"{rel}:{node.lineno}: imports shmproxy.engine.progress")
            elif isinstance(node, ast.arg) and node.annotation is not None and \
                    "ProgressEngine" in ast.unparse(node.annotation):
                bad.append(f"{rel}:{node.lineno}: takes a ProgressEngine ({node.arg})")
    assert not bad, "engine components reach the engine instead of taking what they need:\n" + "\n".join(bad)
