"""Opening the peers in the ranks' own processes (mpi4py's COMM_WORLD; torch.distributed's gloo, whose
TCPStore rank 0 hosts unless torchrun's MASTER_ADDR/MASTER_PORT are set; torch's NCCL on a group of
its own over that default group, where each rank has a GPU of its own), and finding out whether a
peer can run the operation as asked.

A peer that cannot do an operation as asked (mpi4py has no AVG; torch has no in-place
reduce_scatter; a dtype or call its build does not support) is skipped for the run with a note that
says why: first from what is known statically, then by one probing call at the smallest size on
every rank (an error there, e.g. gloo's "Invalid scalar type" for int16, skips the peer everywhere).
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import numpy as np

from shmproxy.tools.bench.libraries import GlooLib, Library, MpiLayerLib, MpiLib, NcclLib
from shmproxy.tools.bench.measure import _prepare
from shmproxy.tools.bench.operation import Ctx, Operation
from shmproxy.tools.bench.overlap import measure_overlap
from shmproxy.tools.bench.traffic import agree, bcast

RENDEZVOUS_TIMEOUT_S = 60.0


def open_mpi(ctx: Ctx) -> tuple[Library | None, str]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return None, f"mpi4py cannot be imported ({exc})"
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (ctx.rank, ctx.size):
        return None, (f"MPI.COMM_WORLD is rank {world.Get_rank()} of {world.Get_size()} but shmproxy is "
                      f"rank {ctx.rank} of {ctx.size} (not started by an MPI launcher?)")
    return MpiLib(MPI), ""


def open_mpi_layer(ctx: Ctx) -> tuple[Library | None, str]:
    """shmproxy.MPI: its COMM_WORLD is a Dup of the bench's communicator (a progress process of its own),
    so the layer's cost is measured beside the native calls of the same job."""
    from shmproxy import MPI
    MPI.attach_world(ctx.comm.Dup())
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (ctx.rank, ctx.size):
        return None, f"shmproxy.MPI.COMM_WORLD is rank {world.Get_rank()} of {world.Get_size()}"
    return MpiLayerLib(MPI), ""


def _torch_dist(ctx: Ctx, backend: str) -> tuple[Any, Any, str]:
    """torch and torch.distributed with ``backend`` available on every rank, or (None, None, why)."""
    torch: Any
    dist: Any
    try:
        import torch
        import torch.distributed as dist
        have = dist.is_available() and (dist.is_gloo_available() if backend == "gloo" else
                                        dist.is_nccl_available() and torch.cuda.is_available())
        missing = f"this torch has no {backend} backend" + (", or no CUDA" if backend == "nccl" else "")
        why = "" if have else missing
    except ImportError as exc:
        torch = dist = None
        have, why = False, f"torch cannot be imported ({exc})"
    if not agree(ctx.comm, have):
        return None, None, why or f"torch.distributed {backend} is missing on another rank"
    return torch, dist, ""


def _default_group(ctx: Ctx, dist: Any) -> str:
    """torch.distributed's default group over gloo, made once per run for the torch peers ('' when it
    exists): torchrun's rendezvous where given, else a TCPStore that rank 0 hosts."""
    if dist.is_initialized():
        return ""
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):    # torchrun and friends
        dist.init_process_group("gloo", init_method="env://", rank=ctx.rank, world_size=ctx.size,
                                timeout=timeout)
        return ""
    # No rendezvous given: rank 0 hosts a TCPStore on a free port and tells the others through shmproxy.
    store, why = None, ""
    if ctx.rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, ctx.size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except (RuntimeError, OSError) as exc:
            port, why = 0, f"rank 0 could not open a TCPStore on 127.0.0.1 ({exc})"
    port = int(bcast(ctx.comm, [port] if ctx.rank == 0 else None, 1)[0])
    if port == 0:
        return why or "rank 0 could not open a TCPStore on 127.0.0.1"
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, ctx.size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.size, timeout=timeout)
    return ""


def open_gloo(ctx: Ctx) -> tuple[Library | None, str]:
    torch, dist, why = _torch_dist(ctx, "gloo")
    if dist is None:
        return None, why
    why = _default_group(ctx, dist)
    return (None, why) if why else (GlooLib(torch, dist), "")


def open_nccl(ctx: Ctx) -> tuple[Library | None, str]:
    """NCCL through torch, on a group of every rank over the default (gloo) group; each rank on a GPU of
    its own, which must exist: NCCL refuses two ranks on one GPU ("Duplicate GPU detected")."""
    torch, dist, why = _torch_dist(ctx, "nccl")
    if dist is None:
        return None, why
    from shmproxy.tools.bench.device import local_gpu, own_gpu_note
    why = own_gpu_note(ctx)
    if not agree(ctx.comm, not why):
        return None, why or "another rank shares its GPU"
    torch.cuda.set_device(local_gpu(ctx))
    why = _default_group(ctx, dist)
    if why:
        return None, why
    group = dist.new_group(list(range(ctx.size)), backend="nccl",
                           timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    return NcclLib(torch, dist, group), ""


def peer_unsupported(op: Operation, lib: Library, args: argparse.Namespace) -> str:
    """Why ``lib`` cannot run ``op`` as asked, known without trying ('' when it may)."""
    if op.reduces and lib.redop(args.redop) is None:
        what = "MPI defines no such op" if isinstance(lib, MpiLib) else "this torch.distributed has none"
        return f"{lib.name} has no {args.redop.upper()} reduction ({what})"
    if isinstance(lib, GlooLib) and op.name == "reduce_scatter":
        if args.in_place:
            return "torch.distributed has no in-place reduce_scatter (MPI_IN_PLACE: input in the output)"
        if lib.fn("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base") is None:
            return "this torch.distributed has no reduce_scatter_single / reduce_scatter_tensor"
    if isinstance(lib, GlooLib) and op.name == "allgather":
        if lib.fn("all_gather_single", "all_gather_into_tensor", "_all_gather_base") is None:
            return "this torch.distributed has no all_gather_single / all_gather_into_tensor"
    return ""


def probe(ctx: Ctx, op: Operation, lib: Library, dtype: np.dtype) -> str:
    """One call of ``op`` with ``lib`` at the smallest size (one element per block), on every rank;
    '' when it worked, else the error. Libraries refuse what they do not support (a dtype, an op)
    before they communicate, on every rank alike, so a refusal cannot leave a peer waiting."""
    n_send, n_recv, _count = op.shape(ctx.size, ctx.size, bool(ctx.args.in_place))
    send = np.array(op.fill(ctx.rank, n_send, dtype, ctx.args.redop))
    recv = np.zeros(n_recv, dtype)
    _prepare(ctx, op, lib, send, recv)
    try:
        made = op.calls[lib.kind](ctx, lib, lib.wrap(send), lib.wrap(recv))
        if op.measure is measure_overlap:
            post, wait = made
            wait(post())
        else:
            made()
    except Exception as exc:                          # whatever the library raises: report it
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{type(exc).__name__}: {first}"
    return ""
