"""Layout of a point-to-point lane (the words that name one peer's pair of rings for the compiled kernels) and the
kernels' status codes: shared by ``p2p_kernels`` (Numba) and the engine and fast path, which must not import Numba."""

from __future__ import annotations

from .transport.shm import SPLIT_SLOT_BYTES, SPLIT_SLOTS, SPLIT_TABLE  # noqa: F401  (the kernels' layout)

HEADER_BYTES = 64
# eager_take: a frame was taken; nothing arrived in the spin; the next frame is not ours; the next frame announces
# a rendezvous of ours (left in the ring: its address is header word 4, its id word 5). take_next besides: an
# acknowledgement of one of this rank's rendezvous was consumed; an announced message was pulled and consumed
TAKEN, EMPTY, OTHER, ANNOUNCED, ACKED, PULLED = 0, 1, 2, 3, 4, 5
# take's statuses besides: an announced message was pulled but its acknowledgement is the caller's to send (the
# ring back was full or had frames queued ahead); the send of an exchange did not fit
PULLED_ACK_DUE, NOT_SENT = 6, 7

# A lane's int64 words at its address (``Engine._build_lanes`` fills them); results besides the status go back in
# its output words.
(L_OUT, L_OUT_CAP, L_OUT_HDR, L_IN, L_IN_CAP, L_IN_HDR, L_BELL, L_SYSCALL, L_FUTEX, L_PID, L_READV, L_META, L_RTS,
 L_ACK, L_YIELD) = range(15)
L_GOT_TAG, L_GOT_BYTES, L_GOT_RID, L_GOT_ADDR = 16, 17, 18, 19
# the address of libc's process_vm_writev where the sender may push part of a large rendezvous (0: it never does);
# the kill system call's number (is the peer alive?); 1 where copies at the short distance bounce (CrossMemory.bounces)
L_WRITEV, L_KILL, L_BOUNCE = 20, 21, 22
LANE_WORDS = 32

# A split rendezvous (transport.shm's split table, in the ring the announcement travels): the slot's words, from its
# address: the state (id * 4 + one of FREE, OFFERED, ACTIVE, PREPARING), the size, the claims (chunks the receiver
# took from the front, plus those the sender took from the back times 2**32), the chunks the sender has written, the
# receiver's buffer address, and a flag the sender raises when a write failed.
SPLIT_FREE, SPLIT_OFFERED, SPLIT_ACTIVE, SPLIT_PREPARING = 0, 1, 2, 3
S_STATE, S_BYTES, S_CLAIMS, S_PUSHED, S_DST, S_FAILED = 0, 8, 16, 24, 32, 40
SPLIT_CHUNK = 128 << 10
SPLIT_MIN_BYTES = 256 << 10  # two chunks at least

# exchange_rdv's state bits: the send was announced; acknowledged; the receive completed; its acknowledgement is due;
# an acknowledgement of another rendezvous was consumed (its id in the source lane's L_GOT_RID); the receive was pulled
ANNOUNCED_OWN, SENT, RECEIVED, ACK_DUE, ACKED_OTHER, PULLED_IN = 1, 2, 4, 8, 16, 32
