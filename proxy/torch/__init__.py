"""torch.distributed on shmproxy: ``import shmproxy.torch`` registers the "shmproxy" backend.

    import torch.distributed as dist
    import shmproxy.torch                       # registers the backend
    dist.init_process_group("shmproxy")         # under torchrun; CPU or CUDA tensors
    model = torch.nn.parallel.DistributedDataParallel(model)

Modules: backend.py (registration, rendezvous of each group), process_group.py (the process group),
ops.py (each torch call on the communicator), work.py (Work, Future, the completion thread),
tensors.py (CPU tensors as numpy views, bfloat16, non-contiguous tensors), cuda.py (CUDA tensors: the
stream order, completion on the device, lifetimes; they need cupy). ``import
shmproxy`` does not import this package (nor torch).
"""
from __future__ import annotations

from shmproxy.torch.backend import create, register
from shmproxy.torch.process_group import BACKEND_NAME, ProcessGroupShmproxy
from shmproxy.torch.work import Work

register()

__all__ = ["BACKEND_NAME", "ProcessGroupShmproxy", "Work", "create", "register"]
