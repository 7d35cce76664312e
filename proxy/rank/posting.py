"""Posting: validate (raise before anything is posted), find or stage the buffers, fill the record.

Isend/Irecv and the buffer collectives of each communicator are bound to the C post path
(shm/_poster.c); ``Posting`` is the full Python path it falls back to for everything uncommon, with
every check and its message, and the only path of what it never takes (probes, cancels, derived
datatypes, device memory, the collectives of shmproxy.rank.collpost). The collective checks run
identically on every rank, so that a call passes or fails everywhere alike and the ranks' sequences
of collectives stay in step.

``Posting`` is a component of shmproxy.rank.comm.Comm (``comm._posting``), made when the ops pool is
mapped (rank/lifecycle.py, ``_attach_pool``), after the C poster and the waiter. It takes what a post
needs: who the rank is and the communicator's parameters, the C poster (sequence numbers, the
record's writing, the splice), the waiter (the records and slots a post claims, the pending
requests), the buffer registry and the staging cache, where this rank's completion slots are (for
device memory's stream-order words), and three calls of the lifecycle (``CommCalls``). It owns what
only posts make: device memory (on first need), the staging of device buffers across nodes, and the
derived datatypes registered. The requests it makes carry the communicator (``comm``: Request._comm,
what Wait, Test and Cancel go back to), which it never calls.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from shmproxy.core import errors, log, params as params_mod
from shmproxy.control.protocol import MsgType
from shmproxy.core.memory import MemKind, device_array_kind, mem_device, mem_word
from shmproxy.core.ops import (COLL_NAMES, DTYPE_BFLOAT16, DTYPE_CODE, FLAG_IN_PLACE, FLAG_MPROBED, FLAG_NO_RECV,
                               FLAG_STREAM_WORD, IN_PLACE, KIND_CANCEL, KIND_COLL, KIND_PROBE, KIND_RECV, KIND_SEND,
                               SUPPORTED_DTYPES, TAG_MAX, TAG_MIN, Coll, ANY_SOURCE, ANY_TAG, check_op)
from shmproxy.rank import typed
from shmproxy.rank.buffers import Registry, StagingCache
from shmproxy.rank.typed import TypedBuffer
from shmproxy.rank.device import DeviceMemory, call_key, message_key
from shmproxy.rank.devstage import DeviceStaging
from shmproxy.rank.request import Request
from shmproxy.rank.waiting import Waiter
from shmproxy.shm import _native

_log = log.get("RANK")
_buffer_info = _native.buffer_info
_DTYPE_CODE = DTYPE_CODE


class CommCalls(NamedTuple):
    """What a post asks of the communicator's lifecycle (rank/lifecycle.py)."""
    usable: Callable[[], None]            # raise the communicator's error if it is closed or failed
    control: Callable[[MsgType, dict], dict]   # a blocking service call (REGISTER, TYPE_REGISTER)
    failed_now: Callable[[], bool]        # whether it failed, recorded if so (device memory's failure watch)


class Posting:
    """Argument checks, buffer location and staging, and the record a post fills."""

    def __init__(self, comm: object, rank: int, size: int, params: params_mod.Params,
                 node_layout: dict | None, pp: Any, waiter: Waiter, registry: Registry, staging: StagingCache,
                 slots: tuple[int, int, int], calls: CommCalls):
        self.comm = comm                  # what the requests carry (Request._comm); never called here
        self.rank, self.size, self.params = rank, size, params
        self.node_layout = node_layout    # the nodes' layout, when the communicator spans nodes
        self.pp = pp                      # the C poster (shm/_poster.c)
        self.waiter = waiter              # the records and slots a post claims, the pending requests
        self.registry, self.staging = registry, staging
        self.slots = slots                # this rank's completion slots: (address of slot 0, first, count)
        # The calls as attributes of their own: a post's check is one lookup, as a method of the Comm was.
        self.check_usable, self.control, self.failed_now = calls
        self.device: DeviceMemory | None = None      # made on first need (device_memory)
        self.devstage: DeviceStaging | None = None   # likewise (across_nodes)
        self.type_ids: dict[tuple[bytes, int], int] = {}   # derived datatypes registered (rank/typed.py)

    def check_peer(self, peer: Any, what: str, wildcard: bool = False) -> int:
        """``peer`` as an int in range; ``wildcard``: ANY_SOURCE too (a receive's source)."""
        if type(peer) is not int:
            if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
                raise errors.InvalidArgument(f"{what} must be an int, got {type(peer).__name__}")
            peer = int(peer)
        if not 0 <= peer < self.size and not (wildcard and peer == ANY_SOURCE):
            raise errors.InvalidArgument(f"{what} {peer} out of range: the communicator has {self.size} ranks"
                                         + ("" if wildcard else " (ANY_SOURCE is for receives)"))
        return peer

    def check_tag(self, tag: Any, wildcard: bool = False) -> int:
        """``tag`` as an int64 other than ANY_TAG; ``wildcard``: ANY_TAG too (a receive's tag)."""
        if type(tag) is not int:
            if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
                raise errors.InvalidArgument(f"tag must be an int, got {type(tag).__name__}")
            tag = int(tag)
        if tag == ANY_TAG:
            if not wildcard:
                raise errors.InvalidArgument("ANY_TAG is for receives: a message needs a tag of its own")
        elif not TAG_MIN <= tag <= TAG_MAX:
            raise errors.InvalidArgument(f"tag {tag} does not fit in 64 bits")
        return tag

    def post(self, kind: int, buf: Any, peer: int, tag: int, flags: int = 0, stream: Any = None,
             buffered: bool = False) -> Request:
        """The full post path: every check with its message, and staging. Isend/Irecv come here only
        when shm._poster's fast path declined (the uncommon cases: see shm/_poster.c); Issend (FLAG_SYNC)
        and the receive of a matched probe's message (FLAG_MPROBED) always do. ``stream`` orders a
        device buffer's op after that stream's work (shmproxy.rank.device); host memory ignores it.
        ``buffered``: a send's host array is copied into staging memory even where it is registered
        (the pickle layer's sends are buffered, whatever memory their arrays live in)."""
        self.check_usable()
        if type(buf) is not np.ndarray:
            if type(buf) is TypedBuffer:   # a derived datatype (shmproxy.rank.typed)
                return typed.post(self, kind, buf, peer, tag, flags)
            if self.is_device_array(buf):
                return self.post_device(kind, buf, peer, tag, flags, stream)
            raise _not_host(buf, "buffer")
        code = _DTYPE_CODE.get(buf.dtype.char)
        if code is None:
            raise errors.InvalidArgument(f"unsupported dtype {buf.dtype}; supported: {SUPPORTED_DTYPES}")
        if type(peer) is not int or not 0 <= peer < self.size:
            peer = self.check_peer(peer, "destination" if kind == KIND_SEND else "source", kind == KIND_RECV)
        if type(tag) is not int or not TAG_MIN <= tag <= TAG_MAX:
            tag = self.check_tag(tag, kind == KIND_RECV)
        nbytes = buf.nbytes
        stage = None
        user_addr = 0
        if kind == KIND_RECV:
            try:
                addr = _buffer_info(buf, True)[0]
            except (BufferError, ValueError):
                why = "read-only" if not buf.flags.writeable else "not C-contiguous"
                raise errors.InvalidArgument(f"receive buffer is {why}") from None
            found = self.registry.find(addr, nbytes)
            if found is None:
                stage = self.staging.get(nbytes)
                found = (stage[0], 0)
                user_addr = addr
        else:
            try:
                addr = _buffer_info(buf, False)[0]
                found = None if buffered else self.registry.find(addr, nbytes)
            except (BufferError, ValueError):
                addr, found = 0, None
            if found is None:
                found, stage = self.stage_send(buf, addr, nbytes)
        return self.emit(kind, code, 0, flags, peer, tag, found[0], found[1], nbytes, buf.size, -1, 0, 0, 0,
                         buf, stage, user_addr)

    # ------------------------------------------------------------------ probes and cancel (engine/p2p.py)
    def probe(self, source: Any, tag: Any, flags: int) -> Request:
        """Post a probe (flags: FLAG_PROBE_BLOCK, FLAG_PROBE_MATCHED); its Wait returns the Status of
        the message a receive (source, tag) would match, or None (a nonblocking probe, no message)."""
        self.check_usable()
        source = self.check_peer(source, "source", True)
        tag = self.check_tag(tag, True)
        return self.emit(KIND_PROBE, 1, 0, flags, source, tag, 0, 0, 0, 0, -1, 0, 0, 0, None, None, 0)

    def post_mprobed(self, buf: Any, source: int, handle: int) -> Request:
        """The receive of the message a matched probe holds (``handle``: that probe's sequence)."""
        return self.post(KIND_RECV, buf, source, handle, FLAG_MPROBED)

    def cancel(self, req: Request) -> bool:
        """Ask the progress process to cancel ``req`` (Request.Cancel); True if it was."""
        self.check_usable()
        c = self.emit(KIND_CANCEL, 1, 0, 0, req._slot, req._seq, 0, 0, 0, 0, -1, 0, 0, 0, None, None, 0)
        st = c.Wait()
        return bool(st is not None and st.nbytes)

    def is_device_array(self, obj: Any) -> bool:
        """Whether a buffer is device memory: a cupy array by its type, anything else by probing."""
        dev = self.device
        return (dev is not None and dev.is_cupy_array(obj)) or device_array_kind(obj) is not None

    def device_memory(self) -> DeviceMemory:
        dev = self.device
        if dev is None:
            control = self.control

            def register(payload: dict) -> None:
                control(MsgType.REGISTER, payload)
            registry = self.registry
            dev = self.device = DeviceMemory(register, registry.new_id, lambda: registry.dead_ids, self.slots,
                                             self.failed_now, self.waiter.slice_s)
        return dev

    def across_nodes(self) -> DeviceStaging:
        """The staging of device buffers through host memory, on a communicator that spans nodes
        (shmproxy.rank.devstage); made on first need."""
        st = self.devstage
        if st is None:
            layout = self.node_layout
            assert layout is not None   # a communicator across nodes
            st = self.devstage = DeviceStaging(self.device_memory(), self.registry, self.params.STAGING_CACHE,
                                               layout["rank_node"], layout["node"])
        return st

    def close(self) -> None:
        """At the communicator's teardown, before the pool is unmapped: the device staging unpins its
        host buffers (shmproxy.rank.devstage) and device memory its completion slots
        (shmproxy.rank.device). Teardown releases everything in any state: a failure here is logged."""
        stage, self.devstage = self.devstage, None
        if stage is not None:
            try:
                stage.close()
            except (errors.ProxyError, RuntimeError) as exc:   # cupy's too
                _log.warning("device staging of rank %d not released cleanly: %s", self.rank, exc)
        device, self.device = self.device, None
        if device is not None:
            try:
                device.close()
            except (errors.ProxyError, RuntimeError) as exc:   # cupy's too; the pool is unmapped next anyway
                _log.warning("device memory of rank %d not released cleanly: %s", self.rank, exc)

    def post_device(self, kind: int, buf: Any, peer: Any, tag: Any, flags: int = 0,
                    stream: Any = None) -> Request:
        """A message from or into device memory: never staged (shmproxy.rank.device), but for one
        that may cross nodes (shmproxy.rank.devstage)."""
        dev = self.device_memory()
        key = message_key(kind, buf, flags, peer, tag)
        if key is not None and dev.posts:
            fields: tuple[Any, ...] | None = dev.posted(key, buf)
            if fields is not None:   # the same live device array, peer and tag as a checked call
                s = None if stream is None else dev.as_stream(stream, mem_device(fields[-1]))
                return self.emit(kind, fields[0], 0, flags, peer, tag,  # type: ignore[call-arg]
                                 *fields[1:-1],   # (bid, off, nbytes, count)
                                 -1, 0, 0, 0, (buf, buf), None, 0, fields[-1], s)
        dev.begin_call()
        arr = dev.as_array(buf, "buffer")
        code = dev.dtype_code(arr)
        if code is None:
            raise errors.InvalidArgument(f"unsupported dtype {arr.dtype}; supported: {SUPPORTED_DTYPES}, "
                                         f"bfloat16 (device)")
        peer = self.check_peer(peer, "destination" if kind == KIND_SEND else "source", kind == KIND_RECV)
        tag = self.check_tag(tag, kind == KIND_RECV)
        if self.node_layout is not None:
            across = self.across_nodes()
            if across.crosses(peer):   # through host memory
                return across.message(lambda host: self.post(kind, host, peer, tag, flags), arr,
                                      kind == KIND_RECV, stream)
        s = dev.as_stream(stream, arr.device.id)
        bid, off, mem = dev.locate(arr)
        req = self.emit(kind, code, 0, flags, peer, tag, bid, off, arr.nbytes, arr.size, -1, 0, 0, 0,
                        (buf, arr), None, 0, mem, s)
        if arr is buf:
            dev.remember_post(key, buf, None, (code, bid, off, arr.nbytes, arr.size, mem))
        return req

    def device_args(self, name: str, sendbuf: Any, recvbuf: Any) -> tuple[Any, Any, int]:
        """A collective's buffers as cupy arrays when they are device memory, with the record's mem
        word (0: host memory); host and device buffers mixed in one call, or two devices, are refused
        here, before anything is posted."""
        named = [(b, w) for b, w in ((sendbuf, "sendbuf"), (recvbuf, "recvbuf"))
                 if b is not None and b is not IN_PLACE]
        on_device = [self.is_device_array(b) for b, _w in named]
        if not any(on_device):
            return sendbuf, recvbuf, 0
        if not all(on_device):
            host = [w for (b, w), d in zip(named, on_device) if not d]
            raise errors.InvalidArgument(f"{name}: host and device buffers mixed in one call ({', '.join(host)} "
                                         f"is host memory, the other device memory): pass both on one side")
        dev = self.device_memory()
        dev.begin_call()
        if sendbuf is not None and sendbuf is not IN_PLACE:
            sendbuf = dev.as_array(sendbuf, f"{name} {'buffer' if recvbuf is None else 'sendbuf'}")
        if recvbuf is not None:
            recvbuf = dev.as_array(recvbuf, f"{name} recvbuf")
        devices = {b.device.id for b in (sendbuf, recvbuf) if b is not None and b is not IN_PLACE}
        if len(devices) > 1:
            raise errors.InvalidArgument(f"{name}: sendbuf and recvbuf are on different devices {sorted(devices)}")
        return sendbuf, recvbuf, mem_word(MemKind.CUDA, devices.pop())

    def stage_send(self, buf: np.ndarray, addr: int, nbytes: int) -> tuple[tuple[int, int], Any]:
        """Copy a send buffer that is not in registered memory into a staging buffer."""
        stage = self.staging.get(nbytes)
        if addr:
            _native.memcopy(stage[1].addr, addr, nbytes)
        else:  # not contiguous: numpy gathers it
            view = np.frombuffer(stage[1].mm, dtype=buf.dtype, count=buf.size).reshape(buf.shape)
            np.copyto(view, buf)
            del view
        return (stage[0], 0), stage

    def locate(self, arr: np.ndarray, writable: bool, copy_in: bool, what: str) -> tuple:
        """(buf_id, offset, stage, user_addr) of an array: registered, or staged (copied in when
        ``copy_in``; a writable staged array is copied out by its request at completion). A device
        array is located in its own allocation, never staged."""
        if type(arr) is not np.ndarray:
            bid, off, _mem = self.device_memory().locate(arr)
            return bid, off, None, 0
        nbytes = arr.nbytes
        try:
            addr = _buffer_info(arr, writable)[0]
        except (BufferError, ValueError):
            if writable:
                why = "read-only" if not arr.flags.writeable else "not C-contiguous"
                raise errors.InvalidArgument(f"{what} is {why}") from None
            addr = 0
        found = self.registry.find(addr, nbytes) if addr else None
        if found is not None:
            return found[0], found[1], None, addr
        if not writable:
            loc, stage = self.stage_send(arr, addr, nbytes)
            return loc[0], 0, stage, 0
        stage = self.staging.get(nbytes)
        if copy_in and nbytes:
            _native.memcopy(stage[1].addr, addr, nbytes)
        return stage[0], 0, stage, addr

    def check_buf(self, buf: Any, what: str, device: bool = False) -> int:
        if type(buf) is not np.ndarray and not device:   # device: a cupy array already (device_args)
            raise _not_host(buf, what)
        if device:
            dev = self.device
            assert dev is not None   # device_args made it
            code = dev.dtype_code(buf)
        else:
            code = _DTYPE_CODE.get(buf.dtype.char)
        if code is None:
            raise errors.InvalidArgument(f"{what}: unsupported dtype {buf.dtype}; supported: "
                                         f"{SUPPORTED_DTYPES}" + (", bfloat16 (device)" if device else ""))
        return code

    def block_count(self, name: str, full: np.ndarray, part: np.ndarray | None, full_name: str,
                    part_name: str) -> int:
        """Elements per block of a buffer holding one block per rank (``full``), checked against the
        one-block buffer ``part`` (None with IN_PLACE)."""
        size = self.size
        if part is None:
            if full.size % size:
                raise errors.InvalidArgument(f"{name}: {full_name} of {full.size} elements is not "
                                             f"{size} equal blocks")
            return full.size // size
        if full.size != part.size * size:
            raise errors.InvalidArgument(f"{name}: {full_name} needs {size} x {part.size} elements "
                                         f"(the {part_name} of every rank), has {full.size}")
        return part.size

    def check_root(self, root: Any) -> int:
        return self.check_peer(root, "root")

    def collective(self, coll: int, sendbuf: Any, recvbuf: Any, op: Any = 0, root: int = 0,
                   stream: Any = None) -> Request:
        """Validate one collective call (before anything is posted), locate its buffers, post it.
        ``stream``: as for ``post`` (device buffers only)."""
        self.check_usable()
        dev = self.device
        key = call_key(coll, sendbuf, recvbuf, op, root) if dev is not None and dev.posts else None
        if dev is not None and key is not None:
            fields: tuple[Any, ...] | None = dev.posted(key, sendbuf, recvbuf)
            if fields is not None:   # the same live device arrays as a call that passed every check
                s = None if stream is None else dev.as_stream(stream, mem_device(fields[-1]))
                pp = self.pp
                pp.coll_seq += 1
                return self.emit(KIND_COLL, *fields[:-1],  # type: ignore[call-arg]
                                 pp.coll_seq, (sendbuf, recvbuf), None, 0, fields[-1], s)
        args_in, root_in = (sendbuf, recvbuf), root   # as the caller passed them: the key of a remembered call
        C = Coll
        size, me = self.size, self.rank
        in_place = sendbuf is IN_PLACE
        redop = 0
        if coll in (C.BCAST, C.REDUCE):
            root = self.check_root(root)
        name = COLL_NAMES[coll]
        send_loc = recv_loc = (0, 0, None, 0)
        flags = FLAG_IN_PLACE if in_place else 0
        keep: tuple = (sendbuf, recvbuf)
        mem = 0
        if coll != C.BARRIER and (type(sendbuf) is not np.ndarray or type(recvbuf) is not np.ndarray):
            sendbuf, recvbuf, mem = self.device_args(name, sendbuf, recvbuf)
            if mem and self.node_layout is not None:   # across nodes: through host memory
                return self.across_nodes().collective(
                    coll, name, sendbuf, recvbuf, in_place, root, me, stream,
                    lambda send, recv: self.collective(coll, send, recv, op, root))
            keep += (sendbuf, recvbuf)
        device = bool(mem)
        dev_stream = None
        if device:
            dev = self.device_memory()   # made by device_args
            if stream is not None:
                dev_stream = dev.as_stream(stream, mem_device(mem))
        if coll == C.BARRIER:
            code, count, snb, rnb = 1, 0, 0, 0
        elif coll == C.BCAST:
            code = self.check_buf(sendbuf, f"{name} buffer", device)
            count, snb, rnb = sendbuf.size, sendbuf.nbytes, sendbuf.nbytes
            # Writable and contiguous on every rank, the root included: a check that passed on some
            # ranks and failed on others would put their sequences of collectives out of step.
            recv_loc = self.locate(sendbuf, True, copy_in=(me == root), what=f"{name} buffer")
            if me == root:
                recv_loc = recv_loc[:3] + (0,)  # the root's buffer is only read: no copy-out
            flags = FLAG_IN_PLACE
        else:
            rcode = None
            if coll != C.REDUCE or me == root:  # a non-root's Reduce recvbuf is not significant
                rcode = self.check_buf(recvbuf, f"{name} recvbuf", device)
            elif recvbuf is not None and device:
                self.check_buf(recvbuf, f"{name} recvbuf", device)   # contiguous: device_args saw to it
            elif recvbuf is not None:
                # ... but it is checked like the root's, so that the same call passes or fails on
                # every rank alike (see Bcast above).
                self.check_buf(recvbuf, f"{name} recvbuf")
                try:
                    _buffer_info(recvbuf, True)
                except (BufferError, ValueError):
                    why = "read-only" if not recvbuf.flags.writeable else "not C-contiguous"
                    raise errors.InvalidArgument(f"{name} recvbuf is {why}") from None
            if in_place:
                if coll in (C.ALLTOALL,) or (coll == C.REDUCE and me != root):
                    raise errors.InvalidArgument(f"{name}: IN_PLACE is not allowed here"
                                                 + (" (only on the root)" if coll == C.REDUCE else ""))
                if rcode is None:
                    raise errors.InvalidArgument(f"{name}: IN_PLACE needs a recvbuf")
                code = rcode
            else:
                code = self.check_buf(sendbuf, f"{name} sendbuf", device)
                if rcode is not None and rcode != code:
                    raise errors.InvalidArgument(f"{name}: sendbuf is {sendbuf.dtype}, recvbuf {recvbuf.dtype}")
            dtype = (recvbuf if in_place else sendbuf).dtype
            if code == DTYPE_BFLOAT16:
                dtype = np.dtype(np.float32)   # reduced through float32: the float rules apply
            if coll in (C.REDUCE, C.ALLREDUCE, C.REDUCE_SCATTER_BLOCK):
                if not isinstance(op, (int, np.integer)) or isinstance(op, bool):
                    raise errors.InvalidArgument(f"{name}: op must be shmproxy.SUM, PROD, MIN, MAX or AVG, got "
                                                 f"{op!r} ({type(op).__name__})")
                redop = int(op)
                check_op(redop, dtype)
            # element counts: count = one rank's contribution
            if coll in (C.ALLREDUCE, C.REDUCE):
                count = recvbuf.size if in_place else sendbuf.size
                if rcode is not None and recvbuf.size != count:
                    raise errors.InvalidArgument(f"{name}: sendbuf has {count} elements, recvbuf {recvbuf.size}")
            elif coll == C.ALLGATHER:
                count = self.block_count(name, recvbuf, None if in_place else sendbuf, "recvbuf", "sendbuf")
            elif coll == C.REDUCE_SCATTER_BLOCK:
                count = (self.block_count(name, recvbuf, None, "recvbuf", "") if in_place
                         else self.block_count(name, sendbuf, recvbuf, "sendbuf", "recvbuf"))
            else:  # ALLTOALL
                if sendbuf.size != recvbuf.size or sendbuf.size % size:
                    raise errors.InvalidArgument(f"{name}: sendbuf and recvbuf need the same number of "
                                                 f"elements, a multiple of {size}")
                count = sendbuf.size // size
            snb = 0 if in_place else sendbuf.nbytes
            rnb = 0 if rcode is None else recvbuf.nbytes
            if not in_place:
                send_loc = self.locate(sendbuf, False, False, f"{name} sendbuf")
            if rcode is not None:
                recv_loc = self.locate(recvbuf, True, copy_in=in_place, what=f"{name} recvbuf")
            else:
                flags |= FLAG_NO_RECV
        pp = self.pp
        pp.coll_seq += 1
        req = self.emit(KIND_COLL, code, redop, flags, root, coll, send_loc[0], send_loc[1], snb, count,
                        recv_loc[0], recv_loc[1], rnb, pp.coll_seq, keep, recv_loc[2], recv_loc[3], mem,
                        dev_stream)
        if mem:
            assert dev is not None   # made by device_args
            dev.remember_post(call_key(coll, *args_in, op, root_in), *args_in,
                              (code, redop, flags, root, coll, send_loc[0], send_loc[1], snb, count,
                               recv_loc[0], recv_loc[1], rnb, mem))
        if send_loc[2] is not None or recv_loc[2] is not None:
            req._extra = (send_loc[2], rnb)
        return req

    def emit(self, kind: int, code: int, redop: int, flags: int, peer: int, tag: int, bid: int, off: int,
             nbytes: int, count: int, bid2: int, off2: int, nbytes2: int, coll_seq: int, keep: Any,
             stage: Any, user_addr: int, mem: int = 0, stream: Any = None) -> Request:
        """Fill a record and its request and post it (or link it into the open group). Device memory
        (``mem``): the request's event is recorded first on ``stream`` (None: the current one;
        shmproxy.rank.device)."""
        slot, index = self.waiter.claim()
        coll = kind == KIND_COLL
        pp = self.pp
        if mem:
            dev = self.device
            assert dev is not None   # the buffers were located there
            if dev.record(slot, pp.seq + 1, mem_device(mem), stream):   # pp.write takes seq + 1
                flags |= FLAG_STREAM_WORD
        seq = pp.write(index, slot, kind, code, redop, flags, peer, 0 if coll else tag, bid, off, nbytes, count,
                       bid2, off2, nbytes2, coll_seq, tag if coll else 0, mem)
        req = Request(self.comm, slot, seq, kind, peer, tag, max(nbytes, nbytes2), keep, stage, user_addr, pp)
        self.waiter.pending[slot] = req
        pp.enqueue(index)
        return req


def _not_host(buf: Any, what: str) -> errors.InvalidArgument:
    """The error for a buffer the host path cannot take (device arrays take their own path before)."""
    kind = device_array_kind(buf)
    if kind is not None:
        return errors.InvalidArgument(f"{what} is {kind} device memory ({type(buf).__name__}) where host "
                                      f"memory is needed")
    return errors.InvalidArgument(f"{what} must be a numpy array, got {type(buf).__name__}")
