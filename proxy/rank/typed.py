"""Sends and receives of derived datatypes (shmproxy.mpi.typemap.TypedBuffer), rank side.

The rank never packs: it registers the type's block list with the communicator's progress process
once (TYPE_REGISTER, cached per communicator by the list's content, so re-creating the same layout
costs no new registration), and posts the op with FLAG_TYPED, the type id and the instance count
(shmproxy.core.ops; shmproxy.shm.typed does the copying). The op's buffer is the *region* the
instances touch, from the type's true lower bound, registered or staged as any buffer:

- a staged send copies the whole region into staging (gaps included: one plain copy);
- a staged receive copies the region *in* first and the whole region back out at completion, so the
  gaps between the type's blocks come back as they were: the copy-out stays one plain contiguous copy
  while the progress process scatters into the staging buffer. The cost of that: two receives posted
  at once whose types interleave in one unregistered buffer (the even and the odd elements, say)
  would each write back the other's gaps; receive into memory from comm.alloc for that (no staging).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shmproxy.control.protocol import TYPE_MAX_BLOCKS, TYPE_PART_BLOCKS, MsgType
from shmproxy.core import errors
from shmproxy.core.ops import FLAG_TYPED, KIND_RECV
from shmproxy.rank.request import Request
from shmproxy.shm import _native

if TYPE_CHECKING:
    from shmproxy.rank.posting import Posting


class TypedBuffer:
    """A receive or send buffer of ``count`` instances of a committed derived type (a
    shmproxy.mpi.typemap.Derived, built by typemap.typed_buffer): ``region`` is the
    uint8 view of the user's memory they touch (from the type's true lower bound), ``nbytes`` the
    bytes of the message (count x size), ``code`` its dtype code."""

    __slots__ = ("region", "dtype", "count", "nbytes", "code", "out")

    def __init__(self, region: np.ndarray, dtype: Any, count: int, out: bool = False):
        self.region, self.dtype, self.count, self.out = region, dtype, count, out
        self.nbytes, self.code = count * dtype.size, dtype.code

    def copy(self) -> "TypedBuffer":
        return TypedBuffer(self.region.copy(), self.dtype, self.count, self.out)

    def temp_dtype(self) -> np.dtype:
        """The dtype of its contiguous form: the type's one predefined dtype, else bytes."""
        return self.dtype.base if self.dtype.base is not None else np.dtype(np.uint8)

    @property
    def size(self) -> int:
        """Elements of its contiguous form (what a collective counts: shmproxy.mpi.typedcoll)."""
        return self.nbytes // self.temp_dtype().itemsize

    def span(self) -> int:
        """Bytes of the region: (count - 1) extents plus one instance's true extent."""
        d = self.dtype
        return 0 if not self.count or not d.size else (self.count - 1) * d.extent + d.true_ub - d.true_lb


def type_id(posting: "Posting", d: Any) -> int:
    """The id of datatype ``d`` (a typemap.Derived) on the communicator's progress process, registered
    once (``posting.type_ids``)."""
    ids = posting.type_ids
    table = d.table()
    key = (table.tobytes(), d.extent)
    tid = ids.get(key)
    if tid is not None:
        return tid
    if len(table) > TYPE_MAX_BLOCKS:
        raise errors.InvalidArgument(f"a derived datatype of {len(table)} blocks: at most {TYPE_MAX_BLOCKS}")
    tid = len(ids) + 1
    flat = table.reshape(-1).tolist()
    step = 2 * TYPE_PART_BLOCKS
    for at in range(0, max(len(flat), 1), step):
        posting.control(MsgType.TYPE_REGISTER, {"type_id": tid, "extent": d.extent,
                                                "blocks": flat[at:at + step], "more": at + step < len(flat)})
    ids[key] = tid
    return tid


def post(posting: "Posting", kind: int, tb: Any, peer: Any, tag: Any, flags: int) -> Request:
    """Post a send or receive of a TypedBuffer (``tb``) through the communicator's post path
    (shmproxy.rank.posting): every check, registration, staging."""
    posting.check_usable()
    peer = posting.check_peer(peer, "destination" if kind != KIND_RECV else "source", kind == KIND_RECV)
    tag = posting.check_tag(tag, kind == KIND_RECV)
    tid = type_id(posting, tb.dtype)
    region: np.ndarray = tb.region
    span = region.nbytes
    stage = None
    user_addr = 0
    if kind == KIND_RECV:
        try:
            addr = _native.buffer_info(region, True)[0]
        except (BufferError, ValueError):
            raise errors.InvalidArgument("receive buffer is read-only") from None
        found = posting.registry.find(addr, span)
        if found is None:
            stage = posting.staging.get(span)
            if span:
                _native.memcopy(stage[1].addr, addr, span)   # the gaps come back unchanged (see above)
            found, user_addr = (stage[0], 0), addr
    else:
        try:
            addr = _native.buffer_info(region, False)[0]
            found = posting.registry.find(addr, span)
        except (BufferError, ValueError):
            addr, found = 0, None
        if found is None:
            found, stage = posting.stage_send(region, addr, span)
    req = posting.emit(kind, tb.code, 0, flags | FLAG_TYPED, peer, tag, found[0], found[1], tb.nbytes,
                       tb.count, -1, tid, 0, 0, tb, stage, user_addr)
    if user_addr:
        req._extra = (None, span)   # copy the whole region out, not the message's bytes
    return req
