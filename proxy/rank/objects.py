"""Python objects over a Comm: the lower-case layer of mpi4py, its wire format and its blocking send and
receive, as module functions that take the communicator first (the nonblocking ones in objp2p.py,
the collectives in objcoll.py, the per-communicator state in objstate.py).

    from shmproxy.rank import objcoll, objects
    objects.send(comm, {"step": 3, "grad": np.zeros(1 << 20)}, dest=1, tag=5)
    obj = objects.recv(comm, source=0, tag=5)
    conf = objcoll.bcast(comm, conf if comm.rank == 0 else None, root=0)
    total = objcoll.allreduce(comm, local_loss, "SUM")

Serialization: pickle protocol 5 with out-of-band buffers. Every ``pickle.PickleBuffer`` the pickler
meets (numpy arrays, C- or Fortran-contiguous, of at least OOB_MIN_BYTES) is handed to our
buffer_callback and travels as a message of its own, straight from the array's memory: the pickle
stream holds no copy of it. The receiver allocates one fresh uint8 array per buffer, receives into it
and gives the list to ``pickle.loads(buffers=...)``, so the arrays it rebuilds are views of the
received memory (no further copy). Smaller and non-contiguous buffers stay in-band (pickle decides
how; a non-contiguous PickleBuffer is refused by pickle itself and reported as below).

Wire format (no receive-size guess). One object on (source, dest, tag) is a sequence of messages that,
since messages of one pair and tag never overtake each other, arrive in order:

    1. header, int64, at most HDR_WORDS words (the receiver always posts HDR_WORDS):
         [0] MAGIC            identifies an object message (and the version of this format)
         [1] op | flags<<8    op: OP_P2P, OP_BCAST, ...; flags: FLAG_INLINE, FLAG_ERROR
         [2] seq              the communicator's object-collective counter (0 for send/recv)
         [3] nbufs            out-of-band buffers that follow
         [4] plen             bytes of the main pickle (or of the error text)
         [5] nlen             buffer lengths carried in this header: nbufs, or 0 when they do not fit
         [6 .. 6+nlen)        len(buf_0) ... len(buf_k)
         then, with FLAG_INLINE, the main pickle itself (plen bytes, zero-padded to whole words)
    2. only when nlen < nbufs: int64 [nbufs]: every buffer length
    3. only without FLAG_INLINE: uint8 [plen]: the main pickle
    4. uint8 [len(buf_i)] for each out-of-band buffer, in pickling order

So a small object (a scalar, a short list, None) is one message of a few dozen bytes. FLAG_ERROR
marks a header whose payload is an error text (utf-8) instead of a pickle: collectives use it to tell
the other ranks that a contribution could not be pickled (or a reduction failed), so every rank
leaves the collective in step and raises, and the communicator stays usable.

Wildcards: recv with ANY_SOURCE or ANY_TAG (the defaults, as in mpi4py) first takes the next header it
accepts out of matching with a matched probe (Comm.Mprobe), then receives the rest of that object from
its actual (source, tag); ANY_TAG never matches the reserved tags below. The nonblocking and combined
calls (isend, irecv, sendrecv, probe, iprobe) are in objp2p.py.

Tags: send/recv use the user's tag. Collectives use the reserved tag OBJ_COLL_TAG; every tag below
OBJ_TAG_BASE (= -2**62) is reserved for shmproxy's internal traffic, and send/recv refuse them. Since
every rank calls collectives in the same order and one pair's messages on one tag are FIFO, one tag is
enough; the header's op and seq words turn a mismatch (rank 0 in bcast, rank 1 in gather) into an
InvalidUsage instead of silently wrong data.

Collectives run over point-to-point for now, rooted (a later change can move bcast onto comm.Bcast):
bcast = the root sends to every other rank (all sends in one comm.group()); gather = every rank sends to
the root, which posts all header receives at once; allgather = gather to rank 0 + bcast of the list;
allreduce = gather to rank 0, reduce in rank order there, bcast of the result (so every rank gets the
identical result, and the reducer runs once); barrier = gather + bcast of empty headers.

Sends are buffered: every array (registered memory's too: comm.alloc, the numpy arena) is copied
into staging memory when its message is posted, so once every message of an object is posted the
caller's memory is free and send (and the sending side of a collective) returns without waiting for
the receiver, like an eager MPI_Send. So receives may pick tags in any order (within the rank's
SHMPROXY_MAX_OPS_PER_RANK requests in flight: a sender out of request slots waits for its receiver).
The error of a buffered send that fails later (the receiver closed first) is raised at the end of
the next object call on the communicator. An object a rank sends to itself never enters the
runtime: it waits, pickled, in a FIFO per tag on the Comm (MPI's self channel), so sending to
oneself cannot wait for request slots that only its own receive would free.

One object is at most OOB_MAX_BUFFERS + 3 messages: when more buffers qualify, the largest
OOB_MAX_BUFFERS go out-of-band and the rest in-band.

Semantics, as in mpi4py: every rank gets a copy, the root included (bcast at the root returns a
pickle round trip of ``obj``, gather's list holds a copy of the root's own object), so results never
alias the caller's objects, and an unpicklable object fails the same way at any size and root.
An object that cannot be pickled raises InvalidArgument on its rank before anything of it is sent; in
a collective the other ranks raise RemoteError naming that rank. Errors of the communicator itself
(PeerDiedError, Timeout, Aborted, ...) propagate unchanged.

What this module uses of Comm beyond its public API: ``_check_usable()`` (so that operations that send
nothing, at size 1, still raise Closed or the communicator's error), ``Request._stage`` (was the send
staged?), and three attributes it sets on the Comm (``_objects_coll_seq``, ``_objects_unwaited``,
``_objects_to_self``). Those attributes, the argument checks and the object reducers are in
objstate.py; the wire format, the operations and their module-level tunables stay here (tests and
bodies set ``objects.HDR_WORDS`` and friends, which the framing reads at call time).
"""
from __future__ import annotations

import collections
import pickle
import struct
from typing import Any, Callable

import numpy as np

from shmproxy.core import errors
from shmproxy.core.ops import ANY_SOURCE, ANY_TAG, KIND_SEND
from shmproxy.rank.objstate import (OBJ_COLL_TAG, OBJ_TAG_BASE, _SELF_ATTR, _complete_sends, _enter, _peer,
                                    _public, _user_tag)
from shmproxy.rank.request import Request, Status

__all__ = ["send", "recv", "recv_status", "OBJ_TAG_BASE",
           "OBJ_COLL_TAG", "OOB_MIN_BYTES", "OOB_MAX_BUFFERS", "HDR_WORDS"]

# Buffers smaller than this are pickled in-band: one more message costs more than copying them. The
# crossover lies between 32 and 64 KiB, since a large pickle grows past SHMPROXY_EAGER_BYTES and
# leaves the eager path.
OOB_MIN_BYTES = 64 << 10
# At most this many buffers of one object go out-of-band (the largest): each is a message, and so a
# request slot of the sender and of the receiver while in flight (SHMPROXY_MAX_OPS_PER_RANK).
OOB_MAX_BUFFERS = 128

# Header capacity (8 KiB): the receiver's first buffer. A main pickle that fits travels inside the
# header (one message instead of two: about half the latency of a small object), and
# so do up to HDR_WORDS - 6 buffer lengths. Only the words used are sent.
HDR_WORDS = 1024
MAGIC = 0x53504F424A310001          # "SPOBJ1" + format version 1
_FIXED = 6                          # words before the lengths
H_MAGIC, H_OPFLAGS, H_SEQ, H_NBUFS, H_PLEN, H_NLEN = range(_FIXED)
FLAG_INLINE = 1
FLAG_ERROR = 2
OP_P2P, OP_BCAST, OP_GATHER, OP_ALLGATHER, OP_ALLREDUCE, OP_BARRIER = range(6)
_OP_NAMES = {OP_P2P: "send/recv", OP_BCAST: "bcast", OP_GATHER: "gather", OP_ALLGATHER: "allgather",
             OP_ALLREDUCE: "allreduce", OP_BARRIER: "barrier"}
# shmproxy.rank.objcoll's
OP_SCATTER, OP_ALLTOALL, OP_REDUCE, OP_SCAN, OP_EXSCAN = range(6, 11)
_OP_NAMES.update({OP_SCATTER: "scatter", OP_ALLTOALL: "alltoall", OP_REDUCE: "reduce", OP_SCAN: "scan",
                  OP_EXSCAN: "exscan"})

_FIXED_FMT = f"={_FIXED}q"
_pack_into = struct.pack_into
_unpack_from = struct.unpack_from


# ------------------------------------------------------------------------------ serialization
class _Out:
    """One object ready to send: the main pickle (or error text) and its out-of-band buffers."""

    __slots__ = ("data", "bufs", "flags")

    def __init__(self, data: bytes, bufs: list[memoryview], flags: int = 0):
        self.data, self.bufs, self.flags = data, bufs, flags

    @classmethod
    def error(cls, text: str) -> "_Out":
        raw = text.encode("utf-8", "replace")[:(HDR_WORDS - _FIXED) * 8]
        return cls(raw, [], FLAG_ERROR)

    def copy(self, what: str) -> Any:
        """What a receiver gets: a pickle round trip, with the buffers copied (no aliasing)."""
        if self.flags & FLAG_ERROR:
            text = self.data.decode("utf-8", "replace")
            exc = errors.RemoteError(f"{what}: {text}")
            exc.marker = text  # type: ignore[attr-defined]
            raise exc
        return _loads(self.data, [np.frombuffer(m, np.uint8).copy() for m in self.bufs], what)


def _pickle(obj: Any, what: str, min_bytes: int, limit: int, at_limit: int) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; contiguous buffers of at least ``min_bytes`` go out-of-band if they are larger
    than ``limit`` bytes, or of exactly ``limit`` bytes and among the first ``at_limit`` such."""
    bufs: list[memoryview] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        nonlocal at_limit
        try:
            raw = pb.raw()
        except BufferError:     # not contiguous: in-band (pickle refuses it if it cannot copy it)
            return True
        n = raw.nbytes
        if n >= min_bytes and (n > limit or (n == limit and at_limit > 0)):
            at_limit -= n == limit
            bufs.append(raw)
            return False
        raw.release()
        return True

    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    except Exception as exc:  # PicklingError, TypeError (locks, sockets), AttributeError (local objects), ...
        raise errors.InvalidArgument(
            f"{what}: cannot pickle the object (a {type(obj).__name__}): {type(exc).__name__}: {exc}; "
            f"nothing was sent") from exc
    return data, bufs


# A serializer of the program's own (shmproxy.MPI.pickle.__init__(dumps, loads), as mpi4py's): (dumps,
# loads) of one bytes-like object, in-band; None: pickle protocol 5 with out-of-band buffers.
CUSTOM: list[tuple[Callable[[Any], Any], Callable[[Any], Any]] | None] = [None]


def _dumps(obj: Any, what: str) -> _Out:
    """Pickle ``obj`` with out-of-band buffers: every contiguous buffer of at least OOB_MIN_BYTES,
    but at most OOB_MAX_BUFFERS of them (the largest; the others in-band), so that one object never
    takes more than a few of the rank's request slots."""
    custom = CUSTOM[0]
    if custom is not None:
        try:
            return _Out(bytes(custom[0](obj)), [])
        except Exception as exc:    # whatever the program's serializer raises for this object
            raise errors.InvalidArgument(f"{what}: the program's pickler cannot serialize the object (a "
                                         f"{type(obj).__name__}): {type(exc).__name__}: {exc}; nothing was "
                                         "sent") from exc
    data, bufs = _pickle(obj, what, OOB_MIN_BYTES, -1, 0)
    if len(bufs) > OOB_MAX_BUFFERS:
        sizes = sorted((m.nbytes for m in bufs), reverse=True)
        limit = sizes[OOB_MAX_BUFFERS - 1]
        at_limit = OOB_MAX_BUFFERS - sum(1 for n in sizes if n > limit)
        for m in bufs:
            m.release()
        data, bufs = _pickle(obj, what, OOB_MIN_BYTES, limit, at_limit)
    return _Out(data, bufs)


def _loads(data: Any, bufs: list[np.ndarray], what: str) -> Any:
    custom = CUSTOM[0]
    try:
        if custom is not None and not bufs:
            return custom[1](data)
        return pickle.loads(data, buffers=bufs)
    except Exception as exc:
        raise errors.InvalidUsage(f"{what}: cannot unpickle the object: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------ sending
def _post_send(comm: Any, out: _Out, dest: int, tag: int, op: int, seq: int) -> list[Request]:
    """Post the messages of one object (see the module doc); the caller waits on the requests."""
    data, bufs = out.data, out.bufs
    nbufs, plen = len(bufs), len(data)
    nlen = nbufs if _FIXED + nbufs <= HDR_WORDS else 0
    words = _FIXED + nlen
    room = (HDR_WORDS - words) * 8
    flags = out.flags
    if plen <= room:
        flags |= FLAG_INLINE
        words += (plen + 7) // 8
    lens = [m.nbytes for m in bufs]
    raw = bytearray(words * 8)
    _pack_into(f"={_FIXED + nlen}q", raw, 0, MAGIC, op | (flags << 8), seq, nbufs, plen, nlen,
               *(lens if nlen else ()))
    if flags & FLAG_INLINE and plen:
        off = (_FIXED + nlen) * 8
        raw[off:off + plen] = data
    hdr = np.frombuffer(raw, np.int64)
    reqs = [comm.Isend(hdr, dest, tag)]
    if nbufs and not nlen:
        reqs.append(comm.Isend(np.array(lens, np.int64), dest, tag))
    if not flags & FLAG_INLINE:
        reqs.append(comm.Isend(np.frombuffer(data, np.uint8), dest, tag))
    for m in bufs:   # buffered whatever memory holds them (the numpy arena too): _complete_sends
        reqs.append(comm._posting.post(KIND_SEND, np.frombuffer(m, np.uint8), dest, tag, buffered=True))
    return reqs


# ------------------------------------------------------------------------------ receiving
class _In:
    """One object being received from ``source`` on ``tag``: its header is received by a receive
    posted now, or, given ``msg`` (a matched probe's Message), as that message."""

    __slots__ = ("source", "tag", "hdr", "req", "reqs", "data", "bufs", "flags", "plen")

    def __init__(self, comm: Any, source: int, tag: int, msg: Any = None):
        self.source, self.tag = source, tag
        self.hdr = np.empty(HDR_WORDS, np.int64)
        self.req = comm.Irecv(self.hdr, source, tag) if msg is None else msg.Irecv(self.hdr)
        self.reqs: list[tuple[Request, int]] = []
        self.data: Any = None
        self.bufs: list[np.ndarray] = []
        self.flags = 0
        self.plen = 0

    def post_body(self, comm: Any, tag: int, op: int, seq: int, what: str) -> None:
        """Wait for the header, check it, and post the receives of the rest of the object."""
        try:
            st = self.req.Wait()
        except errors.TruncationError as exc:
            raise errors.InvalidUsage(f"{what}: the message from rank {self.source} tag {tag} is not an "
                                      f"object message (larger than an object header)") from exc
        hdr, src = self.hdr, self.source
        nb = st.nbytes if st is not None else 0
        if nb % 8 or nb < _FIXED * 8 or _unpack_from("=q", hdr.data)[0] != MAGIC:
            raise errors.InvalidUsage(f"{what}: the message from rank {src} tag {tag} ({nb} B) is not an "
                                      f"object message (sent with Send rather than send?)")
        _magic, opflags, got_seq, nbufs, plen, nlen = fixed = _unpack_from(_FIXED_FMT, hdr.data)
        got_op, flags = opflags & 0xFF, opflags >> 8
        if got_op != op or got_seq != seq:
            raise errors.InvalidUsage(
                f"{what}: ranks disagree on the object operation: this rank is in "
                f"{_OP_NAMES.get(op, op)} #{seq}, rank {src} sent {_OP_NAMES.get(got_op, got_op)} #{got_seq}")
        words = _FIXED + nlen + ((plen + 7) // 8 if flags & FLAG_INLINE else 0)
        if nbufs < 0 or plen < 0 or nlen not in (0, nbufs) or words > HDR_WORDS or nb < 8 * words:
            raise errors.InvalidUsage(f"{what}: malformed object header from rank {src}: "
                                      f"{list(fixed)} in {nb} B")
        self.flags, self.plen = flags, plen
        if nbufs and not nlen:
            lens_arr = np.zeros(nbufs, np.int64)
            st = comm.Recv(lens_arr, src, tag)
            self._check_size(st, lens_arr.nbytes, "buffer lengths", what)
        else:
            lens_arr = hdr[_FIXED:_FIXED + nlen]
        lens = lens_arr.tolist()
        if any(n < 0 for n in lens):
            raise errors.InvalidUsage(f"{what}: negative buffer length from rank {src}: {lens}")
        if flags & FLAG_INLINE:
            off = (_FIXED + nlen) * 8
            self.data = hdr.data.cast("B")[off:off + plen]
        else:
            self.data = np.empty(plen, np.uint8)
            self.reqs.append((comm.Irecv(self.data, src, tag), plen))
        for n in lens:
            buf = np.empty(n, np.uint8)
            self.bufs.append(buf)
            self.reqs.append((comm.Irecv(buf, src, tag), n))

    def _check_size(self, st: Any, expect: int, part: str, what: str) -> None:
        nb = st.nbytes if st is not None else -1
        if nb != expect:
            raise errors.InvalidUsage(f"{what}: rank {self.source} sent {nb} B for the {part}, "
                                      f"its header announced {expect} B")

    def wait(self, what: str) -> None:
        for req, n in self.reqs:
            self._check_size(req.Wait(), n, "object data", what)

    def error_text(self) -> str | None:
        if not self.flags & FLAG_ERROR:
            return None
        return bytes(self.data).decode("utf-8", "replace")

    def load(self, what: str) -> Any:
        text = self.error_text()
        if text is not None:
            exc = errors.RemoteError(f"{what}: {text}")
            exc.marker = text  # type: ignore[attr-defined]  # relayed as is by the root
            raise exc
        return _loads(self.data, self.bufs, f"{what}: the object of rank {self.source}")


# ------------------------------------------------------------------------------ point-to-point
def send_self_sync(comm: Any, obj: Any, tag: int = 0) -> list:
    """An issend to this rank itself: queued as send does, with a token [taken, cancelled] that the
    receive taking the object sets, so that its request completes only then, as MPI's does."""
    token = [False, False]
    send(comm, obj, comm.rank, tag, _token=token)
    return token


def cancel_self_sync(comm: Any, tag: int, token: list) -> bool:
    """Take back an issend to itself that no receive took yet; True if it was still queued."""
    q = (getattr(comm, _SELF_ATTR, None) or {}).get(tag)
    if not q:
        return False
    for entry in list(q):
        if len(entry) > 2 and entry[2] is token:
            q.remove(entry)
            token[1] = True
            return True
    return False


@_public
def send(comm: Any, obj: Any, dest: int, tag: int = 0, _token: list | None = None) -> None:
    """Send a picklable object to ``dest`` (``comm.rank`` itself included).

    Returns once the object no longer needs the caller's memory: at once, since every message is
    copied into staging memory when posted, whatever memory its arrays live in (comm.alloc's and the
    numpy arena's too), so a send does not wait for its receive, as MPI's buffered eager sends.
    Raises InvalidArgument, with nothing sent, if ``obj`` cannot be pickled or an argument is bad."""
    _enter(comm)
    dest = _peer(comm, dest, "destination")
    tag = _user_tag(tag)
    out = _dumps(obj, f"send to rank {dest} tag {tag}")
    if dest == comm.rank:
        # To itself: a local FIFO per tag, as MPI's self channel. Through the runtime a blocking
        # send to self could wait for request slots that only its own later receive frees.
        queues = getattr(comm, _SELF_ATTR, None)
        if queues is None:
            queues = {}
            setattr(comm, _SELF_ATTR, queues)
        bufs = [np.frombuffer(m, np.uint8).copy() for m in out.bufs]  # the caller may reuse its arrays
        queues.setdefault(tag, collections.deque()).append((out.data, bufs) if _token is None
                                                           else (out.data, bufs, _token))
        return
    with comm.group():
        reqs = _post_send(comm, out, dest, tag, OP_P2P, 0)
    _complete_sends(comm, reqs)


def _wild_peer(comm: Any, source: Any, tag: Any) -> tuple[int, int]:
    source = ANY_SOURCE if source == ANY_SOURCE else _peer(comm, source, "source")
    tag = ANY_TAG if tag == ANY_TAG else _user_tag(tag)
    return source, tag


def _from_self(comm: Any, source: int, tag: int, take: bool) -> tuple[Any, int] | None:
    """An object this rank sent itself that a receive (source, tag) accepts: (entry, tag), removed
    when ``take``; None if there is none."""
    if source not in (ANY_SOURCE, comm.rank):
        return None
    queues = getattr(comm, _SELF_ATTR, None) or {}
    for t in ([tag] if tag != ANY_TAG else list(queues)):
        q = queues.get(t)
        if q:
            return (q.popleft() if take else q[0]), t
    return None


def _start_recv(comm: Any, source: int, tag: int, block: bool) -> _In | None:
    """Start receiving one object. With an exact source and tag its header receive is posted at once;
    a wildcard (or a nonblocking start) takes the next header out of matching with a matched probe
    first, so that the rest of the object is received from its actual (source, tag), and no receive
    of ours is left posted where it could take another object's parts. None: nothing there yet."""
    if block and source != ANY_SOURCE and tag != ANY_TAG:
        return _In(comm, source, tag)
    msg = comm.Mprobe(source, tag) if block else comm.Improbe(source, tag)
    if msg is None:
        return None
    return _In(comm, msg.status.source, msg.status.tag, msg)


def _finish_recv(comm: Any, inc: _In, what: str) -> tuple[Any, Status]:
    inc.post_body(comm, inc.tag, OP_P2P, 0, what)
    inc.wait(what)
    nbytes = inc.plen + sum(b.nbytes for b in inc.bufs)
    return inc.load(what), Status(inc.source, inc.tag, nbytes)


def _recv_self(comm: Any, source: int, tag: int, what: str) -> tuple[Any, Status] | None:
    got = _from_self(comm, source, tag, True)
    if got is None:
        return None
    entry, t = got
    data, bufs = entry[0], entry[1]
    if len(entry) > 2:
        entry[2][0] = True      # a synchronous send to itself: now it completes
    return _loads(data, bufs, what), Status(comm.rank, t, len(data) + sum(b.nbytes for b in bufs))


@_public
def recv_status(comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[Any, Status]:
    """recv, and the Status (source, tag, bytes of its pickle and buffers) of the object received."""
    _enter(comm)
    source, tag = _wild_peer(comm, source, tag)
    what = f"recv from {'any rank' if source == ANY_SOURCE else f'rank {source}'} tag " \
           f"{'ANY_TAG' if tag == ANY_TAG else tag}"
    own = _recv_self(comm, source, tag, what)
    if own is not None:
        return own
    # Nothing sent to ourselves that matches: the runtime's receive says why (a buffer message sent
    # with Isend is not an object; none at all times out).
    inc = _start_recv(comm, source, tag, True)
    assert inc is not None
    return _finish_recv(comm, inc, what)


def recv(comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
    """Receive an object sent with ``send`` from ``source`` on ``tag`` (ANY_SOURCE and ANY_TAG, the
    defaults, take the earliest object any rank sent on any user tag, in MPI's matching order)."""
    return recv_status(comm, source, tag)[0]
