/*
 * shm._wire's parts (shm/_wire.c, the Python type; shm/_wire_threads.c, the threads and the frame
 * protocol): the wire's state, one struct per frame part, receive, send and socket. The protocols
 * (frames, the lock, closing) are described at the top of shm/_wire.c.
 */
#ifndef SHM_WIRE_H
#define SHM_WIRE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>

#define MAX_SOCKS 16
#define MAX_KEY 512
#define HDR 32
#define PART_ALIGN 4096
#ifndef FOLD_BYTES   /* (a build may set it: -DFOLD_BYTES=..., to measure another) */
#define FOLD_BYTES (64 * 1024)   /* a folding reader reads this much, then reduces it (L2-sized) */
#endif
enum { T_COLL = 4, T_BYE = 7 };   /* transports/net_wire.py's frame types */

typedef struct Part {             /* a part that arrived before its receive was posted */
    struct Part *next;
    uint64_t off, len;
    char *data;
} Part;

struct Wire;
typedef struct Chain {            /* a send a receive starts once it is complete (recv's `then`) */
    struct Chain *next;           /* on the receiving wire's `spent` list once fired or dropped */
    struct Wire *to;              /* the wire it goes out on (this one or another link's) */
    PyObject *ref;                /* our reference on `to` (NULL when `to` is the receiving wire) */
    uint32_t keylen;
    char key[MAX_KEY];
    long long token;
    const char *addr;             /* what the receive landed, set when it finishes (_sw_finish) */
    uint64_t n;
} Chain;

typedef struct Recv {             /* a posted receive, or (posted 0) a stash entry */
    struct Recv *next;
    uint32_t keylen;
    char key[MAX_KEY];
    char *addr;
    uint64_t nbytes, got;
    int inflight, arrived, posted, cancelled;
    long long token;
    Part *parts;
    struct Recv *job_next;        /* on the copier's queue */
    int fold, op, code;           /* fold: addr = a (op) the frame, element by element (_kernel.h's codes) */
    const char *a;
    Chain *then;                  /* sent from addr once every byte is in (and folded) */
} Recv;

typedef struct Send {
    long long token;
    int left;                     /* parts not written yet */
    uint32_t keylen;
    char key[MAX_KEY];
} Send;

typedef struct Out {              /* one part queued on a socket (send NULL: the BYE) */
    struct Out *next;
    unsigned char hdr[HDR];
    const char *data;
    uint64_t len;
    uint64_t skip;                /* bytes of it (header, key, data) a direct write sent already */
    Send *send;
} Out;

typedef struct {
    struct Wire *w;
    int index, fd, started;
    pthread_t reader, writer;
    pthread_cond_t cv;            /* the writer waits on it (with mu) */
    Out *head, *tail;
    int queued, peer_bye;
    int writing;                  /* a direct write is on the socket: its writer waits */
    int busy;                     /* its writer is writing a part: no direct write */
} Sock;

typedef struct Wire {
    PyObject_HEAD
    pthread_mutex_t mu;
    int peer, nsocks, closed;
    pthread_t copier;             /* lands what arrived before its receive was posted */
    pthread_cond_t copier_cv;
    Recv *jobs, *jobs_tail;
    int copier_started;
    Sock s[MAX_SOCKS];
    uint64_t part_min, max_total;
    uint64_t direct_max;          /* a one-part frame up to this is written by its sender when idle */
    char *pool;
    Recv *posted, *stash;
    long long *done;
    size_t ndone, cap;
    int closing;
    char lost[256];
    int lost_told;
    unsigned rr;
    uint64_t bytes_in, bytes_out;
    Chain *spent;                 /* fired or dropped chains whose reference poll() releases (GIL) */
    uint64_t chained;             /* chains fired */
    uint64_t direct_out, direct_in;   /* frames written by their sender, receives landed by recv() */
} Wire;

/* shm/_wire_threads.c */
void _sw_kernels_init(void);
int _sw_can_fold(int op, int code, uint64_t nbytes);   /* the C kernel reduces it, whole elements */
void _sw_wake_loop(Wire *w);
void _sw_push_done(Wire *w, long long token);
void _sw_set_lost(Wire *w, const char *fmt, int a, const char *b);   /* the first failure, unless closing */
Recv *_sw_find(Recv *list, const char *key, uint32_t keylen);
void _sw_unlink_recv(Recv **list, Recv *r);
void _sw_free_parts(Part *p);
int _sw_settle(Wire *w, Recv *r);
int _sw_finish(Wire *w, Recv *r, int push, Chain **then);   /* under mu: settle, and if done, finish */
void _sw_free_recv(Wire *w, Recv *r);   /* under mu: its chain, unfired, goes to `spent` */
/* 1: written whole by the caller (direct: no token comes), 0: queued, or -errno */
int _sw_queue_send(Wire *w, const char *key, uint32_t keylen, const char *addr, uint64_t n, long long token,
                   int direct);
void _sw_land(const Recv *e, uint64_t off, const char *src, uint64_t len);
void _sw_fire(Wire *w, Chain *c);   /* not under mu */
void _sw_make_header(unsigned char *h, int type, uint32_t length, uint64_t a, uint64_t b, uint64_t c);
void *_sw_reader_main(void *arg);
void *_sw_writer_main(void *arg);
void *_sw_copier_main(void *arg);

#endif
