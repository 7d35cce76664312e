/*
 * Whole-frame socket transfers with the GIL released once, for the TCP transport's reader and
 * writer threads (transports/net_wire.py).
 *
 * Why in C: a 1 MiB chunk crosses a socket in many partial recv/sendmsg returns (loopback hands over
 * what one skb held, a full send buffer takes what drained). Python's socket methods release the GIL
 * for each syscall and take it back after, so a thread moving one chunk queues for the GIL a dozen
 * times behind the progress loop, which holds it between its own syscalls: every wait is up to the
 * switch interval, and a chunk's hops add up to milliseconds that are neither copy nor wire. Here a
 * frame is moved by one loop of syscalls outside the interpreter, and the thread asks for the GIL
 * once, when the whole frame is in or out.
 *
 * The sockets are blocking (the threads own them; a peer's death or a shutdown ends a blocked call
 * with EOF or an error). The loops themselves are shm/_sockio.h's, shared with the collective wire's
 * threads (shm/_wire_threads.c).
 */
#include "_native.h"
#include "_sockio.h"

#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define MAX_PARTS 16

/* sock_recv_into(fd, addr, n) -> bytes read: fill n bytes at addr; fewer only on EOF. OSError on an
 * error (after the bytes it read: the caller drops the link either way). */
PyObject *_sn_sock_recv_into(PyObject *self, PyObject *args) {
    int fd;
    unsigned long long addr, n;
    if (!PyArg_ParseTuple(args, "iKK", &fd, &addr, &n))
        return NULL;
    long long got;
    Py_BEGIN_ALLOW_THREADS
    got = sock_read_full(fd, (char *)(uintptr_t)addr, n);
    Py_END_ALLOW_THREADS
    int err = got < 0 ? (int)-got : 0;
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)got);
}

/* sock_send_parts(fd, parts) -> None: sendmsg every part (objects with the buffer protocol: bytes,
 * memoryviews of registered memory), resuming after partial writes, until all went out. */
PyObject *_sn_sock_send_parts(PyObject *self, PyObject *args) {
    int fd;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "iO", &fd, &parts))
        return NULL;
    PyObject *seq = PySequence_Fast(parts, "sock_send_parts: parts must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(seq);
    if (nparts > MAX_PARTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "sock_send_parts: %zd parts (at most %d)", nparts, MAX_PARTS);
    }
    Py_buffer views[MAX_PARTS];
    struct iovec iov[MAX_PARTS];
    Py_ssize_t nviews = 0;
    int niov = 0;
    for (Py_ssize_t i = 0; i < nparts; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], PyBUF_SIMPLE) < 0)
            goto fail;
        nviews++;
        if (views[i].len > 0) {
            iov[niov].iov_base = views[i].buf;
            iov[niov].iov_len = (size_t)views[i].len;
            niov++;
        }
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = -sock_write_all(fd, iov, niov);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nviews; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t i = 0; i < nviews; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return NULL;
}
