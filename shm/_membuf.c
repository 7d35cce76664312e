/*
 * shm._membuf: the C half of shmproxy.MPI.buffer (proxy/mpi/membuf.py), mpi4py's buffer object.
 *
 * Why compiled: MPI.buffer must *export* the buffer protocol (memoryview(buf), numpy.asarray(buf),
 * buf as a message buffer), and on Python 3.11 only a C type can export it (``__buffer__`` is 3.12).
 * So this type holds the one thing Python cannot: a Py_buffer (an address, a length in bytes, a
 * read-only flag and the object that owns the memory) and exports it as a 1-D array of unsigned
 * bytes. Everything else (constructors, indexing, cast, DLPack) is Python, in membuf.py.
 *
 *   Base()                          an empty buffer (address 0, 0 bytes), as mpi4py's buffer()
 *   b._import(obj, writable)        bind to obj's memory through the buffer protocol (PyBUF_SIMPLE:
 *                                   C-contiguous bytes; PyBUF_WRITABLE too when writable); the export
 *                                   is held until release, as mpi4py holds it
 *   b._wrap(owner, addr, n, ro, k)  bind to n bytes at addr, keeping owner (or None) alive; k is the
 *                                   DLPack device type of the memory (0: the buffer protocol's)
 *   b._set_readonly(flag)           mpi4py's frombuffer/toreadonly set the flag of the view they hold
 *   b._release()                    give the memory back; the buffer is empty again
 *   b.address, b.nbytes, b.readonly, b._owner (the exporter, or None), b._kind
 *
 * A memoryview of the buffer refers to the buffer object (view->obj), as mpi4py's does; releasing the
 * buffer while such a view is alive leaves the view over memory the buffer no longer holds, which
 * mpi4py allows too (it is the program's mistake, as with MPI_Free_mem).
 *
 * AddressInt: the base of MPI.BOTTOM, MPI.IN_PLACE and MPI.BUFFER_AUTOMATIC (an int subclass, for
 * the same 3.11 reason). They are addresses in MPI's C API, and mpi4py makes them int-like objects
 * that also export an empty buffer at that address; the export has no owner (``memoryview(c).obj``
 * is None), as nothing is behind it. Python subclasses (proxy/core/ops.py) add names and pickling.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;   /* view.obj owns the memory (a reference), or NULL */
    int exported;     /* view came from PyObject_GetBuffer: PyBuffer_Release gives it back */
    int kind;         /* DLPack device type of the memory; 0 for the buffer protocol */
} MemBuf;

static void membuf_clear_view(MemBuf *self) {
    if (self->exported) {
        PyBuffer_Release(&self->view);
    } else {
        Py_CLEAR(self->view.obj);
    }
    memset(&self->view, 0, sizeof(self->view));
    self->view.itemsize = 1;
    self->exported = 0;
    self->kind = 0;
}

static PyObject *membuf_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    MemBuf *self = (MemBuf *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    memset(&self->view, 0, sizeof(self->view));
    self->view.itemsize = 1;
    self->exported = 0;
    self->kind = 0;
    return (PyObject *)self;
}

static void membuf_dealloc(MemBuf *self) {
    membuf_clear_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *membuf_import(MemBuf *self, PyObject *args) {
    PyObject *obj;
    int writable;
    if (!PyArg_ParseTuple(args, "Op", &obj, &writable)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0)) < 0) return NULL;
    membuf_clear_view(self);
    self->view = view;
    self->exported = 1;
    Py_RETURN_NONE;
}

static PyObject *membuf_wrap(MemBuf *self, PyObject *args) {
    PyObject *owner, *address;
    Py_ssize_t nbytes;
    int readonly, kind;
    if (!PyArg_ParseTuple(args, "OOnpi", &owner, &address, &nbytes, &readonly, &kind)) return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "expecting non-negative buffer length");
        return NULL;
    }
    void *addr = PyLong_AsVoidPtr(address);
    if (!addr && PyErr_Occurred()) return NULL;
    if (!addr && nbytes > 0) {
        PyErr_SetString(PyExc_ValueError, "expecting non-NULL address");
        return NULL;
    }
    membuf_clear_view(self);
    /* view.obj keeps owner (None: no owner) alive for as long as this buffer holds the memory */
    if (PyBuffer_FillInfo(&self->view, owner == Py_None ? NULL : owner, addr, nbytes, readonly,
                          PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    self->kind = kind;
    Py_RETURN_NONE;
}

static PyObject *membuf_set_readonly(MemBuf *self, PyObject *arg) {
    int flag = PyObject_IsTrue(arg);
    if (flag < 0) return NULL;
    self->view.readonly = flag;
    Py_RETURN_NONE;
}

static PyObject *membuf_release(MemBuf *self, PyObject *unused) {
    membuf_clear_view(self);
    Py_RETURN_NONE;
}

static PyObject *membuf_address(MemBuf *self, void *closure) {
    return PyLong_FromVoidPtr(self->view.buf);
}

static PyObject *membuf_nbytes(MemBuf *self, void *closure) {
    return PyLong_FromSsize_t(self->view.len);
}

static PyObject *membuf_readonly(MemBuf *self, void *closure) {
    return PyBool_FromLong(self->view.readonly);
}

static PyObject *membuf_owner(MemBuf *self, void *closure) {
    PyObject *obj = self->view.obj ? self->view.obj : Py_None;
    Py_INCREF(obj);
    return obj;
}

static PyObject *membuf_kind(MemBuf *self, void *closure) {
    return PyLong_FromLong(self->kind);
}

static Py_ssize_t membuf_length(MemBuf *self) {
    return self->view.len;
}

/* DLPack device types whose memory the CPU can read: none (the buffer protocol), CPU, CUDA host,
 * ROCm host, CUDA managed. Other memory (a GPU's) is exported to no one: a memoryview of it would
 * crash the reader, so it is mpi4py's BufferError("buffer is not CPU-accessible") instead. */
static int cpu_accessible(int kind) {
    return kind == 0 || kind == 1 || kind == 3 || kind == 11 || kind == 13;
}

static int membuf_getbuffer(MemBuf *self, Py_buffer *view, int flags) {
    if (!cpu_accessible(self->kind)) {
        PyErr_SetString(PyExc_BufferError, "buffer is not CPU-accessible");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->view.buf, self->view.len, self->view.readonly, flags);
}

static PyMethodDef membuf_methods[] = {
    {"_import", (PyCFunction)membuf_import, METH_VARARGS, "bind to an object's memory (buffer protocol)"},
    {"_wrap", (PyCFunction)membuf_wrap, METH_VARARGS, "bind to n bytes at an address, keeping an owner"},
    {"_set_readonly", (PyCFunction)membuf_set_readonly, METH_O, "set the read-only flag of the held view"},
    {"_release", (PyCFunction)membuf_release, METH_NOARGS, "give the memory back: empty again"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef membuf_getset[] = {
    {"address", (getter)membuf_address, NULL, "Buffer address.", NULL},
    {"nbytes", (getter)membuf_nbytes, NULL, "Buffer size (in bytes).", NULL},
    {"readonly", (getter)membuf_readonly, NULL, "Buffer is read-only.", NULL},
    {"_owner", (getter)membuf_owner, NULL, "the object owning the memory, or None", NULL},
    {"_kind", (getter)membuf_kind, NULL, "DLPack device type of the memory (0: buffer protocol)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods membuf_as_sequence = {
    .sq_length = (lenfunc)membuf_length,
};

static PyBufferProcs membuf_as_buffer = {
    .bf_getbuffer = (getbufferproc)membuf_getbuffer,
    .bf_releasebuffer = NULL,
};

static PyTypeObject MemBufType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._membuf.Base",
    .tp_basicsize = sizeof(MemBuf),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Memory exported through the buffer protocol as unsigned bytes (MPI.buffer's base).",
    .tp_new = membuf_new,
    .tp_dealloc = (destructor)membuf_dealloc,
    .tp_methods = membuf_methods,
    .tp_getset = membuf_getset,
    .tp_as_sequence = &membuf_as_sequence,
    .tp_as_buffer = &membuf_as_buffer,
};

static int addrint_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    Py_ssize_t addr = PyLong_AsSsize_t(self);
    if (addr == -1 && PyErr_Occurred()) {
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, NULL, (void *)addr, 0, 0, flags);
}

static PyBufferProcs addrint_as_buffer = {
    .bf_getbuffer = (getbufferproc)addrint_getbuffer,
    .bf_releasebuffer = NULL,
};

static PyTypeObject AddressIntType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._membuf.AddressInt",
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_LONG_SUBCLASS,
    .tp_doc = "An int that exports an empty buffer at its value as address (MPI.BOTTOM's base).",
    .tp_as_buffer = &addrint_as_buffer,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._membuf", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__membuf(void) {
    if (PyType_Ready(&MemBufType) < 0) return NULL;
    AddressIntType.tp_base = &PyLong_Type;
    if (PyType_Ready(&AddressIntType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    /* PyModule_AddObjectRef (3.10) takes its own reference: nothing to undo on failure but m */
    if (PyModule_AddObjectRef(m, "Base", (PyObject *)&MemBufType) < 0 ||
        PyModule_AddObjectRef(m, "AddressInt", (PyObject *)&AddressIntType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
