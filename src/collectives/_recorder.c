/* The flight recorder's record of a call, compiled: collectives._comm.record.begin written in C.
 *
 * The record is all the flight recorder costs an asynchronous call, and inside a 30 us call each Python
 * operation of it costs several times what it costs in a tight loop (docs/performance.md, "Stop 50").
 * This module makes the same list, in the same ring slot, from the same facts, with the same call site
 * (record.python_begin: the paths remembered by collectives._records, checked in place, else the walk).
 * Optional: where it is not built (no C compiler, Python < 3.11, a build without the GIL), record.begin is
 * the Python function; tests/unit/test_recorder.py checks that both make the same records.
 *
 * begin(comm, collective, x=None, op=None, root=None, path="blocking") is called directly by the frame that
 * would call the Python begin, whose own frame is depth 0 of a path remembered (_records._raw_site): so
 * here depth d is sys._getframe(d - 1), and the fallback (``found``, a Python function that this calls)
 * stands where the Python begin's frame would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* PyFrame_GetLasti is Python 3.11's; and a build without the GIL (3.13t) keeps the Python function, whose
 * list operations are made safe there by the interpreter itself. */
#if PY_VERSION_HEX >= 0x030B0000 && !defined(Py_GIL_DISABLED)
#define HAVE_BEGIN 1
#include <frameobject.h>
#include <pythread.h>

/* The record's fields, as collectives._records numbers them (SEQ ... ON). */
enum { SEQ, COLLECTIVE, OP, ROOT, DTYPE, SHAPE, NBYTES, PATH, VIA, CODE, LASTI, THREAD, START, END, ERROR, ON, FIELDS };

/* Set once by setup(): the paths remembered (a list of (depth, code, lasti, via)), the count of site hint
 * blocks under way (a list of one int), the fallback (a function returning (code, lasti, via)), the clock
 * (time.time) and sys._getframe. */
static PyObject *paths, *hinting, *found, *clock_fn, *getframe;
static PyObject *s_ring, *s_seq, *s_mask, *s_last, *s_dtype, *s_shape, *s_blocking;

/* x.<name>, or None where x has no such attribute (getattr(x, name, None)); NULL with an error. */
static PyObject *attribute(PyObject *x, PyObject *name) {
    if (x == Py_None) {
        Py_RETURN_NONE;
    }
    PyObject *v = PyObject_GetAttr(x, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return v;
}

/* The call site from the paths remembered: 1 and (code, lasti, via) as new references where one matches,
 * 0 where none does or the stack is shallower than one (the Python begin's ValueError: the walk), -1 with
 * an error. */
static int remembered(PyObject **code, PyObject **lasti, PyObject **via) {
    if (!PyList_CheckExact(paths)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(paths); i++) {
        PyObject *path = PyList_GET_ITEM(paths, i);
        if (!PyTuple_CheckExact(path) || PyTuple_GET_SIZE(path) != 4) {
            return 0;
        }
        Py_INCREF(path); /* (another thread may change the list while sys._getframe runs) */
        Py_ssize_t depth = PyLong_AsSsize_t(PyTuple_GET_ITEM(path, 0));
        if (depth < 1) { /* depth 0: the Python begin's own frame, never a call site; or not an int */
            Py_DECREF(path);
            if (PyErr_Occurred()) {
                return -1;
            }
            continue;
        }
        PyObject *arg = PyLong_FromSsize_t(depth - 1);
        if (arg == NULL) {
            Py_DECREF(path);
            return -1;
        }
        PyObject *frame = PyObject_Vectorcall(getframe, &arg, 1, NULL);
        Py_DECREF(arg);
        if (frame == NULL) {
            Py_DECREF(path);
            if (PyErr_ExceptionMatches(PyExc_ValueError)) { /* a shallower stack */
                PyErr_Clear();
                return 0;
            }
            return -1;
        }
        PyCodeObject *fcode = PyFrame_GetCode((PyFrameObject *)frame);
        int same = (PyObject *)fcode == PyTuple_GET_ITEM(path, 1);
        Py_DECREF(fcode);
        if (same) {
            long want = PyLong_AsLong(PyTuple_GET_ITEM(path, 2));
            if (want == -1 && PyErr_Occurred()) {
                Py_DECREF(frame);
                Py_DECREF(path);
                return -1;
            }
            same = PyFrame_GetLasti((PyFrameObject *)frame) == want;
        }
        Py_DECREF(frame);
        if (same) {
            *code = Py_NewRef(PyTuple_GET_ITEM(path, 1));
            *lasti = Py_NewRef(PyTuple_GET_ITEM(path, 2));
            *via = Py_NewRef(PyTuple_GET_ITEM(path, 3));
            Py_DECREF(path);
            return 1;
        }
        Py_DECREF(path);
    }
    return 0;
}

/* The call site from the fallback (the walk, and the thread's hint where one is set). */
static int fallback(PyObject **code, PyObject **lasti, PyObject **via) {
    PyObject *site = PyObject_CallNoArgs(found);
    if (site == NULL) {
        return -1;
    }
    if (!PyTuple_CheckExact(site) || PyTuple_GET_SIZE(site) != 3) {
        Py_DECREF(site);
        PyErr_SetString(PyExc_TypeError, "_recorder: the fallback must return (code, lasti, via)");
        return -1;
    }
    *code = Py_NewRef(PyTuple_GET_ITEM(site, 0));
    *lasti = Py_NewRef(PyTuple_GET_ITEM(site, 1));
    *via = Py_NewRef(PyTuple_GET_ITEM(site, 2));
    Py_DECREF(site);
    return 0;
}

static PyObject *begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 2 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "begin(comm, collective, x=None, op=None, root=None, path='blocking')");
        return NULL;
    }
    if (found == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_recorder.begin: setup() was not called");
        return NULL;
    }
    PyObject *comm = args[0];
    PyObject *x = nargs > 2 ? args[2] : Py_None, *op = nargs > 3 ? args[3] : Py_None;
    PyObject *root = nargs > 4 ? args[4] : Py_None, *path = nargs > 5 ? args[5] : s_blocking;
    PyObject *ring = PyObject_GetAttr(comm, s_ring);
    if (ring == NULL || ring == Py_None) {
        return ring; /* None: the record is off; NULL: the error */
    }
    PyObject *rec = NULL, *seq = NULL, *dtype = NULL, *shape = NULL, *code = NULL, *lasti = NULL, *via = NULL;
    PyObject *thread = NULL, *start = NULL;
    long long n, mask;
    PyObject *was = PyObject_GetAttr(comm, s_seq);
    if (was == NULL) {
        goto done;
    }
    n = PyLong_AsLongLong(was);
    Py_DECREF(was);
    if ((n == -1 && PyErr_Occurred()) || (seq = PyLong_FromLongLong(++n)) == NULL ||
        PyObject_SetAttr(comm, s_seq, seq) < 0) {
        goto done;
    }
    if ((dtype = attribute(x, s_dtype)) == NULL || (shape = attribute(x, s_shape)) == NULL) {
        goto done;
    }
    int got = 0;
    if (!PyLong_Check(PyList_GET_ITEM(hinting, 0)) || PyLong_AsLong(PyList_GET_ITEM(hinting, 0)) == 0) {
        got = remembered(&code, &lasti, &via);
    }
    if (got < 0 || (got == 0 && fallback(&code, &lasti, &via) < 0)) {
        goto done;
    }
    if ((thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident())) == NULL ||
        (start = PyObject_CallNoArgs(clock_fn)) == NULL) {
        goto done;
    }
    PyObject *mask_obj = PyObject_GetAttr(comm, s_mask);
    if (mask_obj == NULL) {
        goto done;
    }
    mask = PyLong_AsLongLong(mask_obj);
    Py_DECREF(mask_obj);
    if ((mask == -1 && PyErr_Occurred()) || (rec = PyList_New(FIELDS)) == NULL) {
        goto done;
    }
    PyObject *items[FIELDS] = {seq, args[1], op, root, dtype, shape, Py_None, path, via, code, lasti, thread, start,
                               Py_None, Py_None, Py_None};
    for (int i = 0; i < FIELDS; i++) {
        PyList_SET_ITEM(rec, i, Py_NewRef(items[i]));
    }
    Py_ssize_t slot = (Py_ssize_t)(n & mask);
    if (PyList_CheckExact(ring) && slot < PyList_GET_SIZE(ring)) {
        PyObject *old = PyList_GET_ITEM(ring, slot);
        PyList_SET_ITEM(ring, slot, Py_NewRef(rec));
        Py_XDECREF(old); /* (after the store: freeing the old record may run other code) */
    } else {
        PyObject *index = PyLong_FromSsize_t(slot);
        int failed = index == NULL || PyObject_SetItem(ring, index, rec) < 0;
        Py_XDECREF(index);
        if (failed) {
            Py_CLEAR(rec);
            goto done;
        }
    }
    if (PyObject_SetAttr(comm, s_last, start) < 0) {
        Py_CLEAR(rec);
    }
done:
    Py_DECREF(ring);
    Py_XDECREF(seq);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(code);
    Py_XDECREF(lasti);
    Py_XDECREF(via);
    Py_XDECREF(thread);
    Py_XDECREF(start);
    return rec;
}

static PyObject *setup(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *p, *h, *f, *c, *g;
    if (!PyArg_ParseTuple(args, "O!O!OOO:setup", &PyList_Type, &p, &PyList_Type, &h, &f, &c, &g)) {
        return NULL;
    }
    if (PyList_GET_SIZE(h) != 1) {
        PyErr_SetString(PyExc_ValueError, "setup: hinting must be a list of one int");
        return NULL;
    }
    Py_XSETREF(paths, Py_NewRef(p));
    Py_XSETREF(hinting, Py_NewRef(h));
    Py_XSETREF(found, Py_NewRef(f));
    Py_XSETREF(clock_fn, Py_NewRef(c));
    Py_XSETREF(getframe, Py_NewRef(g));
    Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
#ifdef HAVE_BEGIN
    {"begin", (PyCFunction)(void (*)(void))begin, METH_FASTCALL,
     "begin(comm, collective, x=None, op=None, root=None, path='blocking'): collectives._comm.record.begin, "
     "compiled (the record of a call, or None where the record is off)."},
    {"setup", setup, METH_VARARGS,
     "setup(paths, hinting, found, clock, getframe): what begin reads (collectives._comm.record sets it)."},
#endif
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "collectives._recorder",
                                    "The flight recorder's record of a call, compiled (see _recorder.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__recorder(void) {
#ifdef HAVE_BEGIN
    if ((s_ring = PyUnicode_InternFromString("_ring")) == NULL ||
        (s_seq = PyUnicode_InternFromString("_seq")) == NULL ||
        (s_mask = PyUnicode_InternFromString("_mask")) == NULL ||
        (s_last = PyUnicode_InternFromString("_last_activity")) == NULL ||
        (s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL ||
        (s_blocking = PyUnicode_InternFromString("blocking")) == NULL) {
        return NULL;
    }
#endif
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    if (m != NULL && PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) { /* (it holds no state there) */
        Py_CLEAR(m);
    }
#endif
    return m;
}
