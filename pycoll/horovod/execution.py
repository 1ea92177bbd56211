"""How the Horovod engine runs negotiated responses on pycoll: fused allreduces with their scales, and the
other collectives with ranks that have joined."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .. import MPI
from ..algorithms.registry import last_choice
from ..errors import MismatchError
from . import timeline as tl
from .submissions import CACHEABLE, OPS, Request, Response


def _identity(op: str, dtype: np.dtype) -> Any:
    """The value a joined rank contributes to a reduction: it changes nobody's result."""
    if op == "sum":
        return 0
    if op == "product":
        return 1
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.inf if op == "min" else -np.inf
    if dtype.kind == "b":
        return op == "min"
    info = np.iinfo(dtype)
    return info.max if op == "min" else info.min


def _scale_into(out: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``out`` = ``src`` * ``factor`` in one pass (a copy where the factor is 1; integers truncated, as Horovod)."""
    if factor == 1.0:
        np.copyto(out, src)
    elif out.dtype.kind in "iub":
        np.multiply(src, factor, out=out, casting="unsafe")
    else:
        np.multiply(src, out.dtype.type(factor), out=out)


def rows_of(first: int, size: int) -> list[int]:
    """How a reducescatter splits ``first`` rows over ``size`` ranks, as Horovod does: the first ranks one more."""
    base, more = divmod(first, size)
    return [base + (1 if r < more else 0) for r in range(size)]


class Execution:
    """The engine's execution of each cycle's responses (mixed into ``engine.Engine``)."""

    def _execute(self, responses: list[Response], joined: list[bool]) -> None:
        i = 0
        while i < len(responses):
            resp = responses[i]
            if resp.error is not None:
                req = self.pending.pop(resp.name, None)
                if req is not None:
                    req.finish(error=MismatchError(resp.error, op=f"horovod {req.kind} {resp.name!r}", rank=self.rank,
                                                   peers=resp.peers))
                i += 1
                continue
            group = [resp]
            if resp.kind == "allreduce":  # the allreduces after it with the same dtype, op and scales, fused
                key, nbytes = self._fusion_key(resp), self._nbytes(resp)
                while self.threshold > 0 and i + len(group) < len(responses):
                    nxt = responses[i + len(group)]
                    size = self._nbytes(nxt)
                    if nxt.error is not None or nxt.kind != "allreduce" or self._fusion_key(nxt) != key \
                            or nbytes + size > self.threshold:
                        break
                    group.append(nxt)
                    nbytes += size
                self._allreduce(group)
            else:
                getattr(self, "_" + resp.kind)(resp, joined)
            for done in group:
                self._remember(done)
            i += len(group)

    @staticmethod
    def _fusion_key(resp: Response) -> tuple:
        kind, dtype, _, op, _, prescale, postscale = resp.meta
        return dtype, op, prescale, postscale

    def _remember(self, resp: Response) -> None:
        """Enter a negotiated response into the cache, at the same slot on every rank."""
        if resp.kind not in CACHEABLE or resp.name in self.cached or not self.capacity:
            return
        try:
            slot = self.slots.index(None)
        except ValueError:
            return  # full: later requests are negotiated
        self.slots[slot] = (resp.name, resp.meta)
        self.cached[resp.name] = slot

    @staticmethod
    def _nbytes(resp: Response) -> int:
        _, dtype, shape = resp.meta[:3]
        return math.prod(shape) * dtype.itemsize

    def _span(self, name: str, phase: str, t0: float, args: Optional[dict] = None) -> float:
        """Record ``phase`` of ``name`` from ``t0`` to now; now."""
        now = self.timeline.now_us() if self.timeline else 0.0
        if self.timeline is not None:
            self.timeline.span(name, phase, t0, now, args)
        return now

    def _negotiated(self, req: Optional[Request], name: str, kind: str) -> None:
        if self.timeline is not None and req is not None:
            agreed = req.agreed_us or self.timeline.now_us()
            self.timeline.span(name, tl.NEGOTIATE + "_" + kind.upper(), req.submitted_us, agreed)
            self.timeline.span(name, tl.QUEUE, agreed, self.timeline.now_us())

    def _allreduce(self, group: list[Response]) -> None:
        _, dtype, _, op, _, prescale, postscale = group[0].meta
        reqs = [self.pending.pop(r.name, None) for r in group]
        for resp, req in zip(group, reqs):
            self._negotiated(req, resp.name, "allreduce")
        sizes = [math.prod(r.meta[2]) for r in group]
        total = sum(sizes)
        t0 = self.timeline.now_us() if self.timeline else 0.0
        alone = len(group) == 1 and reqs[0] is not None and reqs[0].out is not None and reqs[0].out.flags.c_contiguous
        # the scale factors ride on the copies into and out of the fusion buffer (one pass each)
        if alone:
            req = reqs[0]
            buf = req.out.reshape(-1)  # type: ignore[union-attr]
            if req.out is not req.array or prescale != 1.0:
                _scale_into(buf, req.array.reshape(-1), prescale)  # type: ignore[union-attr]
        else:
            raw = self._fusion if self._fusion.nbytes >= total * dtype.itemsize else np.empty(total * dtype.itemsize, np.uint8)
            self._fusion = raw
            buf = raw[:total * dtype.itemsize].view(dtype)
            if prescale == 1.0 and None not in reqs:  # one call packs them all
                np.concatenate([req.array.reshape(-1) for req in reqs], out=buf)  # type: ignore[union-attr]
            else:
                off = 0
                for n, req in zip(sizes, reqs):
                    if req is not None:
                        _scale_into(buf[off:off + n], req.array.reshape(-1), prescale)  # type: ignore[union-attr]
                    else:  # this rank joined: a value that changes nobody's result
                        buf[off:off + n] = _identity(op, dtype)
                    off += n
        if len(group) > 1:
            self.fused_calls += 1
        t1 = self._span_all(group, tl.MEMCPY_IN, t0) if not alone else t0
        self.comm.Allreduce(MPI.IN_PLACE, buf, OPS[op])
        if alone and postscale != 1.0:
            _scale_into(buf, buf, postscale)
        t2 = self._span_all(group, "ALLREDUCE", t1, {"algorithm": last_choice.algorithm, "tensors": len(group),
                                                     "bytes": total * dtype.itemsize})
        off = 0
        for n, resp, req in zip(sizes, group, reqs):
            if req is not None:
                if alone:
                    result = req.out
                else:
                    seg = buf[off:off + n].reshape(resp.meta[2])
                    result = req.out if req.out is not None else np.empty_like(seg)
                    _scale_into(result, seg, postscale)
                req.finish(result)
            off += n
        if not alone:
            self._span_all(group, tl.MEMCPY_OUT, t2)

    def _span_all(self, group: list[Response], phase: str, t0: float, args: Optional[dict] = None) -> float:
        if self.timeline is None:
            return 0.0
        now = self.timeline.now_us()
        for resp in group:
            self.timeline.span(resp.name, phase, t0, now, args)
        return now

    def _allgather(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "allgather")
        _, dtype, rest, *_ = resp.meta
        row = math.prod(rest)
        firsts = [int(e) if e is not None else 0 for e in resp.extras]  # type: ignore[union-attr]
        out = np.empty((sum(firsts),) + tuple(rest), dtype)
        send = req.array.reshape(-1) if req is not None else np.empty(0, dtype)  # type: ignore[union-attr]
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Allgatherv(send, [out.reshape(-1), [f * row for f in firsts]])
        self._span(resp.name, "ALLGATHER", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            req.finish((out, firsts))

    def _broadcast(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "broadcast")
        _, dtype, shape, _, root, *_ = resp.meta
        if req is None:
            buf = np.empty(shape, dtype)
        elif req.out is not None and req.out.flags.c_contiguous:
            buf = req.out
            if req.out is not req.array:
                np.copyto(buf, req.array)
        else:
            buf = np.array(req.array, copy=True, order="C")
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Bcast(buf.reshape(-1), root=root)
        self._span(resp.name, "BROADCAST", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            if req.out is not None and buf is not req.out:
                np.copyto(req.out, buf)
                buf = req.out
            req.finish(buf)

    def _alltoall(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "alltoall")
        _, dtype, rest, *_ = resp.meta
        row = math.prod(rest)
        splits = [list(e) if e is not None else [0] * self.size for e in resp.extras]  # type: ignore[union-attr]
        sends = splits[self.rank]
        recvs = [splits[s][self.rank] for s in range(self.size)]
        out = np.empty((sum(recvs),) + tuple(rest), dtype)
        send = req.array.reshape(-1) if req is not None else np.empty(0, dtype)  # type: ignore[union-attr]
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Alltoallv([send, [k * row for k in sends]], [out.reshape(-1), [k * row for k in recvs]])
        self._span(resp.name, "ALLTOALL", t0, {"algorithm": last_choice.algorithm})
        if req is not None:
            req.finish((out, recvs))

    def _reducescatter(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "reducescatter")
        _, dtype, shape, op, _, prescale, postscale = resp.meta
        rows = rows_of(shape[0] if shape else 0, self.size)
        row = math.prod(shape[1:])
        if req is not None:
            send = np.empty(math.prod(shape), dtype)
            _scale_into(send, req.array.reshape(-1), prescale)
        else:
            send = np.full(math.prod(shape), _identity(op, dtype), dtype)
        out = np.empty((rows[self.rank],) + tuple(shape[1:]), dtype)
        t0 = self.timeline.now_us() if self.timeline else 0.0
        self.comm.Reduce_scatter(send, out.reshape(-1), [k * row for k in rows], OPS[op])
        self._span(resp.name, "REDUCESCATTER", t0, {"algorithm": last_choice.algorithm})
        _scale_into(out, out, postscale)
        if req is not None:
            req.finish(out)

    def _call(self, resp: Response, joined: list[bool]) -> None:
        """Something every rank runs at the same point of the loop (making a process set's communicator)."""
        req = self.pending.pop(resp.name, None)
        if req is not None and req.fn is not None:
            try:
                result = req.fn()
            except Exception as exc:  # noqa: BLE001 - the caller's error
                req.finish(error=exc)
                return
            req.finish(result)

    def _barrier(self, resp: Response, joined: list[bool]) -> None:
        req = self.pending.pop(resp.name, None)
        self._negotiated(req, resp.name, "barrier")
        if req is not None:
            req.finish(None)
