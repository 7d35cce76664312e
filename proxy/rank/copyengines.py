"""The two-shot device exchanges by the GPUs' copy engines: shmproxy.rank.devcoll's ``PeerKernels``
hands its large Allreduce, Reduce_scatter_block and Allgather calls here where DEVICE_CE_BYTES says.
The scratches, their halves and flags, the epochs and the bounds are devcoll's (its header); only how
the bytes cross the link differs.

A copy-engine two-shot call (from DEVICE_CE_BYTES) moves the same bytes into the same slots,
but by the GPUs' copy engines (peer copies), each followed by a 64-bit flag stored by the stream
(its default fence orders the copy's stores first), and leaves the SMs only the local work: per
window, stream P copies each peer's part of the input into its scratch chunk by chunk (DEVICE_CE_CHUNK)
and flags each chunk; stream R runs a small kernel per chunk of this rank's part that waits for the
peers' flags (the bounded, abort-aware wait of the kernels) and reduces into the output, then copies
the result into the peers' scratches, flagged in the second flags; stream L runs a kernel per chunk
that waits for those and copies the peers' reduced parts into the output. The call's stream starts
P, R and L and waits for all three. A window's P waits for the last window's R and L: that is the
kernels' "one after another" here (below). A kernel queued after one of the call's that failed
returns at once, so a failure costs one bound, not one per chunk. Reduce_scatter_block and
Allgather from DEVICE_CE_BYTES (the buffer of all ranks' shares) the same way with one exchange:
P copies each peer's values into its scratch, R's kernels reduce or copy them out chunk by chunk.

The streams: P (index 0) pushes this rank's values into the peers' scratches, R (1) reduces or copies
out and, for an Allreduce, pushes the result, L (2) copies the peers' results out. Event 0 starts them,
event i + 1 is recorded behind stream i.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from shmproxy.core.ops import ReduceOp
from shmproxy.rank.devkernels import (BLOCK, DATA, FLAG_SHIFT, FLAGS2, MAX_BLOCKS, SIG_ALLGATHER, SIG_REDUCE_SCATTER,
                                      SIGS, signature)
from shmproxy.transports.cuda_driver import Driver

if TYPE_CHECKING:
    from shmproxy.rank.devcoll import Sizing


class CopyEngines:
    """A rank's copy-engine streams and events, and the calls queued on them. It needs the rank's
    scratch size (``cap``), every rank's scratch as this device sees it (``peers``: devcoll's list, filled
    when the peers are mapped), the kernels by (dtype, op, name) and the rank's one epoch counter,
    which the kernels' calls share (``next_epoch``)."""

    def __init__(self, cp: Any, drv: Driver, rank: int, sizing: Sizing, cap: int, peers: list[int],
                 kernel: Callable[[np.dtype, int, str], Any], next_epoch: Callable[[], int]):
        self.drv, self.rank, self.nranks, self.sizing, self.cap = drv, rank, sizing.nranks, sizing, cap
        self.peers = peers
        self._kernel_of, self._next_epoch = kernel, next_epoch
        self.windows = 0   # windows moved so far (the tests ask)
        self._streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
        self._events = [cp.cuda.Event(disable_timing=True) for _ in range(4)]

    @contextlib.contextmanager
    def _call(self, stream: int, nstreams: int) -> Iterator[list[int]]:
        """The first ``nstreams`` copy-engine streams, started after ``stream``'s work; ``stream``
        waits for all of them after what is queued inside."""
        drv = self.drv
        streams = [st.ptr for st in self._streams[:nstreams]]
        start = self._events[0].ptr
        drv.record(start, stream)
        for st in streams:
            drv.wait(st, start)
        yield streams
        for st, ev in zip(streams, self._events[1:]):
            drv.record(ev.ptr, st)
            drv.wait(stream, ev.ptr)

    def _chunk(self, itemsize: int) -> int:
        """DEVICE_CE_CHUNK in elements: a whole number of 16-byte packs."""
        vec = 16 // itemsize
        return max(self.sizing.ce_chunk // itemsize // vec * vec, vec)

    def _window(self, streams: list[int], first: bool, sig: int) -> tuple[int, int, int]:
        """A copy-engine window's start: a new epoch, its signature stored by P in every peer's slots
        of the epoch's parity. A window after the call's first writes the half its last-but-one wrote:
        the peers read that one before they flagged the last window's copies, which R saw, and this
        rank's own reads of the last window are done once R and L are, so P waits for them. Returns
        the epoch, its data half's offset and its flags' base."""
        drv, nr, me, push = self.drv, self.nranks, self.rank, streams[0]
        if not first:
            for st, ev in zip(streams[1:], self._events[2:]):
                drv.record(ev.ptr, st)
                drv.wait(push, ev.ptr)
        e = self._next_epoch()
        self.windows += 1
        sigs = SIGS + (e & 1) * nr * MAX_BLOCKS
        for q in range(nr):
            if q != me:
                drv.write_value64(push, self.peers[q] + 8 * (sigs + me * MAX_BLOCKS), sig)
        return e, DATA + (e & 1) * self.cap, e << FLAG_SHIFT

    def _put(self, stream: int, dst: int, src: int, nbytes: int, flag: int, value: int) -> None:
        """Copy ``nbytes`` into a peer's scratch on ``stream``, then store ``value`` into its ``flag``
        slot (the stream's store is ordered after the copy's)."""
        self.drv.memcpy(dst, src, nbytes, stream)
        self.drv.write_value64(stream, flag, value)

    def allreduce(self, src: int, dst: int, count: int, dtype: np.dtype, op: int, stream: int) -> None:
        """The two-shot Allreduce with the copy engines moving its exchanges (see the header): per window
        of ``window_count`` elements, stream P copies this rank's input for each peer's part into that
        peer's scratch and stores its flag, chunk by chunk; stream R reduces each chunk of this rank's
        part once the peers' copies are here, and copies the result into their scratches, flagged; L
        copies the peers' reduced chunks into the output once they are here."""
        isz, nr, me, z = dtype.itemsize, self.nranks, self.rank, self.sizing
        vec, cchunk = 16 // isz, self._chunk(isz)
        red, out = self._kernel_of(dtype, op, "shmproxy_ce_reduce"), self._kernel_of(dtype, op, "shmproxy_ce_copy_out")
        aligned = not ((src | dst) & 15)
        step = z.window_count(isz)
        with self._call(stream, 3) as streams:
            P, R, L = streams
            for off in range(0, count, step):
                n = min(step, count - off)
                sig = signature(n, dtype, op)
                e, half, base = self._window(streams, not off, sig)
                sub = ((n + nr - 1) // nr + vec - 1) // vec * vec
                lens = [max(min((q + 1) * sub, n) - min(q * sub, n), 0) for q in range(nr)]
                chunks = [(ln + cchunk - 1) // cchunk for ln in lens]
                s_in, s_out = src + off * isz, dst + off * isz
                for launch in (red, out):
                    v = launch.values
                    v[0], v[1], v[2], v[3], v[8], v[9] = s_in, s_out, n, e, sig, aligned
                    v[11 + nr] = cchunk
                d_mine = [((me - q + nr) % nr - 1) * sub * isz for q in range(nr)]   # my slot in q's scratch
                for c in range(max(chunks)):
                    for q in range(nr):
                        if q != me and c < chunks[q]:
                            at = (q * sub + c * cchunk) * isz
                            self._put(P, self.peers[q] + half + d_mine[q] + c * cchunk * isz, s_in + at,
                                      min(cchunk, lens[q] - c * cchunk) * isz,
                                      self.peers[q] + 8 * me * MAX_BLOCKS, base + c + 1)
                    if c < chunks[me]:
                        red.values[10 + nr] = c
                        red(z.ce_blocks, BLOCK, R)
                        at = (me * sub + c * cchunk) * isz
                        nbytes = min(cchunk, lens[me] - c * cchunk) * isz
                        for q in range(nr):
                            if q != me:
                                self._put(R, self.peers[q] + half + (nr - 1) * sub * isz + d_mine[q]
                                          + c * cchunk * isz, s_out + at, nbytes,
                                          self.peers[q] + 8 * (FLAGS2 + me * MAX_BLOCKS), base + c + 1)
                    if any(c < chunks[q] for q in range(nr) if q != me):
                        out.values[10 + nr] = c
                        out(z.ce_blocks, BLOCK, L)

    def shares(self, reduce: bool, src: int, dst: int, count: int, dtype: np.dtype, op: int,
               stream: int) -> None:
        """Reduce_scatter_block or Allgather with the copy engines moving the exchange, as ``allreduce``:
        per window of ``share_window`` elements of each share, stream P copies each peer's values
        (its share of the input, or this rank's input) into its scratch chunk by chunk, flagged; stream
        R runs a kernel per chunk that waits for the peers' and reduces them into the output, or copies
        them into their shares of it."""
        isz, nr, me, z = dtype.itemsize, self.nranks, self.rank, self.sizing
        vec, cchunk = 16 // isz, self._chunk(isz)
        kern = self._kernel_of(dtype, op if reduce else ReduceOp.SUM, "shmproxy_ce_shares")
        v = kern.values
        v[9] = not ((src | dst | count * isz) & 15)
        v[11 + nr], v[12 + nr], v[13 + nr] = cchunk, count, reduce
        step = z.share_window(isz)
        with self._call(stream, 2) as streams:
            P, R = streams
            for off in range(0, count, step):
                n = min(step, count - off)
                sig = signature(n, dtype, (SIG_REDUCE_SCATTER | op) if reduce else SIG_ALLGATHER)
                e, half, base = self._window(streams, not off, sig)
                slot = (n + vec - 1) // vec * vec * isz
                v[0], v[1], v[2], v[3], v[8] = src + off * isz, dst + off * isz, n, e, sig
                if not reduce and src != dst + (me * count + off) * isz:
                    self.drv.memcpy(dst + (me * count + off) * isz, src + off * isz, n * isz, R)   # this rank's share
                for c in range((n + cchunk - 1) // cchunk):
                    at, clen = c * cchunk, min(cchunk, n - c * cchunk)
                    for q in range(nr):
                        if q != me:
                            mine = src + ((q * count if reduce else 0) + off + at) * isz
                            self._put(P, self.peers[q] + half + ((me - q + nr) % nr - 1) * slot + at * isz, mine,
                                      clen * isz, self.peers[q] + 8 * me * MAX_BLOCKS, base + c + 1)
                    v[10 + nr] = c
                    kern(z.ce_blocks, BLOCK, R)
