"""torch's ``Work`` for pycoll's calls: one that completes with a future (the progress thread's, or a call that
ran inline), one already done, and a future done when several are."""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future


class PycollWork(dist.Work):
    """The handle of one operation: ``wait()`` blocks until it completes (raising its error), ``get_future()``
    gives a ``torch.futures.Future`` whose value is the operation's output tensors, as with gloo."""

    def __init__(self, future: Future, source: Optional[Callable[[], int]] = None) -> None:
        super().__init__()
        self._future = future
        self._source = source

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self._future.wait()  # raises the operation's error
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self) -> Optional[BaseException]:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()

    def _source_rank(self) -> int:
        self.wait()
        if self._source is None:
            raise RuntimeError("source rank is only known for a receive from any source")
        return self._source()

    source_rank = _source_rank


class DoneWork(dist.Work):
    """The handle of a call that completed before it was returned (run inline): its future is made if asked for."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result


def all_of(futures: list[Future], value: Any) -> Future:
    """A future done when every one of ``futures`` is, with the first error if any failed."""
    done: Future = Future()
    if not futures:
        done.set_result(value)
        return done

    def settle(_: Any) -> None:
        for f in futures:
            try:
                f.value()
            except Exception as exc:
                done.set_exception(exc)
                return
        done.set_result(value)

    torch.futures.collect_all(futures).add_done_callback(settle)
    return done
