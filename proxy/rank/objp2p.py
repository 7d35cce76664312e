"""The object layer's nonblocking and combined point-to-point calls (mpi4py's isend, irecv, sendrecv,
probe, iprobe) over objects.py's wire format, as module functions that take the communicator first.

isend pickles and posts at once, like send; irecv posts nothing until its request is tested or waited
for: an object's size is unknown until its header is in, so its receive is a matched probe
(Improbe/Mprobe) followed by receives from the object's actual source and tag (objects._start_recv),
and no receive of this rank is left posted where it could take another object's parts.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmproxy.core.ops import ANY_SOURCE, ANY_TAG
from shmproxy.rank.objects import (OP_P2P, _dumps, _finish_recv, _from_self, _loads, _post_send, _start_recv,
                                   _wild_peer, recv, recv_status, send)
from shmproxy.rank.objstate import _complete_sends, _enter, _peer, _public, _user_tag
from shmproxy.rank.request import Request, Status

__all__ = ["ObjRequest", "isend", "irecv", "sendrecv", "probe", "iprobe", "deliver_to_posted"]

_POSTED = "_objp2p_pending_irecvs"    # per communicator: its irecvs not complete yet, in post order


class ObjRequest:
    """The request of isend/irecv: ``wait()`` (the object for irecv, None for isend), ``test()`` ->
    (done, object or None), ``Wait``/``Test`` as aliases, and ``status`` once complete."""

    __slots__ = ("_comm", "_sends", "_recv", "_done", "_value", "status")

    def __init__(self, comm: Any, sends: list[Request] | None = None, recv: tuple[int, int] | None = None):
        self._comm, self._sends, self._recv = comm, sends, recv
        self._done, self._value = False, None
        self.status: Status | None = None

    def wait(self, status: Any = None) -> Any:
        if not self._done:
            if self._sends is not None:
                _complete_sends(self._comm, self._sends)
            else:
                assert self._recv is not None
                self._value, self.status = recv_status(self._comm, *self._recv)
            self._set_done()
        return self._value

    def _set_done(self) -> None:
        self._done = True
        posted = getattr(self._comm, _POSTED, None)
        if posted and self in posted:
            posted.remove(self)

    def test(self, status: Any = None) -> tuple[bool, Any]:
        if not self._done:
            if self._sends is not None:
                if all(r.Test() for r in self._sends if getattr(r, "_stage", None) is None):
                    return True, self.wait()
                return False, None
            assert self._recv is not None
            source, tag = self._recv
            if _from_self(self._comm, source, tag, False) is not None:
                return True, self.wait()
            inc = _start_recv(self._comm, source, tag, False)
            if inc is None:
                return False, None
            what = f"irecv from rank {inc.source} tag {inc.tag}"
            self._value, self.status = _finish_recv(self._comm, inc, what)
            self._set_done()
        return True, self._value

    Wait = wait

    def Test(self) -> bool:
        return self.test()[0]


@_public
def isend(comm: Any, obj: Any, dest: int, tag: int = 0) -> ObjRequest:
    """Nonblocking send: the object is pickled and its messages posted now; wait() returns once the
    caller's memory is free (see send)."""
    _enter(comm)
    dest = _peer(comm, dest, "destination")
    tag = _user_tag(tag)
    if dest == comm.rank:
        send(comm, obj, dest, tag)
        return ObjRequest(comm, [])
    out = _dumps(obj, f"isend to rank {dest} tag {tag}")
    with comm.group():
        reqs = _post_send(comm, out, dest, tag, OP_P2P, 0)
    return ObjRequest(comm, reqs)


@_public
def irecv(comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> ObjRequest:
    """Nonblocking receive of an object: nothing is posted until the request is tested or waited for
    (an object's size is unknown until its header is in), so no receive of this rank is left where it
    could take another object's parts."""
    _enter(comm)
    req = ObjRequest(comm, recv=_wild_peer(comm, source, tag))
    posted = getattr(comm, _POSTED, None)
    if posted is None:
        posted = []
        setattr(comm, _POSTED, posted)
    posted.append(req)
    return req


def deliver_to_posted(comm: Any, obj: Any, tag: int) -> bool:
    """A send of this rank to itself, handed to the earliest irecv of this rank that accepts it (and
    has no earlier object of this rank waiting for it), as MPI matches a send with a posted receive:
    True if one took it, which then is complete. (Its receives post nothing until tested, so an
    issend to itself would otherwise wait for a receive that never looks.)"""
    for req in list(getattr(comm, _POSTED, None) or ()):
        source, rtag = req._recv
        if req._done or source not in (ANY_SOURCE, comm.rank) or rtag not in (ANY_TAG, tag):
            continue
        if _from_self(comm, source, rtag, False) is not None:
            continue        # it takes the object sent before this one
        out = _dumps(obj, f"send to rank {comm.rank} tag {tag}")
        bufs = [np.frombuffer(m, np.uint8).copy() for m in out.bufs]
        req._value = _loads(out.data, bufs, f"irecv from rank {comm.rank} tag {tag}")
        req.status = Status(comm.rank, tag, len(out.data) + sum(b.nbytes for b in bufs))
        req._set_done()
        return True
    return False


@_public
def sendrecv(comm: Any, sendobj: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE,
             recvtag: int = ANY_TAG) -> Any:
    """Send ``sendobj`` to ``dest`` and receive an object from ``source``: the send is posted first and
    waited for last, so ranks that exchange with each other do not wait for one another."""
    req = isend(comm, sendobj, dest, sendtag)
    value = recv(comm, source, recvtag)
    req.wait()
    return value


@_public
def probe(comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status:
    """Wait until an object (source, tag) can be received; its Status says its source and tag (nbytes:
    of its first message). The object stays for recv."""
    _enter(comm)
    source, tag = _wild_peer(comm, source, tag)
    got = _from_self(comm, source, tag, False)
    if got is not None:
        return Status(comm.rank, got[1], 0)
    return comm.Probe(source, tag)


@_public
def iprobe(comm: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Status | None:
    """probe that answers at once: the Status, or None when no object (source, tag) is there yet."""
    _enter(comm)
    source, tag = _wild_peer(comm, source, tag)
    got = _from_self(comm, source, tag, False)
    if got is not None:
        return Status(comm.rank, got[1], 0)
    return comm.Iprobe(source, tag)
