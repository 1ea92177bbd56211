"""The roles of a composed Allreduce, Bcast or Reduce run in segments between two hosts (``composed.segments``).

Each segment's host sum leaves for the other host's leader as soon as the host has made it, through a nonblocking
send that the socket takes while the host works on the next; each segment that arrives is folded (and broadcast in
the host) while the next one crosses. The host's other ranks run the host's steps segment by segment.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from .algorithms.base import blocks_of, even_counts
from .buffers import IN_PLACE


class SegmentedSteps:
    """``HostComposition``'s calls in segments; it provides the communicators (``host_comm``, ``leaders``), the
    layout's facts (``comm``, ``host``, ``leader_rank``), ``_scratch`` and ``_host_bcast``."""

    comm: Any
    host: int
    host_comm: Any
    leaders: Any
    leader_rank: list[int]

    def _scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        raise NotImplementedError

    def _host_bcast(self, buf: Any, root: int, incoming: int) -> None:
        raise NotImplementedError

    @staticmethod
    @contextmanager
    def _withdrawn_on_failure(receives: list[Any]) -> Iterator[None]:
        """Where the call fails inside, cancel its receives that no segment matched yet, so that none lies in wait
        for a later call's message on the leaders' communicator."""
        try:
            yield
        except BaseException:
            for request in receives:
                try:
                    request.Cancel()
                except Exception:  # noqa: BLE001 - completed, or the communicator is broken: nothing lies in wait
                    pass
            raise

    @staticmethod
    def _pieces(buf: Any, count: int) -> list[Any]:
        """``buf``'s ``count`` nearly equal segments, in order."""
        return blocks_of(buf, even_counts(len(buf), count))

    def _other_leader(self) -> int:
        return 1 - self.leader_rank[self.host]

    def _fold(self, op: Any, mine: Any, theirs: Any, out: Any) -> None:
        """``out`` = the two hosts' partial results, the first host's on the left on both leaders (the same bits)."""
        first, second = (mine, theirs) if self.leader_rank[self.host] == 0 else (theirs, mine)
        op.ufunc(first, second, out=out)

    def _leader_allreduce_segments(self, send: Any, out: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        # each segment's host sum leaves for the other leader as soon as it is made; each segment of theirs is folded
        # and broadcast in the host while the next one crosses
        n = len(out)
        scratch = self._scratch(out.dtype, 2 * n)
        partial, theirs = scratch[:n], scratch[n:]
        if in_place:
            partial[...] = out
        other, leaders, host = self._other_leader(), self.leaders, self.host_comm
        mine, incoming, results = self._pieces(partial, count), self._pieces(theirs, count), self._pieces(out, count)
        inputs = mine if in_place else self._pieces(send, count)
        receives = [leaders.Irecv(incoming[k], other, k) for k in range(count)]
        with self._withdrawn_on_failure(receives):
            sends = []
            for k in range(count):
                host.Reduce(IN_PLACE if in_place else inputs[k], mine[k], op, 0)
                sends.append(leaders.Isend(mine[k], other, k))
            for k in range(count):
                receives[k].Wait()
                self._fold(op, mine[k], incoming[k], results[k])
                self._host_bcast(results[k], 0, out.nbytes)
            for request in sends:
                request.Wait()

    def _member_allreduce_segments(self, send: Any, out: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        for piece in self._pieces(out if in_place else send, count):
            self.host_comm.Reduce(piece, None, op, 0)
        for piece in self._pieces(out, count):
            self._host_bcast(piece, 0, out.nbytes)

    def _leader_broadcast_segments(self, send: Any, buf: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        # the root leads its host (``segments``): it sends every segment to the other leader, then serves its host
        pieces, other = self._pieces(buf, count), self._other_leader()
        if self.comm._rank == root:
            sends = [self.leaders.Isend(piece, other, k) for k, piece in enumerate(pieces)]
            self.host_comm.Bcast(buf, 0)
            for request in sends:
                request.Wait()
            return
        receives = [self.leaders.Irecv(piece, other, k) for k, piece in enumerate(pieces)]
        with self._withdrawn_on_failure(receives):
            for request, piece in zip(receives, pieces):
                request.Wait()
                self._host_bcast(piece, 0, buf.nbytes)

    def _member_broadcast_segments(self, send: Any, buf: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        if self.host == self.comm._layout.host_of[root]:
            self.host_comm.Bcast(buf, 0)
            return
        for piece in self._pieces(buf, count):
            self._host_bcast(piece, 0, buf.nbytes)

    def _leader_reduce_segments(self, send: Any, recv: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        # the root leads its host (``segments``): the other leader sends each segment's host sum as it is made; the
        # root folds each into its own host's sum, which its host made meanwhile
        n = len(send)
        partial = self._scratch(send.dtype, 2 * n)
        mine, theirs = self._pieces(partial[:n], count), self._pieces(partial[n:], count)
        inputs, other = self._pieces(send, count), self._other_leader()
        if self.comm._rank != root:
            sends = []
            for k in range(count):
                self.host_comm.Reduce(inputs[k], mine[k], op, 0)
                sends.append(self.leaders.Isend(mine[k], other, k))
            for request in sends:
                request.Wait()
            return
        receives = [self.leaders.Irecv(theirs[k], other, k) for k in range(count)]
        with self._withdrawn_on_failure(receives):
            for k in range(count):
                self.host_comm.Reduce(inputs[k], mine[k], op, 0)
            results = self._pieces(recv, count)
            for k in range(count):
                receives[k].Wait()
                self._fold(op, mine[k], theirs[k], results[k])

    def _member_reduce_segments(self, send: Any, recv: Any, op: Any, root: int, in_place: bool, count: int) -> None:
        for piece in self._pieces(send, count):
            self.host_comm.Reduce(piece, None, op, 0)
