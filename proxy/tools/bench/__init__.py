"""shmproxy-bench: shmproxy and its Python peers measured side by side, in one run (nccl-tests style).

    mpiexec -n 2 shmproxy-bench pingpong -b 8 -e 64M -f 4 --peers mpi4py
    mpiexec -n 2 python -m shmproxy.tools.bench sendrecv --json sendrecv.json --plot sendrecv.png
    mpiexec -n 4 shmproxy-bench allreduce -b 8 -e 64M -f 8 --op sum --dtype float32
    mpiexec -n 4 shmproxy-bench allgather --in-place --no-alloc
    mpiexec -n 2 shmproxy-bench overlap -b 64K -e 16M -f 4
    mpiexec -n 2 shmproxy-bench post --peers mpi4py
    mpiexec -n 2 shmproxy-bench idle --idle-seconds 10

Every rank runs this program under a launcher. Each calls ``shmproxy.init()`` and, for the peers asked
for (``--peers``, default per operation), opens them in the same process: mpi4py's COMM_WORLD, and
torch.distributed's gloo backend (its TCPStore is hosted by rank 0 on 127.0.0.1 at a free port that
rank 0 sends to the others through shmproxy; under torchrun, MASTER_ADDR/MASTER_PORT are used). A peer
that cannot be opened on every rank is skipped with a printed note; shmproxy itself never is.

Where things are
----------------
- ``cli``: the command line (parser, per-operation defaults, ``main``); ``__main__``: ``python -m``.
- ``sweep``: the whole run on one rank, and how a figure is made.
- ``operations``: the operation table ``OPERATIONS``; ``operation``: the ``Operation`` record and
  ``Ctx``, what its calls see; ``calls``: the call each library makes for each operation.
- ``libraries``: shmproxy, mpi4py and gloo behind one interface; ``peers``: opening the peers, and
  skipping one that cannot run the operation as asked.
- ``measure``: one library at one size (timed loops, posting cost, idle CPU, collectives);
  ``overlap``: the overlap of a nonblocking allreduce with work (OSU's method).
- ``sizes``: the sweep and the nccl-tests size convention; ``patterns``: the inputs, the expected
  results and the checks; ``stats``: medians, bandwidth, steal time.
- ``traffic``: our own barrier, gather and broadcast through shmproxy.
- ``table``: the printed table; ``report``: the JSON report, the plot, the environment;
  ``progress_bar``: the progress bar on rank 0's stderr.

This package re-exports what the tests and ``tools/bench`` use.
"""
from __future__ import annotations

from shmproxy.tools.bench.cli import main, make_parser, resolve
from shmproxy.tools.bench.libraries import PEERS
from shmproxy.tools.bench.measure import measure_coll, measure_loop
from shmproxy.tools.bench.operation import Operation, row_size
from shmproxy.tools.bench.operations import OPERATIONS
from shmproxy.tools.bench.overlap import (WORK_CHUNK_S, calibrate, measure_overlap, overlap_percent,
                                          rescale_units, spin, work_for)
from shmproxy.tools.bench.patterns import (_CHECK_CHUNK, _UFUNCS, SENTINEL, CheckSpec, input_period,
                                           matches_periodic, pattern, reduction_input, reduction_period, tiled,
                                           tolerance)
from shmproxy.tools.bench.progress_bar import Progress
from shmproxy.tools.bench.report import ENV_KEYS, SCHEMA, build_report, dumps_report, plot_report, validate_report
from shmproxy.tools.bench.sizes import (block_count, default_iters, default_warmup, element_count, parse_size,
                                        size_sweep)
from shmproxy.tools.bench.stats import StealMeter, cpu_ticks, gbps, steal_note, summarize
from shmproxy.tools.bench.table import check_word, format_header, format_row, format_value, ratios, reduce_result

# What tests/test_bench*.py and tools/bench import from shmproxy.tools.bench (the two private names
# included: the tests use them).
__all__ = [
    "main", "make_parser", "resolve",
    "PEERS",
    "measure_coll", "measure_loop",
    "Operation", "row_size",
    "OPERATIONS",
    "WORK_CHUNK_S", "calibrate", "measure_overlap", "overlap_percent", "rescale_units", "spin", "work_for",
    "_CHECK_CHUNK", "_UFUNCS", "SENTINEL", "CheckSpec", "input_period", "matches_periodic", "pattern",
    "reduction_input", "reduction_period", "tiled", "tolerance",
    "Progress",
    "ENV_KEYS", "SCHEMA", "build_report", "dumps_report", "plot_report", "validate_report",
    "block_count", "default_iters", "default_warmup", "element_count", "parse_size", "size_sweep",
    "StealMeter", "cpu_ticks", "gbps", "steal_note", "summarize",
    "check_word", "format_header", "format_row", "format_value", "ratios", "reduce_result",
]
