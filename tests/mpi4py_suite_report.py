"""Which of mpi4py's test modules shmproxy.MPI answers to, and the report of how they fare.

MODULES is every module of mpi4py's test folder that shmproxy.MPI is meant to pass; OUT_OF_SCOPE
names each other one with the reason (the features shmproxy does not provide at all). KNOWN_FAILS
lists assertion failures that are not wrong data. tests/test_mpi4py_suite.py runs MODULES in CI at
3 ranks; this module's command runs them at any rank counts and writes docs/mpi4py_suite.md:

    python -m tests.mpi4py_suite_report --ranks 1 2 3 4            # every module, the whole table
    python -m tests.mpi4py_suite_report --ranks 3 --modules test_comm --report /tmp/comm.md
"""
from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import re
import sys
import tempfile
import time
from pathlib import Path

MODULES = [
    # point-to-point
    "test_status", "test_request", "test_p2p_buf", "test_p2p_obj", "test_p2p_buf_matched",
    "test_p2p_obj_matched", "test_msgspec", "test_msgzero", "test_buffer",
    # collectives, blocking, nonblocking, neighbourhood, across intercommunicators
    "test_cco_buf", "test_cco_obj", "test_cco_vec", "test_cco_nb_buf", "test_cco_nb_vec",
    "test_cco_ngh_buf", "test_cco_ngh_obj", "test_cco_buf_inter", "test_cco_obj_inter",
    "test_cco_vec_inter",
    # communicators, groups, topologies, datatypes, ops, packing
    "test_comm", "test_comm_inter", "test_comm_topo", "test_group", "test_datatype", "test_op",
    "test_pack",
    # objects, errors, environment
    "test_pickle", "test_objmodel", "test_exceptions", "test_errhandler", "test_errorcode",
    "test_info", "test_environ",
    # mpi4py.util
    "test_util_pkl5", "test_util_dtlib", "test_util_sync", "test_util_pool",
    # MPI 4's persistent collectives and partitioned messages, generalized requests, attributes,
    # MPI memory, subclasses of the handle types, threads
    "test_cco_pr_buf", "test_cco_pr_vec", "test_cco_pr_ngh_buf", "test_p2p_buf_part", "test_grequest",
    "test_attributes", "test_mpimem", "test_subclass", "test_threads",
]

OUT_OF_SCOPE = {
    "test_rma": "one-sided windows (MPI_Win)", "test_rma_nb": "one-sided windows (MPI_Win)",
    "test_win": "one-sided windows (MPI_Win)",
    "test_spawn": "dynamic processes (Spawn)", "test_dynproc": "dynamic processes (Open_port, Accept)",
    "test_file": "MPI-IO", "test_io": "MPI-IO",
    "test_session": "MPI sessions",
    "test_ulfm": "ULFM fault tolerance (Revoke, Shrink, Agree)",
    "test_cffi": "C-level interop (cffi handles)", "test_ctypes": "C-level interop (ctypes handles)",
    "test_address": "C-level interop (absolute addresses, MPI.BOTTOM with Get_address)",
    "test_mpiabi": "the MPI library's C ABI", "test_mpiapi": "the MPI library's C API symbols",
    "test_package": "mpi4py's own package layout (mpi4py.get_include, bench, ...)",
    "test_toplevel": "mpi4py's top-level configuration (mpi4py.rc, mpi4py.profile)",
    "test_doc": "docstrings of mpi4py's C extension",
    "test_handle": "C-level interop (handle integers: py2f, f2py, fromhandle)",
}

# Assertion failures that are not wrong data, each with why (a pattern of test ids, fnmatch's, ->
# reason): they assert on handles, names or warnings, never on a message's contents.
KNOWN_FAILS: dict[str, str] = {
    "test_datatype.*.testContiguousBigMPI":
        "the layer says MPI 3.1, where a count past INT_MAX decodes as a struct of vectors; shmproxy builds "
        "(and decodes) the plain contiguous type, as MPI 4 does",
    "test_msgspec.*.testDtypeLanes": "a DLPack tensor whose dtype has 2 lanes is bytes to mpi4py (UNSIGNED_CHAR), "
                                     "received into an unsigned int buffer: a type-signature mismatch, erroneous in "
                                     "MPI (MPI 4.1 section 3.3.1); MPICH copies the bytes unchecked, shmproxy refuses "
                                     "it as any mismatched dtype (the bytes arrive intact into a byte buffer)",
    "test_msgspec.*.testDtypeCode": "a DLPack tensor of an opaque dtype code is bytes to mpi4py (UNSIGNED_CHAR), "
                                    "received into an unsigned short buffer: a type-signature mismatch, erroneous in "
                                    "MPI; shmproxy refuses it as any mismatched dtype",
    "test_p2p_obj.*.testMixed": "bytes sent as a buffer and received as an object (and the reverse): shmproxy's "
                                "object messages carry a header of their own and travel as objects, mpi4py's are "
                                "the bare pickle in a byte message",
}

# (pattern of a reason, the group it belongs to), first match wins
GROUPS = [
    (r"derived datatype|Create_(contiguous|vector|indexed|hindexed|struct|subarray|resized|f90)|Get_contents|"
     r"Get_envelope|Get_value_index|ORDER_C|DISTRIBUTE_|COMBINER", "derived datatypes (datatypes.py)"),
    (r"Bsend|Attach_buffer|Detach_buffer|buffered mode|Alloc_mem", "buffered sends / Alloc_mem"),
    (r"Win|one-sided|RMA", "one-sided windows: not in scope"),
    (r"_comm_lock_table|threading|THREAD_MULTIPLE", "threads: MPI_THREAD_MULTIPLE not provided"),
    (r"has no attribute 'Info'|Info|info", "MPI.Info objects"),
    (r"matched by a message with dtype uint8", "a buffer Send of pickled bytes received as an object: "
     "shmproxy's object messages carry a header of their own (mpi4py's are the bare pickle)"),
    (r"pickle", "pickling handles"),
    (r"Timeout|the job ended", "the job timed out or ended in the test"),
    (r"!= <shmproxy.MPI.DATATYPE_NULL>", "a count past INT_MAX decodes as in MPI 4 where the layer says "
     "MPI 3.1 (KNOWN_FAILS)"),
]

REPORT = Path(__file__).resolve().parent.parent / "docs" / "mpi4py_suite.md"
HEADER = """# mpi4py's own tests against shmproxy.MPI

Written by `python -m tests.mpi4py_suite_report` (tests/mpi4py_suite_report.py), which fetches mpi4py's
source distribution and runs its test modules unchanged (`from mpi4py import MPI` resolves to
shmproxy.MPI, `mpi4py.util` to shmproxy.util) in real rank processes. A job ends after every test
that did not pass and the next job starts after it, so no test sees another's leftovers. `fail` is an
assertion that did not hold; `unsupported` a NotImplementedError naming a missing feature; `error`
any other exception; `hang` a job that ended inside the test. CI runs the same modules at 3 ranks
(tests/test_mpi4py_suite.py) against a floor per module. The jobs set `MPI4PY_TEST_SPAWN=0`, mpi4py's
own switch for MPI libraries without Spawn (its tests that spawn are skipped, not run). A table
composed from several runs (`--from-json`) takes each module's records from its latest run.

Modules not run, and why: {out_of_scope}.
"""


def group(reason: str) -> str:
    for pattern, name in GROUPS:
        if re.search(pattern, reason):
            return name
    return reason.split(" (at ")[0][:120]


def wrong_results(recs: dict[str, dict]) -> dict[str, str]:
    """Tests that failed on an assertion, less KNOWN_FAILS: results that differ from MPI's."""
    return {tid: r["reason"] for tid, r in recs.items()
            if r["outcome"] == "fail" and not any(fnmatch.fnmatchcase(tid, pat) for pat in KNOWN_FAILS)}


def counts(recs: dict[str, dict]) -> dict[str, collections.Counter]:
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for tid, r in recs.items():
        per[tid.split(".")[0]][r["outcome"]] += 1
    return per


def write(results: dict[int, dict[str, dict]], path: Path = REPORT,
          seconds: dict[int, float] | None = None) -> None:
    out_of_scope = "; ".join(f"{m} ({why})" for m, why in sorted(OUT_OF_SCOPE.items()))
    lines = HEADER.format(out_of_scope=out_of_scope).splitlines()
    for nranks, recs in sorted(results.items()):
        took = f", {seconds[nranks] / 60:.0f} minutes on a 2-core machine" if seconds else ""
        lines += ["", f"## {nranks} rank{'s' if nranks > 1 else ''}{took}", "",
                  "| module | tests | pass | skip | fail | unsupported | error | hang | pass % of run |",
                  "|---|---|---|---|---|---|---|---|---|"]
        per = counts(recs)
        for mod in MODULES:
            c = per.get(mod, collections.Counter())
            ran = sum(c.values()) - c["skip"]
            pct = f"{100 * c['pass'] / ran:.0f}" if ran else "-"
            lines.append(f"| {mod} | {sum(c.values())} | {c['pass']} | {c['skip']} | {c['fail']} | "
                         f"{c['unsupported']} | {c['error']} | {c['hang']} | {pct} |")
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for tid, r in sorted(recs.items()):
            if r["outcome"] not in ("pass", "skip"):
                groups[group(r["reason"])].append(f"{tid} ({r['outcome']}): {r['reason'][:300]}")
        lines += ["", f"### Not passing at {nranks} rank{'s' if nranks > 1 else ''}, by reason", ""]
        for name, items in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"- **{name}** ({len(items)})")
            lines += [f"  - {it}".replace("|", "\\|") for it in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def merge(saved: list[dict]) -> dict[int, dict[str, dict]]:
    """Records of several --json files, by rank count: a module's records come from the last file
    that has that module at that rank count (never a mix of two runs of one module)."""
    out: dict[int, dict[str, dict]] = {}
    for results in saved:
        for n, recs in results.items():
            mine = out.setdefault(int(n), {})
            for mod in {tid.split(".")[0] for tid in recs}:
                for tid in [t for t in mine if t.split(".")[0] == mod]:
                    del mine[tid]
            mine.update(recs)
    return out


def main(argv: list[str] | None = None) -> int:
    from tests.mpi4py_suite_runner import run_suite, sources
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--modules", nargs="+", default=MODULES)
    ap.add_argument("--report", type=Path, default=REPORT)
    ap.add_argument("--json", type=Path, help="also write every record here")
    ap.add_argument("--from-json", type=Path, nargs="+", metavar="JSON",
                    help="write the report from records saved with --json (no run): later files replace "
                         "earlier ones module by module, so a module run again after a change replaces its "
                         "old records")
    args = ap.parse_args(argv)
    if args.from_json:
        merged = merge([json.loads(p.read_text()) for p in args.from_json])
        write(merged, args.report)
        return 0
    root = sources()
    results: dict[int, dict[str, dict]] = {}
    seconds: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="mpi4py-suite-") as tmp:
        for n in args.ranks:
            t0 = time.monotonic()
            results[n] = {}
            for mod in args.modules:
                try:
                    recs = run_suite(root, [mod], n, Path(tmp) / f"{n}-{mod}", timeout=900)
                except AssertionError as exc:    # the job ended outside any test (an import, a setup)
                    recs = {f"{mod}.(job)": {"outcome": "error", "reason": f"{str(exc)[:300]}", "ranks": []}}
                results[n].update(recs)
                c = counts(recs)[mod]
                print(f"{n} ranks {mod}: {dict(c)}", flush=True)
            seconds[n] = time.monotonic() - t0
            write(results, args.report, seconds)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    wrong = {n: wrong_results(r) for n, r in results.items() if wrong_results(r)}
    for n, w in wrong.items():
        print(f"WRONG RESULTS at {n} ranks:\n  " + "\n  ".join(f"{t}: {why}" for t, why in sorted(w.items())))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
