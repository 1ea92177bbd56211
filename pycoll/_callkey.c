/* What every call pays before it moves a byte, in C: a collective call's shape key (pycoll.executor.shape_key), a
 * point-to-point buffer spec's cached resolution (pycoll.p2p_specs.cached_spec), and the eager point-to-point calls
 * between two ranks of one host (eager_send, eager_take, eager_take_object: the frame written into, or taken out
 * of, the peer's ring).
 *
 * Every collective call looks its plan up by the key before anything else runs, so its cost is paid on every
 * call; in Python it was 1.1-1.6 us of a 6-9 us small call. The common entries (a buffer spec [array, count,
 * Datatype] or [array, Datatype], a bare array, an int, an Op, a string, IN_PLACE, None, a flag) are built here;
 * any other argument is handed to the Python describers that ``configure`` gives, so the two forms cannot
 * disagree about anything but these cases, which tests/test_executor.py compares. The eager calls do only the
 * common case and hand everything else to the Python path (tests/test_eager_in_c.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <unistd.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

/* set once by configure(): the types and markers the key tells apart, and the describers of other arguments */
static PyObject *datatype_type, *op_type, *in_place, *flag_true, *flag_false, *describe_items, *describe_scalar;

/* an array's shape as the tuple ``arr.shape`` gives */
static PyObject *shape_of(PyArrayObject *arr)
{
    int ndim = PyArray_NDIM(arr);
    npy_intp *dims = PyArray_DIMS(arr);
    PyObject *shape = PyTuple_New(ndim);
    if (shape == NULL)
        return NULL;
    for (int i = 0; i < ndim; i++) {
        PyObject *extent = PyLong_FromSsize_t(dims[i]);
        if (extent == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, extent);
    }
    return shape;
}

/* (prefix?, shape, dtype, C-contiguous, writable, count?, datatype?): an array's entry, prefixed for a spec */
static PyObject *array_entry(PyArrayObject *arr, PyObject *prefix, PyObject *count, PyObject *datatype)
{
    PyObject *shape = shape_of(arr);
    if (shape == NULL)
        return NULL;
    int flags = PyArray_FLAGS(arr);
    PyObject *parts[7];
    int n = 0;
    if (prefix != NULL)
        parts[n++] = prefix;
    parts[n++] = shape;
    parts[n++] = (PyObject *)PyArray_DESCR(arr);
    parts[n++] = (flags & NPY_ARRAY_C_CONTIGUOUS) ? Py_True : Py_False;
    parts[n++] = (flags & NPY_ARRAY_WRITEABLE) ? Py_True : Py_False;
    if (count != NULL)
        parts[n++] = count;
    if (datatype != NULL)
        parts[n++] = datatype;
    PyObject *entry = PyTuple_New(n);
    if (entry == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (parts[i] != shape)
            Py_INCREF(parts[i]);
        PyTuple_SET_ITEM(entry, i, parts[i]);
    }
    return entry;
}

/* A Python describer's entry for ``arg`` of type ``type``; *unplanned set where it says None */
static PyObject *described(PyObject *describer, PyObject *type, PyObject *arg, int *unplanned)
{
    PyObject *entry = PyObject_CallFunctionObjArgs(describer, type, arg, NULL);
    if (entry == Py_None) {
        Py_DECREF(entry);
        *unplanned = 1;
        return NULL;
    }
    return entry;
}

/* ``_describe_items``' entry for a list or tuple made only of exact arrays, Datatypes, ints, IN_PLACE and such lists
 * (a vector spec's counts and displacements), built here; NULL with *unplanned 0 and no error set where an item is
 * of another kind (the caller then asks the Python describer) */
static PyObject *items_entry(PyObject *type, PyObject *seq, int depth)
{
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *entry = PyTuple_New(len + 1);
    if (entry == NULL)
        return NULL;
    Py_INCREF(type);
    PyTuple_SET_ITEM(entry, 0, type);
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *a = items[i];
        PyTypeObject *ta = Py_TYPE(a);
        PyObject *part = NULL;
        if (ta == &PyArray_Type) {
            part = array_entry((PyArrayObject *)a, NULL, NULL, NULL);
        } else if ((PyObject *)ta == datatype_type) {
            part = PyTuple_Pack(2, (PyObject *)ta, a);
        } else if (ta == &PyLong_Type || a == in_place) {
            Py_INCREF(a);
            part = a;
        } else if ((ta == &PyList_Type || ta == &PyTuple_Type) && depth < 2) {
            part = items_entry((PyObject *)ta, a, depth + 1);
            if (part == NULL && !PyErr_Occurred()) {
                Py_DECREF(entry);
                return NULL;
            }
        } else {
            Py_DECREF(entry);
            return NULL;  /* another kind: the Python describer's */
        }
        if (part == NULL) {
            Py_DECREF(entry);
            return NULL;
        }
        PyTuple_SET_ITEM(entry, i + 1, part);
    }
    return entry;
}

static PyObject *shape_key(PyObject *module, PyObject *args)
{
    if (describe_items == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "pycoll._callkey.configure has not been called");
        return NULL;
    }
    if (!PyTuple_CheckExact(args)) {
        PyErr_SetString(PyExc_TypeError, "shape_key takes the call's argument tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n);
    if (key == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        PyTypeObject *type = Py_TYPE(arg);
        PyObject *entry = NULL;
        int unplanned = 0;
        if (type == &PyList_Type || type == &PyTuple_Type) {
            Py_ssize_t len = PySequence_Fast_GET_SIZE(arg);
            PyObject **items = PySequence_Fast_ITEMS(arg);
            if (len == 3 && Py_TYPE(items[0]) == &PyArray_Type && Py_TYPE(items[1]) == &PyLong_Type
                    && (PyObject *)Py_TYPE(items[2]) == datatype_type)
                entry = array_entry((PyArrayObject *)items[0], (PyObject *)type, items[1], items[2]);
            else if (len == 2 && Py_TYPE(items[0]) == &PyArray_Type && (PyObject *)Py_TYPE(items[1]) == datatype_type)
                entry = array_entry((PyArrayObject *)items[0], (PyObject *)type, NULL, items[1]);
            else {
                entry = items_entry((PyObject *)type, arg, 0);
                if (entry == NULL && !PyErr_Occurred())
                    entry = described(describe_items, (PyObject *)type, arg, &unplanned);
            }
        } else if (type == &PyArray_Type) {
            entry = array_entry((PyArrayObject *)arg, NULL, NULL, NULL);
        } else if (type == &PyLong_Type || (PyObject *)type == op_type || type == &PyUnicode_Type || arg == in_place
                   || arg == Py_None) {
            Py_INCREF(arg);
            entry = arg;
        } else if (type == &PyBool_Type) {  /* True == 1: a flag gets an entry no int equals */
            entry = arg == Py_True ? flag_true : flag_false;
            Py_INCREF(entry);
        } else {
            entry = described(describe_scalar, (PyObject *)type, arg, &unplanned);
        }
        if (entry == NULL) {
            Py_DECREF(key);
            if (unplanned)
                Py_RETURN_NONE;
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, entry);
    }
    return key;
}

/* A point-to-point buffer spec's parts: [array, count, datatype], [array, datatype] or a bare array (the others
 * None); 1 where ``buf`` is one of these over an exact NumPy array, else 0 (the full parse's case) */
static int spec_parts(PyObject *buf, PyObject **obj, PyObject **count, PyObject **datatype)
{
    PyTypeObject *type = Py_TYPE(buf);
    *obj = NULL, *count = *datatype = Py_None;
    if (type == &PyList_Type || type == &PyTuple_Type) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(buf);
        PyObject **items = PySequence_Fast_ITEMS(buf);
        if (len == 3) {
            if (Py_TYPE(items[1]) != &PyLong_Type)
                return 0;
            *obj = items[0], *count = items[1], *datatype = items[2];
        } else if (len == 2) {
            *obj = items[0], *datatype = items[1];
        } else {
            return 0;
        }
    } else if (type == &PyArray_Type) {
        *obj = buf;
    } else {
        return 0;
    }
    return Py_TYPE(*obj) == &PyArray_Type;  /* the caches hold exact NumPy arrays only */
}

/* The cached resolution of point-to-point buffer ``buf`` (see pycoll.p2p_specs.cached_spec_python): 1 with
 * *entry (a new reference) set where the identity cache holds it; 1 with *entry NULL and *addr, *nbytes set where the
 * shape cache knows its length; 0 where neither does; -1 on an error. */
static int find_spec(PyObject *specs, PyObject *shapes, PyObject *buf, int writable, PyObject **entry, void **addr,
                     PyObject **nbytes)
{
    *entry = NULL;
    PyTypeObject *type = Py_TYPE(buf);
    PyObject *obj, *count, *datatype;
    if (!spec_parts(buf, &obj, &count, &datatype))
        return 0;
    PyArrayObject *arr = (PyArrayObject *)obj;
    int flags = PyArray_FLAGS(arr);
    /* held by the identity cache: (array, count, datatype, its dtype then, flat bytes, address, length) */
    PyObject *id = PyLong_FromVoidPtr(obj);
    if (id == NULL)
        return -1;
    PyObject *e = PyDict_GetItemWithError(specs, id);
    Py_DECREF(id);
    if (e == NULL && PyErr_Occurred())
        return -1;
    if (e != NULL && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 7 && PyTuple_GET_ITEM(e, 0) == obj
            && PyTuple_GET_ITEM(e, 2) == datatype && PyTuple_GET_ITEM(e, 3) == (PyObject *)PyArray_DESCR(arr)
            && (!writable || (flags & NPY_ARRAY_WRITEABLE))) {
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(e, 1), count, Py_EQ);
        if (same < 0)
            return -1;
        if (same) {
            Py_INCREF(e);
            *entry = e;
            return 1;
        }
    }
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS))
        return 0;
    /* by its shape: (spec type or ndarray, shape, dtype, writable flag, count, datatype, a receive's) -> length */
    PyObject *shape = shape_of(arr);
    if (shape == NULL)
        return -1;
    PyObject *lookup = PyTuple_Pack(7, (PyObject *)type, shape, (PyObject *)PyArray_DESCR(arr),
                                    (flags & NPY_ARRAY_WRITEABLE) ? Py_True : Py_False, count, datatype,
                                    writable ? Py_True : Py_False);
    Py_DECREF(shape);
    if (lookup == NULL)
        return -1;
    PyObject *length = PyDict_GetItemWithError(shapes, lookup);
    Py_DECREF(lookup);
    if (length == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))  /* an unhashable datatype argument: not cached */
                return -1;
            PyErr_Clear();
        }
        return 0;
    }
    Py_ssize_t n = PyLong_AsSsize_t(length);
    if (n < 0)
        return PyErr_Occurred() ? -1 : 0;
    *addr = n ? PyArray_DATA(arr) : NULL;
    *nbytes = length;
    return 1;
}

/* cached_spec(specs, shapes, buf, writable): as pycoll.p2p_specs.cached_spec_python, whose docstring says what */
static PyObject *cached_spec(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "cached_spec(specs, shapes, buf, writable)");
        return NULL;
    }
    int writable = PyObject_IsTrue(args[3]);
    if (writable < 0)
        return NULL;
    PyObject *entry, *nbytes;
    void *data;
    int found = find_spec(args[0], args[1], args[2], writable, &entry, &data, &nbytes);
    if (found < 0)
        return NULL;
    if (!found)
        Py_RETURN_NONE;
    if (entry != NULL)
        return entry;
    PyObject *obj, *count, *datatype;
    spec_parts(args[2], &obj, &count, &datatype);  /* found: a spec of these parts */
    PyObject *addr = PyLong_FromVoidPtr(data);
    if (addr == NULL)
        return NULL;
    entry = PyTuple_Pack(7, obj, count, datatype, (PyObject *)PyArray_DESCR((PyArrayObject *)obj), Py_None, addr,
                         nbytes);
    Py_DECREF(addr);
    return entry;
}

/* ---- eager point-to-point calls: one small message into, or out of, a peer's shared-memory ring ----------------
 *
 * The lane layout and frame format are pycoll.p2p_lane's and pycoll.p2p_kernels' (whose Numba kernels do every
 * other step of the protocol): a lane is int64 words at address d naming the two rings; a frame is six int64 header
 * words (ctx, tag, nbytes, meta, count, vhash) in 64 bytes, then the payload padded to 64 bytes; a ring's writer
 * count is at its header's byte 0, its reader count at byte 64. These calls move only a plain eager frame; anything
 * else (a rendezvous, an acknowledgement, a frame of another call, a full ring) is left for the Python path. */
enum { L_OUT, L_OUT_CAP, L_OUT_HDR, L_IN, L_IN_CAP, L_IN_HDR, L_BELL, L_SYSCALL, L_FUTEX, L_PID, L_READV, L_META,
       L_RTS, L_ACK, L_YIELD };
#define HEADER_BYTES 64
#define TAIL_AT 0
#define HEAD_AT 64
#define LANE(d, i) (((const int64_t *)(intptr_t)(d))[i])
#define AT(addr) (*(int64_t *)(intptr_t)(addr))

/* the gate tuple FastP2P builds (pycoll.p2p_fast.eager_gate): its items, in order */
enum { G_SPECS, G_SHAPES, G_ENGINE, G_COMM, G_WORLD, G_SENDQ, G_BROKEN, G_CTX, G_EAGER_MAX, G_POSTED, G_UNEXPECTED,
       G_SCHEDULES, G_ABORTS, G_INBOUND, G_LOCK, G_ITEMS };

static PyObject *str_lane_of, *str_freed, *str_aborted, *str_have, *str_target, *str_acquire, *str_release;

/* n bytes from src to dst in a loop the compiler vectorizes: never libc's memcpy, whose ``rep movsb`` is ten times
 * slower where the two lie a short distance apart modulo a page (pycoll.pages.short_distance) */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static void copy_bytes(char *dst, const char *src, int64_t n)
{
    for (; n >= 32; n -= 32, dst += 32, src += 32)
        __builtin_memcpy(dst, src, 32);
    for (; n > 0; n--)
        *dst++ = *src++;
}

/* wake the peer if it sleeps on its doorbell (its flag word set): bump the futex word, then a futex wake */
static void wake(int64_t d)
{
    int64_t bell = LANE(d, L_BELL);
    if (bell != 0 && __atomic_load_n((int64_t *)(intptr_t)bell, __ATOMIC_SEQ_CST) != 0) {
        __atomic_fetch_add((int32_t *)(intptr_t)(bell + 8), 1, __ATOMIC_SEQ_CST);
        if (LANE(d, L_SYSCALL) != 0)
            syscall(LANE(d, L_FUTEX), (void *)(intptr_t)(bell + 8), 1 /* FUTEX_WAKE */, 0x7FFFFFFF, NULL, NULL, 0);
    }
}

/* one pause of a spin on lane d: the CPU's spin hint, or where ranks outnumber cores a sched_yield (the lane's
 * L_YIELD word: its system call number, or -1), as p2p_addresses.relax */
static void relax(int64_t d)
{
    int64_t nr = LANE(d, L_YIELD);
    if (nr >= 0 && LANE(d, L_SYSCALL) != 0) {
        syscall(nr);
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* write a plain frame of n bytes at src into the lane's outbound ring and publish it: 0 where it does not fit */
static int put_frame(int64_t d, const char *src, int64_t n, int64_t ctx, int64_t tag)
{
    int64_t cap = LANE(d, L_OUT_CAP), hdr = LANE(d, L_OUT_HDR), base = LANE(d, L_OUT);
    int64_t tail = AT(hdr + TAIL_AT);  /* only this process writes it */
    int64_t total = HEADER_BYTES + (n + HEADER_BYTES - 1) / HEADER_BYTES * HEADER_BYTES;
    if (cap - (tail - __atomic_load_n((int64_t *)(intptr_t)(hdr + HEAD_AT), __ATOMIC_ACQUIRE)) < total)
        return 0;
    int64_t *h = (int64_t *)(intptr_t)(base + tail % cap);  /* a header never wraps: 64-byte frames */
    h[0] = ctx, h[1] = tag, h[2] = n, h[3] = LANE(d, L_META), h[4] = 0, h[5] = 0;
    int64_t at = (tail + HEADER_BYTES) % cap, first = n < cap - at ? n : cap - at;
    copy_bytes((char *)(intptr_t)(base + at), src, first);
    copy_bytes((char *)(intptr_t)base, src + first, n - first);  /* the rest, where the payload wraps */
    __atomic_store_n((int64_t *)(intptr_t)(hdr + TAIL_AT), tail + total, __ATOMIC_SEQ_CST);
    wake(d);
    return 1;
}

/* take the plain frame at the head of the lane's inbound ring if it is (ctx, tag; any tag if negative): into cap
 * bytes at dst if it fits there, or, with ``fresh`` given, into a new bytes object of its length made there. 1 with
 * its tag and length set; 0 with nothing consumed; -1 where the bytes object could not be made (an error set) */
static int take_frame(int64_t d, char *dst, int64_t cap_bytes, int64_t ctx, int64_t tag, int64_t *got_tag,
                      int64_t *got_bytes, PyObject **fresh)
{
    int64_t hdr = LANE(d, L_IN_HDR);
    int64_t head = AT(hdr + HEAD_AT);  /* only this process writes it */
    int64_t tail = __atomic_load_n((int64_t *)(intptr_t)(hdr + TAIL_AT), __ATOMIC_ACQUIRE);
    if (tail == head)
        return 0;
    int64_t cap = LANE(d, L_IN_CAP), base = LANE(d, L_IN);
    const int64_t *h = (const int64_t *)(intptr_t)(base + head % cap);
    int64_t n = h[2];
    int64_t total = HEADER_BYTES + (n + HEADER_BYTES - 1) / HEADER_BYTES * HEADER_BYTES;
    if (h[3] != LANE(d, L_META) || h[0] != ctx || (tag >= 0 && h[1] != tag) || n < 0
            || (fresh == NULL && n > cap_bytes) || h[4] != 0 || h[5] != 0 || tail - head < total)
        return 0;
    if (fresh != NULL) {
        if ((*fresh = PyBytes_FromStringAndSize(NULL, n)) == NULL)
            return -1;
        dst = PyBytes_AS_STRING(*fresh);
    }
    int64_t at = (head + HEADER_BYTES) % cap, first = n < cap - at ? n : cap - at;
    copy_bytes(dst, (const char *)(intptr_t)(base + at), first);
    copy_bytes(dst + first, (const char *)(intptr_t)base, n - first);
    *got_tag = h[1], *got_bytes = n;
    head += total;
    __atomic_store_n((int64_t *)(intptr_t)(hdr + HEAD_AT), head, __ATOMIC_SEQ_CST);
    /* the frames published behind it come from the writer's cache: ask for their first lines now, while the
     * program gets to its next receive */
    for (int64_t ahead = head, k = 0; k < 4 && ahead < tail; k++, ahead += HEADER_BYTES)
        __builtin_prefetch((const void *)(intptr_t)(base + ahead % cap), 0, 3);
    wake(d);
    return 1;
}

/* an exact int within [lo, hi] as *value: 1, else 0 (a bool, another type, out of range) */
static int int_within(PyObject *obj, int64_t lo, int64_t hi, int64_t *value)
{
    if (Py_TYPE(obj) != &PyLong_Type)
        return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *value = v;
    return v >= lo && v <= hi;
}

/* 1 where a Python object is empty or false, 0 where not, -1 on an error */
static int is_empty(PyObject *obj)
{
    int full = PyObject_IsTrue(obj);
    return full < 0 ? -1 : !full;
}

/* 1 where the gate's communicator is not broken: the engine's broken contexts (keyed by a communicator's even
 * context) hold none, or not this one's; 0 where it is, -1 on an error */
static int not_broken(PyObject *gate)
{
    PyObject *broken = PyTuple_GET_ITEM(gate, G_BROKEN);
    int ok = is_empty(broken);
    if (ok != 0)
        return ok;
    if (!PyDict_Check(broken))
        return 0;
    long long ctx = PyLong_AsLongLong(PyTuple_GET_ITEM(gate, G_CTX));
    if (ctx == -1 && PyErr_Occurred())
        return -1;
    PyObject *base = PyLong_FromLongLong(ctx & ~1LL);
    if (base == NULL)
        return -1;
    int found = PyDict_Contains(broken, base);
    Py_DECREF(base);
    return found < 0 ? -1 : !found;
}

/* The lane to communicator rank ``rank``'s process (its world rank in *peer) where an eager call may use it now:
 * the kernels loaded, the peer on this host and alive, the communicator neither freed, aborted nor broken, nothing
 * queued to the peer ahead. 0 where not, -1 on an error. */
static int64_t lane_to(PyObject *gate, PyObject *rank, PyObject **peer)
{
    PyObject *world = PyTuple_GET_ITEM(gate, G_WORLD);
    int64_t r;
    if (!int_within(rank, 0, PyTuple_GET_SIZE(world) - 1, &r))
        return 0;
    *peer = PyTuple_GET_ITEM(world, r);
    PyObject *lane_of = PyObject_GetAttr(PyTuple_GET_ITEM(gate, G_ENGINE), str_lane_of);
    if (lane_of == NULL)
        return -1;
    int64_t p, d = 0;
    if (PyList_CheckExact(lane_of) && int_within(*peer, 0, PyList_GET_SIZE(lane_of) - 1, &p))
        d = PyLong_AsLongLong(PyList_GET_ITEM(lane_of, p));
    Py_DECREF(lane_of);
    if (d == -1 && PyErr_Occurred())
        return -1;
    if (d == 0)
        return 0;
    PyObject *comm = PyTuple_GET_ITEM(gate, G_COMM);
    PyObject *freed = PyObject_GetAttr(comm, str_freed);
    if (freed == NULL)
        return -1;
    int ok = is_empty(freed);
    Py_DECREF(freed);
    if (ok <= 0)
        return ok;
    PyObject *aborted = PyObject_GetAttr(comm, str_aborted);
    if (aborted == NULL)
        return -1;
    Py_DECREF(aborted);
    if (aborted != Py_None || (ok = not_broken(gate)) <= 0)
        return aborted != Py_None ? 0 : ok;
    PyObject *queue = PyDict_GetItemWithError(PyTuple_GET_ITEM(gate, G_SENDQ), *peer);
    if (queue == NULL)
        return PyErr_Occurred() ? -1 : 0;
    ok = is_empty(queue);
    return ok <= 0 ? ok : d;
}

/* a gate's spec of buf: 1 with its address and length, 0 where not cached (or not a point-to-point buffer), -1 */
static int spec_bytes(PyObject *gate, PyObject *buf, int writable, char **addr, int64_t *nbytes)
{
    PyObject *entry, *length;
    void *data;
    int found = find_spec(PyTuple_GET_ITEM(gate, G_SPECS), PyTuple_GET_ITEM(gate, G_SHAPES), buf, writable, &entry,
                          &data, &length);
    if (found <= 0)
        return found;
    if (entry != NULL) {
        data = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 5));
        length = PyTuple_GET_ITEM(entry, 6);
    }
    *nbytes = PyLong_AsLongLong(length);
    Py_XDECREF(entry);  /* the cache still holds it, and so its items */
    *addr = data;
    return PyErr_Occurred() ? -1 : 1;
}

/* whether an eager call got its gate (from pycoll.p2p_fast.eager_gate) and ``nargs`` arguments; a TypeError if not */
static int gate_given(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage)
{
    if (nargs == want && PyTuple_CheckExact(args[0]) && PyTuple_GET_SIZE(args[0]) == G_ITEMS && str_lane_of != NULL)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s: gate from pycoll.p2p_fast.eager_gate", usage);
    return 0;
}

/* eager_send(gate, buf, dest, tag): True once buf (a cached spec, or a bytes object: a pickle) went to communicator
 * rank dest as one frame in its ring; False where the call needs the Python path (a rendezvous size, a full ring,
 * a spec not cached yet, ...) */
static PyObject *eager_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *peer;
    char *src;
    int64_t n, tag;
    if (!gate_given(args, nargs, 4, "eager_send(gate, buf, dest, tag)"))
        return NULL;
    PyObject *gate = args[0], *buf = args[1];
    if (!int_within(args[3], 0, INT64_MAX, &tag))
        Py_RETURN_FALSE;
    if (PyBytes_CheckExact(buf)) {
        src = PyBytes_AS_STRING(buf);
        n = PyBytes_GET_SIZE(buf);
    } else {
        int found = spec_bytes(gate, buf, 0, &src, &n);
        if (found <= 0)
            return found < 0 ? NULL : Py_NewRef(Py_False);
    }
    if (n > PyLong_AsLongLong(PyTuple_GET_ITEM(gate, G_EAGER_MAX)))
        Py_RETURN_FALSE;
    int64_t d = lane_to(gate, args[2], &peer);
    if (d <= 0)
        return d < 0 ? NULL : Py_NewRef(Py_False);
    return PyBool_FromLong(put_frame(d, src, n, PyLong_AsLongLong(PyTuple_GET_ITEM(gate, G_CTX)), tag));
}

/* The receive of an eager call (``buf``: a spec to take into; NULL: into a new bytes object) from communicator
 * rank ``source``, waiting up to ``polls`` polls for a frame: (tag, nbytes) or, into a new bytes object, (tag,
 * nbytes, bytes); False where nothing came (every other condition held); None where the call needs the Python path
 * (receives posted or messages buffered that match first, another kind of frame, a spec not cached yet, ...) */
static PyObject *take(PyObject *gate, PyObject *buf, PyObject *source, int64_t tag, int64_t polls)
{
    PyObject *peer;
    char *dst = NULL;
    int64_t cap_bytes = 0;
    if (buf != NULL) {
        int found = spec_bytes(gate, buf, 1, &dst, &cap_bytes);
        if (found <= 0)
            return found < 0 ? NULL : Py_NewRef(Py_None);
    }
    int64_t ctx = PyLong_AsLongLong(PyTuple_GET_ITEM(gate, G_CTX));
    for (int i = G_POSTED; i <= G_ABORTS; i++) {  /* what could match first, or must run first */
        int empty = is_empty(PyTuple_GET_ITEM(gate, i));
        if (empty <= 0)
            return empty < 0 ? NULL : Py_NewRef(Py_None);
    }
    int64_t d = lane_to(gate, source, &peer);
    if (d <= 0)
        return d < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *stream = PyDict_GetItemWithError(PyTuple_GET_ITEM(gate, G_INBOUND), peer);
    if (stream == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *have = PyObject_GetAttr(stream, str_have), *target = have ? PyObject_GetAttr(stream, str_target) : NULL;
    int mid = have == NULL || target == NULL ? -1 : (target != Py_None || PyObject_IsTrue(have));
    Py_XDECREF(have);
    Py_XDECREF(target);
    if (mid != 0)  /* the engine is part way through a message of this stream */
        return mid < 0 ? NULL : Py_NewRef(Py_None);
    /* the engine's lock, held by a thread inside a wait: asked for only where this process has another thread */
    PyThreadState *first = PyInterpreterState_ThreadHead(PyInterpreterState_Get());
    PyObject *lock = first != NULL && PyThreadState_Next(first) == NULL ? NULL : PyTuple_GET_ITEM(gate, G_LOCK);
    if (lock != NULL) {
        PyObject *held = PyObject_CallMethodOneArg(lock, str_acquire, Py_False);
        if (held == NULL)
            return NULL;
        Py_DECREF(held);
        if (held != Py_True)  /* another thread is inside a wait */
            Py_RETURN_NONE;
    }
    int64_t got_tag, got_bytes, hdr = LANE(d, L_IN_HDR), head = AT(hdr + HEAD_AT);
    while (polls-- > 0 && __atomic_load_n((int64_t *)(intptr_t)(hdr + TAIL_AT), __ATOMIC_ACQUIRE) == head)
        relax(d);
    PyObject *fresh = NULL;
    int taken = take_frame(d, dst, cap_bytes, ctx, tag, &got_tag, &got_bytes, buf == NULL ? &fresh : NULL);
    int empty = __atomic_load_n((int64_t *)(intptr_t)(hdr + TAIL_AT), __ATOMIC_ACQUIRE) == head;
    if (lock != NULL) {
        PyObject *released = PyObject_CallMethodNoArgs(lock, str_release);
        if (released == NULL) {
            Py_XDECREF(fresh);
            return NULL;
        }
        Py_DECREF(released);
    }
    if (taken <= 0)
        return taken < 0 ? NULL : Py_NewRef(empty ? Py_False : Py_None);
    PyObject *got_t = PyLong_FromLongLong(got_tag), *got_n = PyLong_FromLongLong(got_bytes);
    PyObject *got = NULL;
    if (got_t != NULL && got_n != NULL)
        got = fresh != NULL ? PyTuple_Pack(3, got_t, got_n, fresh) : PyTuple_Pack(2, got_t, got_n);
    Py_XDECREF(got_t);
    Py_XDECREF(got_n);
    Py_XDECREF(fresh);
    return got;
}

/* eager_take(gate, buf, source, tag): (tag, nbytes) once the next frame from communicator rank source was this
 * receive's plain message and went into buf; None where the call needs the Python path */
static PyObject *eager_take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t tag;
    if (!gate_given(args, nargs, 4, "eager_take(gate, buf, source, tag)"))
        return NULL;
    if (!int_within(args[3], -1, INT64_MAX, &tag))
        Py_RETURN_NONE;
    PyObject *got = take(args[0], args[1], args[2], tag, 0);
    if (got == Py_False) {  /* nothing there yet: the Python path posts the receive */
        Py_DECREF(got);
        Py_RETURN_NONE;
    }
    return got;
}

/* eager_take_object(gate, source, tag, polls): (tag, nbytes, bytes) once the next frame from communicator rank
 * source, waited for up to ``polls`` polls, was a plain message of this receive's, copied into a new bytes object (a
 * pickle, for the object receive); False where nothing came; None where the call needs the Python path */
static PyObject *eager_take_object(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t tag, polls;
    if (!gate_given(args, nargs, 4, "eager_take_object(gate, source, tag, polls)"))
        return NULL;
    if (!int_within(args[2], -1, INT64_MAX, &tag) || !int_within(args[3], 0, INT64_MAX, &polls))
        Py_RETURN_NONE;
    return take(args[0], NULL, args[1], tag, polls);
}

/* the lane layout and header size these calls assume, for a test to compare with pycoll.p2p_lane's */
static PyObject *eager_layout(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "L_OUT", L_OUT, "L_OUT_CAP",
                         L_OUT_CAP, "L_OUT_HDR", L_OUT_HDR, "L_IN", L_IN, "L_IN_CAP", L_IN_CAP, "L_IN_HDR", L_IN_HDR,
                         "L_BELL", L_BELL, "L_SYSCALL", L_SYSCALL, "L_FUTEX", L_FUTEX, "L_META", L_META,
                         "HEADER_BYTES", HEADER_BYTES, "TAIL_AT", TAIL_AT, "HEAD_AT", HEAD_AT, "G_ITEMS", G_ITEMS);
}

/* buffer_address(array or None): where the array's first byte is, 0 for None or no bytes (as
 * pycoll.algorithms.direct_cma.address, without the buffer export) */
static PyObject *buffer_address(PyObject *module, PyObject *arr)
{
    if (arr == Py_None)
        return PyLong_FromLong(0);
    if (!PyArray_Check(arr)) {
        PyErr_Format(PyExc_TypeError, "buffer_address takes a NumPy array or None, not %.80s", Py_TYPE(arr)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)arr;
    if (PyArray_SIZE(a) == 0 || PyArray_ITEMSIZE(a) == 0)
        return PyLong_FromLong(0);
    return PyLong_FromVoidPtr(PyArray_DATA(a));
}

static PyObject *configure(PyObject *module, PyObject *args)
{
    PyObject *given[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO:configure", &given[0], &given[1], &given[2], &given[3], &given[4], &given[5],
                          &given[6]))
        return NULL;
    PyObject **slots[7] = {&datatype_type, &op_type, &in_place, &flag_true, &flag_false, &describe_items,
                           &describe_scalar};
    for (int i = 0; i < 7; i++) {
        Py_INCREF(given[i]);
        Py_XSETREF(*slots[i], given[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"shape_key", shape_key, METH_O, "The shape key of a call's argument tuple, as pycoll.executor.shape_key."},
    {"buffer_address", buffer_address, METH_O, "Where a NumPy array's first byte is (0: None, or no bytes)."},
    {"cached_spec", (PyCFunction)(void (*)(void))cached_spec, METH_FASTCALL,
     "cached_spec(specs, shapes, buf, writable): as pycoll.p2p_specs.cached_spec_python."},
    {"eager_send", (PyCFunction)(void (*)(void))eager_send, METH_FASTCALL,
     "eager_send(gate, buf, dest, tag): True once sent as one eager frame; False: the Python path's call."},
    {"eager_take", (PyCFunction)(void (*)(void))eager_take, METH_FASTCALL,
     "eager_take(gate, buf, source, tag): (tag, nbytes) once taken from the peer's ring; None: the Python path's."},
    {"eager_take_object", (PyCFunction)(void (*)(void))eager_take_object, METH_FASTCALL,
     "eager_take_object(gate, source, tag, polls): (tag, nbytes, bytes) once taken; False: none came; None: Python's."},
    {"eager_layout", eager_layout, METH_NOARGS, "The lane layout the eager calls assume."},
    {"configure", configure, METH_VARARGS,
     "configure(Datatype, Op, IN_PLACE, flag_true, flag_false, describe_items, describe_scalar)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "pycoll._callkey",
                                        "Call keys, buffer specs and eager point-to-point calls in C.", -1, methods};

PyMODINIT_FUNC PyInit__callkey(void)
{
    import_array();
    PyObject **names[] = {&str_lane_of, &str_freed, &str_aborted, &str_have, &str_target, &str_acquire, &str_release};
    const char *texts[] = {"lane_of", "_freed", "_aborted", "have", "target", "acquire", "release"};
    for (int i = 0; i < 7; i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    return PyModule_Create(&module_def);
}
