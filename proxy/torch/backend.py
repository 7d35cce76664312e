"""Registration of the "shmproxy" backend and the rendezvous of each process group it makes.

``torch.distributed`` calls ``create(store, rank, size, timeout)`` on the members of every group
with this backend (``init_process_group("shmproxy")``, ``new_group(backend="shmproxy")``), with a
store prefixed by the group's name. Each group is its own shmproxy communicator, joined with
``shmproxy.init`` and explicit numbers:

- **job id**: the group's rank 0 puts a fresh random id into the group's store and every member
  reads it: two groups over the same ranks (the default group and a ``new_group``) never share a
  progress process, and the id never depends on the launcher.
- **local rank and size**: for the group of the whole job, torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE
  as shmproxy's launcher detection reads them; for a smaller group, each member publishes its host
  identity in the store and counts the members on its host before it (and all of them).

Why not ``Comm.Split`` of the default group for ``new_group``: torch calls the creator on the
group's members only, and Split is collective over every rank of the parent. ``dist.split_group``
itself is refused by torch 2.13 before any backend is asked, on machines without an accelerator.
"""
from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import shmproxy
from shmproxy.control import bootstrap
from shmproxy.core import params
from shmproxy.torch.process_group import BACKEND_NAME, ProcessGroupShmproxy

_JOB_KEY = "shmproxy/job_id"


def _local(store: Any, rank: int, size: int) -> tuple[int, int]:
    info = bootstrap.detect()
    if (info.rank, info.size) == (rank, size):
        return info.local_rank, info.local_size
    me = bootstrap.host_identity()
    store.set(f"shmproxy/host/{rank}", me)
    hosts = [store.get(f"shmproxy/host/{r}").decode() for r in range(size)]
    same = [r for r in range(size) if hosts[r] == me]
    return same.index(rank), len(same)


def create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupShmproxy:
    """The backend's creator, as torch.distributed.Backend.register_backend expects it."""
    if rank == 0:
        store.set(_JOB_KEY, uuid.uuid4().hex)
    job = store.get(_JOB_KEY).decode()
    local_rank, local_size = _local(store, rank, size)
    # torch's timeout bounds each operation of the group: a Work's wait, and the communicator's own
    # waits (a blocking call the group runs directly), unless SHMPROXY_TIMEOUT is shorter.
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    limit = min(secs, params.get().TIMEOUT)
    comm = shmproxy.init(timeout=limit, rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                         job_id=f"torch-{job}")
    return ProcessGroupShmproxy(comm, rank, size, timeout, label=job[:8])


def register() -> None:
    """Make "shmproxy" a torch.distributed backend for CPU and CUDA tensors (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu", "cuda"])
