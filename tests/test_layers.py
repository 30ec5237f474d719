"""The layers read top-down: no module imports a layer above its own (xronos/__init__.py).

    0  xronos.contract  (and the package root, for __version__)
    1  xronos.planner
    2  edge_node, controller  (peers: neither imports the other)
    3  the front end: the rest of xronos

Every import counts, those inside functions too: a lazy import that runs back
is still an arrow the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("xronos", "edge_node", "controller")


def layer(module: str) -> tuple[int, str] | None:
    """(layer, group) of an Xronos module; None for anything else (the standard library, torch, ...)."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if module == "xronos" or module.startswith("xronos.contract"):
        return 0, "contract"
    if module.startswith("xronos.planner"):
        return 1, "planner"
    if top in ("edge_node", "controller"):
        return 2, top
    return 3, "front end"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, text: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file's `text`, relative ones resolved."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            # `from xronos import wire` imports the module xronos.wire, not only the package
            out += [
                (node.lineno, f"{base}.{alias.name}")
                for alias in node.names
                if layer(f"{base}.{alias.name}")
                and (REPO / Path(*f"{base}.{alias.name}".split("."))).with_suffix(".py").is_file()
            ]
    return out


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def violations(path: Path, text: str | None = None) -> list[str]:
    mine = layer(module_name(path))
    out = []
    for line, target in imports(path, path.read_text() if text is None else text):
        theirs = layer(target)
        if theirs is None or mine is None:
            continue
        if theirs[0] > mine[0] or (mine[0] == theirs[0] == 2 and mine[1] != theirs[1]):
            out.append(f"{path.relative_to(REPO)}:{line}: {mine[1]} imports {target} ({theirs[1]})")
    return out


def test_no_module_imports_a_layer_above_its_own():
    found = [v for path in sources() for v in violations(path)]
    assert not found, "imports running back up the layers:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, target",
    [
        ("xronos/contract/wire.py", "xronos.cli"),
        ("xronos/planner/partitioner.py", "edge_node.profiler"),
        ("edge_node/agent.py", "controller.registry"),
        ("controller/service.py", "edge_node.worker_process"),
    ],
)
def test_the_check_catches_an_import_running_back(source, target):
    path = REPO / source
    assert not violations(path)
    planted = path.read_text() + f"\n\ndef _planted():\n    import {target}\n"
    assert any(target in v for v in violations(path, planted))
