/* aiodat/_shim/pyattrs.h: reading a Python object's attributes in the hot-path modules
 * (completions.c, posts.c), on the limited API, and writing the counts they keep.  Each returns -1
 * with the exception set on error. */
#ifndef AIODAT_PYATTRS_H
#define AIODAT_PYATTRS_H

#include <Python.h>

/* attribute ``name`` of ``obj`` as a C integer: 0, or -1 */
static inline int attr_ull(PyObject *obj, PyObject *name, unsigned long long *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    return *out == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* attribute ``name`` of ``obj`` is true (1), false (0), or an error (-1) */
static inline int attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    int truth = value ? PyObject_IsTrue(value) : -1;
    Py_XDECREF(value);
    return truth;
}

/* attribute ``name`` of ``obj`` is ``expected`` (1), is not (0), or an error (-1) */
static inline int attr_is(PyObject *obj, PyObject *name, PyObject *expected)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

/* obj.<name> += delta (an int attribute, such as an LMR's in-flight count): 0, or -1 */
static inline int attr_add(PyObject *obj, PyObject *name, Py_ssize_t delta)
{
    PyObject *value = PyObject_GetAttr(obj, name), *by = PyLong_FromSsize_t(delta);
    PyObject *sum = value && by ? PyNumber_Add(value, by) : NULL;
    int err = sum == NULL || PyObject_SetAttr(obj, name, sum) < 0;
    Py_XDECREF(sum); Py_XDECREF(by); Py_XDECREF(value);
    return err ? -1 : 0;
}

/* ``module.name`` (a new reference), or NULL with the exception set: for what a module looks up once */
static inline PyObject *module_attr(const char *module, const char *name)
{
    PyObject *mod = PyImport_ImportModule(module);
    PyObject *value = mod ? PyObject_GetAttrString(mod, name) : NULL;
    Py_XDECREF(mod);
    return value;
}

/* Forget an error of the bookkeeping once a request is posted or taken (an allocation failed under
 * memory pressure: a count stays high, which refuses a free and loses nothing), but not a Ctrl-C
 * that a signal handler raised on the way: it comes again at the next check. */
static inline void drop_error(void)
{
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        PyErr_SetInterrupt();
    PyErr_Clear();
}

#endif
