"""The engine's failures: dead channels, control messages between ranks (aborts, skips, status questions),
broken communicators, aborts asked from other threads and stall reports."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .errors import (
    AbortedError,
    MismatchError,
    PeerFailureError,
    PeerLostError,
    PeerMismatchError,
    ProtocolError,
    PycollError,
    RemoteError,
    TimeoutError,
)
from .p2p_protocol import (
    ABORT_TAG,
    CHECK_KIND,
    GOODBYE_TAG,
    SKIP_TAG,
    STATUS_ASK,
    STATUS_TELL,
    CONTROL_CTX,
    P2P_SIG,
    Unexpected,
    Owner,
    RecvRequest,
    Request,
    Schedule,
    SendRequest,
    Sig,
    broken_from,
    drop_unreachable,
)

log = logging.getLogger("pycoll")


class FailureHandling:
    """How the engine learns of failures and tells the other ranks (mixed into ``p2p.Engine``)."""

    def _channel_failed(self, peer: int, cause: str) -> None:
        if peer in self._dead:
            return
        if peer in self._pulling:
            # A reply to its stream failed (an ack to a peer that reported another rank's death and exited): the
            # rest of the stream, that report included, is read first, by the pull on the stack, which fails it after.
            self._fail_after_pull.setdefault(peer, cause)
            return
        self._dead[peer] = cause
        self._readable.pop(peer, None)
        clean = getattr(self.channels[peer], "closed_by_peer", False)
        try:  # what it sent before it went (a goodbye, a report of another rank's death) comes first
            self._pull(peer)
        except PeerFailureError:
            pass
        clean = clean or peer in self._left
        log.info("channel to rank %d failed: %s", peer, cause)
        for req in self._sendq[peer]:
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        self._sendq[peer].clear()
        for key in [k for k in self._rdv_sends if k[0] == peer]:  # the peer never pulled them: the buffers are untouched
            self._rdv_data.pop(key, None)
            req = self._rdv_sends.pop(key)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        for key in [k for k in self._rdv_recvs if k[0] == peer]:
            req = self._rdv_recvs.pop(key)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        for req in [r for r in self._posted if r.peer == peer]:
            self._posted.remove(req)
            req.fail(req.owner.error(PeerFailureError, cause, [peer]))
        st = self._inbound[peer]
        if isinstance(st.target, RecvRequest):
            st.target.fail(st.target.owner.error(PeerFailureError, cause, [peer]))
        elif isinstance(st.target, Unexpected) and st.target.got < st.target.data.nbytes:
            # a message cut short before its receive was posted: the receive that took it meanwhile fails, and no
            # later one may take it (it would wait for the rest of a stream that has ended)
            cut = st.target
            self._unexpected[:] = [u for u in self._unexpected if u is not cut]
            if cut.waiter is not None:
                cut.waiter.fail(cut.waiter.owner.error(PeerFailureError, cause, [peer]))
        self._closed.add(peer)
        self._drop_lane(peer)
        # The fast paths never look at a closed channel again (its rings may be unmapped once it is closed).
        self._peers = [e for e in self._peers if e[0] != peer]
        self._inputs.pop(peer, None)
        try:
            self.channels[peer].close()
        except Exception:  # closing a broken channel is best effort
            pass
        if clean:
            self._left.add(peer)
            return  # a normal shutdown: it finished its part; only what still needed it (failed above) fails
        # It died: collectives of every communicator that has it cannot finish. Fail them now, naming it
        # (a collective that only waited for flags it already set finishes first).
        for sched in list(self._schedules):
            if not sched.done and peer in sched.owner.members:
                if not sched.gen.gi_running:
                    sched.advance()
                if not sched.done:
                    self.break_ctx(sched.owner.ctx & ~1, sched.owner.error(PeerFailureError, cause, [peer]), sched.owner.tag)

    def _on_control(self, src: int, msg: Unexpected) -> None:
        try:
            info = json.loads(bytes(msg.data).decode())
            base = int(info["ctx"])
        except (ValueError, KeyError, UnicodeDecodeError):
            raise ProtocolError(f"malformed control message from rank {src}", peers=[src]) from None
        peers = [info["rank"]] if info.get("rank") is not None else []
        if msg.tag == GOODBYE_TAG:
            self._left.add(src)
            return
        if msg.tag == STATUS_ASK:
            self._tell_status(src, info)
            return
        if msg.tag == STATUS_TELL:
            self._compare_calls(src, info.get("calls") or ())
            if info.get("quiet"):
                return
            self._asked.discard(src)
            log.warning("stall report: world rank %d answers: %s", src, info.get("doing") or "no pycoll operation in progress")
            return
        if msg.tag == SKIP_TAG:
            err = RemoteError(
                f"rank {info.get('rank')} rejected its arguments and skipped this call ({info.get('cause', '?')})",
                op=info.get("op"),
                peers=peers,
            )
            err.contained = True  # type: ignore[attr-defined]  # only this call fails; nothing to abort
            key = (base, int(info.get("seq", -1)))
            for sched in self._schedules:
                if (sched.owner.ctx, sched.owner.tag) == key:
                    sched.fail(self._with_rank(err, sched.owner))
                    return
            self._skipped[key] = err
            return
        lost = [int(q) for q in info.get("lost") or ()]
        if lost:  # a peer died: say which, so every survivor names the same dead rank
            dead = ", ".join(map(str, lost))
            err = PeerLostError(
                f"rank {dead} failed: rank {info.get('rank')} saw it in {info.get('op', '?')} ({info.get('cause', '?')})",
                peers=lost,
            )
        elif info.get("error") in ("MismatchError", "PeerMismatchError"):  # a mismatch: every rank raises one
            cause = str(info.get("cause", "?")).replace("this rank called", f"rank {info.get('rank')} called")
            if info.get("error") == "MismatchError":  # a relayed report already says who found it
                cause = f"{cause} (found by rank {info.get('rank')})"
            err = PeerMismatchError(cause, peers=sorted(set(peers + list(info.get("ranks") or ()))))
        else:
            err = RemoteError(
                f"rank {info.get('rank')} failed in {info.get('op', '?')} ({info.get('error', 'error')}: {info.get('cause', '?')})",
                peers=peers,
            )
        if info.get("error") == "TimeoutError":
            err.timed_out = True  # type: ignore[attr-defined]  # stalled ranks here name whom they still wait for
        members = [int(m) for m in info.get("members") or ()]
        if lost:  # src only passes the news on: if its own stream ends next, it was no death (``witnessed``)
            self._messengers.setdefault(src, set()).update(members[q] for q in lost if 0 <= q < len(members))
        for q in lost:  # a witness saw it die: stop waiting on it everywhere, naming it
            w = members[q] if 0 <= q < len(members) else -1
            if w != self.rank and w in self.channels and w not in self._dead:
                self._channel_failed(w, f"rank {q} failed (rank {info.get('rank')} saw it: {info.get('cause', '?')})")
        self.break_ctx(base & ~1, err, int(info.get("seq", -1)))
        if lost and base & ~1 not in self._told and self.rank in members:
            # Pass a death on before this rank can raise (and perhaps exit): whoever sees this rank's
            # stream end has then heard which rank really died.
            self._told.add(base & ~1)
            fwd = Owner(info.get("op", "?"), base | 1, members.index(self.rank), lambda w: w, members, tag=int(info.get("seq", -1)))
            self._tell_members(fwd, err, ABORT_TAG, base & ~1)

    def _is_broken_for(self, owner: Owner) -> bool:
        """Calls numbered before the failed one finish normally; that one, later ones and p2p fail (``broken_from``;
        an owner's tag is its call number, -1 for point-to-point)."""
        return broken_from(self._broken, owner.ctx, owner.tag)

    def break_ctx(self, base: int, err: PycollError, seq: int) -> None:
        """Fail what is pending on a communicator from collective ``seq`` on (all of it if seq < 0)."""
        entry = self._broken.get(base)
        if entry is not None and (entry[1] < 0 or 0 <= entry[1] <= seq):
            return  # already broken from this call on
        self._broken[base] = (err, seq)  # a failure in an earlier call than the one known: from there on
        drop_unreachable(self._unexpected, self._broken, self.tags_per_call)
        broken = [s for s in self._schedules if self._is_broken_for(s.owner)]
        stalled = [self._stalled(err, s) for s in broken]  # before their receives fail below
        for req in [r for r in self._posted if self._is_broken_for(r.owner)]:
            self._posted.remove(req)
            req.fail(self._with_rank(err, req.owner))
        for sched, own in zip(broken, stalled):
            sched.fail(own or self._with_rank(err, sched.owner))

    @staticmethod
    def _pending_peers(waits: Iterable[Any]) -> list[int]:
        """World ranks that the given waits still need something from."""
        flat = [x for w in waits for x in getattr(w, "requests", (w,))]
        return sorted({r.peer for r in flat if not r.done and r.peer >= 0})

    def _stalled(self, err: PycollError, sched: Schedule) -> Optional[PycollError]:
        """After another rank timed out: this rank's own TimeoutError if it still waits for someone else."""
        if not getattr(err, "timed_out", False):
            return None
        waiting = [p for p in self._pending_peers(sched.waiting) if p not in {sched.owner.members[q] for q in err.peers}]
        if not waiting:
            return None
        owner = sched.owner
        ranks = ", ".join(str(owner.to_comm(p)) for p in waiting)
        return owner.error(TimeoutError, f"stalled waiting for ranks {ranks} ({err.cause})", waiting)

    @staticmethod
    def _with_rank(err: PycollError, owner: Owner) -> PycollError:
        """A peer's report as this rank's error in ``owner``'s operation (its op and sequence number)."""
        if isinstance(err, RemoteError) and err.rank is None:
            out = type(err)(err.cause, op=owner.op, rank=owner.rank, peers=err.peers)
            out.contained = getattr(err, "contained", False)  # type: ignore[attr-defined]
            return out
        if isinstance(err, AbortedError) and err.op != owner.op:  # name the call that was waiting
            return AbortedError(err.cause, op=owner.op, rank=owner.rank)
        return err

    def poll_reports(self) -> None:
        """Read what peers sent (reports of failures among them) without advancing any schedule."""
        for peer in self._order:
            if peer not in self._dead:
                try:
                    self._pull(peer)
                except PeerFailureError as err:
                    self._channel_failed(peer, err.cause)

    def dead_peers(self) -> dict[int, str]:
        """World ranks whose channel failed, with the reason."""
        return self._dead

    def unexpected_in(self, ctx: int, lo: int, hi: int) -> Optional[tuple[int, Sig]]:
        """(source, signature) of the first buffered unmatched message on ``ctx`` with lo <= tag < hi."""
        for u in self._unexpected:
            if u.ctx == ctx and lo <= u.tag < hi:
                return u.src, u.sig
        return None

    def broken_since(self, ctx: int) -> int:
        """The call number from which the communicator is broken (-1: all of it, 0: not broken)."""
        entry = self._broken.get(ctx & ~1)
        return 0 if entry is None else entry[1]

    def broken_here(self, ctx: int) -> bool:
        """Whether a failure broke the communicator of context ``ctx`` (cheap while none broke)."""
        broken = self._broken
        return bool(broken) and ctx & ~1 in broken

    def broken(self, ctx: int) -> Optional[PycollError]:
        entry = self._broken.get(ctx & ~1)
        return entry[0] if entry is not None else None

    def witnessed(self, err: PycollError, owner: Owner) -> PycollError:
        """``err``, a lost connection in ``owner``'s operation; or, where the peers it names had reported that
        another rank died before their streams ended (they exited after passing the news on, on this or another
        communicator), an error naming the rank that really died, as this operation's."""
        if type(err) is not PeerFailureError or not err.peers:
            return err
        known = self.broken(owner.ctx)
        if isinstance(known, PeerLostError) and not set(known.peers) & set(err.peers):
            return self._with_rank(known, owner)
        members = list(owner.members)
        named = [members[q] for q in err.peers if 0 <= q < len(members)]
        if not named or not all(w in self._messengers for w in named):
            return err
        dead = sorted({members.index(w) for m in named for w in self._messengers[m] if w in members} - set(err.peers))
        if not dead:
            return err
        who = ", ".join(map(str, dead))
        return PeerLostError(f"rank {who} failed: rank {err.peers[0]} reported it before its own connection ended "
                             f"({err.cause})", op=owner.op, rank=owner.rank, peers=dead)

    def _tell_members(self, owner: Owner, err: PycollError, tag: int, ctx: int) -> list[SendRequest]:
        info = {"ctx": ctx, "seq": owner.tag, "op": owner.op, "rank": owner.rank, "error": type(err).__name__, "cause": err.cause,
                "members": list(owner.members)}
        if isinstance(err, PeerFailureError) and err.peers:  # the ranks that died (a lost peer's report passes them on)
            info["lost"] = list(err.peers)
        elif isinstance(err, MismatchError):
            info["ranks"] = list(err.peers)
        body = json.dumps(info).encode()
        payload = np.frombuffer(body, np.uint8)
        return [
            self.isend(p, payload, CONTROL_CTX, tag, P2P_SIG, owner)
            for p in owner.members
            if p != self.rank and p not in self._dead
        ]

    def notify_skip(self, owner: Owner, err: PycollError) -> None:
        """Tell the other members that this rank will not take part in collective ``owner.tag``."""
        self._tell_members(owner, err, SKIP_TAG, owner.ctx)

    def abort(self, owner: Owner, err: PycollError) -> None:
        """Tell the communicator's other members that this operation failed here, then break it locally."""
        base = owner.ctx & ~1
        if getattr(err, "contained", False):
            return
        if base not in self._told:
            # Tell the others even if a peer's report broke the communicator here: a rank's report then always
            # precedes its exit on every stream, so no survivor mistakes a survivor's exit for the failure.
            self._told.add(base)
            self._tell_members(owner, err, ABORT_TAG, base)
            self._broken.setdefault(base, (err, owner.tag))
            drop_unreachable(self._unexpected, self._broken, self.tags_per_call)
        self.flush(1.0, delivered=True)  # best effort: a peer that does not drain is probably dead
        for sched in self._schedules:
            if self._is_broken_for(sched.owner):
                sched.fail(err)

    def request_abort(self, base: int, err: PycollError, members: Sequence[int], seq: int = -1) -> bool:
        """Break communicator ``base`` (world ranks ``members``) from its collective ``seq`` on (every call where
        ``seq`` < 0), from any thread: at once if no thread is waiting in this engine (True), else the waiting
        thread does it within one sleep (at most 50 ms)."""
        self._abort_requests.append((base, err, list(members), seq))
        if self.lock.acquire(blocking=False):
            try:
                self.take_aborts()
            finally:
                self.lock.release()
            return True
        return False

    def take_aborts(self) -> None:
        """Carry out the aborts other threads asked for: tell the peers, fail everything pending on the communicator."""
        while self._abort_requests:
            base, err, members, seq = self._abort_requests.popleft()
            rank = err.rank if err.rank is not None else -1
            owner = Owner(err.op or "Abort", base | 1, rank, lambda w: w, members, tag=seq)
            self._told.add(base)
            reqs = self._tell_members(owner, err, ABORT_TAG, base)
            self.break_ctx(base, err, seq)  # seq < 0: earlier calls too, nothing on this communicator completes any more
            deadline = time.monotonic() + 1.0  # best effort, as in abort()
            told = {r.peer for r in reqs}
            while time.monotonic() < deadline and not (
                all(r.done for r in reqs) and not any(self.channels[p].unsafe_to_exit() for p in told if p not in self._dead)
            ):
                if not self.progress():
                    time.sleep(0.0005)

    def _report_stall(self, owner: Owner, pending: Iterable[Request], waited: float) -> None:
        """Log who has not joined ``owner``'s operation and what they were last seen in; ask them what they do."""
        waiting = [p for p in self._pending_peers(pending) if p != self.rank]
        parts = []
        for p in waiting:
            seen = self._seen.get(p)
            if seen is None:
                where = "no message from it yet"
            elif seen[0] & ~1 == owner.ctx & ~1 and seen[1] >= 0:
                where = f"last seen in call #{seen[1] // self.tags_per_call} of this communicator"
            else:
                where = "last seen in another communicator" + (f" (call #{seen[1] // self.tags_per_call})" if seen[1] >= 0 else " (point-to-point)")
            if p in self._asked:
                where += "; it has not answered the last status question (busy outside pycoll?)"
            parts.append(f"rank {owner.to_comm(p)} (world {p}): {where}")
        log.warning(
            "stall: %s on world rank %d (rank %d of its communicator) has waited %.0f s; not joined: %s",
            owner.op, self.rank, owner.rank, waited, "; ".join(parts) or "no rank (waiting on local work)",
        )
        self._ask(owner, pending, quiet=False)

    def _ask(self, owner: Owner, pending: Iterable[Request], quiet: bool) -> None:
        """Ask the ranks ``owner``'s operation waits for what they are doing (``quiet``: only to spot a mismatch)."""
        body = np.frombuffer(json.dumps({"ctx": owner.ctx & ~1, "op": owner.op, "rank": owner.rank, "quiet": quiet}).encode(), np.uint8)
        for p in self._pending_peers(pending):
            if p != self.rank and p not in self._dead and p in self.channels:
                if not quiet:
                    self._asked.add(p)
                self.isend(p, body, CONTROL_CTX, STATUS_ASK, P2P_SIG, owner)

    def _compare_calls(self, src: int, calls: Iterable) -> None:
        """A peer said which calls it is in: one of ours with the same number but another signature is a mismatch
        (both sides wait, so no message would ever show it: rooted calls whose roots disagree, say)."""
        theirs = {(int(c[0]), int(c[1])): Sig(*(int(v) for v in c[2])) for c in calls if len(c) == 3 and len(c[2]) == 6}
        for sched in list(self._schedules):
            own = sched.owner
            sig = theirs.get((own.ctx, own.tag))
            if not sched.done and own.sig is not None and sig is not None and sig != own.sig and src in own.members:
                sched.fail(own.error(
                    MismatchError, f"rank {own.to_comm(src)} called {own.describe(sig)}, this rank called {own.describe(own.sig)}", [src]
                ))

    def _tell_status(self, src: int, info: dict) -> None:
        """Answer a stalled peer: the operations this rank waits in, and for whom."""
        doing = []
        for w in self._waits:
            scheds = [s for s in self._schedules if s.owner is w]
            pending = [x for s in scheds for x in s.waiting]
            who = [p for p in self._pending_peers(pending) if p != self.rank]
            doing.append(f"in {w.op} (rank {w.rank} of its communicator)" + (f", waiting for world ranks {who}" if who else ""))
        running = [s.owner.op for s in self._schedules if s.owner not in self._waits]
        if running:
            doing.append("started without waiting: " + ", ".join(running))
        calls = [[s.owner.ctx, s.owner.tag, list(s.owner.sig)] for s in self._schedules if s.owner.sig is not None and s.owner.tag >= 0]
        body = json.dumps({"ctx": int(info.get("ctx", 0)), "rank": self.rank, "doing": "; ".join(doing), "calls": calls,
                           "quiet": bool(info.get("quiet"))}).encode()
        owner = Owner("stall report", CONTROL_CTX, self.rank, lambda w: w, (), tag=-1)
        self.isend(src, np.frombuffer(body, np.uint8), CONTROL_CTX, STATUS_TELL, P2P_SIG, owner)

    def _check_strays(self) -> None:
        """Fail a waiting collective when a peer sent a message for the same call number with another signature:
        it called something else (a message nobody will ever receive), whatever the algorithms' meeting points."""
        for sched in self._schedules:
            own = sched.owner
            if sched.done or own.sig is None or own.tag < 0:
                continue
            lo, hi = own.tag * self.tags_per_call, (own.tag + 1) * self.tags_per_call
            for u in self._unexpected:
                if u.ctx == own.ctx and lo <= u.tag < hi and u.sig != own.sig and u.sig.kind != CHECK_KIND:
                    sched.fail(own.error(
                        MismatchError, f"rank {own.to_comm(u.src)} called {own.describe(u.sig)}, this rank called {own.describe(own.sig)}",
                        [u.src],
                    ))
                    break

    def _check_liveness(self) -> None:
        for peer, ch in self.channels.items():
            if peer in self._dead:
                continue
            reason = ch.check_alive()
            if reason is not None:
                self._channel_failed(peer, reason)  # drains what it sent before it went away

    def _timed_out(self, owner: Owner, timeout: float, pending: Iterable[Request]) -> None:
        pending = [x for r in pending for x in getattr(r, "requests", (r,))]  # waits on any of several groups
        waiting_on = self._pending_peers(pending)
        sends = sorted({r.peer for r in pending if isinstance(r, SendRequest) and not r.done})
        what = f"waiting for ranks {', '.join(str(owner.to_comm(p)) for p in waiting_on)}" if waiting_on else "waiting"
        extra = f" (sends to ranks {', '.join(str(owner.to_comm(p)) for p in sends)} not drained)" if sends else ""
        err = owner.error(TimeoutError, f"Timed out after {timeout:g} s {what}{extra}", waiting_on)
        self.abort(owner, err)
        raise err
