"""Counters in shared memory: uint64, one writer each, read and written through memoryview('Q').

Why this is correct without locks or atomics (the memory-ordering argument):

1. One writer per counter. Every uint64 in the pool has exactly one process (and, inside the progress
   process, one thread: the progress loop) that stores to it. Readers never write it. So there is no
   read-modify-write race to protect against; ``x[i] += 1`` by the single writer is fine.
   The exceptions are named where they are declared: the abort flag only ever goes 0 -> 1 (any writer,
   idempotent), and the futex words (uint32) are bumped with an atomic fetch-add in shm._native.
2. No torn values. Counters are 8-byte aligned (the layout asserts it), and memoryview.cast('Q')
   item access compiles to a single aligned 64-bit load or store on x86-64 and AArch64, which the
   hardware performs atomically.
3. Publication order. The writer fills the payload first (bytes of a buffer, the fields of a
   completion slot) and stores the counter that publishes it last; the reader loads the counter first
   and the payload after. On x86-64 (TSO) stores are not reordered with earlier stores and loads are
   not reordered with earlier loads, so a reader that sees the new counter sees the payload. CPython
   executes each memoryview access as an opaque C call, so the C compiler cannot reorder across them.
   Copies done by worker threads are published to the progress loop through the GIL handoff
   (a full barrier), and only then does the loop store the counter.
4. On a weakly ordered CPU (ARM) point 3 needs a release store for the counter and an acquire load
   for the reader (``stlr``/``ldar``, or ``__atomic_store_n(..., __ATOMIC_RELEASE)``). This code base
   targets x86-64 hosts; porting means routing the publishing stores and loads through shm._native
   with explicit release/acquire ordering.

A memoryview access costs about a tenth of a microsecond; the PyPI ``atomics`` package costs two
orders of magnitude more per access and is not an option (docs/architecture.md, "Lock protocol").
"""
from __future__ import annotations

import mmap


def u64_view(mm: mmap.mmap | memoryview) -> memoryview:
    """The whole mapping as uint64 items; item i is the counter at byte offset 8*i."""
    mv = memoryview(mm)
    if len(mv) % 8:
        mv = mv[: len(mv) - len(mv) % 8]
    return mv.cast("Q")


def i32_view(mm: mmap.mmap | memoryview) -> memoryview:
    """The whole mapping as int32 items (chain heads, record links); item i is at byte offset 4*i."""
    mv = memoryview(mm)
    if len(mv) % 4:
        mv = mv[: len(mv) - len(mv) % 4]
    return mv.cast("i")


def u32_view(mm: mmap.mmap | memoryview) -> memoryview:
    """The whole mapping as uint32 items (futex words)."""
    mv = memoryview(mm)
    if len(mv) % 4:
        mv = mv[: len(mv) - len(mv) % 4]
    return mv.cast("I")
