"""Integer handles of mpi4py's requests and messages: the table that maps a live one's handle back to it, and
the conversions that every handle type spells the same way."""

from __future__ import annotations

import weakref
from typing import Any

HANDLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # handle -> request or message


class HandleForms:
    """mpi4py's other spellings of ``handle`` and ``fromhandle`` (the class defines those two)."""

    __slots__ = ()

    def toint(self) -> int:
        return self.handle  # type: ignore[attr-defined]

    def py2f(self) -> int:
        return self.handle  # type: ignore[attr-defined]

    @classmethod
    def fromint(cls, arg: int, /) -> Any:
        return cls.fromhandle(arg)  # type: ignore[attr-defined]

    @classmethod
    def f2py(cls, arg: int) -> Any:
        return cls.fromhandle(arg)  # type: ignore[attr-defined]
