"""torch.distributed's data-movement collectives on pycoll: broadcast, all-gather, gather, scatter and all-to-all,
in their list, single-tensor and coalesced forms."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..buffers import IN_PLACE
from ..errors import InvalidArgumentError
from . import tensors as T
from .work import PycollWork, all_of


class DataMovement:
    """The group's collectives that move data: broadcast, the gathers, scatter and all-to-all (mixed into
    ``backend.ProcessGroupPycoll``)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "broadcast"
        t = self._one(name, tensors)
        root = self._root(name, (opts or dist.BroadcastOptions()).rootRank)
        at = self._place(name, [t])
        buf = T.Staged(t)
        return self._submit(name, lambda: [self.comm.Ibcast(buf.arr, root, stream=at.stream)],
                            lambda: (buf.done(), tensors)[1], at=at, blocking=lambda: self.comm.Bcast(buf.arr, root),
                            nbytes=T.tensor_nbytes(t), opts=opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "all_gather"
        t = self._one(name, inputs)
        if len(outputs) != 1:
            raise InvalidArgumentError(f"takes one output list, got {len(outputs)}", op=name, rank=self.comm.rank)
        outs = self._checked_list(name, outputs[0], t.dtype, "tensor_list")
        counts = [o.numel() for o in outs]
        if counts[self.comm.rank] != t.numel():
            raise InvalidArgumentError(
                f"tensor has {t.numel()} elements, tensor_list[{self.comm.rank}] {counts[self.comm.rank]}", op=name, rank=self.comm.rank
            )
        at = self._place(name, [t, *outs])
        send = T.Staged(t)
        recv = T.flat_empty(sum(counts), t)
        if len(set(counts)) == 1:
            start = lambda: [self.comm.Iallgather(send.arr, T.buffer(recv), stream=at.stream)]  # noqa: E731
        else:
            start = lambda: [self.comm.Iallgatherv(send.arr, T.vector(T.buffer(recv), counts), stream=at.stream)]  # noqa: E731
        return self._submit(name, start, lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PycollWork:  # noqa: A002
        name = "all_gather_into_tensor"
        self._tensor(name, output, "output")
        self._tensor(name, input, "input")
        self._dtypes(name, [input], output.dtype)
        if output.numel() != input.numel() * self.comm.size:
            raise InvalidArgumentError(
                f"output has {output.numel()} elements, not {self.comm.size} x input's {input.numel()}", op=name, rank=self.comm.rank
            )
        at = self._place(name, [output, input])
        if T.is_own_block(input, output, self.comm.rank):  # FSDP2 gathers from its slice of the output: in place
            whole = T.Staged(output)
            return self._submit(name, lambda: [self.comm.Iallgather(IN_PLACE, whole.arr, stream=at.stream)],
                                lambda: (whole.done(), [output])[1], at=at,
                                blocking=lambda: self.comm.Allgather(IN_PLACE, whole.arr), nbytes=T.tensor_nbytes(output), opts=opts)
        send, buf = T.Staged(input), T.Staged(output, load=False)
        return self._submit(name, lambda: [self.comm.Iallgather(send.arr, buf.arr, stream=at.stream)],
                            lambda: (buf.done(), [output])[1], at=at, blocking=lambda: self.comm.Allgather(send.arr, buf.arr),
                            nbytes=T.tensor_nbytes(output), opts=opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        """torch's layout: ``outputs[rank][k]`` receives rank ``rank``'s ``inputs[k]``."""
        name = "all_gather_coalesced"
        if len(outputs) != self.comm.size:
            raise InvalidArgumentError(f"output_tensor_lists has {len(outputs)} lists, not one per rank ({self.comm.size})",
                                       op=name, rank=self.comm.rank)
        for q, row in enumerate(outputs):
            if len(row) != len(inputs):
                raise InvalidArgumentError(f"output_tensor_lists[{q}] has {len(row)} tensors for {len(inputs)} inputs",
                                           op=name, rank=self.comm.rank)
        per_input = [[row[k] for row in outputs] for k in range(len(inputs))]
        works = [self.allgather([per_input[k]], [t], opts) for k, t in enumerate(inputs)]
        return PycollWork(all_of([w.get_future() for w in works], outputs))

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        return self._each("all_gather_into_tensor_coalesced", outputs, inputs, lambda o, i: self.all_gather_single(o, i, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "gather"
        t = self._one(name, inputs)
        root = self._root(name, (opts or dist.GatherOptions()).rootRank)
        at = self._place(name, [t])
        send = T.Staged(t)
        if self.comm.rank != root:
            if outputs and any(outputs):
                raise InvalidArgumentError("gather_list must be empty on ranks other than the root", op=name, rank=self.comm.rank)
            return self._submit(name, lambda: [self.comm.Igatherv(send.arr, None, root, stream=at.stream)], lambda: [], at=at)
        if len(outputs) != 1:
            raise InvalidArgumentError(f"the root takes one gather_list, got {len(outputs)}", op=name, rank=self.comm.rank)
        outs = self._checked_list(name, outputs[0], t.dtype, "gather_list")
        self._place(name, [t, *outs])
        counts = [o.numel() for o in outs]
        recv = T.flat_empty(sum(counts), t)
        return self._submit(name, lambda: [self.comm.Igatherv(send.arr, T.vector(T.buffer(recv), counts), root, stream=at.stream)],
                            lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> PycollWork:
        name = "scatter"
        out = self._one(name, outputs)
        root = self._root(name, (opts or dist.ScatterOptions()).rootRank)
        at = self._place(name, [out])
        buf = T.Staged(out, load=False)
        if self.comm.rank != root:
            if inputs and any(inputs):
                raise InvalidArgumentError("scatter_list must be empty on ranks other than the root", op=name, rank=self.comm.rank)
            return self._submit(name, lambda: [self.comm.Iscatterv(None, buf.arr, root, stream=at.stream)],
                                lambda: (buf.done(), outputs)[1], at=at)
        if len(inputs) != 1:
            raise InvalidArgumentError(f"the root takes one scatter_list, got {len(inputs)}", op=name, rank=self.comm.rank)
        parts = self._checked_list(name, inputs[0], out.dtype, "scatter_list")
        self._place(name, [out, *parts])
        counts = [p.numel() for p in parts]
        send = T.flat_concat(parts)
        return self._submit(name, lambda: [self.comm.Iscatterv(T.vector(T.buffer(send), counts), buf.arr, root, stream=at.stream)],
                            lambda: (buf.done(), outputs)[1], at=at)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> PycollWork:
        name = "all_to_all"
        if not inputs:
            raise InvalidArgumentError("input_tensor_list is empty", op=name, rank=self.comm.rank)
        dtype = self._tensor(name, inputs[0], "input_tensor_list").dtype
        ins = self._checked_list(name, inputs, dtype, "input_tensor_list")
        outs = self._checked_list(name, outputs, dtype, "output_tensor_list")
        at = self._place(name, [*ins, *outs])
        scounts, rcounts = [t.numel() for t in ins], [t.numel() for t in outs]
        send = T.flat_concat(ins)
        recv = T.flat_empty(sum(rcounts), send)
        return self._submit(name, lambda: [self.comm.Ialltoallv(T.vector(T.buffer(send), scounts), T.vector(T.buffer(recv), rcounts),
                                                                stream=at.stream)],
                            lambda: (T.split_into(recv, outs), outputs)[1], at=at)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                          input_split_sizes: list[int], opts: Any = None) -> PycollWork:
        name = "all_to_all_single"
        self._tensor(name, output, "output")
        self._tensor(name, input, "input")
        self._dtypes(name, [input], output.dtype)
        scounts = self._split_counts(name, input, input_split_sizes, "input")
        rcounts = self._split_counts(name, output, output_split_sizes, "output")
        at = self._place(name, [output, input])
        send, buf = T.Staged(input), T.Staged(output, load=False)
        return self._submit(name, lambda: [self.comm.Ialltoallv(T.vector(send.arr, scounts), T.vector(buf.arr, rcounts),
                                                                stream=at.stream)],
                            lambda: (buf.done(), [output])[1], at=at)

    def _split_counts(self, name: str, t: torch.Tensor, splits: list[int], what: str) -> list[int]:
        """Elements per rank for a split of ``t`` along its first dimension (even when ``splits`` is empty)."""
        p = self.comm.size
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % p:
                raise InvalidArgumentError(f"{what}'s first dimension {rows} does not split evenly over {p} ranks", op=name, rank=self.comm.rank)
            return [rows // p * per_row] * p
        if len(splits) != p or sum(splits) != rows or min(splits) < 0:
            raise InvalidArgumentError(
                f"{what}_split_sizes {list(splits)} must be {p} sizes summing to the first dimension {rows}", op=name, rank=self.comm.rank
            )
        return [int(s) * per_row for s in splits]

    def _each(self, name: str, outputs: list, inputs: list, one: Callable[[Any, Any], PycollWork]) -> PycollWork:
        """A coalesced call: one operation per pair, one handle that completes when all have."""
        if len(outputs) != len(inputs):
            raise InvalidArgumentError(f"{len(outputs)} outputs for {len(inputs)} inputs", op=name, rank=self.comm.rank)
        works = [one(o, i) for o, i in zip(outputs, inputs)]
        return PycollWork(all_of([w.get_future() for w in works], outputs))
