"""PyTorch integration: ``import pycoll.torch`` registers ``"pycoll"`` as a ``torch.distributed`` backend.

    import pycoll.torch  # noqa: F401
    torch.distributed.init_process_group("pycoll")
"""

from .backend import BACKEND, ProcessGroupPycoll
from .registration import Options, register
from .work import PycollWork

register()

__all__ = ["BACKEND", "Options", "ProcessGroupPycoll", "PycollWork", "register"]
