"""Numba intrinsics for compiled code that shares memory with other processes: ordered loads and stores, the spin
hint, raw byte pointers, calls into libc by address. Importing this module needs Numba."""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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
