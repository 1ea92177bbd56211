/* One frame each way on a TCP socket in one call, for the small calls between two hosts (pycoll.paired and the
 * engine's eager frames): the outgoing frame (header, zero padding to HEADER_SIZE, payload, zero padding to ALIGN)
 * leaves in one sendmsg; the incoming one is read into the channel's staging area, matched against the header the
 * caller expects, byte for byte (or, for a point-to-point receive, by its context and tag), and copied out whole,
 * polling the socket for a bounded spin while it is not in.
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
#include <sys/uio.h>
#include <time.h>

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

/* the frame ``m`` wants, its payload into dst (room bytes at most; *got: its size, *tag: its tag); stage[start:end]
 * holds what was read before and not consumed, and is compacted when the frame would not fit behind start */
static int take(int fd, char *stage, Py_ssize_t cap, Py_ssize_t *pstart, Py_ssize_t *pend, const struct match *m,
                char *dst, Py_ssize_t room, int64_t spin_ns, int64_t yield_ns, Py_ssize_t *got, int64_t *tag)
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
            int64_t yield_until = until + yield_ns;
            do
                sched_yield();
            while (!(ready = poll(&p, 1, 0)) && now_ns() < yield_until);
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

/* swap(fd, stage, start, end, head_out, out, head_in, into, spin_ns[, yield_ns]) -> (sent, status, start, end)
 * sent: bytes the socket took of the outgoing frame (-1: none to send; below -1: minus the errno of a failed send);
 * status: TAKEN, NOT_YET (nothing consumed after spin_ns of polling, then yield_ns of polling between sched_yields,
 * which only a frame sent whole waits through), OTHER, ENDED or NOTHING_ASKED (into None) */
static PyObject *swap(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    int fd;
    Py_buffer stage = {0}, out = {0}, into = {0};
    Py_ssize_t start, end;
    int sending = nargs > 6 && args[4] != Py_None, receiving = nargs > 6 && args[6] != Py_None;
    const char *head_out = NULL, *head_in = NULL;
    Py_ssize_t out_hlen = 0, in_hlen = 0;
    long long spin_ns = nargs > 8 ? PyLong_AsLongLong(args[8]) : 0;
    long long yield_ns = nargs > 9 ? PyLong_AsLongLong(args[9]) : 0;
    if ((PyErr_Occurred()) || (sending && header_of(args[4], &head_out, &out_hlen) < 0) ||
        (receiving && header_of(args[6], &head_in, &in_hlen) < 0) ||
        channel_of(args, nargs, nargs == 10 ? 10 : 9, "swap", &fd, &stage, &start, &end) < 0)
        return NULL;
    PyObject *result = NULL;
    if (sending && PyObject_GetBuffer(args[5], &out, PyBUF_SIMPLE) < 0)
        goto done;
    if (receiving && PyObject_GetBuffer(args[7], &into, PyBUF_WRITABLE) < 0)
        goto done;
    Py_ssize_t sent = -1;
    int status = NOTHING_ASKED;
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
                      &got, &tag);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("ninn", sent, status, start, end);
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
    status = take(fd, stage.buf, stage.len, &start, &end, &m, into.buf, into.len, spin_ns, 0, &got, &tag);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("inLnn", status, got, (long long)tag, start, end);
done:
    PyBuffer_Release(&stage);
    if (into.obj)
        PyBuffer_Release(&into);
    return result;
}

static PyMethodDef methods[] = {
    {"swap", (PyCFunction)(void (*)(void))swap, METH_FASTCALL,
     "swap(fd, stage, start, end, head_out, out, head_in, into, spin_ns[, yield_ns]) -> (sent, status, start, end)"},
    {"take_message", (PyCFunction)(void (*)(void))take_message, METH_FASTCALL,
     "take_message(fd, stage, start, end, ctx, tag, any_tag, meta, into, spin_ns) -> "
     "(status, nbytes, tag, start, end)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_tcpframe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tcpframe(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TAKEN", TAKEN) < 0 || PyModule_AddIntConstant(m, "NOT_YET", NOT_YET) < 0 ||
        PyModule_AddIntConstant(m, "OTHER", OTHER) < 0 || PyModule_AddIntConstant(m, "ENDED", ENDED) < 0 ||
        PyModule_AddIntConstant(m, "NOTHING_ASKED", NOTHING_ASKED) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 || PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
