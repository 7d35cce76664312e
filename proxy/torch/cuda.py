"""CUDA tensors in the shmproxy process group: stream order at the call, completion on the device.

A CUDA tensor is handed to the communicator as it is (the native API reads torch tensors through the
CUDA array interface; shmproxy.rank.device): the progress process maps the tensor's allocation and
copies on its own GPU streams, never through host memory. What this module adds for torch:

- **Which stream.** Every native call of one torch call gets ``stream=`` torch's current stream of the
  tensors' device, read in the calling thread at the call (the native default would be cupy's
  current stream, which torch does not set). So the operation is ordered after the work queued on
  that stream before the call, as NCCL's is. Temporaries the call fills at post time (the
  contiguous copy of a non-contiguous tensor, the packed input of a reduce_scatter of a list, a
  rank's own block of an alltoall, gather or scatter) are written on that same stream, so the op is
  ordered after them too.
- **When it is done.** The native request completes once the progress process's copies finished on
  the GPU, so the bytes in the tensor are then visible to every stream. What the rank itself queued
  at the call (the own-block copies) is covered by an event recorded on the current stream after the
  last post when that stream is still busy then (``seal``), which the completion thread waits for;
  copies back into the user's tensors (non-contiguous outputs, an all_gather into a list) run on a
  side stream of the group, which the completion thread synchronizes. Only then are the Work and
  its Future completed: a completed Work's result is on the device, visible to every stream.
- **What ``Work.wait`` does** (NCCL's semantics): it makes the caller's current stream wait for the
  result and returns, without blocking the host. The stream waits on the GPU for each request's
  completion word in its slot of the pool (``Request.wait_on_stream``: cuStreamWaitValue32 on pinned
  memory), which the progress process stores, or its GPU right behind the copy: no thread of this
  process is between the operation's end and the stream's next kernel. So kernels queued after
  ``wait`` see the result, and ``synchronize()`` (or the stream's) blocks until it is there; the
  completion thread completes the Work and its Future on the host meanwhile. Where the host waits
  instead: a small Work (work.py, SMALL_WAIT_BYTES) on an idle stream completes in microseconds and
  its waiting thread completes it; a Work with copies back (non-contiguous outputs, lists), whose
  result is in place only once the completion thread ran them; and a group that spans nodes, where
  each request's result is copied back from host memory when the rank reaps it (the staging of
  shmproxy.rank.devstage). A Work that fails lets its streams go too: a communicator's failure
  completes every request a stream waits for, failed; a Work that times out while a stream waits for
  it aborts the group (as NCCL's watchdog does), since its completion may never come.
  ``exception()``/``is_success()`` say what failed.
- **Lifetimes.** Every CUDA tensor of a call (inputs included) is held until completion: torch's
  caching allocator would otherwise hand a freed block to the next kernel of the same stream while
  the progress process still reads or writes it.

bfloat16 reduces on the device as bfloat16 (the native device path rounds after each step, as
torch's own bfloat16 arithmetic does); no float32 temporary as on the CPU path.
A call whose tensors are on different devices, CPU and CUDA mixed included, is refused before
anything is posted.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from shmproxy.core import errors


def common_device(tensors: Iterable[Any], what: str) -> torch.device | None:
    """The CUDA device every tensor of the call is on; None when they are all CPU tensors (or none).
    InvalidArgument for a mix of devices."""
    seen: torch.device | None = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue        # check_tensor says what is wrong with it
        dev = t.device
        if seen is None:
            seen = dev
        elif dev != seen:
            raise errors.InvalidArgument(
                f"shmproxy backend: {what}: tensors on {seen} and {dev} in one call; every tensor of a call "
                "must be on the same device (CPU tensors and CUDA tensors cannot be mixed)")
    if seen is None or seen.type != "cuda":
        return None
    return seen if seen.index is not None else torch.device("cuda", torch.cuda.current_device())


class SideStreams:
    """One side stream per device of a group (made on first use; ``get`` from one thread at a time)."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> torch.cuda.Stream:
        idx = int(device.index or 0)
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s


def begin(stage: Any, device: torch.device, side: SideStreams) -> None:
    """Make ``stage`` a CUDA call's: its native calls get torch's current stream of ``device``."""
    stage.device = device
    stage.side = side
    stage.kw = {"stream": torch.cuda.current_stream(device)}


def seal(stage: Any) -> None:
    """After the last post: an event on the current stream, behind the rank's own copies of the call,
    unless that stream is idle by now (its copies done, nothing to wait for). Recording on an idle
    stream would still be GPU work of this process's context: where ranks share a GPU without MPS,
    the GPU switches contexts to run it, which costs more than a small message (the native
    ``DeviceMemory.record`` skips idle streams for the same reason)."""
    stream = stage.kw["stream"]
    if not stream.query():
        ev = torch.cuda.Event()
        ev.record(stream)
        stage.posted = ev


def finish(stage: Any) -> None:
    """At completion (completion thread): the call's own copies done, the copies back run and done."""
    if stage.posted is not None:
        stage.posted.synchronize()
    if stage.after:
        side = stage.side.get(stage.device)
        with torch.cuda.device(stage.device), torch.cuda.stream(side):
            for fn in stage.after:
                fn()
        side.synchronize()


def move_view(t: torch.Tensor, stage: Any, output: bool) -> torch.Tensor:
    """A flat CUDA tensor over ``t`` (or over a contiguous copy of it, copied back at completion when
    ``output``), held by ``stage`` until completion."""
    src = t.detach()
    stage.keep.append(src)
    if src.is_contiguous():
        return src.reshape(-1)
    tmp = src.contiguous()          # on the current stream: the op is ordered after it
    stage.keep.append(tmp)
    if output:
        stage.after.append(lambda: src.copy_(tmp))
    return tmp.reshape(-1)


def scratch(numel: int, like: torch.Tensor, stage: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous CUDA temporary of ``numel`` elements of ``like``'s dtype on its device."""
    tmp = torch.empty(numel, dtype=like.dtype, device=like.device)
    stage.keep.append(tmp)
    return tmp, tmp


# torch's current stream as a raw cudaStream_t without a Stream object (microseconds a call): a private
# function of torch's C module since 1.x, which triton uses; where it is missing, the public way.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: int) -> int:
    """The current stream of CUDA device ``device`` (an index), as its cudaStream_t."""
    if _raw_stream is not None:
        return int(_raw_stream(device))
    return int(torch.cuda.current_stream(device).cuda_stream)
