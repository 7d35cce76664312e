"""Posting the collectives past the C post path: Gather, Scatter, Gatherv, Scatterv, Allgatherv,
Alltoallv, Reduce_scatter (with counts), Scan and Exscan. The progress process runs them
(shmproxy.coll.vector); nothing here moves data between ranks.

The 128-byte op record holds one count. What differs per rank (counts and displacements) travels in a
*counts table* (shmproxy.core.counts: 4 x size int64, in elements) at the start of a registered
staging buffer whose id the record carries in its tag word, which collectives do not otherwise use.
A send buffer outside registered memory is staged in the same buffer after the table, so the request
gives back one staging buffer when it completes. The progress process copies the table once, checks
every block against the registered buffers and that every pair of ranks agrees on what moves
between them.

Device arrays (both buffers this rank uses on one device; a host/device mix is refused here) are
never staged: they are located in the rank's own allocation (shmproxy.rank.device), the record carries
their memory word, and the progress process queues the collective on its GPU stream
(shmproxy.transports.cuda_coll_vector). The counts table stays in host staging memory even then: only the
progress process's Python reads it.

Every check that can fail raises here, before anything is posted. Arguments that only the root reads
(the root's counts) are checked on the root alone; a mismatch between ranks is the progress
process's to find, and it fails the communicator naming both ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from shmproxy.core import counts as T, errors
from shmproxy.core.memory import mem_device
from shmproxy.core.ops import (COLL_NAMES, DTYPE_BFLOAT16, DTYPE_CODE, FLAG_IN_PLACE, FLAG_NO_RECV,
                               FLAG_STREAM_WORD, IN_PLACE, KIND_COLL, SUPPORTED_DTYPES, Coll, ReduceOp, check_op)
from shmproxy.rank.request import Request
from shmproxy.shm import _native

if TYPE_CHECKING:
    from shmproxy.rank.posting import Posting

_ROOTED = frozenset((Coll.GATHER, Coll.SCATTER, Coll.GATHERV, Coll.SCATTERV))
_REDUCING = frozenset((Coll.REDUCE_SCATTER, Coll.SCAN, Coll.EXSCAN))


def _code(buf: Any, what: str, dev: Any = None) -> int:
    """The record's dtype code of a host array, or (``dev``) of a device array ``_device`` made."""
    if dev is not None:
        code = dev.dtype_code(buf)
    elif type(buf) is not np.ndarray:
        raise errors.InvalidArgument(f"{what} must be a numpy array, got {type(buf).__name__}")
    else:
        code = DTYPE_CODE.get(buf.dtype.char)
    if code is None:
        raise errors.InvalidArgument(f"{what}: unsupported dtype {buf.dtype}; supported: {SUPPORTED_DTYPES}"
                                     + (", bfloat16 (device)" if dev is not None else ""))
    return code


def _ints(seq: Any, size: int, what: str) -> list[int]:
    """A sequence of ``size`` non-negative ints (counts or displacements)."""
    if seq is None or isinstance(seq, (str, bytes)):
        raise errors.InvalidArgument(f"{what}: expected a sequence of {size} ints, got {seq!r}")
    try:
        vals = list(seq)
    except TypeError:
        raise errors.InvalidArgument(f"{what}: expected a sequence of {size} ints, got "
                                     f"{type(seq).__name__}") from None
    if len(vals) != size:
        raise errors.InvalidArgument(f"{what}: {len(vals)} values for {size} ranks")
    out = []
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise errors.InvalidArgument(f"{what}: {v!r} is not an int")
        if v < 0:
            raise errors.InvalidArgument(f"{what}: negative value {int(v)}")
        out.append(int(v))
    return out


def _vector(counts: Any, displs: Any, size: int, nelem: int, name: str,
            what: str) -> tuple[list[int], list[int]]:
    """Counts and displacements of ``size`` blocks in a buffer of ``nelem`` elements; displacements
    default to the blocks packed in rank order."""
    cs = _ints(counts, size, f"{name} {what}counts")
    if displs is None:
        ds, acc = [], 0
        for c in cs:
            ds.append(acc)
            acc += c
    else:
        ds = _ints(displs, size, f"{name} {what}displs")
    for r, (c, d) in enumerate(zip(cs, ds)):
        if d + c > nelem:
            raise errors.InvalidArgument(f"{name}: block {r} ({c} elements at {d}) does not fit the "
                                         f"{what}buf of {nelem} elements")
    return cs, ds


def post(posting: "Posting", coll: int, sendbuf: Any, recvbuf: Any, root: int = 0, op: Any = 0,
         scounts: Sequence[int] | None = None, sdispls: Sequence[int] | None = None,
         rcounts: Sequence[int] | None = None, rdispls: Sequence[int] | None = None,
         stream: Any = None) -> Request:
    """Validate one call, write its counts table, locate (or stage) its buffers and post it, through
    the communicator's post path (shmproxy.rank.posting)."""
    posting.check_usable()
    C = Coll
    name = COLL_NAMES[coll]
    size, me = posting.size, posting.rank
    if coll in _ROOTED:
        root = posting.check_root(root)
    else:
        root = 0
    is_root = me == root
    send_in_place = sendbuf is IN_PLACE
    recv_in_place = recvbuf is IN_PLACE
    # Which sides this rank has: a rooted collective's other side is only the root's business.
    has_send = not send_in_place and not (coll in (C.SCATTER, C.SCATTERV) and not is_root)
    has_recv = not recv_in_place and not (coll in (C.GATHER, C.GATHERV) and not is_root)
    if recv_in_place and not (coll in (C.SCATTER, C.SCATTERV) and is_root):
        raise errors.InvalidArgument(f"{name}: IN_PLACE is the sendbuf's (the root's recvbuf for Scatter)")
    if send_in_place and (coll == C.ALLTOALLV or (coll in (C.GATHER, C.GATHERV) and not is_root)):
        raise errors.InvalidArgument(f"{name}: IN_PLACE is not allowed here"
                                     + ("" if coll == C.ALLTOALLV else " (only on the root)"))
    keep: tuple = (sendbuf, recvbuf)
    dev, mem = None, 0
    if (has_send and type(sendbuf) is not np.ndarray) or (has_recv and type(recvbuf) is not np.ndarray):
        # device memory (both buffers this rank uses, one device), or the mix refused: the post path's check
        given = (sendbuf, recvbuf)
        sendbuf, recvbuf, mem = posting.device_args(name, sendbuf if has_send else None,
                                                    recvbuf if has_recv else None)
        if mem and posting.node_layout is not None:   # across nodes: through host memory (rank/devstage.py)
            # the receive buffer is copied in too: blocks the call does not write keep their values
            return posting.across_nodes().collective(
                coll, name, sendbuf, recvbuf, True, root, me, stream,
                lambda send, recv: post(posting, coll, given[0] if send is None else send,
                                        given[1] if recv is None else recv, root, op, scounts, sdispls,
                                        rcounts, rdispls))
        dev = posting.device_memory() if mem else None
        keep += (sendbuf, recvbuf)
    scode = _code(sendbuf, f"{name} sendbuf", dev) if has_send else 0
    rcode = _code(recvbuf, f"{name} recvbuf", dev) if has_recv else 0
    if scode and rcode and scode != rcode:
        raise errors.InvalidArgument(f"{name}: sendbuf is {sendbuf.dtype}, recvbuf {recvbuf.dtype}")
    if not (scode or rcode):
        raise errors.InvalidArgument(f"{name}: IN_PLACE needs the other buffer")
    code = scode or rcode
    dtype = (sendbuf if scode else recvbuf).dtype
    in_place = send_in_place or recv_in_place
    redop = 0
    if coll in _REDUCING:
        if not isinstance(op, (int, np.integer)) or isinstance(op, bool):
            raise errors.InvalidArgument(f"{name}: op must be shmproxy.SUM, PROD, MIN, MAX or AVG, got "
                                         f"{op!r} ({type(op).__name__})")
        redop = int(op)
        check_op(redop, np.dtype(np.float32) if code == DTYPE_BFLOAT16 else dtype)
        if redop == ReduceOp.AVG and coll != C.REDUCE_SCATTER:
            raise errors.InvalidArgument(f"{name}: AVG is not defined for a prefix reduction")
    ssize = sendbuf.size if scode else 0
    rsize = recvbuf.size if rcode else 0
    table: np.ndarray | None = None
    if coll == C.GATHER:
        count = ssize if scode else (rsize // size if rsize % size == 0 else -1)
        if is_root and rsize != count * size:
            raise errors.InvalidArgument(f"{name}: recvbuf needs {size} blocks of the sendbuf's {count} "
                                         f"elements, has {rsize}")
    elif coll == C.SCATTER:
        count = rsize if rcode else (ssize // size if ssize % size == 0 else -1)
        if is_root and ssize != count * size:
            raise errors.InvalidArgument(f"{name}: sendbuf needs {size} blocks of the recvbuf's {count} "
                                         f"elements, has {ssize}")
    elif coll == C.GATHERV:
        table = T.empty(size)
        if is_root:
            table[T.RCOUNTS], table[T.RDISPLS] = _vector(rcounts, rdispls, size, rsize, name, "recv")
        count = int(table[T.RCOUNTS][root]) if send_in_place else ssize
        if is_root and not send_in_place and count != table[T.RCOUNTS][root]:
            raise errors.InvalidArgument(f"{name}: the root's sendbuf has {count} elements, its "
                                         f"recvcounts[{root}] says {table[T.RCOUNTS][root]}")
    elif coll == C.SCATTERV:
        table = T.empty(size)
        if is_root:
            table[T.SCOUNTS], table[T.SDISPLS] = _vector(scounts, sdispls, size, ssize, name, "send")
        count = int(table[T.SCOUNTS][root]) if recv_in_place else rsize
        if is_root and not recv_in_place and count != table[T.SCOUNTS][root]:
            raise errors.InvalidArgument(f"{name}: the root's recvbuf has {count} elements, its "
                                         f"sendcounts[{root}] says {table[T.SCOUNTS][root]}")
    elif coll == C.ALLGATHERV:
        table = T.empty(size)
        table[T.RCOUNTS], table[T.RDISPLS] = _vector(rcounts, rdispls, size, rsize, name, "recv")
        count = int(table[T.RCOUNTS][me]) if in_place else ssize
        if count != table[T.RCOUNTS][me]:
            raise errors.InvalidArgument(f"{name}: sendbuf has {count} elements, recvcounts[{me}] says "
                                         f"{table[T.RCOUNTS][me]}")
    elif coll == C.ALLTOALLV:
        table = T.empty(size)
        table[T.SCOUNTS], table[T.SDISPLS] = _vector(scounts, sdispls, size, ssize, name, "send")
        table[T.RCOUNTS], table[T.RDISPLS] = _vector(rcounts, rdispls, size, rsize, name, "recv")
        if table[T.SCOUNTS][me] != table[T.RCOUNTS][me]:
            raise errors.InvalidArgument(f"{name}: sendcounts[{me}] is {table[T.SCOUNTS][me]} but "
                                         f"recvcounts[{me}] is {table[T.RCOUNTS][me]} (what this rank sends "
                                         f"itself)")
        count = 0
    elif coll == C.REDUCE_SCATTER:
        table = T.empty(size)
        if rcounts is None:   # equal blocks: the recvbuf's size (the whole vector's share, in place)
            if in_place and rsize % size:
                raise errors.InvalidArgument(f"{name}: IN_PLACE without recvcounts needs a recvbuf of {size} "
                                             f"equal blocks, has {rsize} elements")
            rcounts = [rsize // size if in_place else rsize] * size
        table[T.RCOUNTS], table[T.RDISPLS] = _vector(rcounts, None, size, 1 << 62, name, "recv")
        total = int(table[T.RCOUNTS].sum())
        count = int(table[T.RCOUNTS][me])
        full = rsize if in_place else ssize
        if full < total:
            raise errors.InvalidArgument(f"{name}: {'recvbuf' if in_place else 'sendbuf'} has {full} "
                                         f"elements, the recvcounts add up to {total}")
        if not in_place and rsize < count:
            raise errors.InvalidArgument(f"{name}: recvbuf has {rsize} elements, recvcounts[{me}] is {count}")
    else:  # SCAN, EXSCAN
        count = rsize
        if scode and ssize != count:
            raise errors.InvalidArgument(f"{name}: sendbuf has {ssize} elements, recvbuf {rsize}")
    if count < 0:
        raise errors.InvalidArgument(f"{name}: the buffer of {rsize or ssize} elements is not {size} equal "
                                     f"blocks")
    # Locate the buffers; the counts table and a staged send share one staging buffer.
    snb = sendbuf.nbytes if scode else 0
    rnb = recvbuf.nbytes if rcode else 0
    send_found = None
    send_addr = 0
    dev_stream = None
    if dev is not None:   # never staged: located in the rank's own allocation
        if stream is not None:
            dev_stream = dev.as_stream(stream, mem_device(mem))
        if scode:
            send_found = dev.locate(sendbuf)[:2]
    elif scode:
        try:
            send_addr = _native.buffer_info(sendbuf, False)[0]
            send_found = posting.registry.find(send_addr, snb)
        except (BufferError, ValueError):
            send_addr = 0
    tbytes = T.nbytes(size) if table is not None else 0
    soff = -(-tbytes // 64) * 64
    aux = None
    if table is not None or (scode and send_found is None):
        aux = posting.staging.get(soff + (snb if scode and send_found is None else 0) or 8)
    meta = 0
    if table is not None:
        assert aux is not None
        T.write(aux[1].mm, table)
        meta = aux[0]
    send_loc = (0, 0)
    if scode:
        if send_found is not None:
            send_loc = send_found
        else:
            assert aux is not None
            if send_addr:
                _native.memcopy(aux[1].addr + soff, send_addr, snb)
            elif snb:
                view = np.frombuffer(aux[1].mm, dtype=sendbuf.dtype, count=sendbuf.size, offset=soff)
                np.copyto(view, sendbuf.reshape(-1))
                del view
            send_loc = (aux[0], soff)
    flags = FLAG_IN_PLACE if in_place else 0
    recv_loc: tuple = (0, 0, None, 0)
    if rcode:
        # copied in: blocks this collective does not write (gaps, Exscan on rank 0) keep their values
        recv_loc = posting.locate(recvbuf, True, copy_in=True, what=f"{name} recvbuf")
    else:
        flags |= FLAG_NO_RECV
    return _emit(posting, coll, code, redop, flags, root, meta, send_loc, snb, count, recv_loc, rnb,
                 keep, aux, mem, dev_stream)


def _emit(posting: "Posting", coll: int, code: int, redop: int, flags: int, root: int, meta: int,
          send_loc: tuple, snb: int, count: int, recv_loc: tuple, rnb: int, keep: tuple, aux: Any,
          mem: int = 0, stream: Any = None) -> Request:
    """Fill the record (the counts table's buffer id in the tag word) and post it. Device memory
    (``mem``): the request's event is recorded first on ``stream`` (None: the current one)."""
    slot, index = posting.waiter.claim()
    pp = posting.pp
    # pp.write takes seq + 1 (device memory: made when the buffers were located)
    if mem and posting.device_memory().record(slot, pp.seq + 1, mem_device(mem), stream):
        flags |= FLAG_STREAM_WORD
    pp.coll_seq += 1
    seq = pp.write(index, slot, KIND_COLL, code, redop, flags, root, meta, send_loc[0], send_loc[1], snb,
                   count, recv_loc[0], recv_loc[1], rnb, pp.coll_seq, coll, mem)
    req = Request(posting.comm, slot, seq, KIND_COLL, root, coll, max(snb, rnb), keep, recv_loc[2],
                  recv_loc[3], pp)
    if aux is not None or recv_loc[2] is not None:
        req._extra = (aux, rnb)
    posting.waiter.pending[slot] = req
    pp.enqueue(index)
    return req
