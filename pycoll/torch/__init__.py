"""PyTorch integration: ``import pycoll.torch`` registers ``"pycoll"`` as a ``torch.distributed`` backend.

    import pycoll.torch  # noqa: F401
    torch.distributed.init_process_group("pycoll")
"""

from .backend import BACKEND, Options, ProcessGroupPycoll, PycollWork, register

register()

__all__ = ["BACKEND", "Options", "ProcessGroupPycoll", "PycollWork", "register"]
