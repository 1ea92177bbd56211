/* One frame each way on a TCP socket in one call, for the small calls between two hosts (pycoll.paired and the
 * engine's eager frames): the outgoing frame (header, zero padding to HEADER_SIZE, payload, zero padding to ALIGN)
 * leaves in one sendmsg; the incoming one is read into the channel's staging area, matched against the header the
 * caller expects, byte for byte (or, for a point-to-point receive, by its context and tag), and copied out whole,
 * polling the socket for a bounded spin while it is not in. ``exchange`` moves one larger frame each way with each
 * of several sockets at once (a direct collective's blocks to other hosts), the incoming ones read straight into
 * place; a peer of the same host joins it through its shared-memory rings (pycoll.transport.shm), so that one
 * loop serves every peer of the call.
 *
 * The Python path (pycoll.p2p_eager) does the same in several calls and is what runs without this module; this
 * one only moves bytes: the engine's checks, its lock and what happens to a frame that could not move stay there.
 * The GIL is released throughout: the caller holds the engine's lock, so nobody else touches the channel. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>

#define HEADER_SIZE 64
#define ALIGN 64
/* a read takes at most this much more than the frame wanted (READ_WINDOW in tcp.py) */
#define READ_WINDOW (32 << 10)

/* what became of the incoming frame */
enum { TAKEN = 0, NOT_YET = 1, OTHER = 2, ENDED = 3, NOTHING_ASKED = -1 };

static const char zeros[ALIGN];

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static Py_ssize_t padded(Py_ssize_t nbytes)
{
    return nbytes + (-nbytes & (ALIGN - 1));
}

/* which frame a receive takes: the one whose header starts with head[0:hlen] (a collective's: pycoll.paired), or,
 * without head, a point-to-point message of ctx and tag (any tag if any_tag) of at most the receive's size, as
 * pycoll.p2p_eager matches them; the header is HEADER in pycoll/p2p_protocol.py: <QqQIiQQ, little-endian */
struct match {
    const char *head;
    Py_ssize_t hlen;
    uint64_t ctx;
    int64_t tag;
    int any_tag;
    uint32_t meta;
};

#define HEADER_FIELDS 48

/* the payload's size of the frame at stage[0:have] if it is the one wanted (-1: not yet known, -2: another one) */
static Py_ssize_t wanted(const char *frame, Py_ssize_t have, const struct match *m, Py_ssize_t room, int64_t *tag)
{
    if (m->head != NULL) {
        if (have < m->hlen)
            return -1;
        return memcmp(frame, m->head, (size_t)m->hlen) ? -2 : room;
    }
    if (have < HEADER_FIELDS)
        return -1;
    uint64_t ctx, nbytes, count, vhash;
    int64_t got_tag;
    uint32_t meta;
    int32_t root;
    memcpy(&ctx, frame, 8);
    memcpy(&got_tag, frame + 8, 8);
    memcpy(&nbytes, frame + 16, 8);
    memcpy(&meta, frame + 24, 4);
    memcpy(&root, frame + 28, 4);
    memcpy(&count, frame + 32, 8);
    memcpy(&vhash, frame + 40, 8);
    if (ctx != m->ctx || (got_tag != m->tag && !m->any_tag) || meta != m->meta || root || count || vhash ||
        nbytes > (uint64_t)room)
        return -2;  /* another call's message, a rendezvous, a bad fit: the engine's path */
    *tag = got_tag;
    return (Py_ssize_t)nbytes;
}

/* what a wait's first sched_yield showed (``take``'s *cpu): another task ran on this CPU meanwhile and the frame
 * was in as it returned (the peer may share this CPU: spinning only keeps it from sending), or the yield came back
 * at once with the frame still out (the peer runs elsewhere) */
#define CPU_SHARED 1
#define CPU_OWN (-1)
#define HANDED_NS 4000  /* a yield that took this long ran another task */
#define KEPT_NS 1000    /* one back this soon ran none */

/* the frame ``m`` wants, its payload into dst (room bytes at most; *got: its size, *tag: its tag); stage[start:end]
 * holds what was read before and not consumed, and is compacted when the frame would not fit behind start; *cpu
 * (where not NULL): CPU_SHARED, CPU_OWN or 0, as the first yield of the wait, if any, showed */
static int take(int fd, char *stage, Py_ssize_t cap, Py_ssize_t *pstart, Py_ssize_t *pend, const struct match *m,
                char *dst, Py_ssize_t room, int64_t spin_ns, int64_t yield_ns, Py_ssize_t *got, int64_t *tag, int *cpu)
{
    Py_ssize_t start = *pstart, end = *pend;
    int64_t until = 0;
    int status;
    for (;;) {
        Py_ssize_t have = end - start, nbytes = wanted(stage + start, have, m, room, tag);
        if (nbytes == -2) {
            status = OTHER;
            break;
        }
        Py_ssize_t want = nbytes >= 0 ? HEADER_SIZE + padded(nbytes) : HEADER_SIZE;
        if (want > cap) {
            status = OTHER;  /* it cannot be staged whole: the engine's path */
            break;
        }
        if (nbytes >= 0 && have >= want) {
            memcpy(dst, stage + start + HEADER_SIZE, (size_t)nbytes);
            start += want;
            if (start == end)
                start = end = 0;
            *got = nbytes;
            status = TAKEN;
            break;
        }
        if (start + want > cap) {
            memmove(stage, stage + start, (size_t)have);
            start = 0;
            end = have;
        }
        Py_ssize_t ask = (want > READ_WINDOW ? want : READ_WINDOW) - have;  /* > 0: have < want here */
        if (ask > cap - end)
            ask = cap - end;
        ssize_t n = recv(fd, stage + end, (size_t)ask, MSG_DONTWAIT);
        if (n > 0) {
            end += n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            status = ENDED;  /* the stream ended or broke: the Python path reads it again and names the failure */
            break;
        }
        if (!until)
            until = now_ns() + spin_ns;
        struct pollfd p = {fd, POLLIN, 0};
        int ready = 0;
        while (!(ready = poll(&p, 1, 0)) && now_ns() < until)
            ;
        if (!ready && yield_ns > 0) {  /* then give the core away between looks: the peer may need it to send */
            int64_t yield_until = until + yield_ns, before = now_ns();
            sched_yield();
            int64_t took = now_ns() - before;
            ready = poll(&p, 1, 0);
            if (cpu)
                *cpu = took >= HANDED_NS && ready ? CPU_SHARED : took < KEPT_NS && !ready ? CPU_OWN : 0;
            while (!ready && now_ns() < yield_until) {
                sched_yield();
                ready = poll(&p, 1, 0);
            }
            yield_ns = 0;
        }
        if (!ready) {
            status = NOT_YET;
            break;
        }
    }
    *pstart = start;
    *pend = end;
    return status;
}

static int header_of(PyObject *obj, const char **head, Py_ssize_t *hlen)
{
    if (PyBytes_AsStringAndSize(obj, (char **)head, hlen) < 0)
        return -1;
    if (*hlen > HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "a frame header has at most %d bytes, not %zd", HEADER_SIZE, *hlen);
        return -1;
    }
    return 0;
}

/* the channel's part of a call's arguments: args[0] the socket, args[1] the staging area (taken as a writable
 * buffer, released by the caller), args[2:4] the staged bytes' bounds; -1 with an error set (nothing held) */
static int channel_of(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name, int *fd,
                      Py_buffer *stage, Py_ssize_t *start, Py_ssize_t *end)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    *fd = (int)PyLong_AsLong(args[0]);
    *start = PyLong_AsSsize_t(args[2]);
    *end = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred() || PyObject_GetBuffer(args[1], stage, PyBUF_WRITABLE) < 0)
        return -1;
    if (*start < 0 || *end < *start || *end > stage->len) {
        PyErr_Format(PyExc_ValueError, "staged bytes [%zd, %zd) outside a staging area of %zd", *start, *end,
                     stage->len);
        PyBuffer_Release(stage);
        return -1;
    }
    return 0;
}

/* the header ``head`` (hlen bytes) with its tag field replaced by ``tag``, in ``copy`` (HEADER_SIZE bytes) */
static const char *tagged(const char *head, Py_ssize_t hlen, int64_t tag, char *copy)
{
    if (hlen < 16) {
        PyErr_Format(PyExc_ValueError, "a frame header to tag has at least 16 bytes, not %zd", hlen);
        return NULL;
    }
    memcpy(copy, head, (size_t)hlen);
    memcpy(copy + 8, &tag, 8);
    return copy;
}

/* swap(fd, stage, start, end, head_out, out, head_in, into, spin_ns[, yield_ns[, tag]]) -> (sent, status, start, end,
 * cpu)
 * sent: bytes the socket took of the outgoing frame (-1: none to send; below -1: minus the errno of a failed send);
 * status: TAKEN, NOT_YET (nothing consumed after spin_ns of polling, then yield_ns of polling between sched_yields,
 * which only a frame sent whole waits through), OTHER, ENDED or NOTHING_ASKED (into None); cpu: what the wait's first
 * yield showed of the peer (1: it may share this CPU, -1: it runs elsewhere, 0: no yield, or neither). ``tag``,
 * unless None, replaces the tag field of both headers (a plan's headers made once, each call its own tag); out and
 * into are any contiguous buffers, taken as their bytes */
static PyObject *swap(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    int fd;
    Py_buffer stage = {0}, out = {0}, into = {0};
    Py_ssize_t start, end;
    if (nargs < 9 || nargs > 11) {
        PyErr_Format(PyExc_TypeError, "swap takes 9 to 11 arguments, not %zd", nargs);
        return NULL;
    }
    int sending = args[4] != Py_None, receiving = args[6] != Py_None;
    const char *head_out = NULL, *head_in = NULL;
    char out_copy[HEADER_SIZE], in_copy[HEADER_SIZE];
    Py_ssize_t out_hlen = 0, in_hlen = 0;
    long long spin_ns = PyLong_AsLongLong(args[8]);
    long long yield_ns = nargs > 9 ? PyLong_AsLongLong(args[9]) : 0;
    int retag = nargs > 10 && args[10] != Py_None;
    int64_t tag = retag ? (int64_t)PyLong_AsLongLong(args[10]) : 0;
    if ((PyErr_Occurred()) || (sending && header_of(args[4], &head_out, &out_hlen) < 0) ||
        (receiving && header_of(args[6], &head_in, &in_hlen) < 0))
        return NULL;
    if (retag && ((sending && !(head_out = tagged(head_out, out_hlen, tag, out_copy))) ||
                  (receiving && !(head_in = tagged(head_in, in_hlen, tag, in_copy)))))
        return NULL;
    if (channel_of(args, nargs, nargs, "swap", &fd, &stage, &start, &end) < 0)
        return NULL;
    PyObject *result = NULL;
    if (sending && PyObject_GetBuffer(args[5], &out, PyBUF_SIMPLE) < 0)
        goto done;
    if (receiving && PyObject_GetBuffer(args[7], &into, PyBUF_WRITABLE) < 0)
        goto done;
    Py_ssize_t sent = -1;
    int status = NOTHING_ASKED, cpu = 0;
    Py_BEGIN_ALLOW_THREADS
    if (sending) {
        struct iovec iov[4] = {
            {(void *)head_out, (size_t)out_hlen},
            {(void *)zeros, (size_t)(HEADER_SIZE - out_hlen)},
            {out.buf, (size_t)out.len},
            {(void *)zeros, (size_t)(padded(out.len) - out.len)},
        };
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = 4;
        ssize_t n;
        do
            n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        sent = n >= 0 ? n : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1 - errno;
    }
    if (receiving) {
        struct match m = {head_in, in_hlen, 0, 0, 0, 0};
        Py_ssize_t got = 0;
        int64_t tag = 0;
        int whole = !sending || sent == HEADER_SIZE + padded(out.len);  /* else the rest must go out first */
        status = take(fd, stage.buf, stage.len, &start, &end, &m, into.buf, into.len, spin_ns, whole ? yield_ns : 0,
                      &got, &tag, &cpu);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("ninni", sent, status, start, end, cpu);
done:
    PyBuffer_Release(&stage);
    if (out.obj)
        PyBuffer_Release(&out);
    if (into.obj)
        PyBuffer_Release(&into);
    return result;
}

/* take_message(fd, stage, start, end, ctx, tag, any_tag, meta, into, spin_ns) -> (status, nbytes, tag, start, end)
 * the next frame if it is a point-to-point message of ctx and tag (any tag if any_tag) and meta, with no root, count
 * or hash, of at most len(into) bytes: its payload into ``into``; status as swap's */
static PyObject *take_message(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    int fd;
    Py_buffer stage = {0}, into = {0};
    Py_ssize_t start, end;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "take_message takes 10 arguments");
        return NULL;
    }
    struct match m = {NULL, 0, PyLong_AsUnsignedLongLongMask(args[4]), PyLong_AsLongLong(args[5]),
                      PyObject_IsTrue(args[6]), (uint32_t)PyLong_AsUnsignedLongMask(args[7])};
    long long spin_ns = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred() || m.any_tag < 0 || channel_of(args, nargs, 10, "take_message", &fd, &stage, &start, &end) < 0)
        return NULL;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[8], &into, PyBUF_WRITABLE) < 0)
        goto done;
    Py_ssize_t got = 0;
    int64_t tag = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = take(fd, stage.buf, stage.len, &start, &end, &m, into.buf, into.len, spin_ns, 0, &got, &tag, NULL);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("inLnn", status, got, (long long)tag, start, end);
done:
    PyBuffer_Release(&stage);
    if (into.obj)
        PyBuffer_Release(&into);
    return result;
}

/* the most sockets one exchange takes (the caller leaves the rest to the engine) */
#define EXCHANGE_FLOWS 64

/* One large frame each way with each of several peers at once (pycoll.p2p_frames.exchange_frames: a direct
 * collective's blocks, as an Alltoall's): every outgoing frame leaves by sendmsg as its socket takes it, and every
 * incoming one, matched against the header its caller expects, is read straight into its destination (no staging
 * copy), all in one loop that polls the sockets together. */
struct flow {
    int fd;
    int ring;              /* a shared-memory flow: the ring fields below, no socket */
    char *out_ring, *in_ring;
    int64_t out_cap, in_cap, *out_tail, *out_head, *in_tail, *in_head, bell;
    char *stage;
    Py_ssize_t cap, start, end;
    const char *head_out, *head_in;
    Py_ssize_t out_hlen, in_hlen;
    char *out, *into;
    Py_ssize_t out_len, into_len;
    Py_ssize_t sent, got;  /* bytes of the outgoing frame sent, of the incoming frame consumed */
    int status;            /* the incoming frame's: TAKEN, NOT_YET, OTHER, ENDED, NOTHING_ASKED */
    int send_errno;
};

/* the outgoing frame's bytes from ``f->sent`` as an iovec (header, its padding, payload, its padding), at most
 * ``most`` bytes of them (0: all): how many entries */
static int rest_of_frame(const struct flow *f, struct iovec *iov, Py_ssize_t most)
{
    const char *parts[4] = {f->head_out, zeros, f->out, zeros};
    Py_ssize_t sizes[4] = {f->out_hlen, HEADER_SIZE - f->out_hlen, f->out_len, padded(f->out_len) - f->out_len};
    Py_ssize_t skip = f->sent, left = most > 0 ? most : PY_SSIZE_T_MAX;
    int k = 0;
    for (int i = 0; i < 4 && left > 0; i++) {
        if (skip >= sizes[i]) {
            skip -= sizes[i];
            continue;
        }
        Py_ssize_t len = sizes[i] - skip < left ? sizes[i] - skip : left;
        iov[k].iov_base = (void *)(parts[i] + skip);
        iov[k].iov_len = (size_t)len;
        left -= len;
        skip = 0;
        k++;
    }
    return k;
}

/* one read of up to ``want`` bytes into dst without blocking: 1 if bytes came (added to *count), 0 to read again
 * (interrupted), -1 if none is in, or the stream ended (the flow's status is then ENDED) */
static int read_into(struct flow *f, char *dst, Py_ssize_t want, Py_ssize_t *count)
{
    ssize_t n = recv(f->fd, dst, (size_t)want, MSG_DONTWAIT);
    if (n > 0) {
        *count += n;
        return 1;
    }
    if (n < 0 && errno == EINTR)
        return 0;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
        f->status = ENDED;
    return -1;
}

/* wake the peer of a shared-memory flow if it sleeps on its doorbell: the flag word at ``bell`` set, the futex
 * word 8 bytes after it (pycoll.transport.shm.Doorbell) */
static void ring_bell(int64_t bell)
{
    if (bell != 0 && __atomic_load_n((int64_t *)(intptr_t)bell, __ATOMIC_SEQ_CST) != 0) {
        __atomic_fetch_add((int32_t *)(intptr_t)(bell + 8), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, (void *)(intptr_t)(bell + 8), FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
    }
}

/* n bytes between a ring of cap bytes (from stream position pos) and flat memory, wrapping at the ring's end */
static void ring_copy(char *ring, int64_t cap, int64_t pos, char *flat, int64_t n, int into_ring)
{
    int64_t at = pos % cap, first = n < cap - at ? n : cap - at;
    if (into_ring) {
        memcpy(ring + at, flat, (size_t)first);
        memcpy(ring, flat + first, (size_t)(n - first));
    } else {
        memcpy(flat, ring + at, (size_t)first);
        memcpy(flat + first, ring, (size_t)(n - first));
    }
}

static int sending(const struct flow *f);

/* move what the rings allow of a shared-memory flow: the outgoing frame's bytes into the peer's ring as far as it
 * has room, published by its tail; the incoming frame from ours once its header is the one wanted, its payload
 * straight into place, consumed by our head. 1 if any byte moved (the peer's doorbell then rung) */
static int move_ring(struct flow *f)
{
    int moved = 0;
    if (sending(f)) {
        int64_t tail = *f->out_tail;  /* only this process writes it */
        int64_t room = f->out_cap - (tail - __atomic_load_n(f->out_head, __ATOMIC_ACQUIRE));
        if (room > 0) {
            struct iovec iov[4];
            int k = rest_of_frame(f, iov, room);
            for (int i = 0; i < k; i++) {
                ring_copy(f->out_ring, f->out_cap, tail, iov[i].iov_base, (int64_t)iov[i].iov_len, 1);
                tail += (int64_t)iov[i].iov_len;
                f->sent += (Py_ssize_t)iov[i].iov_len;
            }
            __atomic_store_n(f->out_tail, tail, __ATOMIC_RELEASE);
            moved = k > 0;
        }
    }
    Py_ssize_t in_total = HEADER_SIZE + padded(f->into_len);
    while (f->status == NOT_YET) {
        if (f->got == in_total) {
            f->status = TAKEN;
            break;
        }
        int64_t head = *f->in_head, avail = __atomic_load_n(f->in_tail, __ATOMIC_ACQUIRE) - head;
        if (f->got == 0) {  /* frames are 64-byte aligned in the stream: a header never wraps */
            if (avail < HEADER_SIZE)
                break;
            if (memcmp(f->in_ring + head % f->in_cap, f->head_in, (size_t)f->in_hlen)) {
                f->status = OTHER;
                break;
            }
            __atomic_store_n(f->in_head, head + HEADER_SIZE, __ATOMIC_RELEASE);
            f->got = HEADER_SIZE;
            moved = 1;
            continue;
        }
        if (avail == 0)
            break;
        Py_ssize_t at = f->got - HEADER_SIZE, want = in_total - f->got;
        if (at < f->into_len) {
            want = f->into_len - at;
            if (want > avail)
                want = (Py_ssize_t)avail;
            ring_copy(f->in_ring, f->in_cap, head, f->into + at, want, 0);
        } else if (want > avail) {  /* the padding */
            want = (Py_ssize_t)avail;
        }
        __atomic_store_n(f->in_head, head + want, __ATOMIC_RELEASE);
        f->got += want;
        moved = 1;
    }
    if (moved)
        ring_bell(f->bell);
    return moved;
}

/* whether the flow's outgoing frame still has bytes to send (and its socket has not failed) */
static int sending(const struct flow *f)
{
    return f->head_out != NULL && !f->send_errno && f->sent < HEADER_SIZE + padded(f->out_len);
}

/* move what the socket allows of one flow, without blocking: 1 if any byte moved. One sendmsg writes at most
 * ``slice`` bytes (0: no limit) before the socket is read: each write then fits one segmentation-offload packet,
 * and the peer's bytes are read between writes (pycoll.transport.tcp.PUSH_SLICE) */
static int move_flow(struct flow *f, Py_ssize_t slice)
{
    int moved = 0;
    if (sending(f)) {
        struct iovec iov[4];
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)rest_of_frame(f, iov, slice);
        ssize_t n;
        do
            n = sendmsg(f->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        if (n > 0) {
            f->sent += n;
            moved = 1;
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            f->send_errno = errno;
        }
    }
    Py_ssize_t in_total = HEADER_SIZE + padded(f->into_len);
    while (f->status == NOT_YET) {
        if (f->got == in_total) {
            f->status = TAKEN;
            break;
        }
        Py_ssize_t staged = f->end - f->start;
        if (f->got == 0) {  /* the header: staged until whole and matched, then consumed */
            if (staged >= HEADER_SIZE) {
                if (memcmp(f->stage + f->start, f->head_in, (size_t)f->in_hlen)) {
                    f->status = OTHER;
                    break;
                }
                f->start += HEADER_SIZE;
                f->got = HEADER_SIZE;
                moved = 1;
                continue;
            }
            if (f->start + HEADER_SIZE > f->cap) {
                memmove(f->stage, f->stage + f->start, (size_t)staged);
                f->start = 0;
                f->end = staged;
            }
            int r = read_into(f, f->stage + f->end, HEADER_SIZE - staged, &f->end);
            moved |= r > 0;
            if (r >= 0)
                continue;
            break;  /* not in yet, or ENDED with nothing of this frame consumed: the engine's path names it */
        }
        Py_ssize_t at = f->got - HEADER_SIZE, want = in_total - f->got;
        char sink[ALIGN];
        char *dst = at < f->into_len ? f->into + at : sink;
        if (at < f->into_len)
            want = f->into_len - at;
        if (staged) {  /* bytes read before, behind the header */
            Py_ssize_t k = staged < want ? staged : want;
            if (dst != sink)
                memcpy(dst, f->stage + f->start, (size_t)k);
            f->start += k;
            if (f->start == f->end)
                f->start = f->end = 0;
            f->got += k;
            moved = 1;
            continue;
        }
        int r = read_into(f, dst, want, &f->got);
        moved |= r > 0;
        if (r >= 0)
            continue;
        break;  /* not in yet, or ENDED inside the frame: the caller hands the rest to the engine, which names it */
    }
    return moved;
}

/* a copy within the caller's memory that the exchange makes while its sockets have nothing to move (an Allgather's or
 * an Alltoall's own block into its result), a piece at a time, so that the link's waits hide it */
#define LOCAL_PIECE (64 << 10)
struct local_copy {
    const char *src;
    char *dst;
    Py_ssize_t len, done;
};

/* the next piece of ``lc``: 1 if it copied one */
static int copy_piece(struct local_copy *lc)
{
    if (lc == NULL || lc->done >= lc->len)
        return 0;
    Py_ssize_t n = lc->len - lc->done < LOCAL_PIECE ? lc->len - lc->done : LOCAL_PIECE;
    memcpy(lc->dst + lc->done, lc->src + lc->done, (size_t)n);
    lc->done += n;
    return 1;
}

/* the flows until none is busy or none moved for spin_ns of polling, yield_ns of polling between sched_yields and
 * wait_ns of waiting in poll(2); while none moves, a piece of ``lc`` (NULL: none) is copied instead of a poll, and
 * the wait starts again after it */
static void run_flows(struct flow *flows, int k, int64_t spin_ns, int64_t yield_ns, int64_t wait_ns, Py_ssize_t slice,
                      struct local_copy *lc)
{
    struct pollfd fds[EXCHANGE_FLOWS];
    int64_t idle_since = 0;
    for (;;) {
        int moved = 0, busy = 0, nfds = 0;
        int rings_busy = 0;
        for (int i = 0; i < k; i++) {
            if (flows[i].ring) {  /* no descriptor to poll */
                moved |= move_ring(&flows[i]);
                rings_busy |= flows[i].status == NOT_YET || sending(&flows[i]);
                continue;
            }
            moved |= move_flow(&flows[i], slice);
            short ev = (short)((flows[i].status == NOT_YET ? POLLIN : 0) | (sending(&flows[i]) ? POLLOUT : 0));
            if (ev) {
                busy = 1;
                fds[nfds].fd = flows[i].fd;
                fds[nfds].events = ev;
                fds[nfds].revents = 0;
                nfds++;
            }
        }
        if (!busy && !rings_busy)
            return;
        int64_t now = now_ns();
        if (moved || !idle_since) {
            idle_since = now;
            continue;
        }
        if (copy_piece(lc)) {
            idle_since = now_ns();
            continue;
        }
        int64_t idle = now - idle_since;
        if (idle < spin_ns) {
            poll(fds, (nfds_t)nfds, 0);
            continue;
        }
        if (idle < spin_ns + yield_ns) {
            sched_yield();
            continue;
        }
        int64_t left = spin_ns + yield_ns + wait_ns - idle;
        if (left <= 0 || rings_busy)  /* a ring has no descriptor to sleep on: the engine's wait (its doorbell) */
            return;
        int ms = (int)((left + 999999) / 1000000);
        poll(fds, (nfds_t)nfds, ms > 5 ? 5 : ms);
    }
}

/* a shared-memory flow's rings: ``lane`` is (out data, out capacity, out header, in data, in capacity, in header,
 * the peer's doorbell flag or 0) as pycoll.transport.shm.ShmChannel.lane_addresses gives them; a ring's header
 * holds the writer's count at byte 0 and the reader's at byte 64. -1 with an error set */
static int ring_of(PyObject *lane, struct flow *f)
{
    if (!PyTuple_Check(lane) || PyTuple_GET_SIZE(lane) != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "exchange: a ring flow's lane is (out, out_cap, out_hdr, in, in_cap, in_hdr, bell)");
        return -1;
    }
    int64_t v[7];
    for (int i = 0; i < 7; i++)
        v[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(lane, i));
    if (PyErr_Occurred())
        return -1;
    if (v[0] == 0 || v[2] == 0 || v[3] == 0 || v[5] == 0 || v[1] < HEADER_SIZE || v[4] < HEADER_SIZE
            || v[1] % ALIGN || v[4] % ALIGN) {
        PyErr_SetString(PyExc_ValueError, "exchange: a ring flow needs rings of whole 64-byte lines");
        return -1;
    }
    f->fd = -1;
    f->ring = 1;
    f->out_ring = (char *)(intptr_t)v[0], f->out_cap = v[1];
    f->out_tail = (int64_t *)(intptr_t)v[2], f->out_head = (int64_t *)(intptr_t)(v[2] + 64);
    f->in_ring = (char *)(intptr_t)v[3], f->in_cap = v[4];
    f->in_tail = (int64_t *)(intptr_t)v[5], f->in_head = (int64_t *)(intptr_t)(v[5] + 64);
    f->bell = v[6];
    return 0;
}

/* each flow's (sent, got, status, start, end, send_errno), as ``exchange`` returns them */
static PyObject *flow_states(const struct flow *flows, Py_ssize_t k)
{
    PyObject *result = PyList_New(k);
    for (Py_ssize_t i = 0; result != NULL && i < k; i++) {
        const struct flow *f = &flows[i];
        PyObject *item = Py_BuildValue("nninni", f->sent, f->got, f->status, f->start, f->end, f->send_errno);
        if (item == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, item);
    }
    return result;
}

/* exchange(flows, spin_ns, yield_ns, wait_ns[, slice]) -> list of (sent, got, status, start, end, send_errno)
 * slice: the most bytes one sendmsg writes (0 or absent: no limit);
 * flows: a sequence of (fd, stage, start, end, head_out, out, head_in, into), head_out/out or head_in/into None for
 * no frame that way; a shared-memory flow gives -1 and its rings (``ring_of``) for fd and stage; sent: bytes the
 * socket (or ring) took of the outgoing frame (-1: none), got: bytes of the incoming frame consumed (0: none, the
 * frame untouched; its whole size once status is TAKEN) */
static PyObject *exchange(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "exchange takes 4 or 5 arguments");
        return NULL;
    }
    long long spin_ns = PyLong_AsLongLong(args[1]), yield_ns = PyLong_AsLongLong(args[2]);
    long long wait_ns = PyLong_AsLongLong(args[3]);
    Py_ssize_t slice = nargs == 5 ? PyLong_AsSsize_t(args[4]) : 0;
    PyObject *seq = PySequence_Fast(args[0], "exchange: flows must be a sequence");
    if (seq == NULL || PyErr_Occurred()) {
        Py_XDECREF(seq);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k > EXCHANGE_FLOWS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "exchange: at most %d flows", EXCHANGE_FLOWS);
        return NULL;
    }
    struct flow flows[EXCHANGE_FLOWS];
    Py_buffer bufs[EXCHANGE_FLOWS][3];
    memset(bufs, 0, sizeof(bufs));
    PyObject *result = NULL;
    for (Py_ssize_t ready = 0; ready < k; ready++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, ready);
        struct flow *f = &flows[ready];
        memset(f, 0, sizeof(*f));
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 8) {
            PyErr_SetString(PyExc_TypeError, "exchange: each flow is (fd, stage, start, end, head_out, out, head_in, into)");
            goto done;
        }
        PyObject *const *a = &PyTuple_GET_ITEM(t, 0);
        if (PyTuple_Check(a[1])) {
            if (ring_of(a[1], f) < 0)
                goto done;
        } else {
            if (channel_of(a, 8, 8, "exchange", &f->fd, &bufs[ready][0], &f->start, &f->end) < 0)
                goto done;
            f->stage = bufs[ready][0].buf;
            f->cap = bufs[ready][0].len;
        }
        f->sent = -1;
        f->status = NOTHING_ASKED;
        if (a[4] != Py_None) {
            if (header_of(a[4], &f->head_out, &f->out_hlen) < 0 || PyObject_GetBuffer(a[5], &bufs[ready][1], PyBUF_SIMPLE) < 0)
                goto done;
            f->out = bufs[ready][1].buf;
            f->out_len = bufs[ready][1].len;
            f->sent = 0;
        }
        if (a[6] != Py_None) {
            if (header_of(a[6], &f->head_in, &f->in_hlen) < 0 || PyObject_GetBuffer(a[7], &bufs[ready][2], PyBUF_WRITABLE) < 0)
                goto done;
            f->into = bufs[ready][2].buf;
            f->into_len = bufs[ready][2].len;
            f->status = NOT_YET;
        }
        if (!f->ring && f->cap < HEADER_SIZE) {
            PyErr_Format(PyExc_ValueError, "exchange: a staging area of %zd bytes cannot hold a header", f->cap);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run_flows(flows, (int)k, spin_ns, yield_ns, wait_ns, slice, NULL);
    Py_END_ALLOW_THREADS
    result = flow_states(flows, k);
done:
    for (Py_ssize_t i = 0; i < k; i++)  /* zeroed where never taken */
        for (int j = 0; j < 3; j++)
            if (bufs[i][j].obj)
                PyBuffer_Release(&bufs[i][j]);
    Py_DECREF(seq);
    return result;
}

/* a socket channel's staging bounds, as TcpChannel keeps them (its ``_start`` and ``_end``) */
static PyObject *START_NAME, *END_NAME;

static int bounds_of(PyObject *channel, Py_ssize_t *start, Py_ssize_t *end)
{
    PyObject *a = PyObject_GetAttr(channel, START_NAME), *b = a ? PyObject_GetAttr(channel, END_NAME) : NULL;
    if (b != NULL) {
        *start = PyLong_AsSsize_t(a);
        *end = PyLong_AsSsize_t(b);
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    return PyErr_Occurred() ? -1 : 0;
}

/* exchange_blocks(parts, send, recv, tag, spin_ns, yield_ns, wait_ns, slice[, copy_from, copy_to]) -> None or a list
 * as ``exchange``'s (copy_from, copy_to: buffers of one length, copied while the sockets wait, and whole before it
 * returns, whatever the frames did):
 * ``exchange`` for a plan made once (pycoll.p2p_frames.FramePaths.frame_exchanger): each part is (channel, fd,
 * stage, head_out, out_start, out_stop, head_in, in_start, in_stop), its frames' payloads the bytes
 * send[out_start:out_stop] and recv[in_start:in_stop], its headers made with tag 0 and given ``tag`` here; a socket's
 * channel is the TcpChannel whose staging bounds (``_start``, ``_end``) are read and written back here, a ring's is
 * None with its lane (``ring_of``) for stage. None where every frame moved whole both ways; otherwise each flow's
 * (sent, got, status, start, end, send_errno), for the caller to hand what is left to the engine. */
static PyObject *exchange_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "exchange_blocks takes 8 or 10 arguments");
        return NULL;
    }
    PyObject *parts = args[0];
    int64_t tag = (int64_t)PyLong_AsLongLong(args[3]);
    long long spin_ns = PyLong_AsLongLong(args[4]), yield_ns = PyLong_AsLongLong(args[5]);
    long long wait_ns = PyLong_AsLongLong(args[6]);
    Py_ssize_t slice = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) > EXCHANGE_FLOWS) {
        PyErr_Format(PyExc_ValueError, "exchange_blocks: parts is a tuple of at most %d flows", EXCHANGE_FLOWS);
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(parts);
    struct flow flows[EXCHANGE_FLOWS];
    char heads[EXCHANGE_FLOWS][2][HEADER_SIZE];
    Py_buffer stages[EXCHANGE_FLOWS], send = {0}, recv = {0}, copy_from = {0}, copy_to = {0};
    memset(stages, 0, sizeof(stages));
    PyObject *result = NULL;
    struct local_copy local = {0}, *lc = NULL;
    if (PyObject_GetBuffer(args[1], &send, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(args[2], &recv, PyBUF_WRITABLE) < 0)
        goto done;
    if (nargs == 10 && args[8] != Py_None) {
        if (PyObject_GetBuffer(args[8], &copy_from, PyBUF_SIMPLE) < 0
                || PyObject_GetBuffer(args[9], &copy_to, PyBUF_WRITABLE) < 0)
            goto done;
        if (copy_from.len != copy_to.len) {
            PyErr_SetString(PyExc_ValueError, "exchange_blocks: copy_from and copy_to differ in length");
            goto done;
        }
        local.src = copy_from.buf;
        local.dst = copy_to.buf;
        local.len = copy_from.len;
        lc = &local;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *t = PyTuple_GET_ITEM(parts, i);
        struct flow *f = &flows[i];
        memset(f, 0, sizeof(*f));
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) {
            PyErr_SetString(PyExc_TypeError, "exchange_blocks: each part is (channel, fd, stage, head_out, "
                                             "out_start, out_stop, head_in, in_start, in_stop)");
            goto done;
        }
        PyObject *const *a = &PyTuple_GET_ITEM(t, 0);
        Py_ssize_t os = PyLong_AsSsize_t(a[4]), oe = PyLong_AsSsize_t(a[5]);
        Py_ssize_t is = PyLong_AsSsize_t(a[7]), ie = PyLong_AsSsize_t(a[8]);
        if (PyErr_Occurred())
            goto done;
        if (os < 0 || oe < os || oe > send.len || is < 0 || ie < is || ie > recv.len) {
            PyErr_SetString(PyExc_ValueError, "exchange_blocks: a block lies outside its buffer");
            goto done;
        }
        if (a[0] == Py_None) {
            if (ring_of(a[2], f) < 0)
                goto done;
        } else {
            f->fd = (int)PyLong_AsLong(a[1]);
            if (PyErr_Occurred() || bounds_of(a[0], &f->start, &f->end) < 0
                    || PyObject_GetBuffer(a[2], &stages[i], PyBUF_WRITABLE) < 0)
                goto done;
            f->stage = stages[i].buf;
            f->cap = stages[i].len;
            if (f->start < 0 || f->end < f->start || f->end > f->cap || f->cap < HEADER_SIZE) {
                PyErr_SetString(PyExc_ValueError, "exchange_blocks: a staging area's bounds do not fit it");
                goto done;
            }
        }
        if (header_of(a[3], &f->head_out, &f->out_hlen) < 0 || header_of(a[6], &f->head_in, &f->in_hlen) < 0
                || !(f->head_out = tagged(f->head_out, f->out_hlen, tag, heads[i][0]))
                || !(f->head_in = tagged(f->head_in, f->in_hlen, tag, heads[i][1])))
            goto done;
        f->out = (char *)send.buf + os;
        f->out_len = oe - os;
        f->into = (char *)recv.buf + is;
        f->into_len = ie - is;
        f->sent = 0;
        f->status = NOT_YET;
    }
    Py_BEGIN_ALLOW_THREADS
    run_flows(flows, (int)k, spin_ns, yield_ns, wait_ns, slice, lc);
    while (copy_piece(lc))
        ;
    Py_END_ALLOW_THREADS
    int whole = 1;
    for (Py_ssize_t i = 0; i < k; i++) {
        struct flow *f = &flows[i];
        if (!f->ring) {
            PyObject *t = PyTuple_GET_ITEM(parts, i), *channel = PyTuple_GET_ITEM(t, 0);
            PyObject *a = PyLong_FromSsize_t(f->start), *b = PyLong_FromSsize_t(f->end);
            int bad = a == NULL || b == NULL || PyObject_SetAttr(channel, START_NAME, a) < 0
                      || PyObject_SetAttr(channel, END_NAME, b) < 0;
            Py_XDECREF(a);
            Py_XDECREF(b);
            if (bad)
                goto done;
        }
        whole &= f->sent == HEADER_SIZE + padded(f->out_len) && f->status == TAKEN;
    }
    if (whole) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    result = flow_states(flows, k);
done:
    for (Py_ssize_t i = 0; i < k; i++)
        if (stages[i].obj)
            PyBuffer_Release(&stages[i]);
    if (send.obj)
        PyBuffer_Release(&send);
    if (recv.obj)
        PyBuffer_Release(&recv);
    if (copy_from.obj)
        PyBuffer_Release(&copy_from);
    if (copy_to.obj)
        PyBuffer_Release(&copy_to);
    return result;
}

static PyMethodDef methods[] = {
    {"swap", (PyCFunction)(void (*)(void))swap, METH_FASTCALL,
     "swap(fd, stage, start, end, head_out, out, head_in, into, spin_ns[, yield_ns[, tag]]) -> (sent, status, start, end, "
     "cpu)"},
    {"take_message", (PyCFunction)(void (*)(void))take_message, METH_FASTCALL,
     "take_message(fd, stage, start, end, ctx, tag, any_tag, meta, into, spin_ns) -> "
     "(status, nbytes, tag, start, end)"},
    {"exchange", (PyCFunction)(void (*)(void))exchange, METH_FASTCALL,
     "exchange(flows, spin_ns, yield_ns, wait_ns[, slice]) -> [(sent, got, status, start, end, send_errno), ...]"},
    {"exchange_blocks", (PyCFunction)(void (*)(void))exchange_blocks, METH_FASTCALL,
     "exchange_blocks(parts, send, recv, tag, spin_ns, yield_ns, wait_ns, slice[, copy_from, copy_to]) -> None or "
     "[(sent, got, status, start, end, send_errno), ...]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_tcpframe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tcpframe(void)
{
    START_NAME = PyUnicode_InternFromString("_start");
    END_NAME = PyUnicode_InternFromString("_end");
    if (START_NAME == NULL || END_NAME == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TAKEN", TAKEN) < 0 || PyModule_AddIntConstant(m, "NOT_YET", NOT_YET) < 0 ||
        PyModule_AddIntConstant(m, "OTHER", OTHER) < 0 || PyModule_AddIntConstant(m, "ENDED", ENDED) < 0 ||
        PyModule_AddIntConstant(m, "NOTHING_ASKED", NOTHING_ASKED) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "EXCHANGE_FLOWS", EXCHANGE_FLOWS) < 0 || PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
