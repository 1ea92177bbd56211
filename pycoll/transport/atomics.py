"""Numba intrinsics for compiled code that shares memory with other processes: ordered loads and stores, the spin
hint, raw byte pointers, calls into libc by address, copies to and from another process. Importing this module needs
Numba."""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..pages import BOUNCE_BYTES, PAGE, SHORT_DISTANCE

_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _word_pointer(context, builder, sig, args):
    aryty = sig.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])


@intrinsic
def load_acquire(typingctx, words, index):
    """words[index] read with acquire order: never hoisted out of a spin loop."""

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_word_pointer(context, builder, sig, args), "acquire", 8)

    return types.uint64(words, index), codegen


@intrinsic
def store_seq_cst(typingctx, words, index, value):
    """words[index] = value, sequentially consistent: earlier writes are visible first, later reads wait."""

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store_atomic(value, _word_pointer(context, builder, sig, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(words, index, value), codegen


@intrinsic
def cpu_relax(typingctx):
    """The x86 PAUSE hint inside a spin loop (a no-op elsewhere)."""

    def codegen(context, builder, sig, args):
        if _X86:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def byte_pointer(typingctx, arr, offset):
    """A uint8 pointer ``offset`` bytes into ``arr``'s data."""

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [args[1]])

    return types.CPointer(types.uint8)(arr, types.intp), codegen


@intrinsic
def call_c0(typingctx, fn):
    """Call the C function at address ``fn`` (no arguments; its int result, as int64), such as libc's sched_yield.
    The address is an argument, never a constant, so the compiled code stays valid in every process."""

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        ptr = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), fnty.as_pointer())
        return builder.sext(builder.call(ptr, []), ir.IntType(64))

    return types.int64(fn), codegen


@intrinsic
def address_pointer(typingctx, address):
    """A uint8 pointer to the integer ``address`` (memory of this process, for ``carray``)."""

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.inttoptr(value, ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(address), codegen


@intrinsic
def call6(typingctx, fn, a, b, c, d, e, f):
    """Call the C function at address ``fn`` with six 64-bit integer arguments; its 64-bit result. The address is an
    argument, never a constant, so the compiled code stays cacheable across processes."""

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:])]
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)] * 6)
        ptr = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), fnty.as_pointer())
        return builder.call(ptr, vals)

    return types.int64(fn, a, b, c, d, e, f), codegen


@njit(inline="always", cache=True, nogil=True)
def copy_at(dst, src, n):
    """``n`` bytes from address ``src`` to address ``dst`` (this process), in a loop LLVM vectorizes: not libc's
    memcpy, whose ``rep movsb`` runs about 10x slower at the short distance (``pages.short_distance``) from 4 KiB up."""
    d = carray(address_pointer(dst), n)
    s = carray(address_pointer(src), n)
    for i in range(n):
        d[i] = s[i]


@njit(inline="always", cache=True, nogil=True)
def _vm_copy(fn, pid, local, remote, n, iov):
    """``n`` bytes between ``local`` and ``remote`` in ``pid`` by ``fn``, repeated while the kernel copies part."""
    done = 0
    while done < n:
        iov[0] = local + done
        iov[1] = n - done
        iov[2] = remote + done
        iov[3] = n - done
        at = iov.ctypes.data
        got = call6(fn, pid, at, 1, at + 16, 1, 0)
        if got <= 0:
            return False
        done += got
    return True


@njit(cache=True, nogil=True)
def cross_copy(fn, pid, local, remote, n, reading, bounce):
    """Copy ``n`` bytes between ``local`` in this process and ``remote`` in process ``pid`` by ``fn`` (the address of
    libc's process_vm_readv when ``reading``, else of _writev); False if a call failed (the caller's Python path
    finds out why). Where ``bounce`` is set (``CrossMemory.bounces``: this CPU copies slowly at that distance), a
    copy whose destination lies a few bytes past its source within a page goes through a bounce buffer half a page
    from both (``pages.short_distance``)."""
    local, remote, n = np.int64(local), np.int64(remote), np.int64(n)
    iov = np.empty(4, np.int64)
    dist = ((local - remote) if reading else (remote - local)) & (PAGE - 1)
    if not bounce or dist == 0 or dist >= SHORT_DISTANCE:
        return _vm_copy(fn, pid, local, remote, n, iov)
    chunk = min(n, BOUNCE_BYTES)
    staging = np.empty(chunk + PAGE, np.uint8)
    b = np.int64(staging.ctypes.data)
    b += (remote + PAGE // 2 - b) & (PAGE - 1)
    done = 0
    while done < n:
        m = min(chunk, n - done)
        if reading:
            if not _vm_copy(fn, pid, b, remote + done, m, iov):
                return False
            copy_at(local + done, b, m)
        else:
            copy_at(b, local + done, m)
            if not _vm_copy(fn, pid, b, remote + done, m, iov):
                return False
        done += m
    return True
