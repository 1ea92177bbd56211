"""The README's knob table and docs/algorithms.md stay in step with the code."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from pycoll import config
from pycoll.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


def _table_names(text: str) -> set[str]:
    return set(re.findall(r"^\| `(PYCOLL_[A-Z0-9_]+)` \|", text, flags=re.M))


# the modules that declare knobs, between them importing every one that does
KNOB_MODULES = ("pycoll.algorithms", "pycoll.bootstrap", "pycoll.comm", "pycoll.horovod.knobs", "pycoll.launcher",
                "pycoll.p2p", "pycoll.topology.discover", "pycoll.transport", "pycoll.transport.rdma")


def test_readme_lists_every_knob() -> None:
    for name in KNOB_MODULES:
        importlib.import_module(name)
    declared = {p.name for p in config.declared_params()}
    listed = _table_names((ROOT / "README.md").read_text())
    assert declared - listed == set(), f"knobs missing from the README table: {sorted(declared - listed)}"
    assert listed - declared == set(), f"README lists knobs the code does not declare: {sorted(listed - declared)}"


def test_algorithm_table_lists_every_algorithm() -> None:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    rows = set(re.findall(r"^\| (\w+) \| (\w+) \|", text, flags=re.M))
    registered = {(coll, name) for coll, table in ALGORITHMS.items() for name in table}
    assert registered - rows == set(), f"algorithms missing from docs/algorithms.md: {sorted(registered - rows)}"
    assert rows - registered - {("collective", "name")} == set()
