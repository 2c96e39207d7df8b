/* aiodat/_shim/posts.c: the extension module aiodat._shim._posts.
 *
 * The hot paths of EP.post_recv and EP.post_send (post.py) in C: one bare
 * segment (or a list of one), default receive flags, a send without immediate
 * data on a connected RC EP.  They check what post.py's general paths check,
 * post with ibv_post_recv / ibv_post_send and record the request as wr.py's
 * tracking expects (the queue entry, the LMR's in-flight count, the
 * UNSIGNALLED mark), so completions.c and wr.py find it again.  Anything else
 * returns -1 having done nothing, and post.py's general path takes it: that is
 * also where every bad argument gets its error message.
 *
 * Returns 0 when posted, the errno of a refused post (nothing recorded), -1
 * when it is not the hot path.  Built with the limited API (abi3); verbs'
 * posting calls are inline functions of the provider's ops, so it links to
 * no library.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include "pyattrs.h"

/* set once by configure() */
static PyObject *segment_type, *flags_type, *send_bits, *op_send, *state_connected, *state_disconnected,
                *state_error;
static PyObject *s_srq, *s_closed, *s_lmr, *s_pz, *s_conn, *s_state, *s_ids, *s_address, *s_offset,
                *s_length, *s_lkey, *s_inflight, *s_recv_q, *s_send_q, *s_quiet, *s_rc, *s_max_inline,
                *s_append, *s_add;

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *seg, *flags, *bits, *send, *conn, *disc, *err;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &seg, &flags, &bits, &send, &conn, &disc, &err))
        return NULL;
    if (segment_type != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._posts is configured once");
        return NULL;
    }
    if (!PyList_Check(bits) || PyList_Size(bits) != 16) {
        PyErr_SetString(PyExc_TypeError, "configure: the send bits are a list of 16 (flags, quiet) pairs");
        return NULL;
    }
    Py_INCREF(seg); Py_INCREF(flags); Py_INCREF(bits); Py_INCREF(send);
    Py_INCREF(conn); Py_INCREF(disc); Py_INCREF(err);
    segment_type = seg; flags_type = flags; send_bits = bits; op_send = send;
    state_connected = conn; state_disconnected = disc; state_error = err;
    Py_RETURN_NONE;
}

/* The segment of a hot-path post: a Segment, or a list holding one, else NULL.  A new reference:
 * the post runs Python (attribute reads, the entry's tuple) that could empty the caller's list. */
static PyObject *one_segment(PyObject *segments)
{
    if (PyList_Check(segments) && PyList_Size(segments) == 1)
        segments = PyList_GetItem(segments, 0);
    if ((PyObject *)Py_TYPE(segments) != segment_type)
        return NULL;
    Py_INCREF(segments);
    return segments;
}

/* What every hot post checks: the EP is open, the segment's LMR is open and of the EP's PZ.
 * Fills the LMR (a new reference) and the scatter/gather element.  1: go on; 0: not the hot path. */
static int check_segment(PyObject *ep, PyObject *seg, PyObject **lmr, struct ibv_sge *sge)
{
    unsigned long long address = 0, offset = 0, length = 0, lkey = 0;  /* (set below; -O1 cannot tell) */
    int open = attr_is(ep, s_closed, Py_False);
    if (open <= 0)
        return open;
    *lmr = PyObject_GetAttr(seg, s_lmr);
    if (*lmr == NULL)
        return -1;
    PyObject *pz = PyObject_GetAttr(ep, s_pz);
    int ok = pz ? attr_is(*lmr, s_pz, pz) : -1;
    Py_XDECREF(pz);
    if (ok == 1)
        ok = attr_is(*lmr, s_closed, Py_False);
    if (ok == 1 && (attr_ull(*lmr, s_address, &address) < 0 || attr_ull(seg, s_offset, &offset) < 0
                    || attr_ull(seg, s_length, &length) < 0 || attr_ull(*lmr, s_lkey, &lkey) < 0))
        ok = -1;
    if (ok == 1 && length > UINT32_MAX)
        ok = 0;  /* more than one scatter/gather element holds: the general path says so */
    if (ok <= 0) {
        Py_CLEAR(*lmr);
        return ok;
    }
    sge->addr = address + offset;
    sge->length = (uint32_t)length;
    sge->lkey = (uint32_t)lkey;
    return 1;
}

/* The EP's connection state, checked: 1 when ``connected_only`` and CONNECTED, or when not
 * ``connected_only`` and neither DISCONNECTED nor ERROR; 0 otherwise; -1 on error. */
static int state_allows(PyObject *ep, int connected_only)
{
    PyObject *conn = PyObject_GetAttr(ep, s_conn);
    PyObject *state = conn ? PyObject_GetAttr(conn, s_state) : NULL;
    Py_XDECREF(conn);
    if (state == NULL)
        return -1;
    int ok = connected_only ? state == state_connected : state != state_disconnected && state != state_error;
    Py_DECREF(state);
    return ok;
}

/* the next request number of the EP (next(ep._ids)); -1 on error */
static long long next_id(PyObject *ep)
{
    PyObject *ids = PyObject_GetAttr(ep, s_ids);
    PyObject *n = ids ? PyIter_Next(ids) : NULL;
    Py_XDECREF(ids);
    if (n == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the EP's request numbers ran out");
        return -1;
    }
    long long id = PyLong_AsLongLong(n);
    Py_DECREF(n);
    return id;
}

/* Record a posted request: ep.<queue>.append(entry), lmr._inflight += 1, and the quiet mark.
 * Nothing here fails on real objects; if it did, the post is done and the error is raised. */
static int record(PyObject *ep, PyObject *queue_name, PyObject *entry, PyObject *lmr, PyObject *quiet_id)
{
    PyObject *queue = PyObject_GetAttr(ep, queue_name);
    PyObject *res = queue ? PyObject_CallMethodObjArgs(queue, s_append, entry, NULL) : NULL;
    Py_XDECREF(queue);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    PyObject *count = PyObject_GetAttr(lmr, s_inflight);
    PyObject *one = PyLong_FromLong(1);
    PyObject *more = count && one ? PyNumber_Add(count, one) : NULL;
    int err = more == NULL || PyObject_SetAttr(lmr, s_inflight, more) < 0;
    Py_XDECREF(more); Py_XDECREF(one); Py_XDECREF(count);
    if (err)
        return -1;
    if (quiet_id != NULL) {
        PyObject *quiet = PyObject_GetAttr(ep, s_quiet);
        res = quiet ? PyObject_CallMethodObjArgs(quiet, s_add, quiet_id, NULL) : NULL;
        Py_XDECREF(quiet);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

static struct ibv_qp *qp_at(PyObject *address)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(address);
    return value == (unsigned long long)-1 && PyErr_Occurred() ? NULL : (struct ibv_qp *)(uintptr_t)value;
}

/* post_recv's work on its one segment ``seg`` (not NULL: the caller checked) */
static PyObject *post_recv_one(PyObject *ep, PyObject *address, PyObject *seg, PyObject *cookie)
{
    PyObject *lmr = NULL, *entry = NULL;
    struct ibv_sge sge;
    int ok = attr_is(ep, s_srq, Py_None);
    if (ok == 1)
        ok = state_allows(ep, 0);
    if (ok == 1)
        ok = check_segment(ep, seg, &lmr, &sge);
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    struct ibv_qp *qp = qp_at(address);
    if (qp == NULL) {  /* (an open EP always has its QP's address) */
        Py_DECREF(lmr);
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    }
    long long id = next_id(ep);
    unsigned long long wr_id = (unsigned long long)id * 2 + 1;
    if (id >= 0)  /* the entry first: once the request is posted, recording it must not need memory */
        entry = Py_BuildValue("(KO(O))", wr_id, cookie, seg);
    if (entry == NULL) {
        Py_DECREF(lmr);
        return NULL;
    }
    struct ibv_recv_wr wr = { .wr_id = wr_id, .next = NULL, .sg_list = &sge, .num_sge = 1 }, *bad;
    int err = ibv_post_recv(qp, &wr, &bad);
    if (!err && record(ep, s_recv_q, entry, lmr, NULL) < 0)
        err = -2;
    Py_DECREF(entry);
    Py_DECREF(lmr);
    return err == -2 ? NULL : PyLong_FromLong(err);
}

/* post_send's work on its one segment ``seg`` (not NULL: the caller checked) */
static PyObject *post_send_one(PyObject *ep, PyObject *address, PyObject *seg, PyObject *cookie, PyObject *flags)
{
    PyObject *lmr = NULL, *entry = NULL, *quiet_id = NULL;
    if ((PyObject *)Py_TYPE(flags) != flags_type)
        return PyLong_FromLong(-1);
    long bits = PyLong_AsLong(flags);
    if (bits < 0 || bits >= 16) {
        if (PyErr_Occurred())
            return NULL;
        return PyLong_FromLong(-1);
    }
    struct ibv_sge sge;
    int ok = attr_is(ep, s_rc, Py_True);
    if (ok == 1)
        ok = state_allows(ep, 1);
    if (ok == 1)
        ok = check_segment(ep, seg, &lmr, &sge);
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    /* (ibv_send_flags, posted UNSIGNALLED) of these CompletionFlags: post.py's _SEND_BITS */
    PyObject *pair = PyList_GetItem(send_bits, bits);
    long send_flags = PyLong_AsLong(PyTuple_GetItem(pair, 0));
    int quiet = PyObject_IsTrue(PyTuple_GetItem(pair, 1));
    unsigned long long max_inline;
    struct ibv_qp *qp = qp_at(address);
    if (qp == NULL) {  /* (an open EP always has its QP's address) */
        Py_DECREF(lmr);
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    }
    long long id = -1;
    if (send_flags >= 0 && quiet >= 0 && attr_ull(ep, s_max_inline, &max_inline) == 0)
        id = next_id(ep);
    unsigned long long wr_id = (unsigned long long)id * 2;
    if (id >= 0) {
        entry = Py_BuildValue("(KOO(O)O)", wr_id, cookie, op_send, seg, Py_None);
        if (entry != NULL && quiet && (quiet_id = PyLong_FromUnsignedLongLong(wr_id)) == NULL)
            Py_CLEAR(entry);
    }
    if (entry == NULL) {
        Py_DECREF(lmr);
        return NULL;
    }
    if (sge.length <= max_inline)
        send_flags |= IBV_SEND_INLINE;
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = (unsigned int)send_flags;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    int err = ibv_post_send(qp, &wr, &bad);
    if (!err && record(ep, s_send_q, entry, lmr, quiet_id) < 0)
        err = -2;
    Py_DECREF(entry);
    Py_XDECREF(quiet_id);
    Py_DECREF(lmr);
    return err == -2 ? NULL : PyLong_FromLong(err);
}

/* post_recv(ep, qp_address, segments, cookie) -> 0 | errno | -1 */
static PyObject *post_recv(PyObject *self, PyObject *args)
{
    PyObject *ep, *address, *segments, *cookie;
    if (!PyArg_UnpackTuple(args, "post_recv", 4, 4, &ep, &address, &segments, &cookie))
        return NULL;
    PyObject *seg = one_segment(segments);
    if (seg == NULL)
        return PyLong_FromLong(-1);
    PyObject *res = post_recv_one(ep, address, seg, cookie);
    Py_DECREF(seg);
    return res;
}

/* post_send(ep, qp_address, segments, cookie, flags) -> 0 | errno | -1 */
static PyObject *post_send(PyObject *self, PyObject *args)
{
    PyObject *ep, *address, *segments, *cookie, *flags;
    if (!PyArg_UnpackTuple(args, "post_send", 5, 5, &ep, &address, &segments, &cookie, &flags))
        return NULL;
    PyObject *seg = one_segment(segments);
    if (seg == NULL)
        return PyLong_FromLong(-1);
    PyObject *res = post_send_one(ep, address, seg, cookie, flags);
    Py_DECREF(seg);
    return res;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Segment, CompletionFlags, send_bits, DTOOp.SEND, CONNECTED, DISCONNECTED, ERROR)."},
    {"post_recv", post_recv, METH_VARARGS,
     "post_recv(ep, qp_address, segments, cookie) -> 0 posted, errno refused, -1 not the hot path."},
    {"post_send", post_send, METH_VARARGS,
     "post_send(ep, qp_address, segments, cookie, flags) -> 0 posted, errno refused, -1 not the hot path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiodat._shim._posts",
    "The hot paths of EP.post_recv and EP.post_send, in C (see post.py).", -1, methods,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__posts(void)
{
    INTERN(s_srq, "_srq"); INTERN(s_closed, "_closed"); INTERN(s_lmr, "lmr"); INTERN(s_pz, "_pz");
    INTERN(s_conn, "_conn"); INTERN(s_state, "state"); INTERN(s_ids, "_ids"); INTERN(s_address, "address");
    INTERN(s_offset, "offset"); INTERN(s_length, "length"); INTERN(s_lkey, "lmr_context");
    INTERN(s_inflight, "_inflight"); INTERN(s_recv_q, "_recv_q"); INTERN(s_send_q, "_send_q");
    INTERN(s_quiet, "_quiet"); INTERN(s_rc, "_rc"); INTERN(s_max_inline, "max_inline");
    INTERN(s_append, "append"); INTERN(s_add, "add");
    return PyModule_Create(&module);
}
