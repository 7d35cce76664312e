"""Shared-memory segments: named POSIX shm for the ops pool, memfd for rank buffers.

Lifecycle rules (docs/architecture.md, "The ops pool"):
- A pool segment is created exclusively (O_CREAT|O_EXCL), mode 0600, with a random suffix, and its
  name is removed again at once, before it is even sized: the name exists for microseconds, so no
  kill, however it lands (the whole job at once included), leaves it in /dev/shm. The ranks get the
  fd over the service socket (SCM_RIGHTS) and map it with ``from_fd``; the name stays only as the
  fd's link target (``/dev/shm/shmproxy-... (deleted)``), by which the dump tool finds a pool.
- It is sized up front with posix_fallocate: a full /dev/shm is an error here, at init, naming the
  directory and its free space, instead of a SIGBUS on first touch later.
- Rank buffers are memfds: they never have a name, so nothing can leak in /dev/shm; their fds travel
  over the service socket (SCM_RIGHTS).
- We never use ``multiprocessing.shared_memory``: before Python 3.13 every attacher registers the
  segment with the resource tracker, which unlinks it when *that* process exits, under live peers.

The file descriptor of a mapped segment stays open in the progress process: the dump tool reads an
unlinked pool through ``/proc/<pid>/fd/<n>`` when the process itself is wedged.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil

import posix_ipc

from shmproxy.core import errors, log
from shmproxy.shm import _native

_log = log.get("SHM")

NAME_PREFIX = "shmproxy-"


def _address(mm: mmap.mmap) -> int:
    return _native.buffer_info(mm, True)[0]


def _fallocate(fd: int, size: int, where: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            try:
                free = shutil.disk_usage(where).free
                detail = f"{free / 2**20:.0f} MiB free in {where}"
            except OSError:
                detail = f"free space of {where} unknown"
            raise errors.SystemError_(
                f"cannot reserve {size / 2**20:.1f} MiB of shared memory ({detail}): enlarge {where} "
                f"(e.g. `mount -o remount,size=8G {where}`, or docker --shm-size) or lower "
                f"SHMPROXY_MAX_OPS_PER_RANK / the buffer sizes", errno=exc.errno) from exc
        raise errors.from_oserror(f"posix_fallocate({size}) in {where}", exc) from exc


class Segment:
    """A named POSIX shared-memory segment, mapped read-write (or read-only for the dump tool)."""

    def __init__(self, name: str, fd: int, size: int, readonly: bool = False):
        self.name = name
        self.fd = fd
        self.size = size
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self.addr = 0 if readonly else _address(self.mm)

    @classmethod
    def create(cls, tag: str, size: int, shm_dir: str = "/dev/shm") -> "Segment":
        """A new segment of ``size`` bytes whose name is already gone; share it by passing ``fd``."""
        name = f"/{NAME_PREFIX}{tag}-{secrets.token_hex(4)}"
        try:
            seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.Error as exc:
            raise errors.SystemError_(f"cannot create shared memory {name}: {exc}") from exc
        fd = seg.fd
        try:
            posix_ipc.unlink_shared_memory(name)
            _fallocate(fd, size, shm_dir)
            self = cls(name, fd, size)
        except BaseException:
            os.close(fd)
            raise
        _log.info("created %s (%d bytes), its name removed", name, size)
        return self

    @classmethod
    def from_fd(cls, fd: int, size: int, name: str) -> "Segment":
        """Map a segment another process created and passed (SCM_RIGHTS); takes ownership of ``fd``."""
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise errors.RemoteError(f"shared memory {name} has {actual} bytes, expected {size}")
            return cls(name, fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open_fd_readonly(cls, path: str) -> "Segment":
        """Map a segment read-only from a path such as /proc/<pid>/fd/<n> (dump tool)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            return cls(path, fd, os.fstat(fd).st_size, readonly=True)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Unmap and close the fd. Idempotent. Views into the mapping must be released first."""
        if self.mm is not None and not self.mm.closed:
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MemfdBuffer:
    """An anonymous shared buffer (memfd) mapped in this process; share it by passing ``fd``."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        # mmap refuses length 0; a 0-byte buffer still gets one page so it has an address.
        self.mm = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.addr = _address(self.mm)

    @classmethod
    def create(cls, size: int, label: str = "shmproxy-buf") -> "MemfdBuffer":
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC)
        except OSError as exc:
            raise errors.from_oserror("memfd_create", exc) from exc
        try:
            _fallocate(fd, max(size, 1), "memory (memfd)")
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int, size: int) -> "MemfdBuffer":
        """Adopt an fd received over the service socket (this object then owns it)."""
        actual = os.fstat(fd).st_size
        if actual < max(size, 1):
            os.close(fd)
            raise errors.InvalidArgument(f"buffer fd has {actual} bytes, {size} announced")
        try:
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Idempotent. Raises BufferError if numpy views of the mapping are still alive."""
        if self.mm is not None and not self.mm.closed:
            self.mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
