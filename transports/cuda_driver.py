"""The CUDA driver calls on the progress process's per-op path, through ctypes.

Each device op costs the progress process a few CUDA calls: a copy or a kernel launch, an event
record, event queries. cupy reaches them through the runtime API and its own Python wrappers, which
cost microseconds more per call than the driver entry points below (a kernel launch most: cupy also
converts and packs every argument on each call). For an 8-byte collective those calls are most of the
progress process's time, so the hot path calls the driver directly (BENCHMARKS.md has the figures).
cupy still does everything that is not per op: contexts, streams, events, IPC handles, compiling kernels.

Every call acts on the calling thread's current context: the caller (transports/cuda_gpu.py) makes
the device's primary context current first (``Gpu.use``), which is the context cupy's streams, events
and kernels of that device belong to. A failed call raises SystemError_ naming the call and the driver's
error; the progress loop then fails the communicator, as NCCL reports an asynchronous CUDA error.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

from shmproxy.core.errors import InvalidArgument, SystemError_

_SUCCESS, _NOT_READY = 0, 600          # CUresult: CUDA_SUCCESS, CUDA_ERROR_NOT_READY
_CAPTURE_THREAD_LOCAL = 1              # CUstreamCaptureMode: other threads' CUDA calls stay unrestricted
_RECORD_EXTERNAL = 1                   # CU_EVENT_RECORD_EXTERNAL: captured as an event record node
_HOST_PORTABLE, _HOST_DEVICEMAP = 1, 2     # CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_DEVICEMAP
_WAIT_VALUE_GEQ = 0                    # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*word - value) >= 0, wrap-safe
_WAIT_VALUE_EQ = 1                     # CU_STREAM_WAIT_VALUE_EQ
_U64, _VP, _UINT = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint


class Driver:
    """libcuda's copy, launch, record, query and wait entry points, typed once."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise InvalidArgument(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
        self._memcpy = _fn(lib, "cuMemcpyAsync", [_U64, _U64, ctypes.c_size_t, _VP])
        self._launch = _fn(lib, "cuLaunchKernel", [_VP, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _VP,
                                                   _VP, _VP])
        self._record = _fn(lib, "cuEventRecord", [_VP, _VP])
        self._query = _fn(lib, "cuEventQuery", [_VP])
        self._wait = _fn(lib, "cuStreamWaitEvent", [_VP, _VP, _UINT])
        self._error_name = _fn(lib, "cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._begin = _fn(lib, "cuStreamBeginCapture_v2", [_VP, ctypes.c_int])
        self._end = _fn(lib, "cuStreamEndCapture", [_VP, ctypes.POINTER(_VP)])
        self._instantiate = _fn(lib, "cuGraphInstantiateWithFlags", [ctypes.POINTER(_VP), _VP, ctypes.c_ulonglong])
        self._graph_launch = _fn(lib, "cuGraphLaunch", [_VP, _VP])
        # for shm._native.publish_launch, which calls it without Python between its stores and the call
        self.graph_launch_addr = ctypes.cast(self._graph_launch, _VP).value
        self._exec_destroy = _fn(lib, "cuGraphExecDestroy", [_VP])
        self._graph_destroy = _fn(lib, "cuGraphDestroy", [_VP])
        self._record_flags = _fn(lib, "cuEventRecordWithFlags", [_VP, _VP, _UINT])
        self._host_register = _fn(lib, "cuMemHostRegister_v2", [_VP, ctypes.c_size_t, _UINT])
        self._host_unregister = _fn(lib, "cuMemHostUnregister", [_VP])
        self._host_device_pointer = _fn(lib, "cuMemHostGetDevicePointer_v2", [ctypes.POINTER(_U64), _VP, _UINT])
        self._write_value = _fn(lib, "cuStreamWriteValue32_v2", [_VP, _U64, _UINT, _UINT])
        self._wait_value = _fn(lib, "cuStreamWaitValue32_v2", [_VP, _U64, _UINT, _UINT])
        self._write_value64 = getattr(lib, "cuStreamWriteValue64_v2", None)   # only the ranks' copy engines'
        if self._write_value64 is not None:
            self._write_value64.argtypes = [_VP, _U64, _U64, _UINT]
            self._write_value64.restype = ctypes.c_int

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cuMemcpyAsync: the direction from the pointers (unified addressing), peers included."""
        rc = self._memcpy(dst, src, nbytes, stream)
        if rc:
            self.fail("cuMemcpyAsync", rc)

    def record(self, event: int, stream: int) -> None:
        rc = self._record(event, stream)
        if rc:
            self.fail("cuEventRecord", rc)

    def done(self, event: int) -> bool:
        """Whether everything before the event's last record has finished (a host-side query)."""
        rc = self._query(event)
        if rc == _SUCCESS:
            return True
        if rc == _NOT_READY:
            return False
        self.fail("cuEventQuery", rc)
        return False

    def wait(self, stream: int, event: int) -> None:
        """Order the stream's later work after the event's last record (another context's included)."""
        rc = self._wait(stream, event, 0)
        if rc:
            self.fail("cuStreamWaitEvent", rc)

    def write_value(self, stream: int, word: int, value: int) -> None:
        """Queue on ``stream`` the store of the 32-bit ``value`` at device address ``word`` (registered
        host memory): it happens once the stream's earlier work is done (transports/cuda_order.py)."""
        rc = self._write_value(stream, word, value, 0)
        if rc:
            self.fail("cuStreamWriteValue32", rc)

    def write_value64(self, stream: int, word: int, value: int) -> None:
        """Queue the store of the 64-bit ``value`` at device address ``word`` (a peer's memory too), after
        the stream's earlier work, a copy's stores included (the default flags: a system-wide fence
        before the store)."""
        if self._write_value64 is None:
            raise InvalidArgument("the CUDA driver (libcuda.so.1) has no cuStreamWriteValue64_v2")
        rc = self._write_value64(stream, word, value, 0)
        if rc:
            self.fail("cuStreamWriteValue64", rc)

    def wait_value(self, stream: int, word: int, value: int, at_least: bool = False) -> None:
        """Hold ``stream``'s later work until the 32-bit word at device address ``word`` equals ``value``
        (``at_least``: has reached it, in wrap-around order)."""
        rc = self._wait_value(stream, word, value, _WAIT_VALUE_GEQ if at_least else _WAIT_VALUE_EQ)
        if rc:
            self.fail("cuStreamWaitValue32", rc)

    def host_register(self, addr: int, nbytes: int) -> None:
        """Pin ``nbytes`` of this process's memory at ``addr`` (page-aligned) and map it for every
        context's devices, so that its streams and kernels can store into it and wait on it
        (transports/cuda_order.py, transports/cuda_publish.py)."""
        rc = self._host_register(addr, nbytes, _HOST_PORTABLE | _HOST_DEVICEMAP)
        if rc:
            self.fail("cuMemHostRegister", rc)

    def host_unregister(self, addr: int) -> None:
        rc = self._host_unregister(addr)
        if rc:
            self.fail("cuMemHostUnregister", rc)

    def host_device_pointer(self, addr: int) -> int:
        """The current context's device address of registered host memory at ``addr``."""
        out = _U64()
        rc = self._host_device_pointer(ctypes.byref(out), addr, 0)
        if rc:
            self.fail("cuMemHostGetDevicePointer", rc)
        return out.value

    def launcher(self, function: int, nparams: int) -> "Launch":
        return Launch(self, function, nparams)

    def capture(self, stream: int, queue: Callable[[], None], event: Any) -> "Graph":
        """What ``queue`` puts on ``stream``, then a record of ``event`` (a cupy Event, which the graph
        keeps), as one executable graph: a later launch costs one call, and the GPU starts it sooner
        than the separate calls (BENCHMARKS.md). The stream's earlier work is not part of it."""
        rc = self._begin(stream, _CAPTURE_THREAD_LOCAL)
        if rc:
            self.fail("cuStreamBeginCapture", rc)
        graph = _VP()
        try:
            queue()
            rc = self._record_flags(event.ptr, stream, _RECORD_EXTERNAL)
        except BaseException:   # a capture left open would break the stream for every later op
            self._end(stream, ctypes.byref(graph))
            if graph.value:
                self._graph_destroy(graph)
            raise
        rc_end = self._end(stream, ctypes.byref(graph))
        if rc or rc_end:
            if graph.value:
                self._graph_destroy(graph)
            self.fail("cuEventRecordWithFlags" if rc else "cuStreamEndCapture", rc or rc_end)
        exe = _VP()
        rc = self._instantiate(ctypes.byref(exe), graph, 0)
        if rc:
            self._graph_destroy(graph)
            self.fail("cuGraphInstantiateWithFlags", rc)
        assert graph.value is not None and exe.value is not None   # set by the driver when rc == 0
        return Graph(self, graph.value, exe.value, event)

    def fail(self, call: str, rc: int) -> None:
        name = ctypes.c_char_p()
        self._error_name(rc, ctypes.byref(name))
        raise SystemError_(f"CUDA driver call {call} failed: {(name.value or b'?').decode()} ({rc})")


class Launch:
    """One kernel's launch with 64-bit parameters (pointers and counts), its argument block built once:
    a launch sets the values that changed and makes one call."""

    def __init__(self, driver: Driver, function: int, nparams: int):
        self.driver, self.function = driver, function
        self.values = (_U64 * nparams)()
        base = ctypes.addressof(self.values)
        self.params = (_VP * nparams)(*(base + 8 * i for i in range(nparams)))

    def set(self, values: Any) -> None:
        for i, v in enumerate(values):
            self.values[i] = v

    def __call__(self, grid: int, block: int, stream: int) -> None:
        rc = self.driver._launch(self.function, grid, 1, 1, block, 1, 1, 0, stream, self.params, None)
        if rc:
            self.driver.fail("cuLaunchKernel", rc)


class Graph:
    """An instantiated graph ending in its own event's record (``Driver.capture``)."""

    def __init__(self, driver: Driver, graph: int, exe: int, event: Any):
        self.driver, self.graph, self.exe, self.event = driver, graph, exe, event
        self.busy = False   # launched and not yet seen done (transports/cuda.py)
        self.cell: int | None = None   # the publish cell its kernel reads (transports/cuda_publish.py)
        self.token = 0                 # its last launch's token in that cell (Publisher.fill, acked)

    def launch(self, stream: int) -> None:
        rc = self.driver._graph_launch(self.exe, stream)
        if rc:
            self.driver.fail("cuGraphLaunch", rc)

    def destroy(self) -> None:
        """Once no launch of it can be in flight (the caller's bookkeeping)."""
        if self.exe:
            self.driver._exec_destroy(self.exe)
            self.driver._graph_destroy(self.graph)
            self.exe = self.graph = 0
            self.event = None


def _fn(lib: Any, name: str, argtypes: list) -> Any:
    f = getattr(lib, name, None)
    if f is None:
        raise InvalidArgument(f"the CUDA driver (libcuda.so.1) has no {name}: too old for shmproxy")
    f.argtypes = argtypes
    f.restype = ctypes.c_int
    return f
