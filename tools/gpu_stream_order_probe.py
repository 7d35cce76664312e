"""Stream order without interprocess events: can a rank's stream publish "my work so far is done" as a
word of shared host memory, and the progress process's stream wait for that word, across processes
and GPUs, and what does it cost against the interprocess event it would replace?

    python3 tools/gpu_stream_order_probe.py      # a GPU host, cupy only; 2 GPUs add the cross-GPU rows

Why: the ranks' interprocess events, which shmproxy used then, left a file per process in /dev/shm
that only the rank or the progress process could remove, and a wait for one from another GPU's
stream crashed the driver (docs/decisions.md, "What the first 2-GPU run changed"). The replacement:
cuStreamWriteValue32 on the rank's stream into a word of the ops pool and cuStreamWaitValue32 on the
progress process's. CUDA warns that such an order is invisible to its scheduler, and shmproxy's
common case is two contexts time-sliced on one GPU: this probe checked that first, and shmproxy has
ordered streams this way since (transports/cuda_order.py; the probe's run on 2x H200 is in
docs/bench/h200x2-32core/session23/).

Two processes, a "rank" and a "proxy", share one page (multiprocessing.shared_memory) that each
registers with the driver (cuMemHostRegister, portable and device-mapped); they talk through words of
that page, spinning. Printed:
  1. each GPU's stream memory operation attributes (through cuda-bindings where installed);
  2. order, ROUNDS times per variant: the rank queues a ~2 ms kernel that fills its 64 MiB buffer with
     the round's number, then the write of the word; the proxy's stream waits for the word, copies the
     rank's buffer (CUDA IPC) into its own, and every element is checked. Variants: the proxy's wait
     queued after the rank posted (shmproxy's order) or before (a wait that must hold its stream);
     the proxy on the rank's GPU, and on the other GPU where there are two. A round whose copy is not
     done in STALL_S is reported as a stall and ends the probe (the stream cannot be recovered);
  3. cost, on the rank's GPU: the rank's call (cuStreamWriteValue32 against cuEventRecord of an
     interprocess event) after a short kernel, the proxy's calls once it sees the post (a load of the
     word, then cuStreamWaitValue32 if not yet there; against cuEventQuery, then cuStreamWaitEvent),
     and the trip from the rank's call until an event the proxy recorded behind the wait is done;
     medians in us;
  4. the cuda.shm files of the rank's pid (the events make one; the word none), then removed.
"""
from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

ROUNDS, CALLS, SKIP = 20, 300, 30
NBYTES = 64 << 20
LONG_CYCLES, SHORT_CYCLES = 4_000_000, 20_000    # ~2 ms and ~10 us of spinning at ~2 GHz
STALL_S = 10.0
PAGE = 4096
_U64, _VP, _UINT = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
_PORTABLE_DEVICEMAP, _WAIT_GEQ, _LAZY_PEER = 1 | 2, 0, 1
# the page: u32 word 0 is the one the GPU writes; u64 words 1.. are the two processes' host words
_CMD_SEQ, _CMD_KIND, _CMD_CYCLES, _POSTED, _T_CALL, _CALL_NS, _STOP = 1, 2, 3, 4, 5, 6, 7
_WORD, _EVENT = 0, 1
_SPIN = r"""
extern "C" __global__ void spin_then_fill(float* x, long long n, float v, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) x[i] = v;
}
"""


def _driver() -> Any:
    drv = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuMemHostRegister_v2", [_VP, ctypes.c_size_t, _UINT]),
                       ("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(_U64), _VP, _UINT]),
                       ("cuStreamWriteValue32_v2", [_VP, _U64, _UINT, _UINT]),
                       ("cuStreamWaitValue32_v2", [_VP, _U64, _UINT, _UINT]),
                       ("cuEventRecord", [_VP, _VP]), ("cuEventQuery", [_VP]),
                       ("cuStreamWaitEvent", [_VP, _VP, _UINT]),
                       ("cuMemcpyAsync", [_U64, _U64, ctypes.c_size_t, _VP]),
                       ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                       ("cuDeviceGetAttribute", [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int])):
        getattr(drv, name).argtypes = args
    return drv


def _register(drv: Any, page: shared_memory.SharedMemory) -> int:
    """Register the page for every context; returns its host address."""
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page.buf))
    rc = drv.cuMemHostRegister_v2(addr, PAGE, _PORTABLE_DEVICEMAP)
    assert rc == 0, f"cuMemHostRegister: {rc}"
    return addr


def _devptr(drv: Any, addr: int) -> int:
    """The current context's device address of the registered page."""
    out = _U64()
    rc = drv.cuMemHostGetDevicePointer_v2(ctypes.byref(out), addr, 0)
    assert rc == 0, f"cuMemHostGetDevicePointer: {rc}"
    return out.value


def rank(conn: Any, name: str, device: int) -> None:
    import cupy as cp
    cp.cuda.Device(device).use()
    drv = _driver()
    page = shared_memory.SharedMemory(name=name)
    addr = _register(drv, page)
    word = _devptr(drv, addr)
    w = np.ndarray((PAGE // 8,), np.uint64, page.buf)
    n = NBYTES // 4
    x = cp.zeros(n, cp.float32)
    kern = cp.RawKernel(_SPIN, "spin_then_fill")
    s = cp.cuda.Stream(non_blocking=True)
    ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    cp.cuda.Device(device).synchronize()
    rt = cp.cuda.runtime
    conn.send((bytes(rt.ipcGetMemHandle(x.data.ptr)), bytes(rt.ipcGetEventHandle(ev.ptr)), os.getpid()))
    seen = 0
    while not w[_STOP]:
        seq = int(w[_CMD_SEQ])
        if seq == seen:
            continue
        seen = seq
        with s:
            kern((132,), (256,), (x, cp.int64(n), cp.float32(seq), cp.int64(int(w[_CMD_CYCLES]))))
        t0 = time.perf_counter_ns()
        if w[_CMD_KIND] == _WORD:
            rc = drv.cuStreamWriteValue32_v2(s.ptr, word, seq & 0xFFFFFFFF, 0)
        else:
            rc = drv.cuEventRecord(ev.ptr, s.ptr)
        t1 = time.perf_counter_ns()
        assert rc == 0, f"rank's post: {rc}"
        w[_T_CALL], w[_CALL_NS] = t0, t1 - t0
        w[_POSTED] = seq   # after the driver call returned: what a rank's post publishes
    conn.send("done")


class Proxy:
    def __init__(self, page: shared_memory.SharedMemory, handles: tuple, rank_device: int) -> None:
        import cupy as cp
        self.cp, self.drv, self.rank_device = cp, _driver(), rank_device
        self.w = np.ndarray((PAGE // 8,), np.uint64, page.buf)
        self.w32 = np.ndarray((PAGE // 4,), np.uint32, page.buf)
        self.addr = _register(self.drv, page)
        self.mem_handle, self.event_handle = handles
        self.seq = 0
        self.on: dict[int, tuple] = {}   # device -> (stream, own event, rank buffer there, own buffer, word)

    def at(self, device: int) -> tuple:
        if device not in self.on:
            cp = self.cp
            with cp.cuda.Device(device):
                base = cp.cuda.runtime.ipcOpenMemHandle(self.mem_handle, _LAZY_PEER)
                ev = cp.cuda.Event(block=False, disable_timing=True)
                mine, word = cp.zeros(NBYTES // 4, cp.float32), _devptr(self.drv, self.addr)
                self.on[device] = (cp.cuda.Stream(non_blocking=True), ev, base, mine, word)
        return self.on[device]

    def command(self, kind: int, cycles: int) -> int:
        self.seq += 1
        self.w[_CMD_KIND], self.w[_CMD_CYCLES] = kind, cycles
        self.w[_CMD_SEQ] = self.seq
        return self.seq

    def posted(self, seq: int) -> None:
        while self.w[_POSTED] != seq:
            pass

    def queue_wait(self, device: int, seq: int) -> None:
        stream, _ev, _b, _y, word = self.at(device)
        assert self.drv.cuStreamWaitValue32_v2(stream.ptr, word, seq & 0xFFFFFFFF, _WAIT_GEQ) == 0

    def copy_and_record(self, device: int) -> None:
        stream, ev, base, y, _w = self.at(device)
        assert self.drv.cuMemcpyAsync(y.data.ptr, base, NBYTES, stream.ptr) == 0
        assert self.drv.cuEventRecord(ev.ptr, stream.ptr) == 0

    def done_within(self, device: int, bound_s: float) -> bool:
        ev = self.at(device)[1]
        deadline = time.monotonic() + bound_s
        while self.drv.cuEventQuery(ev.ptr) != 0:
            if time.monotonic() > deadline:
                return False
        return True

    def order(self, device: int, wait_first: bool) -> dict:
        cp = self.cp
        self.cp.cuda.Device(device).use()
        bad = 0
        for _ in range(ROUNDS):
            if wait_first:
                seq = self.seq + 1
                self.queue_wait(device, seq)
                self.copy_and_record(device)
                self.command(_WORD, LONG_CYCLES)
            else:
                seq = self.command(_WORD, LONG_CYCLES)
                self.posted(seq)
                self.queue_wait(device, seq)
                self.copy_and_record(device)
            if not self.done_within(device, STALL_S):
                return {"rounds": ROUNDS, "wrong": bad, "stalled": True}
            self.posted(seq)
            y = self.at(device)[3]
            with cp.cuda.Device(device):
                bad += int(not bool((y == float(seq)).all()))
        return {"rounds": ROUNDS, "wrong": bad, "stalled": False}

    def cost(self, kind: int) -> dict:
        """Calls and trip of one mechanism on the rank's GPU (see the module header, 3)."""
        device = self.rank_device
        self.cp.cuda.Device(device).use()
        stream, ev, _b, _y, word = self.at(device)
        rank_ev = None
        if kind == _EVENT:
            with self.cp.cuda.Device(device):
                rank_ev = self.cp.cuda.runtime.ipcOpenEventHandle(self.event_handle)
        calls, proxy_calls, trips, waited = [], [], [], 0
        for _ in range(CALLS):
            seq = self.command(kind, SHORT_CYCLES)
            self.posted(seq)
            t0 = time.perf_counter_ns()
            if kind == _WORD:
                if self.w32[0] < (seq & 0xFFFFFFFF):
                    waited += 1
                    assert self.drv.cuStreamWaitValue32_v2(stream.ptr, word, seq & 0xFFFFFFFF, _WAIT_GEQ) == 0
            elif self.drv.cuEventQuery(rank_ev) != 0:
                waited += 1
                assert self.drv.cuStreamWaitEvent(stream.ptr, rank_ev, 0) == 0
            assert self.drv.cuEventRecord(ev.ptr, stream.ptr) == 0
            t1 = time.perf_counter_ns()
            while self.drv.cuEventQuery(ev.ptr) != 0:
                pass
            t2 = time.perf_counter_ns()
            calls.append(int(self.w[_CALL_NS]))
            proxy_calls.append(t1 - t0)
            trips.append(t2 - int(self.w[_T_CALL]))
        med = lambda xs: round(statistics.median(xs[SKIP:]) / 1e3, 2)   # noqa: E731
        return {"rank_call_us": med(calls), "proxy_calls_us": med(proxy_calls), "trip_us": med(trips),
                "waits_queued": waited}


def _attributes(drv: Any, ngpu: int) -> dict:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return {"cuda-bindings": "not installed: attributes not read"}
    out: dict = {}
    for d in range(ngpu):
        dev = ctypes.c_int()
        assert drv.cuDeviceGet(ctypes.byref(dev), d) == 0
        for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM",
                     "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V2",
                     "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
                     "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES"):
            attr = getattr(cu.CUdevice_attribute, name, None)
            if attr is None:
                out[f"GPU {d} {name}"] = "unknown to this cuda-bindings"
                continue
            v = ctypes.c_int()
            rc = drv.cuDeviceGetAttribute(ctypes.byref(v), int(getattr(attr, "value", attr)), dev.value)
            out[f"GPU {d} {name}"] = v.value if rc == 0 else f"error {rc}"
    return out


def main() -> None:
    import cupy as cp
    ngpu = cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(0).use()
    page = shared_memory.SharedMemory(create=True, size=PAGE)
    np.ndarray((PAGE // 8,), np.uint64, page.buf)[:] = 0
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=rank, args=(there, page.name, 0))
    child.start()
    res: dict = {}
    try:
        mem, evh, pid = here.recv()
        proxy = Proxy(page, (mem, evh), 0)
        res["attributes"] = _attributes(proxy.drv, ngpu)
        for device in range(min(ngpu, 2)):
            for first in (False, True):
                key = f"order: proxy on GPU {device}, wait queued {'before' if first else 'after'} the post"
                res[key] = proxy.order(device, first)
                print(key, res[key], flush=True)
                if res[key]["stalled"]:   # the stream cannot be recovered, nor this process's exit trusted
                    print("PROBE_JSON " + json.dumps(res), flush=True)
                    np.ndarray((PAGE // 8,), np.uint64, page.buf)[_STOP] = 1
                    child.kill()
                    page.unlink()
                    os._exit(2)
        for kind, label in ((_WORD, "word"), (_EVENT, "interprocess event")):
            res[f"cost: {label}"] = proxy.cost(kind)
            print(f"cost: {label}", res[f"cost: {label}"], flush=True)
        proxy.w[_STOP] = 1
        here.recv()
        child.join(30)
        left = [f for f in os.listdir("/dev/shm")
                if f.startswith("cuda.shm.") and f.split(".")[3:4] == [f"{pid:x}"]]
        res["cuda.shm files of the rank"] = left
        for f in left:
            os.unlink(os.path.join("/dev/shm", f))
        print("PROBE_JSON " + json.dumps(res))
    finally:
        np.ndarray((PAGE // 8,), np.uint64, page.buf)[_STOP] = 1
        if child.is_alive():
            child.kill()
        page.unlink()


if __name__ == "__main__":
    main()
