"""CUDA IPC handles against CUDA VMM shareable file descriptors: what the progress process pays to map a
rank's device memory, and what it gets from the mapping.

    python3 tools/gpu_mapping_probe.py [--mib 256] [--buffers 4] [--reps 20]

Two processes on GPU 0, as a rank and its progress process. The "rank" allocates ``--buffers``
buffers of ``--mib`` MiB twice: with cudaMalloc (cupy), exported as IPC handles, and with cuMemCreate
(the driver's virtual memory management), exported as POSIX file descriptors passed over a Unix
socket (SCM_RIGHTS), as they would travel over the service socket. The "proxy" opens both kinds,
times each open (first buffer and all), copies from each mapping into its own memory and adds two
mapped buffers into a third with cupy on its own stream (GB/s, median of ``--reps``, CUDA events),
and times the close. The driver API is reached through ctypes (libcuda), so nothing beyond cupy is
needed. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

# driver API constants (cuda.h)
_PINNED, _POSIX_FD, _LOC_DEVICE, _RW, _GRAN_MIN = 1, 1, 1, 3, 0


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Flags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):      # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _Flags)]


class _Access(ctypes.Structure):    # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


class Driver:
    """The few VMM calls, each checked."""

    def __init__(self, device: int):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.prop = _Prop(_PINNED, _POSIX_FD, _Loc(_LOC_DEVICE, device), None, _Flags())
        self.access = _Access(_Loc(_LOC_DEVICE, device), _RW)
        g = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self.prop), _GRAN_MIN)
        self.granularity = g.value

    def call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def create(self, nbytes: int) -> int:
        h = ctypes.c_ulonglong()
        self.call("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(self.prop),
                  ctypes.c_ulonglong(0))
        return h.value

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int()
        self.call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_ulonglong(handle), _POSIX_FD,
                  ctypes.c_ulonglong(0))
        return fd.value

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_ulonglong()
        self.call("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd), _POSIX_FD)
        return h.value

    def map(self, handle: int, nbytes: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                  ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        self.call("cuMemMap", ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                  ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0))
        self.call("cuMemSetAccess", ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes),
                  ctypes.byref(self.access), ctypes.c_size_t(1))
        return ptr.value

    def unmap(self, ptr: int, handle: int, nbytes: int) -> None:
        self.call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))
        self.call("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))
        self.call("cuMemRelease", ctypes.c_ulonglong(handle))


def _gbps(cp: Any, stream: Any, nbytes: int, reps: int, fn: Any) -> float:
    start, end = cp.cuda.Event(), cp.cuda.Event()
    fn()
    times = []
    for _ in range(reps):
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise RuntimeError("the rank closed the socket")
        buf += part
    return buf


def rank(args: argparse.Namespace) -> None:
    import cupy as cp
    cp.cuda.Device(0).use()
    drv = Driver(0)
    nbytes = -(-args.mib * (1 << 20) // drv.granularity) * drv.granularity
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cmd = [sys.executable, __file__, "--role", "proxy", "--fd", str(b.fileno()), "--mib", str(args.mib),
           "--buffers", str(args.buffers), "--reps", str(args.reps)]
    proxy = subprocess.Popen(cmd, pass_fds=[b.fileno()])
    b.close()
    t0 = time.perf_counter()
    ipc_bufs = [cp.full(nbytes // 4, float(i + 1), cp.float32) for i in range(args.buffers)]
    cp.cuda.Device(0).synchronize()
    t_malloc = time.perf_counter() - t0
    handles = [cp.cuda.runtime.ipcGetMemHandle(x.data.ptr) for x in ipc_bufs]
    t0 = time.perf_counter()
    vmm = [drv.create(nbytes) for _ in range(args.buffers)]
    t_create = time.perf_counter() - t0
    t0 = time.perf_counter()
    fds = [drv.export_fd(h) for h in vmm]
    t_export = time.perf_counter() - t0
    ptrs = [drv.map(h, nbytes) for h in vmm]   # the rank's own view, filled like the IPC buffers
    for i, p in enumerate(ptrs):
        mem = cp.cuda.UnownedMemory(p, nbytes, None, 0)
        cp.ndarray((nbytes // 4,), cp.float32, cp.cuda.MemoryPointer(mem, 0)).fill(float(i + 1))
    cp.cuda.Device(0).synchronize()
    msg = json.dumps({"nbytes": nbytes, "ipc": [h.hex() for h in handles]}).encode()
    a.sendall(len(msg).to_bytes(8, "little") + msg)
    socket.send_fds(a, [b"f"], fds)
    for fd in fds:
        os.close(fd)   # the proxy holds its own copies now
    out = json.loads(a.makefile("rb").readline())
    proxy.wait(timeout=120)
    for p, h in zip(ptrs, vmm):
        drv.unmap(p, h, nbytes)
    out["rank"] = {"cudaMalloc_ms": t_malloc * 1e3, "cuMemCreate_ms": t_create * 1e3,
                   "export_fds_ms": t_export * 1e3, "granularity": drv.granularity}
    print(json.dumps(out, indent=1))


def proxy(args: argparse.Namespace) -> None:
    import cupy as cp
    sock = socket.socket(fileno=args.fd)
    n = int.from_bytes(_recv_exact(sock, 8), "little")
    meta = json.loads(_recv_exact(sock, n))   # exactly: the next byte carries the descriptors
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 16, args.buffers)
    nbytes = meta["nbytes"]
    cp.cuda.Device(0).use()
    cp.empty(1, cp.uint8)          # the context exists before anything is timed
    drv = Driver(0)
    stream = cp.cuda.Stream(non_blocking=True)
    res: dict = {"mib": nbytes >> 20, "buffers": args.buffers}

    t0 = time.perf_counter()
    ipc = [cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(meta["ipc"][0]))]
    t1 = time.perf_counter()
    ipc += [cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(h)) for h in meta["ipc"][1:]]
    t2 = time.perf_counter()
    res["ipc_open_first_ms"], res["ipc_open_all_ms"] = (t1 - t0) * 1e3, (t2 - t0) * 1e3

    t0 = time.perf_counter()
    h0 = drv.import_fd(fds[0])
    v = [(drv.map(h0, nbytes), h0)]
    t1 = time.perf_counter()
    for fd in fds[1:]:
        h = drv.import_fd(fd)
        v.append((drv.map(h, nbytes), h))
    t2 = time.perf_counter()
    res["vmm_open_first_ms"], res["vmm_open_all_ms"] = (t1 - t0) * 1e3, (t2 - t0) * 1e3
    for fd in fds:
        os.close(fd)

    def view(ptr: int) -> Any:
        mem = cp.cuda.UnownedMemory(ptr, nbytes, None, 0)
        return cp.ndarray((nbytes // 4,), cp.float32, cp.cuda.MemoryPointer(mem, 0))

    local = cp.empty(nbytes // 4, cp.float32)
    with stream:
        for kind, ptrs in (("ipc", ipc), ("vmm", [p for p, _h in v])):
            x, y = view(ptrs[0]), view(ptrs[1 % len(ptrs)])
            src = ptrs[0]
            copy = cp.cuda.runtime.memcpyAsync
            res[f"{kind}_copy_GBps"] = _gbps(cp, stream, nbytes, args.reps,
                                             lambda: copy(local.data.ptr, src, nbytes, 3, stream.ptr))
            res[f"{kind}_add_GBps"] = _gbps(cp, stream, nbytes, args.reps, lambda: cp.add(x, y, out=local))
            ok = bool((local[:4] == float(1 + (2 if len(ptrs) > 1 else 1))).all())
            res[f"{kind}_data_ok"] = ok
        other = cp.empty(nbytes // 4, cp.float32)   # the limit: a copy between this process's own buffers
        res["local_copy_GBps"] = _gbps(cp, stream, nbytes, args.reps, lambda: cp.cuda.runtime.memcpyAsync(
            local.data.ptr, other.data.ptr, nbytes, 3, stream.ptr))
    stream.synchronize()
    t0 = time.perf_counter()
    for p in ipc:
        cp.cuda.runtime.ipcCloseMemHandle(p)
    t1 = time.perf_counter()
    for p, h in v:
        drv.unmap(p, h, nbytes)
    t2 = time.perf_counter()
    res["ipc_close_all_ms"], res["vmm_close_all_ms"] = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    sock.sendall(json.dumps(res).encode() + b"\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--role", choices=("rank", "proxy"), default="rank")
    p.add_argument("--fd", type=int, default=-1)
    args = p.parse_args()
    (proxy if args.role == "proxy" else rank)(args)


if __name__ == "__main__":
    main()
