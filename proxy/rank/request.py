"""Requests: the rank's handle on a posted operation.

A request owns one completion slot of the pool until it is *reaped*: the progress process writes the
slot (bytes, status, source, tag) and then ``done_seq = seq``; the rank sees ``done_seq == seq``, reads
the result, copies a staged receive out to the user's array, and returns the slot and the staging
buffer. Reaping happens in Wait/Test, or in bulk when the rank runs out of slots, so a request the
user never waits on does not leak anything.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from shmproxy.core import errors
from shmproxy.core.ops import (CODE_DTYPE, KIND_COLL, KIND_NAMES, KIND_RECV, KIND_SEND, STATUS_CANCELLED,
                               STATUS_NO_MESSAGE)
from shmproxy.shm._poster import RequestBase, Status

__all__ = ["Message", "Request", "Status"]


class Request(RequestBase):
    # The fields live in the C base (shm/_poster.c), so that the C post path can build a request
    # without running this __init__; this class adds the behaviour. Wait() and Test() are the base's:
    # they finish the common case (complete, no error, nothing staged) in C and call _wait_slow /
    # _test_slow below for everything else.
    __slots__ = ()

    # Request(comm, slot, seq, kind, peer, tag, nbytes, keep, stage, user_addr, poster): ``keep`` is the
    # user's array (alive until completion, as MPI requires), ``stage`` the (buf_id, MemfdBuffer)
    # staging buffer or None, ``user_addr`` where a staged receive is copied to. ``_extra`` is set by
    # collectives: (send staging buffer or None, bytes to copy out), and a third item where device
    # buffers were staged through host memory (shmproxy.rank.devstage): called (ok, nbytes) last.

    def describe(self) -> str:
        if self._kind == KIND_COLL:
            from shmproxy.core.ops import COLL_NAMES
            return f"{COLL_NAMES.get(self._tag, 'collective')} of {self._nbytes} B"
        what = KIND_NAMES.get(self._kind, "op")
        arrow = "from" if self._kind == KIND_RECV else "to"
        return f"{what} of {self._nbytes} B {arrow} rank {self._peer} tag {self._tag}"

    def _finish(self, nbytes: int, status_word: int, tag: int) -> None:
        """Called by the comm once the slot says complete (slot already returned)."""
        code = status_word & 0xFFFF
        peer_dtype = (status_word >> 16) & 0xFFFF
        source = (status_word >> 32) & 0xFFFFFFFF
        if source >= 2**31:
            source -= 2**32
        if tag >= 2**63:
            tag -= 2**64
        self._done = True
        if code == STATUS_CANCELLED:
            self.status = Status(source, tag, 0, cancelled=True)
            code = -1   # no error, and nothing landed to copy out
        elif code == STATUS_NO_MESSAGE:
            self.status = None   # a nonblocking probe that found nothing
            code = -1
        else:
            self.status = Status(source, tag, nbytes)
        stage, self._stage = self._stage, None
        extra, self._extra = self._extra, None
        if code == 0:
            if stage is not None and self._user_addr:
                n = nbytes if extra is None else extra[1]
                if n:
                    from shmproxy.shm import _native
                    _native.memcopy(self._user_addr, stage[1].addr, n)
        elif code > 0:
            self._error = self._make_error(code, nbytes, source, tag, peer_dtype)
        if stage is not None:
            self._comm._staging.put(*stage)
        if extra is not None and extra[0] is not None:
            self._comm._staging.put(*extra[0])
        self._keep = None
        if extra is not None and len(extra) > 2:   # device buffers staged across nodes (rank/devstage.py)
            try:
                extra[2](code == 0, nbytes)
            except Exception as exc:   # a copy back that failed (a CUDA error) is this request's error
                if self._error is None:
                    self._error = errors.InternalError(f"{self.describe()}: the copy of the result back "
                                                       f"to device memory failed: {type(exc).__name__}: {exc}")

    def _make_error(self, code: int, nbytes: int, source: int, tag: int, peer_dtype: int) -> errors.ProxyError:
        if code == errors.TruncationError.code:
            return errors.TruncationError(
                f"message of {nbytes} B from rank {source} tag {tag} does not fit the receive buffer of "
                f"{self._nbytes} B; nothing was written to the buffer")
        if code == errors.InvalidUsage.code and peer_dtype:
            return errors.InvalidUsage(
                f"{self.describe()} was matched by a message with dtype {CODE_DTYPE[peer_dtype].name} "
                f"from rank {source}: the two sides disagree on the dtype")
        if code == errors.InvalidUsage.code:
            return errors.PeerClosed(f"{self.describe()}: the peer closed the communicator first")
        return errors.from_code(code, f"{self.describe()} failed")

    def Cancel(self) -> bool:
        """Cancel a point-to-point request that nothing matched yet (MPI_Cancel): a posted receive, or
        a send that no receive took and the progress process did not buffer. The request then
        completes with ``status.cancelled`` true and no error (Wait returns that status; a cancelled
        receive wrote nothing). Returns whether it was cancelled; False when it had already matched or
        completed (it completes as usual). Waits for the progress process's answer (a round trip)."""
        if self._done:
            return False
        if self._kind not in (KIND_SEND, KIND_RECV):
            raise errors.InvalidUsage(f"{self.describe()}: only point-to-point requests can be cancelled")
        return self._comm._posting.cancel(self)

    def wait_on_stream(self, stream: Any) -> bool:
        """Have a CUDA ``stream`` (cupy's or torch's, or a cudaStream_t on the current device) wait on
        the GPU until this request completes, and return at once: work queued on the stream from now
        on runs after the operation, as after NCCL's ``work.wait()``. No thread of this process takes
        part: the stream waits for the request's completion word in its slot, which the progress
        process stores (shmproxy.rank.device, ``_Words``). False where the stream cannot (the request
        already completed, or its result is copied into place when it is reaped: a host buffer staged
        for the call, device buffers staged through host memory across nodes): wait on the host then.
        The request must still be completed (Wait, Test) as any other; if the communicator fails
        first, the stream is let go at the failure, its request failed."""
        if self._done or self._stage is not None or self._extra is not None:
            return False
        dev = self._comm._posting.device_memory()
        device = dev.stream_device(stream)
        dev.wait_done(self._slot, self._seq, device, dev.as_stream(stream, device))
        return True

    # ---- the Python halves of Wait() and Test() (shm/_poster.c) -----------------------------------
    def _test_slow(self) -> bool:
        if not self._done:
            self._comm._waiter.test(self)
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def _wait_slow(self, timeout: float | None) -> Status | None:
        if not self._done:
            self._comm._waiter.wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self.status

    @staticmethod
    def Waitall(requests: Sequence["Request"] | Iterable["Request"], timeout: float | None = None) -> list:
        """Wait for every request (one shared deadline); raises the first error after all finished."""
        reqs = list(requests)
        if not reqs:
            return []
        comm = reqs[0]._comm
        deadline = comm._deadline(timeout)
        first: BaseException | None = None
        out = []
        for r in reqs:
            try:
                out.append(r.Wait(max(deadline - comm._now(), 0.0)))
            except errors.Timeout:
                raise
            except errors.ProxyError as exc:
                if isinstance(exc, (errors.PeerDiedError, errors.Aborted, errors.Closed)):
                    raise
                first = first or exc
                out.append(None)
        if first is not None:
            raise first
        return out

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<shmproxy.Request {self.describe()} {state}>"


class Message:
    """A message a matched probe (Comm.Mprobe/Improbe) took out of matching: ``status`` says what it is
    (source, tag, nbytes), and only ``Recv``/``Irecv`` of this handle can receive it (MPI_Message)."""

    __slots__ = ("_comm", "_handle", "status")

    def __init__(self, comm: object, handle: int, status: Status):
        self._comm, self._handle, self.status = comm, handle, status

    def Irecv(self, buf: object) -> Request:
        """Receive this message into ``buf``; can be called once."""
        if self._handle < 0:
            raise errors.InvalidUsage("this message was received already")
        handle, self._handle = self._handle, -1
        posting = self._comm._posting   # type: ignore[attr-defined]
        return posting.post_mprobed(buf, self.status.source, handle)

    def Recv(self, buf: object) -> Status | None:
        return self.Irecv(buf).Wait()

    def __repr__(self) -> str:
        return f"<shmproxy.Message {self.status!r}{'' if self._handle >= 0 else ' received'}>"
