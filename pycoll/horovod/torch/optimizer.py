"""Horovod's DistributedOptimizer and its broadcast helpers: gradients reduced as their hooks fire, during backward."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

import torch

from ...errors import InvalidArgumentError
from . import api, processes
from .compression import Compression


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class (see ``DistributedOptimizer``): ``step`` first waits for the reduced
    gradients, each started by its parameter's post-accumulate hook once ``backward_passes_per_step`` backward
    passes have accumulated into it."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, process_set: Any, sparse_as_dense: bool) -> None:
        super(self.__class__, self).__init__(params)  # the user's optimizer class, on its own param groups
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"noname.{i}.{j}", v) for i, group in enumerate(self.param_groups)
                     for j, v in enumerate(group["params"])]
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) pairs, as "
                             "model.named_parameters() gives")
        names = [n for n, _ in named]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"parameter names in named_parameters must be unique; repeated: {dupes}")
        all_params = {id(v) for group in self.param_groups for v in group["params"]}
        known = {id(v) for _, v in named}
        if named_parameters is not None and all_params - known:
            raise ValueError("named_parameters was given, but some parameters of the optimizer are not in it")
        self._parameter_names = {id(v): f"allreduce.{k}" for k, v in named}
        self._compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be at least 1")
        if op == api.Average and gradient_predivide_factor != 1.0:
            self._prescale, self._postscale = 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
        elif gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is taken only with op=hvd.Average")
        else:
            self._prescale = self._postscale = 1.0
        self.op = op
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self._handles: dict[Any, tuple[Optional[int], Any]] = {}
        self._delay: dict[Any, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._requires_update = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._hooks = []
        if process_set.size() > 1 if process_set.included() else False:
            for p in self._requires_update:
                self._delay[p] = self.backward_passes_per_step
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        handle = self._handles.get(p, (None, None))[0]
        if handle is not None and self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step times before step(); "
                                 "raise backward_passes_per_step to accumulate gradients locally")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._handles[p] = self._reduce_async(p)
        else:
            self._handles[p] = (None, None)

    def _reduce_async(self, p: torch.Tensor) -> tuple[int, Any]:
        if p.grad is None:  # a parameter the backward pass did not reach: every rank reduces zeros for it
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                raise InvalidArgumentError("sparse gradients are reduced here only with sparse_as_dense=True",
                                           op="DistributedOptimizer")
            grad = p.grad = grad.to_dense()
        compressed, ctx = self._compression.compress(grad)
        handle = api.allreduce_async_(compressed, name=self._parameter_names.get(id(p)), op=self.op,
                                      prescale_factor=self._prescale, postscale_factor=self._postscale,
                                      process_set=self._process_set)
        return handle, (compressed, ctx)

    def synchronize(self) -> None:
        """Wait for every parameter's reduced gradient (starting those whose hooks did not fire)."""
        if not self._hooks:
            self._synchronized = True
            return
        for p in self._requires_update:
            if self._handles.get(p, (None, None))[0] is None:
                self._handles[p] = self._reduce_async(p)
        for p, (handle, (compressed, ctx)) in self._handles.items():
            output = processes.synchronize(handle)
            self._delay[p] = self.backward_passes_per_step
            result = self._compression.decompress(output, ctx)
            if result is not p.grad:
                with torch.no_grad():
                    p.grad.copy_(result)
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step`` without waiting, after an explicit ``synchronize()`` (gradient clipping between the two)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize(): the gradients were reduced "
                              "already; use 'with optimizer.skip_synchronize():' around step()", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(); the gradients being reduced would be lost")
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802 - Horovod's name
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step`` applies gradients averaged (``op``) over the process set. Grouping
    arguments (``num_groups``, ``groups``) are accepted; the engine's fusion packs the ready gradients anyway."""
    op = api.Average if op is None else op
    if op == api.Adasum:
        api._op(op, None, api.Average, "DistributedOptimizer")  # raises: not built
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, process_set or processes.global_process_set, sparse_as_dense)


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every tensor of ``params`` (a state_dict, or (name, tensor) pairs) with ``root_rank``'s."""
    process_set = process_set or processes.global_process_set
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__iter__"):
        items = list(params)
        if items and not all(isinstance(x, tuple) and len(x) == 2 for x in items):
            items = [(str(i), x) for i, x in enumerate(items)]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    handles = [api.broadcast_async_(p, root_rank, name=f"broadcast.{name}", process_set=process_set)
               for name, p in items if isinstance(p, torch.Tensor)]
    for h in handles:
        processes.synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, process_set: Any = None) -> None:
    """Give every rank's optimizer ``root_rank``'s state (its state_dict, sent as one object)."""
    process_set = process_set or processes.global_process_set
    state = api.broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state", process_set=process_set)
    if process_set.rank() != root_rank:
        optimizer.load_state_dict(state)
