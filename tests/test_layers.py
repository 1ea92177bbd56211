"""The layers as the code keeps them: import-linter's contracts, no import cycles, docs/architecture.md's drawing,
and no module or class past its size (docs/architecture.md lists the exceptions and why)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# names of the contract's layers, top to bottom, as docs/architecture.md shows them
LABELS = ("tools", "front ends", "communicators", "execution", "algorithms", "point-to-point", "engine parts",
          "wire format", "transports",
          "rendezvous", "topology", "memory", "device kernels", "base")


def _contract_layers() -> list[list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c.get("id") == "layers")["layers"]
    return [[m.strip() for m in re.split(r"[:|]", layer)] for layer in layers]


def drawing() -> str:
    """The layers block of docs/architecture.md, made from the contract."""
    layers = _contract_layers()
    lines = []
    for k, (label, modules) in enumerate(zip(LABELS, layers), 1):
        if k > 1:
            lines.append(" " * 23 + "|")
        lines.append(f"{k:2d}  {label:<16} {', '.join(modules)}")
    return "\n".join(lines)


def test_lint_imports_keeps_every_contract() -> None:
    """lint-imports (import-linter, configured in pyproject.toml) exits 0: every layer imports only downward."""
    script = Path(sys.executable).with_name("lint-imports")
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_no_module_imports_itself_back() -> None:
    """No import cycle between pycoll's modules (annotation-only imports excepted: they do not run)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("pycoll", exclude_type_checking_imports=True, cache_dir=None)
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if graph.chain_exists(importer=imported, imported=module):
                back = graph.find_shortest_chain(importer=imported, imported=module)
                cycles.append(f"{module} -> " + " -> ".join(back))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_architecture_doc_draws_the_contract() -> None:
    assert len(LABELS) == len(_contract_layers()), "a layer was added or removed: name it in LABELS"
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers:.*?-->\n```\n(.*?)\n```\n<!-- end layers -->", text, re.S)
    assert block, "docs/architecture.md lost its layers block"
    assert block.group(1) == drawing(), "docs/architecture.md's layers differ from pyproject.toml's; paste:\n" + drawing()


MODULE_LINES, CLASS_LINES = 600, 400


def oversized(paths: list[Path]) -> list[str]:
    """``path: N lines`` for each module over MODULE_LINES, ``path: class C, N lines`` for each class over CLASS_LINES
    (paths relative to the repository root)."""
    found = []
    for path in paths:
        text = path.read_text()
        name = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else path.as_posix()
        lines = text.count("\n")
        if lines > MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                found.append(f"{name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    return found


def _size_exceptions() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- size exceptions -->\n(.*?)<!-- end size exceptions -->", text, re.S)
    assert block, "docs/architecture.md lost its list of size exceptions"
    return set(re.findall(r"^- `([^`]+)`", block.group(1), re.M))


def test_no_module_or_class_outgrows_its_limit() -> None:
    """No module of pycoll/ or perf/ over 600 lines and no class over 400, but those docs/architecture.md names with
    the reason; and every one it names is still over (a stale exception hides the next file that grows)."""
    paths = sorted([*(ROOT / "pycoll").rglob("*.py"), *(ROOT / "perf").rglob("*.py")])
    found = oversized(paths)
    allowed = _size_exceptions()
    unexplained = [f for f in found if f.split(":")[0] not in allowed]
    assert not unexplained, "split these along their seams, or say in docs/architecture.md why not:\n" + "\n".join(unexplained)
    stale = allowed - {f.split(":")[0] for f in found}
    assert not stale, f"docs/architecture.md excuses files that are no longer too large: {sorted(stale)}"


def test_the_size_check_sees_long_modules_and_classes(tmp_path: Path) -> None:
    long_module = tmp_path / "long.py"
    long_module.write_text("x = 1\n" * (MODULE_LINES + 1))
    long_class = tmp_path / "wide.py"
    long_class.write_text("class Wide:\n" + "    a = 1\n" * CLASS_LINES)
    fits = tmp_path / "fits.py"
    fits.write_text("class Small:\n" + "    a = 1\n" * (CLASS_LINES - 1) + "y = 2\n" * (MODULE_LINES - CLASS_LINES))
    found = oversized([long_module, long_class, fits])
    assert found == [f"{long_module.as_posix()}: {MODULE_LINES + 1} lines", f"{long_class.as_posix()}: class Wide, {CLASS_LINES + 1} lines"]


if __name__ == "__main__":  # print the block to paste into docs/architecture.md
    print(drawing())
