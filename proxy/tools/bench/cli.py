"""The command line of ``shmproxy-bench``: the parser, the per-operation defaults and the checks of
an argument combination (``resolve``), and ``main``.

``--inject-error`` (hidden) is a test hook: it corrupts shmproxy's first received buffer on every rank
before the check, so that the failure path (FAIL in the table, exit status 1) can be tested.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from shmproxy.tools.bench.libraries import PEERS
from shmproxy.tools.bench.measure import RAW_TIMES
from shmproxy.tools.bench.operation import Ctx, Operation
from shmproxy.tools.bench.operations import OPERATIONS
from shmproxy.tools.bench.patterns import REDOPS
from shmproxy.tools.bench.sizes import parse_size, size_sweep
from shmproxy.tools.bench.sweep import run

GROUP_SIZE = 64


def _peers_arg(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if names in ((), ("none",)):
        return ()
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(bad)}; known: {', '.join(PEERS)}, none")
    return tuple(dict.fromkeys(names))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmproxy-bench",
        description="Benchmark shmproxy against mpi4py and torch gloo in the same run. Run it under a "
                    "launcher, e.g. `mpiexec -n 2 shmproxy-bench pingpong -b 8 -e 64M -f 4`.",
        epilog="Operations: " + "; ".join(f"{o.name}: {o.summary}" for o in OPERATIONS.values()))
    p.add_argument("op", choices=list(OPERATIONS), help="what to measure")
    p.add_argument("-b", "--minbytes", type=parse_size, help="smallest message (default per operation)")
    p.add_argument("-e", "--maxbytes", type=parse_size, help="largest message (K/M/G suffixes)")
    p.add_argument("-f", "--stepfactor", type=int, help="size multiplier between steps")
    p.add_argument("-n", "--iters", type=int, help="timed iterations (default: adapts to the size)")
    p.add_argument("-w", "--warmup-iters", type=int, help="warm-up iterations (default: adapts)")
    p.add_argument("-r", "--rounds", type=int, default=1,
                   help="split the iterations into this many slices, alternating between the libraries, "
                        "so that drift of a noisy host hits every library alike (timed sweeps only)")
    p.add_argument("--dtype", help="element type (default: uint8 for pingpong/post/idle, float32 otherwise)")
    p.add_argument("--op", dest="redop", choices=REDOPS,
                   help="reduction of allreduce, reduce, reduce_scatter, overlap (default: sum; avg needs a "
                        "float dtype)")
    p.add_argument("--in-place", action="store_true",
                   help="allreduce, allgather, reduce_scatter: in place (MPI_IN_PLACE semantics)")
    p.add_argument("--peers", type=_peers_arg,
                   help="comma-separated peers to compare with: mpi4py, gloo, nccl (--device cuda, a GPU "
                        "per rank), shmproxy.MPI, or none (default: mpi4py and gloo; none for idle)")
    p.add_argument("--alloc", action=argparse.BooleanOptionalAction, default=None,
                   help="shmproxy's buffers: comm.alloc only (--alloc, zero-copy) or plain numpy arrays only "
                        "(--no-alloc); default both, plain arrays as the row the ratios compare with and "
                        "comm.alloc as the row shmproxy:alloc")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every received buffer with what was sent")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, help="posts per group for `post`")
    p.add_argument("--idle-seconds", type=float, default=10.0, help="measurement window for `idle`")
    p.add_argument("--device", choices=("host", "cuda"), default="host",
                   help="where the buffers live: host (numpy) or cuda (cupy for shmproxy, torch CUDA tensors "
                        "for gloo and nccl; mpi4py is left out)")
    p.add_argument("--json", metavar="FILE", help="write every figure and the environment here")
    p.add_argument("--plot", metavar="FILE.png", help="plot time and bandwidth against size (matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on rank 0's stderr (tqdm if installed; default: when stderr is a terminal)")
    p.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # test hook, see top
    return p


def resolve(args: argparse.Namespace,
            parser: argparse.ArgumentParser) -> tuple[Operation, list[int], np.dtype]:
    """Fill the per-operation defaults in; parser.error (exit 2) on a bad combination."""
    op = OPERATIONS[args.op]
    lo_d, hi_d, f_d = op.default_sizes
    lo = args.minbytes if args.minbytes is not None else parse_size(lo_d)
    hi = args.maxbytes if args.maxbytes is not None else max(parse_size(hi_d), lo)
    try:
        sizes = size_sweep(lo, hi, args.stepfactor if args.stepfactor is not None else f_d)
        dtype = np.dtype(args.dtype or op.default_dtype)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from shmproxy.core.ops import DTYPE_CODE, SUPPORTED_DTYPES
    if dtype.char not in DTYPE_CODE or dtype.kind == "b":
        parser.error(f"--dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES} (bool excepted)")
    if args.iters is not None and args.iters < 1 or args.warmup_iters is not None and args.warmup_iters < 0:
        parser.error("-n must be at least 1 and -w at least 0")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.rounds > 1 and op.measure not in RAW_TIMES:
        timed = ", ".join(o.name for o in OPERATIONS.values() if o.measure in RAW_TIMES)
        parser.error(f"--rounds applies to the timed sweeps ({timed}), not to {op.name}")
    if args.group_size < 1 or not args.idle_seconds > 0:
        parser.error("--group-size must be at least 1 and --idle-seconds positive")
    reductions = ", ".join(o.name for o in OPERATIONS.values() if o.reduces)
    if args.redop is not None and not op.reduces:
        parser.error(f"--op is the reduction of {reductions}; {op.name} has none")
    args.redop = args.redop or "sum"
    if args.redop == "avg" and dtype.kind not in "fc":
        parser.error(f"--op avg needs a floating or complex --dtype, not {dtype}")
    if args.in_place and not op.in_place_ok:
        parser.error("--in-place applies to "
                     + ", ".join(o.name for o in OPERATIONS.values() if o.in_place_ok))
    if args.device == "cuda":
        from shmproxy.tools.bench.device import DEVICE_OPS
        if op.name not in DEVICE_OPS:
            parser.error(f"--device cuda applies to {', '.join(DEVICE_OPS)}, not to {op.name}")
    if not op.sized:
        sizes = [0]                                   # barrier: one row, no data
    if args.peers is None:
        args.peers = op.default_peers
    return op, sizes, dtype


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    op, sizes, dtype = resolve(args, parser)

    import shmproxy
    from shmproxy.control.bootstrap import detect
    info = detect()
    if info.size < 2:
        print(f"shmproxy-bench: {op.name} needs at least 2 ranks (found {info.size}, launcher "
              f"{info.launcher}); run it under a launcher, e.g.\n"
              f"    mpiexec -n 2 shmproxy-bench {op.name}", file=sys.stderr)
        return 2
    with shmproxy.init() as comm:
        ctx = Ctx(comm, comm.rank, comm.size, args, inject_pending=args.inject_error)
        return run(ctx, op, sizes, dtype)
