"""Reads a topology file in either format it may come in: pycoll's own JSON (``Topology.dump``) or NCCL's XML
(``NCCL_TOPO_FILE``), told apart by content."""

from __future__ import annotations

import json

from .model import Topology


def load(path: str) -> Topology:
    """The topology in the file at ``path``."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("<"):
        from .nccl_xml import parse  # only for that format: a job that loads none never imports the XML reader

        return parse(text, source=f"nccl-xml:{path}")
    topo = Topology.from_dict(json.loads(text))
    topo.source = topo.source or path
    return topo
