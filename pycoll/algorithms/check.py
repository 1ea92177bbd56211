"""Optional call checking (PYCOLL_CHECK_CALLS): ranks compare call signatures before any data moves."""

from __future__ import annotations

import numpy as np

from ..config import bool_param
from ..errors import MismatchError
from ..p2p_protocol import Sig
from .base import Schedule, Steps

CHECK_CALLS = bool_param(
    "PYCOLL_CHECK_CALLS",
    False,
    "Set to 1 to compare every collective's arguments across ranks before it moves data (log2(p) extra small messages per call); "
    "every rank then raises MismatchError on a mismatch, no buffer is touched, and the communicator stays usable.",
)

CHECK_KIND = 15  # header kind of the checking messages
_SIG, _DET, _CUL, _CSIG, _DSIG = slice(0, 6), 6, 7, slice(8, 14), slice(14, 20)


def verify_call(st: Steps, sig: Sig, describe) -> Schedule:
    """Dissemination exchange: after ceil(log2 p) rounds every rank has heard, directly or not, from all.

    Each message carries the sender's signature and the first disagreement anyone has seen
    (who found it, whose call differed, and both signatures), so all ranks reach the same verdict.
    """
    p, r = st.size, st.rank
    state = np.zeros(20, np.uint64)
    state[_SIG] = [v & 0xFFFFFFFFFFFFFFFF for v in sig]
    incoming = np.empty_like(state)
    wire = Sig(kind=CHECK_KIND, count=state.size)
    distance = 1
    while distance < p:
        outgoing = state.copy()
        yield (st.send((r + distance) % p, outgoing, sig=wire), st.recv((r - distance) % p, incoming, sig=wire))
        if state[_DET] == 0:
            if not np.array_equal(incoming[_SIG], state[_SIG]):
                state[_DET], state[_CUL] = r + 1, (r - distance) % p + 1
                state[_CSIG], state[_DSIG] = incoming[_SIG], state[_SIG]
            elif incoming[_DET]:
                state[_DET:] = incoming[_DET:]
        distance *= 2
    if state[_DET]:
        finder, culprit = int(state[_DET]) - 1, int(state[_CUL]) - 1
        theirs = describe(Sig(*(int(v) for v in state[_CSIG])))
        found = describe(Sig(*(int(v) for v in state[_DSIG])))
        err = MismatchError(
            f"ranks disagree: rank {culprit} called {theirs}, rank {finder} called {found}"
            + (f"; this rank called {describe(sig)}" if r not in (culprit, finder) else ""),
            op=st.owner.op,
            rank=r,
            peers=sorted({culprit, finder} - {r}),
        )
        err.contained = True  # type: ignore[attr-defined]  # every rank raises it; nothing to abort
        raise err
