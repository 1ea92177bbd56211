"""The compiled point-to-point path's access to memory by address: Numba intrinsics that load, store and swap int64
words at raw addresses, and the lane helpers built on them (a lane is one peer's pair of rings, described by int64
words at address ``d``: ``p2p_lane.L_*``; ``Engine._build_lanes`` fills them). Importing this module needs Numba."""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .p2p_lane import L_BELL, L_BOUNCE, L_FUTEX, L_KILL, L_PID, L_READV, L_SYSCALL, L_YIELD
from .transport.atomics import call6, cpu_relax, cross_copy

TAIL_AT, HEAD_AT = 0, 64  # byte offsets of a ring's writer and reader counts in its header


def int_arg(context, builder, sig, args, i):
    return context.cast(builder, args[i], sig.args[i], types.int64)


def _pointer(context, builder, sig, args, bits=64):
    """The first argument, an address, as a pointer to a ``bits``-bit integer."""
    return builder.inttoptr(int_arg(context, builder, sig, args, 0), ir.IntType(bits).as_pointer())


@intrinsic
def word(typingctx, addr):
    """The int64 at address ``addr`` (a plain load)."""

    def codegen(context, builder, sig, args):
        return builder.load(_pointer(context, builder, sig, args))

    return types.int64(addr), codegen


@intrinsic
def put_word(typingctx, addr, value):
    """Store the int64 ``value`` at address ``addr`` (a plain store)."""

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig, args)
        builder.store(int_arg(context, builder, sig, args, 1), ptr)
        return context.get_dummy_value()

    return types.void(addr, value), codegen


@intrinsic
def acquire(typingctx, addr):
    """The int64 at ``addr`` read with acquire order (never hoisted out of a spin loop)."""

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig, args)
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(addr), codegen


@intrinsic
def publish(typingctx, addr, value):
    """Store ``value`` at ``addr``, sequentially consistent: the bytes written before it are visible first."""

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig, args)
        builder.store_atomic(int_arg(context, builder, sig, args, 1), ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(addr, value), codegen


@intrinsic
def bump32(typingctx, addr):
    """Add one to the 32-bit word at ``addr`` (atomically)."""

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig, args, 32)
        builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(32), 1), "seq_cst")
        return context.get_dummy_value()

    return types.void(addr), codegen


@intrinsic
def cas(typingctx, addr, expected, new):
    """Compare the int64 at ``addr`` with ``expected`` and, if equal, store ``new`` (atomically): 1 if stored."""

    def codegen(context, builder, sig, args):
        ptr = _pointer(context, builder, sig, args)
        res = builder.cmpxchg(ptr, int_arg(context, builder, sig, args, 1), int_arg(context, builder, sig, args, 2),
                              "seq_cst", "seq_cst")
        return builder.zext(builder.extract_value(res, 1), ir.IntType(64))

    return types.int64(addr, expected, new), codegen


@njit(inline="always", cache=True, nogil=True)
def wake(d):
    """Wake the peer if it sleeps on its doorbell (its flag word set): bump the futex word, then a futex wake."""
    bell = word(d + 8 * L_BELL)
    if bell != 0 and acquire(bell) != 0:
        bump32(bell + 8)
        fn = word(d + 8 * L_SYSCALL)
        if fn != 0:
            call6(fn, word(d + 8 * L_FUTEX), bell + 8, 1, 0x7FFFFFFF, 0, 0)


@njit(inline="always", cache=True, nogil=True)
def relax(d):
    """One pause of a spin: the PAUSE hint, or where ranks outnumber cores a sched_yield (the core to a rank with
    work)."""
    nr = word(d + 8 * L_YIELD)
    fn = word(d + 8 * L_SYSCALL)
    if nr >= 0 and fn != 0:
        call6(fn, nr, 0, 0, 0, 0, 0)
    else:
        cpu_relax()


@njit(inline="always", cache=True, nogil=True)
def pull(d, dst, addr, n):
    """Copy ``n`` bytes at ``addr`` in the peer into ``dst`` by process_vm_readv; False if a call failed (the
    Python path finds out why)."""
    fn = word(d + 8 * L_READV)
    return fn != 0 and cross_copy(fn, word(d + 8 * L_PID), dst, addr, n, True, word(d + 8 * L_BOUNCE) != 0)


@njit(inline="always", cache=True, nogil=True)
def peer_alive(d):
    """False once the peer's pid is gone (kill(pid, 0) fails); True where that cannot be asked."""
    fn = word(d + 8 * L_SYSCALL)
    nr = word(d + 8 * L_KILL)
    return fn == 0 or nr <= 0 or call6(fn, nr, word(d + 8 * L_PID), 0, 0, 0, 0) == 0
