"""The layers as the code keeps them: import-linter's contracts, no import cycles, and docs/architecture.md's drawing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# names of the contract's layers, top to bottom, as docs/architecture.md shows them
LABELS = ("tools", "front ends", "communicators", "execution", "algorithms", "point-to-point", "transports",
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


if __name__ == "__main__":  # print the block to paste into docs/architecture.md
    print(drawing())
