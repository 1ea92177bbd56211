"""The MPI features pycoll does not provide (intercommunicators, one-sided windows, MPI-IO, dynamic processes):
every call raises NotProvidedError, a NotImplementedError, which is how mpi4py's tests detect an MPI without them."""

from __future__ import annotations

from typing import Any, NoReturn

from .errors import NotProvidedError

INTERCOMM = "intercommunicators"
WINDOWS = "one-sided communication (MPI.Win)"
FILES = "MPI-IO (MPI.File)"
DYNAMIC = "dynamic processes (spawn, ports, connect/accept)"


def refuse(feature: str, call: str) -> NoReturn:
    """Raise the error that says pycoll does not provide ``feature`` (asked for by ``call``)."""
    raise NotProvidedError(f"pycoll does not provide {feature}", op=call)


class Win:
    """mpi4py's one-sided window class: every constructor raises NotProvidedError."""

    def __init__(self, *args: Any) -> None:
        refuse(WINDOWS, "Win")

    @classmethod
    def Create(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(WINDOWS, "Win.Create")

    @classmethod
    def Allocate(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(WINDOWS, "Win.Allocate")

    @classmethod
    def Allocate_shared(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(WINDOWS, "Win.Allocate_shared")

    @classmethod
    def Create_dynamic(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(WINDOWS, "Win.Create_dynamic")


class File:
    """mpi4py's MPI-IO file class: opening or deleting a file raises NotProvidedError."""

    def __init__(self, *args: Any) -> None:
        refuse(FILES, "File")

    @classmethod
    def Open(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(FILES, "File.Open")

    @classmethod
    def Delete(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        refuse(FILES, "File.Delete")


def Open_port(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
    refuse(DYNAMIC, "Open_port")


def Close_port(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
    refuse(DYNAMIC, "Close_port")


def Publish_name(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
    refuse(DYNAMIC, "Publish_name")


def Unpublish_name(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
    refuse(DYNAMIC, "Unpublish_name")


def Lookup_name(*args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
    refuse(DYNAMIC, "Lookup_name")
