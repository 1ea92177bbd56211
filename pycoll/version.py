"""The installed pycoll's version, read from the package metadata once asked for (not at import)."""

from __future__ import annotations

import functools

SOURCE_TREE_VERSION = "0.1.0"  # what pyproject.toml says, for a source tree that was never installed


@functools.lru_cache(maxsize=None)
def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pycoll")
    except PackageNotFoundError:  # running from a source tree
        return SOURCE_TREE_VERSION
