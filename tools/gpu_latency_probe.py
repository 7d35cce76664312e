"""Where the time of a small device message goes when ranks and the progress process share one GPU.

    python3 tools/gpu_latency_probe.py [--iters N]

Two processes with CUDA contexts on GPU 0, as a rank and its progress process: the "rank" asks through a
shared-memory word, the "proxy" does the GPU part of one 8-byte message between two of the rank's
allocations (opened by CUDA IPC, as transports/cuda.py does), and answers through another word. Each
variant changes one thing of that GPU part; the figures are median and p90 round trips in microseconds
(the rank's view), plus the proxy's own split into queueing (host calls) and waiting for the GPU.
No MPS: every context on the GPU is time-sliced, which is what the variants expose.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

# rank-side actions per message, proxy-side actions per message
VARIANTS = [
    # name,                  rank action,      proxy action
    ("host_signal_only",     "none",           "none"),
    ("proxy_copy_spin",      "none",           "copy_spin"),
    ("proxy_copy_yield",     "none",           "copy_yield"),
    ("proxy_copy_blocking",  "none",           "copy_blocking_event"),
    ("proxy_copy_hostfunc",  "none",           "copy_hostfunc"),
    ("proxy_copy_writevalue", "none",          "copy_writevalue"),
    ("ipc_record_wait",      "record",         "wait_copy_spin"),       # the first step's design
    ("ipc_record_query",     "record",         "query_copy_spin"),      # proxy skips a finished event
    ("rank_skips_idle",      "query_stream",   "wait_copy_spin"),       # rank records only if busy
    ("rank_skips_both",      "query_stream",   "query_copy_spin"),      # ... and the proxy queries first
    ("rank_kernel_record",   "kernel_record",  "wait_copy_spin"),       # the rank's context has work
    ("rank_kernel_sync",     "kernel_sync",    "copy_spin"),            # its work done before the ask
]
W_REQ, W_DONE, W_FLAG = 0, 8, 64     # byte offsets in the shared page (W_FLAG: written by the GPU)


def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def _fn(lib: Any, *names: str) -> Any:
    for n in names:
        f = getattr(lib, n, None)
        if f is not None:
            return f
    raise AttributeError(names[0])


def _query(rt: Any, ptr: int) -> bool:
    try:
        return rt.eventQuery(ptr) == 0
    except rt.CUDARuntimeError:
        return False


def rank_main(shm_name: str, q_out: Any, q_in: Any, iters: int) -> None:
    import cupy as cp
    cp.cuda.Device(0).use()
    rt = cp.cuda.runtime
    shm = shared_memory.SharedMemory(shm_name)
    w = np.ndarray((512,), np.int64, shm.buf)
    buf = cp.zeros(1 << 20, cp.uint8)        # a cudaMalloc of its own: src at 0, dst at 4096
    ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    stream = cp.cuda.get_current_stream()    # cupy's default: the legacy null stream
    tiny = cp.zeros(1, cp.float32)
    q_out.put((bytes(rt.ipcGetMemHandle(buf.data.ptr)), bytes(rt.ipcGetEventHandle(ev.ptr))))
    q_in.get()
    res: dict = {}
    seq = 0
    skipped = 0
    for name, raction, _pa in VARIANTS:
        lat = np.empty(iters, np.float64)
        skipped = 0
        for i in range(-iters // 10, iters):
            t0 = time.perf_counter_ns()
            if raction == "record":
                ev.record(stream)
            elif raction == "query_stream":
                if not stream.done:
                    ev.record(stream)
                    skipped -= 1
                skipped += 1
            elif raction == "kernel_record":
                tiny += 1
                ev.record(stream)
            elif raction == "kernel_sync":
                tiny += 1
                stream.synchronize()
            seq += 1
            w[W_REQ // 8] = seq
            if _pa_is_writevalue(name):
                while w[W_FLAG // 8] != seq:
                    pass
            else:
                while w[W_DONE // 8] != seq:
                    pass
            if i >= 0:
                lat[i] = (time.perf_counter_ns() - t0) / 1e3
        res[name] = {"median_us": float(np.median(lat)), "p90_us": float(np.percentile(lat, 90)),
                     "min_us": float(lat.min())}
        if raction == "query_stream":
            res[name]["records_skipped"] = skipped
    q_out.put(res)
    del w
    shm.close()


def _pa_is_writevalue(name: str) -> bool:
    return dict((n, p) for n, _r, p in VARIANTS)[name] == "copy_writevalue"


def proxy_main(shm_name: str, q_in: Any, q_out: Any, iters: int) -> None:
    import cupy as cp
    cp.cuda.Device(0).use()
    rt = cp.cuda.runtime
    shm = shared_memory.SharedMemory(shm_name)
    w = np.ndarray((512,), np.int64, shm.buf)
    memh, evh = q_in.get()
    base = rt.ipcOpenMemHandle(memh, 1)
    rev = rt.ipcOpenEventHandle(evh)
    stream = cp.cuda.Stream(non_blocking=True)
    ev = cp.cuda.Event(block=False, disable_timing=True)
    bev = cp.cuda.Event(block=True, disable_timing=True)
    src, dst = base, base + 4096
    out: dict = {"api_us": {}}
    # host cost of each call, in this process alone
    def cost(fn: Any, n: int = 2000) -> float:
        fn()
        stream.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        t = (time.perf_counter_ns() - t0) / n / 1e3
        stream.synchronize()
        return t
    ev.record(stream)
    stream.synchronize()
    out["api_us"]["memcpyAsync_8B"] = cost(lambda: rt.memcpyAsync(dst, src, 8, 4, stream.ptr))
    out["api_us"]["eventRecord"] = cost(lambda: ev.record(stream))
    out["api_us"]["eventQuery_done"] = cost(lambda: ev.done)
    out["api_us"]["streamWaitEvent_ipc"] = cost(lambda: rt.streamWaitEvent(stream.ptr, rev, 0))
    out["api_us"]["eventQuery_ipc"] = cost(lambda: _query(rt, rev))
    out["api_us"]["streamQuery"] = cost(lambda: stream.done)
    def device_cm() -> None:
        with cp.cuda.Device(0):
            pass
    out["api_us"]["Device_ctx_manager"] = cost(device_cm)
    # single process floor: copy, record, spin until done
    lat = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        rt.memcpyAsync(dst, src, 8, 4, stream.ptr)
        ev.record(stream)
        while not ev.done:
            pass
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    out["single_process_copy_spin_us"] = float(np.median(lat[200:]))
    # stream memory ops: the GPU writes the completion word into the shared page itself
    wv_ok = ""
    try:
        lib = _driver()
        reg = _fn(lib, "cuMemHostRegister_v2", "cuMemHostRegister")
        getp = _fn(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        wv = _fn(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        page = w.ctypes.data
        reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rc = reg(page, 4096, 2)                       # CU_MEMHOSTREGISTER_DEVICEMAP
        dptr = ctypes.c_uint64()
        getp.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        rc2 = getp(ctypes.byref(dptr), page, 0)
        wv.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        flag_dev = dptr.value + W_FLAG
        if rc or rc2:
            wv_ok = f"cuMemHostRegister {rc} / GetDevicePointer {rc2}"
    except (OSError, AttributeError) as exc:
        wv, flag_dev, wv_ok = None, 0, f"unavailable: {exc}"
    out["writevalue"] = wv_ok or "ok"
    hostfunc_done = threading.Event()

    def on_host(_arg: Any) -> None:
        hostfunc_done.set()

    q_out.put("ready")
    seq = 0
    split: dict = {}
    for name, _r, paction in VARIANTS:
        queue_ns = wait_ns = 0
        waits_skipped = 0
        for i in range(-iters // 10, iters):
            seq += 1
            while w[W_REQ // 8] != seq:
                pass
            t0 = time.perf_counter_ns()
            if paction == "none":
                w[W_DONE // 8] = seq
                continue
            if paction.startswith("wait_"):
                rt.streamWaitEvent(stream.ptr, rev, 0)
            elif paction.startswith("query_"):
                if _query(rt, rev):
                    waits_skipped += 1
                else:
                    rt.streamWaitEvent(stream.ptr, rev, 0)
            rt.memcpyAsync(dst, src, 8, 4, stream.ptr)
            if paction == "copy_writevalue":
                if wv is not None and not wv_ok:
                    wv(stream.ptr, flag_dev, seq & 0xFFFFFFFF, 0)
                else:
                    ev.record(stream)
                    while not ev.done:
                        pass
                    w[W_FLAG // 8] = seq
                t1 = time.perf_counter_ns()
                w[W_DONE // 8] = seq
                queue_ns += t1 - t0
                continue
            if paction == "copy_hostfunc":
                hostfunc_done.clear()
                stream.launch_host_func(on_host, None)
                t1 = time.perf_counter_ns()
                hostfunc_done.wait()
            elif paction == "copy_blocking_event":
                bev.record(stream)
                t1 = time.perf_counter_ns()
                bev.synchronize()
            else:
                ev.record(stream)
                t1 = time.perf_counter_ns()
                if paction.endswith("yield"):
                    while not ev.done:
                        os.sched_yield()
                else:
                    while not ev.done:
                        pass
            t2 = time.perf_counter_ns()
            w[W_DONE // 8] = seq
            if i >= 0:
                queue_ns += t1 - t0
                wait_ns += t2 - t1
        split[name] = {"proxy_queue_us": queue_ns / iters / 1e3, "proxy_gpu_wait_us": wait_ns / iters / 1e3}
        if paction.startswith("query_"):
            split[name]["waits_skipped"] = waits_skipped
    out["split"] = split
    q_out.put(out)
    stream.synchronize()
    rt.ipcCloseMemHandle(base)
    del w
    shm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=4096)
    np.ndarray((512,), np.int64, shm.buf)[:] = 0
    r2p, p2r = ctx.Queue(), ctx.Queue()
    rank_out = ctx.Queue()
    prox_out = ctx.Queue()
    p = ctx.Process(target=proxy_main, args=(shm.name, r2p, prox_out, a.iters))
    r = ctx.Process(target=rank_main, args=(shm.name, rank_out, p2r, a.iters))
    p.start()
    r.start()
    r2p.put(rank_out.get(timeout=120))
    p2r.put(prox_out.get(timeout=120))
    rank_res = rank_out.get(timeout=600)
    prox_res = prox_out.get(timeout=600)
    r.join(60)
    p.join(60)
    shm.close()
    shm.unlink()
    api = {k: round(v, 2) for k, v in prox_res["api_us"].items()}
    print("host calls in the proxy process (us):", json.dumps(api))
    print(f"single process 8 B copy + record + spin: {prox_res['single_process_copy_spin_us']:.1f} us;"
          f" cuStreamWriteValue32 to a host page: {prox_res['writevalue']}")
    print(f"{'variant':24} {'median':>8} {'p90':>8} {'min':>7} {'p.queue':>8} {'p.gpuwait':>9}  notes")
    for name, _r, _p in VARIANTS:
        x, s = rank_res[name], prox_res["split"][name]
        notes = {k: v for k, v in {**x, **s}.items() if k in ("records_skipped", "waits_skipped")}
        print(f"{name:24} {x['median_us']:8.1f} {x['p90_us']:8.1f} {x['min_us']:7.1f} "
              f"{s['proxy_queue_us']:8.1f} "
              f"{s['proxy_gpu_wait_us']:9.1f}  {json.dumps(notes) if notes else ''}")
    print("PROBE_JSON " + json.dumps({"rank": rank_res, "proxy": prox_res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
