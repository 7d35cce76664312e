/*
 * What the files of shm._native share: the entry points of shm/_native_wake.c, _native_blocks.c,
 * _native_fast.c, _native_device.c, _native_armed.c and _native_ops.c that the module's method table
 * (shm/_native.c) lists, and their initialisation.
 */
#ifndef SHM_NATIVE_H
#define SHM_NATIVE_H

#include <Python.h>
#include <stdint.h>

PyObject *_sn_complete_coll(PyObject *self, PyObject *args);
PyObject *_sn_wake_owners(PyObject *self, PyObject *args);
PyObject *_sn_copy_blocks(PyObject *self, PyObject *args);   /* shm/_native_blocks.c */
PyObject *_sn_fast_take(PyObject *self, PyObject *args);     /* shm/_native_fast.c */
PyObject *_sn_fast_wake_coll(PyObject *self, PyObject *arg);
PyObject *_sn_fast_ref_done(PyObject *self, PyObject *args);
PyObject *_sn_publish_launch(PyObject *self, PyObject *args);   /* shm/_native_device.c */
PyObject *_sn_watch_words(PyObject *self, PyObject *args);
PyObject *_sn_fire_armed(PyObject *self, PyObject *args);      /* shm/_native_armed.c */
/* cuGraphLaunch's signature (the caller passes its address: the extension links nothing of CUDA) */
typedef int (*graph_launch_fn)(void *exe, void *stream);
void _sn_fill_cell(uint64_t slots, uint64_t cell, uint64_t token, uint64_t delta, uint64_t nbytes, int n,
                   const long long *slot, const long long *rseq, const long long *source,
                   const uint64_t *tag);
PyObject *_sn_bind_op(PyObject *self, PyObject *cls);        /* shm/_native_ops.c */
PyObject *_sn_sock_recv_into(PyObject *self, PyObject *args);   /* shm/_native_net.c */
PyObject *_sn_sock_send_parts(PyObject *self, PyObject *args);
PyObject *_sn_unpack_ops(PyObject *self, PyObject *args);
int _sn_wake_init(void);   /* interns the Op attribute names below; -1 with an exception */

/* An Op's integer attribute (shm/_native_wake.c), by one of its names interned at init; -1 with an
 * exception. complete_coll and publish_launch read ops through it. */
int _sn_op_field(PyObject *op, PyObject *name, long long *out);
extern PyObject *_sn_s_req_slot, *_sn_s_owner, *_sn_s_req_seq, *_sn_s_peer;

#endif
