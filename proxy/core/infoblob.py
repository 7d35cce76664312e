"""The pool's info blob, published so that a reader never takes a half-written one (a seqlock).

The blob (shm/pool.py, region ``info_off``: a u64 length, then that many bytes of JSON) is what the
outside dump reads besides the counters and records. Its writer rewrites it while the job runs (what
waits, the links between nodes), and the reader is another process that takes no lock (the writer
may be the wedged party), so a rewrite must never be seen half done. The region's last u64 is a
sequence: the writer makes it odd, writes the length and the bytes, then makes it even again; the
reader loads the sequence, then the length and bytes, then the sequence again, and keeps what it
read only when both loads gave the same even value. Otherwise it tries again, for at most
``READ_PATIENCE_S``: a writer stopped mid-write (SIGSTOP, a crash) leaves the sequence odd, and the
reader says so instead of waiting.

One writer: the progress loop (engine/introspect.py); other threads hand it their news with
``post_event``. The ordering argument is shm/counters.py's: on x86-64 stores are not reordered with
stores nor loads with loads, and each memoryview access is an opaque C call.

A blob written by PoolView.write_info (tests) leaves the sequence at zero, and reads the same way
(the bytes written here stop short of the sequence word).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from shmproxy.shm import pool as P

MAX_BYTES = P.INFO_BYTES - 16   # the length word before the bytes, the sequence word after them
READ_PATIENCE_S = 0.5   # the live writer rewrites at most once a heartbeat: a few tries are enough


def _seq_index(view: P.PoolView) -> int:
    return (view.layout.info_off + P.INFO_BYTES - 8) // 8


def encode(info: dict) -> bytes:
    """The blob's bytes for ``info``; a stand-in naming the truncation when it does not fit (a cut
    document would be invalid JSON)."""
    data = json.dumps(info, default=str).encode()
    if len(data) > MAX_BYTES:
        data = json.dumps({"truncated": True, "pid": info.get("pid"), "cpus": info.get("cpus")}).encode()
    return data


def publish(view: P.PoolView, data: bytes) -> None:
    """The single writer: replace the blob with ``data`` (from ``encode``)."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"info blob of {len(data)} B, at most {MAX_BYTES}")
    q, off, si = view.q, view.layout.info_off, _seq_index(view)
    seq = q[si] | 1   # odd: being written (an odd one left by a writer that died is reused)
    q[si] = seq
    view.buf[off + 8:off + 8 + len(data)] = data
    q[off // 8] = len(data)
    q[si] = seq + 1   # even: published


def read(view: P.PoolView) -> dict[str, Any]:
    """The last published blob as a dict: {} when none was written yet, {"error": ...} when it is not
    valid JSON or was being rewritten on every try."""
    q, buf, off, si = view.q, view.buf, view.layout.info_off, _seq_index(view)
    deadline = time.monotonic() + READ_PATIENCE_S
    while True:
        seq = q[si]
        if not seq & 1:
            n = q[off // 8]
            raw = bytes(buf[off + 8:off + 8 + n]) if 0 < n <= P.INFO_BYTES - 8 else b""
            if q[si] == seq:
                break
        if time.monotonic() > deadline:
            return {"error": "info blob was being rewritten on every read (its writer stopped mid-write?)"}
        os.sched_yield()   # let the writer finish its rewrite
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return {"error": "info blob is not valid JSON (corrupt)"}
    return info if isinstance(info, dict) else {"error": "info blob is not a JSON object"}
