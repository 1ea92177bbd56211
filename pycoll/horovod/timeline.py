"""The Horovod engine's timeline: a Chrome trace (JSON array of events) with one track per tensor name and its phases."""

from __future__ import annotations

import json
import threading
import time
from typing import IO, Any, Optional

# The phases a tensor goes through, as Horovod's timeline names them.
NEGOTIATE, QUEUE = "NEGOTIATE", "QUEUE"
MEMCPY_IN, MEMCPY_OUT = "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"


class Timeline:
    """Writes trace events to ``path`` as they happen: ``B``/``E`` pairs on a track (``pid``) per tensor name, the
    track named by a metadata event the first time it appears. The array is closed by ``close``; a trace cut short
    (a crash) still loads in Perfetto, which accepts an unterminated array."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._file.write("[\n")
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _track(self, name: str) -> int:
        pid = self._tracks.get(name)
        if pid is None:
            pid = self._tracks[name] = len(self._tracks) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        return pid

    def _emit(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def span(self, name: str, phase: str, start_us: float, end_us: float, args: Optional[dict[str, Any]] = None) -> None:
        """One phase of tensor ``name`` from ``start_us`` to ``end_us`` (``now_us`` readings)."""
        with self._lock:
            if self._file is None:
                return
            pid = self._track(name)
            begin = {"name": phase, "ph": "B", "ts": round(start_us, 3), "pid": pid, "tid": 1}
            if args:
                begin["args"] = args
            self._emit(begin)
            self._emit({"name": phase, "ph": "E", "ts": round(max(end_us, start_us), 3), "pid": pid, "tid": 1})

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            # a last event without a trailing comma closes the array as strict JSON
            self._file.write(json.dumps({"name": "timeline_end", "ph": "i", "ts": round(self.now_us(), 3), "pid": 0,
                                         "s": "g"}) + "\n]\n")
            self._file.close()
            self._file = None
