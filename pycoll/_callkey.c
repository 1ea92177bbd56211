/* A call's shape key (pycoll.executor.shape_key) and a point-to-point buffer spec's cached resolution
 * (pycoll.p2p_specs.cached_spec) in C: the same results, built in a fifth of the time.
 *
 * Every collective call looks its plan up by this key before anything else runs, so its cost is paid on every
 * call; in Python it was 1.1-1.6 us of a 6-9 us small call. The common entries (a buffer spec [array, count,
 * Datatype] or [array, Datatype], a bare array, an int, an Op, a string, IN_PLACE, None, a flag) are built here;
 * any other argument is handed to the Python describers that ``configure`` gives, so the two forms cannot
 * disagree about anything but these cases, which tests/test_executor.py compares. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
            else
                entry = described(describe_items, (PyObject *)type, arg, &unplanned);
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

/* cached_spec(specs, shapes, buf, writable): as pycoll.p2p_specs.cached_spec_python, whose docstring says what */
static PyObject *cached_spec(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "cached_spec(specs, shapes, buf, writable)");
        return NULL;
    }
    PyObject *specs = args[0], *shapes = args[1], *buf = args[2];
    int writable = PyObject_IsTrue(args[3]);
    if (writable < 0)
        return NULL;
    PyTypeObject *type = Py_TYPE(buf);
    PyObject *obj, *count = Py_None, *datatype = Py_None;
    if (type == &PyList_Type || type == &PyTuple_Type) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(buf);
        PyObject **items = PySequence_Fast_ITEMS(buf);
        if (len == 3) {
            if (Py_TYPE(items[1]) != &PyLong_Type)
                Py_RETURN_NONE;
            obj = items[0], count = items[1], datatype = items[2];
        } else if (len == 2) {
            obj = items[0], datatype = items[1];
        } else {
            Py_RETURN_NONE;
        }
    } else if (type == &PyArray_Type) {
        obj = buf;
    } else {
        Py_RETURN_NONE;
    }
    if (Py_TYPE(obj) != &PyArray_Type)  /* the identity cache holds exact NumPy arrays only */
        Py_RETURN_NONE;
    PyArrayObject *arr = (PyArrayObject *)obj;
    int flags = PyArray_FLAGS(arr);
    /* held by the identity cache: (array, count, datatype, its dtype then, flat bytes, address, length) */
    PyObject *id = PyLong_FromVoidPtr(obj);
    if (id == NULL)
        return NULL;
    PyObject *e = PyDict_GetItemWithError(specs, id);
    Py_DECREF(id);
    if (e == NULL && PyErr_Occurred())
        return NULL;
    if (e != NULL && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 7 && PyTuple_GET_ITEM(e, 0) == obj
            && PyTuple_GET_ITEM(e, 2) == datatype && PyTuple_GET_ITEM(e, 3) == (PyObject *)PyArray_DESCR(arr)
            && (!writable || (flags & NPY_ARRAY_WRITEABLE))) {
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(e, 1), count, Py_EQ);
        if (same < 0)
            return NULL;
        if (same) {
            Py_INCREF(e);
            return e;
        }
    }
    if (!(flags & NPY_ARRAY_C_CONTIGUOUS))
        Py_RETURN_NONE;
    /* by its shape: (spec type or ndarray, shape, dtype, writable flag, count, datatype, a receive's) -> length */
    PyObject *shape = shape_of(arr);
    if (shape == NULL)
        return NULL;
    PyObject *lookup = PyTuple_Pack(7, (PyObject *)type, shape, (PyObject *)PyArray_DESCR(arr),
                                    (flags & NPY_ARRAY_WRITEABLE) ? Py_True : Py_False, count, datatype,
                                    writable ? Py_True : Py_False);
    Py_DECREF(shape);
    if (lookup == NULL)
        return NULL;
    PyObject *nbytes = PyDict_GetItemWithError(shapes, lookup);
    Py_DECREF(lookup);
    if (nbytes == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))  /* an unhashable datatype argument: not cached */
                return NULL;
            PyErr_Clear();
        }
        Py_RETURN_NONE;
    }
    Py_ssize_t length = PyLong_AsSsize_t(nbytes);
    if (length < 0) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *addr = PyLong_FromVoidPtr(length ? PyArray_DATA(arr) : NULL);
    if (addr == NULL)
        return NULL;
    PyObject *entry = PyTuple_Pack(7, obj, count, datatype, (PyObject *)PyArray_DESCR(arr), Py_None, addr, nbytes);
    Py_DECREF(addr);
    return entry;
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
    {"cached_spec", (PyCFunction)(void (*)(void))cached_spec, METH_FASTCALL,
     "cached_spec(specs, shapes, buf, writable): as pycoll.p2p_specs.cached_spec_python."},
    {"configure", configure, METH_VARARGS,
     "configure(Datatype, Op, IN_PLACE, flag_true, flag_false, describe_items, describe_scalar)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "pycoll._callkey",
                                        "A call's shape key in C (see pycoll.executor.shape_key).", -1, methods};

PyMODINIT_FUNC PyInit__callkey(void)
{
    import_array();
    return PyModule_Create(&module_def);
}
