/*
 * Whole transfers on a blocking socket, outside the interpreter: the loops of syscalls that the TCP
 * transport's Python-threaded bulk path (shm/_native_net.c) and the collective wire's threads
 * (shm/_wire_threads.c) share. EINTR retries: their callers are never the main thread, so no Python
 * signal handler waits on them.
 */
#ifndef SHM_SOCKIO_H
#define SHM_SOCKIO_H

#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* Fill n bytes at p: n, or fewer on EOF, or -errno on an error. */
static inline long long sock_read_full(int fd, char *p, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, p + got, (size_t)(n - got), 0);
        if (k > 0) got += (uint64_t)k;
        else if (k == 0) break;
        else if (errno != EINTR) return -errno;
    }
    return (long long)got;
}

/* sendmsg every byte of iov[0..niov), resuming after partial writes (iov is consumed): 0, or -errno. */
static inline int sock_write_all(int fd, struct iovec *iov, int niov) {
    struct msghdr msg = {0};
    while (niov > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)niov;
        ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        size_t left = (size_t)k;
        while (niov > 0 && left >= iov->iov_len) {   /* drop what went out whole */
            left -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {                              /* and the front of a part cut short */
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

#endif
