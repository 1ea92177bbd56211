"""PyTorch integration: ``import pycoll.torch`` registers ``"pycoll"`` as a ``torch.distributed`` backend.

    import pycoll.torch  # noqa: F401
    torch.distributed.init_process_group("pycoll")
"""

import os

# torch's CPU allocator puts tensors from 2 MiB on transparent huge pages when this is set at its first allocation,
# as NumPy does from 4 MiB by default; the kernel's cross-memory copy, which pycoll's large calls on one host make,
# reads huge pages 1.5-1.9x as fast as 4 KiB ones. A value the user set stands (see huge_page_tensors).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .backend import BACKEND, ProcessGroupPycoll  # noqa: E402
from .registration import Options, register  # noqa: E402
from .tensors import huge_page_tensors  # noqa: E402
from .work import PycollWork  # noqa: E402

register()

__all__ = ["BACKEND", "Options", "ProcessGroupPycoll", "PycollWork", "huge_page_tensors", "register"]
