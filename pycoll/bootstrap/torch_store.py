"""The rendezvous store on torch's TCPStore: the store a later ``init_process_group`` shares, under a key prefix."""

from __future__ import annotations

from typing import Any

from pycoll.errors import PeerFailureError, TimeoutError
from .store import Store, check_key


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _torch_error(exc: BaseException, what: str, cause: str) -> Exception:
    """Map a torch store error to pycoll's: timeouts to TimeoutError, the rest to PeerFailureError."""
    if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
        return TimeoutError(cause, op=what)
    return PeerFailureError(f"{cause}: {exc}", op=what)


class TorchStore(Store):
    """Wraps a ``torch.distributed`` store (e.g. the torchrun agent's TCPStore); keys get a prefix."""

    def __init__(self, store: Any, prefix: str = "pycoll/") -> None:
        self._store = store
        self.prefix = prefix

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        world_size: int,
        is_master: bool,
        timeout: float,
        prefix: str = "pycoll/",
    ) -> "TorchStore":
        """Create a ``torch.distributed.TCPStore`` the way torch's env:// rendezvous does.

        The master uses ``multi_tenant=True``, so a later ``init_process_group`` in this process on
        the same port shares the server.
        """
        from torch.distributed import TCPStore as _TorchTCPStore  # lazy: torch is optional

        kwargs: dict[str, Any] = {}
        if is_master:
            kwargs["multi_tenant"] = True
        try:
            store = _TorchTCPStore(
                host, int(port), world_size, is_master, timeout=_timedelta(timeout), **kwargs
            )
        except RuntimeError as exc:
            raise _torch_error(
                exc, "store connect", f"could not reach the torch store at {host}:{port} within {timeout:.1f} s"
            ) from exc
        return cls(store, prefix)

    def _live(self, what: str) -> Any:
        if self._store is None:
            raise PeerFailureError("the torch store wrapper is closed", op=what)
        return self._store

    def set(self, key: str, value: bytes) -> None:
        check_key(key)
        try:
            self._live("store set").set(self.prefix + key, bytes(value))
        except RuntimeError as exc:
            raise _torch_error(exc, "store set", f"could not set key {key!r}") from exc

    def get(self, key: str, timeout: float) -> bytes:
        check_key(key)
        store = self._live("store get")
        full = self.prefix + key
        try:
            # torch reads a zero timeout as "forever": poll instead.
            if timeout <= 0:
                if not store.check([full]):
                    raise TimeoutError(f"waited {timeout:.1f} s for key {key!r}", op="store get")
            else:
                store.wait([full], _timedelta(timeout))
            return bytes(store.get(full))
        except RuntimeError as exc:
            raise _torch_error(exc, "store get", f"waited {timeout:.1f} s for key {key!r}") from exc

    def add(self, key: str, delta: int) -> int:
        check_key(key)
        try:
            return int(self._live("store add").add(self.prefix + key, int(delta)))
        except RuntimeError as exc:
            raise _torch_error(exc, "store add", f"could not add to key {key!r}") from exc

    def check(self, keys: list[str]) -> bool:
        try:
            return bool(self._live("store check").check([self.prefix + k for k in keys]))
        except RuntimeError as exc:
            raise _torch_error(exc, "store check", f"could not check keys {keys}") from exc

    def wait(self, keys: list[str], timeout: float) -> None:
        for key in keys:
            check_key(key)
        store = self._live("store wait")
        try:
            if timeout <= 0:
                ok = store.check([self.prefix + k for k in keys])
            else:
                store.wait([self.prefix + k for k in keys], _timedelta(timeout))
                ok = True
        except RuntimeError as exc:
            ok = False
            if not isinstance(_torch_error(exc, "", ""), TimeoutError):
                raise _torch_error(exc, "store wait", f"could not wait for keys {keys}") from exc
        if not ok:
            missing = [k for k in keys if not self._safe_check(k)]
            raise TimeoutError(f"waited {timeout:.1f} s for keys {missing}", op="store wait")

    def _safe_check(self, key: str) -> bool:
        try:
            return self.check([key])
        except Exception:
            return False

    def close(self) -> None:
        # torch stores have no close(); dropping the reference closes the connection.
        self._store = None
