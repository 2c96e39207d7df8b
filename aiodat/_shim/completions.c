/* aiodat/_shim/completions.c: the extension module aiodat._shim._completions.
 *
 * The common case of turning polled completions into events, in C: what
 * EVD._queue_backlog (evd.py) and WorkRequests._completion_event (wr.py)
 * do in Python, for a successful completion that is the oldest request of its
 * EP's queue (or a send after plain sends posted suppressed, retired with it: selective
 * signalling), has no UNSIGNALLED requests beside it and, for a send, has no
 * internal target.  It stops at the first completion that is anything else and
 * says where; the Python path takes the rest, so the rules live in one place
 * (wr.py) and C only skips the interpreter for the case that dominates a
 * ping-pong or a stream.  A Python error inside (which valid objects never
 * raise) is cleared and also hands over: Python then meets it and keeps the
 * completions it could not turn into events.
 *
 * look() is EVD._poll's common case: it polls through the shim's own
 * aiodat_cq_poll (its address given to configure(), so the shim's fault
 * injection still applies) and queues the events, in one call from Python.
 *
 * turn() is the loop's poller (poller.py) in C: its pass over its EVDs (sweep()), its look at
 * each and the hand-over (the callback's delivery or the waiting task's wake-up); whatever is
 * not the common case it hands to the same Python methods.  wait_begin() and Spin are a wait's
 * common case: up to its sleep, its spinning looks and the sleep itself.
 *
 * Built with the limited API (abi3), like the cffi module beside it; it reads
 * the struct aiodat_wc array the cffi module polls into, at the address the
 * EVD passes, and links to no library.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#include "shim.h"  /* struct aiodat_wc, the array the cffi module polls into */
#include "pyattrs.h"

#define WC_RECV_RDMA_WITH_IMM 129
#define WC_WITH_IMM 2

/* set once by configure(): the event class and the values an event carries */
static PyObject *event_cls, *dto_completion, *op_recv, *op_recv_imm, *plain_send_ops, *success;
/* plain_send_ops' members (enum members: singletons), compared by identity: hashing an Enum runs
 * Python (Enum.__hash__), where a signal handler may raise in the middle of the completions */
#define MAX_PLAIN_OPS 8
static PyObject *plain_ops[MAX_PLAIN_OPS];
static int n_plain_ops;

static int is_plain_send(PyObject *op)
{
    for (int k = 0; k < n_plain_ops; k++)
        if (op == plain_ops[k])
            return 1;
    return 0;
}
static allocfunc event_alloc;
/* an event's __dict__ with its constant fields filled in, copied per event (configure() makes it) */
static PyObject *event_template;
/* wr.SendRun, set by configure_send_run(): a batch's one send-queue entry; NULL: runs are Python's */
static PyObject *send_run_cls;
/* the shim's aiodat_cq_poll (the cffi module), whose address configure() is given */
static int (*poll_fn)(struct ibv_cq *cq, struct aiodat_wc *out, int max);
/* the shim's aiodat_cq_drain: a wake-up's read of the channel event, and an arm, with its poll */
static int (*drain_fn)(struct ibv_comp_channel *channel, struct ibv_cq *cq, int arm, struct aiodat_wc *out,
                       int max, int *status);
static PyObject *s_closed, *s_backlog, *s_awaited, *s_cq_address, *s_wcs_address, *s_qlen, *s_queue,
                *s_qpn_refs, *s_polled, *s_wc_next, *s_zero;
static PyObject *s_callback, *s_waiter, *s_threshold, *s_solicited, *s_solicited_hit, *s_busy_poll_us,
                *s_busy_until, *s_overflow_reported, *s_done, *s_set_result, *s_clear,
                *s_napi_failed, *s_callback_raised, *s_polling_the_cq;
static PyObject *s_attached_loop, *s_sharers, *s_pending_error, *s_armed_solicited, *s_unarmed, *s_poller,
                *s_loop, *s_hot, *s_scheduled, *s_create_future, *s_set_deadline, *s_napi_add, *s_poll_rest,
                *s_deadline, *s_waiter_task, *s_cancelling, *s_cancelled, *s_get_loop, *s_future_blocking, *s_result, *s_decide, *s_is_closed,
                *s_turn, *s_call_soon, *s_channel_address, *s_status_address, *s_arm_error, *s_rearms,
                *s_arm_retried, *s_note_arm, *s_napi_arm, *s_napi_arm_retry, *s_woken, *s_watch,
                *s_draining_the_cq;
static PyObject *get_running_loop;  /* asyncio.events._get_running_loop: the running loop, or None */
static PyObject *s_base, *s_last, *s_srq, *s_eps, *s_eps_seen, *s_posted;
static PyObject *s_append, *s_recv_q, *s_send_q, *s_quiet, *s_ud, *s_lmr, *s_inflight, *s_length, *s_popleft, *s_pop, *s_dict;
static PyObject *k_type, *k_evd, *k_ep, *k_cookie, *k_status, *k_length, *k_operation, *k_imm,
                *k_vendor_err, *k_src_qp, *k_notify;

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *cls, *dto, *recv, *recv_imm, *sends;
    unsigned long long poll_address, drain_address;
    if (!PyArg_ParseTuple(args, "OOOOOKK", &cls, &dto, &recv, &recv_imm, &sends, &poll_address, &drain_address))
        return NULL;
    if (event_cls != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._completions is configured once");
        return NULL;
    }
    if (!PyType_Check(cls) || poll_address == 0 || drain_address == 0) {
        PyErr_SetString(PyExc_TypeError, "configure(event class, DTO type, RECV, RECV_IMM, set of send ops, "
                                         "address of aiodat_cq_poll, address of aiodat_cq_drain)");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)cls, Py_tp_alloc);
    if (alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "the event class has no tp_alloc");
        return NULL;
    }
    /* the keys in DTOCompletionEvent._completed's order; a copy of a dict this size is one memcpy */
    PyObject *template = PyDict_New(), *zero = PyLong_FromLong(0);
    PyObject *const pairs[][2] = {{k_type, dto}, {k_evd, Py_None}, {k_ep, Py_None}, {k_cookie, Py_None},
                                  {k_status, success}, {k_length, zero}, {k_operation, Py_None},
                                  {k_imm, Py_None}, {k_vendor_err, zero}, {k_src_qp, Py_None},
                                  {k_notify, Py_True}};
    for (size_t i = 0; template != NULL && i < sizeof(pairs) / sizeof(pairs[0]); i++)
        if (zero == NULL || PyDict_SetItem(template, pairs[i][0], pairs[i][1]) < 0)
            Py_CLEAR(template);
    Py_XDECREF(zero);
    if (template == NULL)
        return NULL;
    event_template = template;
    event_alloc = alloc;
    Py_INCREF(cls); Py_INCREF(dto); Py_INCREF(recv); Py_INCREF(recv_imm); Py_INCREF(sends);
    event_cls = cls; dto_completion = dto; op_recv = recv; op_recv_imm = recv_imm; plain_send_ops = sends;
    PyObject *it = PyObject_GetIter(sends), *member;
    while (it != NULL && (member = PyIter_Next(it)) != NULL) {
        if (n_plain_ops < MAX_PLAIN_OPS)
            plain_ops[n_plain_ops++] = member;  /* (the set holds it: this module holds the set) */
        Py_DECREF(member);
    }
    Py_XDECREF(it);
    if (PyErr_Occurred())
        return NULL;
    poll_fn = (int (*)(struct ibv_cq *, struct aiodat_wc *, int))(uintptr_t)poll_address;
    drain_fn = (int (*)(struct ibv_comp_channel *, struct ibv_cq *, int, struct aiodat_wc *, int, int *))
               (uintptr_t)drain_address;
    Py_RETURN_NONE;
}

/* The total length of a tuple of segments; -1 on error. */
static long long segments_length(PyObject *segs)
{
    long long total = 0;
    for (Py_ssize_t k = 0; k < PyTuple_Size(segs); k++) {
        PyObject *seglen = PyObject_GetAttr(PyTuple_GetItem(segs, k), s_length);
        long long len = seglen ? PyLong_AsLongLong(seglen) : -1;
        Py_XDECREF(seglen);
        if (len < 0)
            return -1;
        total += len;
    }
    return total;
}

/* Append ``event`` to ``queue`` before its request's entry is taken: a deque's append may need a block,
 * and a failure after the take would hand Python a completion whose entry is gone.  0, or -1. */
static int queue_event(PyObject *queue, PyObject *event)
{
    PyObject *res = PyObject_CallMethodObjArgs(queue, s_append, event, NULL);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

/* Take back the event queue_event just appended: its entry could not be taken (a deque's pop
 * allocates nothing). */
static void unqueue_event(PyObject *queue)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);  /* (the failure that is being reported) */
    PyObject *res = PyObject_CallMethodObjArgs(queue, s_pop, NULL);
    Py_XDECREF(res);
    PyErr_Restore(type, value, tb);
}

/* The in-flight counts a completion lowers, worked out before anything is taken (a count that is
 * no small int allocates) and set after, by steps that allocate nothing: a MemoryError in
 * between would leave a count high for ever (an LMR that can never be freed).  The LMRs are
 * noted in a small array in place, grown on the heap when a completion retires requests on more
 * (a pool whose buffers are each their own LMR), up to MAX_LOWERED: beyond, wr.py's _lowered
 * (the search here is linear). */
#define LOWERED_IN_PLACE 8
#define MAX_LOWERED 256
struct lower {
    PyObject *lmr;    /* held */
    Py_ssize_t by;
    PyObject *value;  /* the new count, once lowered_values made it */
};
struct lowered {
    int n, size;
    struct lower *at;  /* in_place, or a PyMem block */
    struct lower in_place[LOWERED_IN_PLACE];
    PyObject *held;    /* the retired entries (lower_head), let go only once all is taken */
};

static void lowered_init(struct lowered *l)
{
    l->n = 0;
    l->size = LOWERED_IN_PLACE;
    l->at = l->in_place;
    l->held = NULL;
}

/* Let go of what was noted; the held entries last (their release may run a finalizer). */
static void lowered_clear(struct lowered *l)
{
    for (int k = 0; k < l->n; k++) {
        Py_CLEAR(l->at[k].lmr);
        Py_CLEAR(l->at[k].value);
    }
    l->n = 0;
    if (l->at != l->in_place)
        PyMem_Free(l->at);
    l->at = l->in_place;
    Py_CLEAR(l->held);
}

/* Note ``requests`` requests on each of ``segs``: 1, 0 (more LMRs than it notes: Python's path),
 * or -1 on error. */
static int lower_segments(struct lowered *l, PyObject *segs, Py_ssize_t requests)
{
    if (!PyTuple_Check(segs))
        return 0;
    for (Py_ssize_t j = 0; j < PyTuple_Size(segs); j++) {
        PyObject *lmr = PyObject_GetAttr(PyTuple_GetItem(segs, j), s_lmr);
        if (lmr == NULL)
            return -1;
        int k = l->n - 1;
        while (k >= 0 && l->at[k].lmr != lmr)  /* (from the last: segments in a row are mostly one LMR's) */
            k--;
        if (k >= 0) {
            l->at[k].by += requests;
            Py_DECREF(lmr);
            continue;
        }
        if (l->n == MAX_LOWERED) {
            Py_DECREF(lmr);
            return 0;
        }
        if (l->n == l->size) {
            int size = 2 * l->size;
            struct lower *at = PyMem_Malloc(size * sizeof *at);
            if (at == NULL) {
                Py_DECREF(lmr);
                PyErr_NoMemory();
                return -1;
            }
            memcpy(at, l->at, l->n * sizeof *at);
            if (l->at != l->in_place)
                PyMem_Free(l->at);
            l->at = at;
            l->size = size;
        }
        l->at[l->n++] = (struct lower){lmr, requests, NULL};
    }
    return 1;
}

/* Note the segments of the ``count`` plain entries (suppressed sends) at the head of ``q``, and
 * hold the entries: 1, 0 (Python's path), or -1. */
static int lower_head(struct lowered *l, PyObject *q, Py_ssize_t count)
{
    if (count == 1) {  /* the usual case (one suppressed send per signalled one): no iterator, no tuple */
        PyObject *only = PySequence_GetItem(q, 0);
        if (only == NULL)
            return -1;
        l->held = only;  /* (held as is: lowered_clear lets it go) */
        return PyTuple_Check(only) && PyTuple_Size(only) == 5 ? lower_segments(l, PyTuple_GetItem(only, 3), 1) : 0;
    }
    PyObject *it = PyObject_GetIter(q), *entry;
    int rc = 1;
    l->held = it ? PyTuple_New(count) : NULL;
    if (l->held == NULL) {
        Py_XDECREF(it);
        return -1;
    }
    for (Py_ssize_t k = 0; rc == 1 && k < count && (entry = PyIter_Next(it)) != NULL; k++) {
        rc = PyTuple_Check(entry) && PyTuple_Size(entry) == 5 ? lower_segments(l, PyTuple_GetItem(entry, 3), 1) : 0;
        PyTuple_SetItem(l->held, k, entry);  /* (takes the reference over) */
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : rc;
}

/* Make the new counts from the counts as they are now: 0, or -1.  Called after the event is
 * made, the last step that can run Python (its allocations may start a collection, whose
 * finalizers may post on or reset the EP): from here to lowered_set only ints are made and the
 * event appended to a deque, which start no collection and run no Python, so the counts read
 * here are still the LMRs' when they are set (no need to read them again). */
static int lowered_values(struct lowered *l)
{
    for (int k = 0; k < l->n; k++) {
        PyObject *now = PyObject_GetAttr(l->at[k].lmr, s_inflight);
        long long was = now != NULL && PyLong_CheckExact(now) ? PyLong_AsLongLong(now) : -1;
        if (was >= 0 && was - l->at[k].by >= 0) {  /* the usual case: no Python number protocol */
            l->at[k].value = PyLong_FromLongLong(was - l->at[k].by);
        } else {  /* (the error of a count beyond long long is dropped: the general way below) */
            if (now != NULL && PyErr_Occurred())
                PyErr_Clear();
            PyObject *by = now ? PyLong_FromSsize_t(l->at[k].by) : NULL;
            l->at[k].value = by ? PyNumber_Subtract(now, by) : NULL;
            Py_XDECREF(by);
        }
        Py_XDECREF(now);
        if (l->at[k].value == NULL)
            return -1;
    }
    return 0;
}

/* Whether the plan still holds, read with no allocation after the last one that can run Python
 * (the event's): ``planned`` is still the head of ``q``.  An allocation may start a collection
 * whose finalizers (a cookie's) reset this EP (its queue emptied, its counts lowered) or post on
 * it: the plan's pops would then be wrong.  (The counts need no check: lowered_values read them
 * after that allocation.) */
static int lowered_holds(struct lowered *l, PyObject *q, PyObject *planned)
{
    (void)l;
    if (PyObject_Length(q) <= 0) {
        if (PyErr_Occurred())
            drop_error();
        return 0;
    }
    PyObject *head = PySequence_GetItem(q, 0);  /* (a deque's item: a new reference, no allocation) */
    if (head == NULL) {
        drop_error();
        return 0;
    }
    Py_DECREF(head);  /* (the deque holds it: only its address is compared) */
    return head == planned;
}

/* Set the new counts (an attribute that exists already: nothing is allocated). */
static void lowered_set(struct lowered *l)
{
    for (int k = 0; k < l->n; k++)
        if (PyObject_SetAttr(l->at[k].lmr, s_inflight, l->at[k].value) < 0)
            drop_error();
}

/* Pop the ``count`` entries at the head of ``q`` (a deque's popleft, called unbound, allocates
 * nothing and does not fail on a deque that holds them). */
static void pop_head(PyObject *q, Py_ssize_t count)
{
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *old = PyObject_CallMethodObjArgs(q, s_popleft, NULL);
        if (old == NULL) {
            drop_error();
            break;
        }
        Py_DECREF(old);
    }
}

/* a DTOCompletionEvent made as DTOCompletionEvent._completed makes it: no __init__, one __dict__
 * (a copy of the template, with only the fields that vary set) */
static PyObject *make_event(PyObject *evd, PyObject *ep, PyObject *cookie, long long length, PyObject *op,
                            PyObject *imm, uint32_t vendor_err, PyObject *src_qp)
{
    PyObject *d = PyDict_Copy(event_template), *ev = NULL, *len = NULL, *verr = NULL;
    if (d == NULL)
        return NULL;
    len = PyLong_FromLongLong(length);
    verr = vendor_err ? PyLong_FromUnsignedLong(vendor_err) : NULL;
    if (len && (verr || !vendor_err)
        && !PyDict_SetItem(d, k_evd, evd) && !PyDict_SetItem(d, k_ep, ep) && !PyDict_SetItem(d, k_cookie, cookie)
        && !PyDict_SetItem(d, k_length, len) && !PyDict_SetItem(d, k_operation, op)
        && (imm == Py_None || !PyDict_SetItem(d, k_imm, imm))
        && (verr == NULL || !PyDict_SetItem(d, k_vendor_err, verr))
        && (src_qp == Py_None || !PyDict_SetItem(d, k_src_qp, src_qp))) {
        ev = event_alloc((PyTypeObject *)event_cls, 0);
        if (ev && PyObject_GenericSetAttr(ev, s_dict, d) < 0)
            Py_CLEAR(ev);
    }
    Py_XDECREF(len); Py_XDECREF(verr); Py_DECREF(d);
    return ev;
}

/* Where wr_id's entry is in a send queue whose entries before it are all plain (a 5-tuple with
 * a tuple of segments and no target: a request posted suppressed), with wr_ids below it: its
 * index; 0 when it is not there or anything before it is not plain; -1 on error. */
static Py_ssize_t suppressed_before(PyObject *q, unsigned long long wr_id)
{
    PyObject *it = PyObject_GetIter(q), *entry;
    Py_ssize_t index = 0, found = 0;
    if (it == NULL)
        return -1;
    while ((entry = PyIter_Next(it)) != NULL) {
        unsigned long long id = PyTuple_Check(entry) && PyTuple_Size(entry) == 5
            ? PyLong_AsUnsignedLongLong(PyTuple_GetItem(entry, 0)) : (unsigned long long)-1;
        int plain = id != (unsigned long long)-1 && PyTuple_GetItem(entry, 4) == Py_None
                    && PyTuple_Check(PyTuple_GetItem(entry, 3));
        Py_DECREF(entry);
        if (PyErr_Occurred()) {
            found = -1;
            break;
        }
        if (id == wr_id) {
            found = index;
            break;
        }
        if (!plain || id > wr_id)
            break;
        index++;
    }
    Py_DECREF(it);
    return found < 0 || PyErr_Occurred() ? -1 : found;
}

/* The event of a receive completion whose entry held ``cookie``: its operation, length, immediate
 * data and, on UD, source QP; a new reference, NULL on error. */
static PyObject *recv_event(PyObject *evd, PyObject *ep, const struct aiodat_wc *wc, PyObject *cookie)
{
    PyObject *op = wc->opcode == WC_RECV_RDMA_WITH_IMM ? op_recv_imm : op_recv, *ev = NULL, *src = NULL;
    PyObject *imm = wc->wc_flags & WC_WITH_IMM ? PyLong_FromUnsignedLong(wc->imm_data) : (Py_INCREF(Py_None), Py_None);
    PyObject *ud = imm ? PyObject_GetAttr(ep, s_ud) : NULL;
    int is_ud = ud ? PyObject_IsTrue(ud) : -1;
    Py_XDECREF(ud);
    if (is_ud >= 0)
        src = is_ud ? PyLong_FromUnsignedLong(wc->src_qp) : (Py_INCREF(Py_None), Py_None);
    if (src != NULL)
        ev = make_event(evd, ep, cookie, wc->byte_len, op, imm, wc->vendor_err, src);
    Py_XDECREF(imm); Py_XDECREF(src);
    return ev;
}

/* Whether an SRQ receive's plan still holds, read with no allocation after the last one (as
 * lowered_holds, and wr.py's _commit with its guard): ``entry`` is still posted[key] (a finalizer
 * run by the event's making may have closed the SRQ: the table cleared, every buffer released)
 * and every count the one the new counts were made from (lowered_values read them after that,
 * and a deque's append runs no Python: a check in depth, the queue is the caller's). */
static int srq_plan_holds(struct lowered *l, PyObject *posted, PyObject *key, PyObject *entry)
{
    PyObject *now = PyDict_GetItemWithError(posted, key);  /* (borrowed; an int key's lookup allocates nothing) */
    if (now != entry) {
        drop_error();
        return 0;
    }
    for (int k = 0; k < l->n; k++) {  /* (each count still the new value plus what it lowers) */
        PyObject *count = PyObject_GetAttr(l->at[k].lmr, s_inflight);
        long long count_now = count != NULL ? PyLong_AsLongLong(count) : -1;
        long long made = PyLong_AsLongLong(l->at[k].value);  /* (an int's read allocates nothing) */
        Py_XDECREF(count);
        if (PyErr_Occurred()) {
            drop_error();
            return 0;
        }
        if (count_now != made + l->at[k].by)
            return 0;
    }
    return 1;
}

/* A receive on an EP of an SRQ (its own receive queue is empty): the SRQ's entry of the request,
 * taken as wr.py's _completion_event takes it, while the SRQ knows every EP it has (else
 * _completion_event notes their EVDs first).  1, 0 (Python's path, nothing changed) or -1 on error. */
static int srq_event(PyObject *evd, PyObject *ep, const struct aiodat_wc *wc, PyObject *queue)
{
    int taken = -1;
    struct lowered counts;
    lowered_init(&counts);
    PyObject *eps = NULL, *seen = NULL, *posted = NULL, *key = NULL, *entry = NULL, *event = NULL;
    PyObject *srq = PyObject_GetAttr(ep, s_srq);
    if (srq == NULL)
        return -1;
    if (srq == Py_None) {
        Py_DECREF(srq);
        return 0;
    }
    eps = PyObject_GetAttr(srq, s_eps);
    seen = eps ? PyObject_GetAttr(srq, s_eps_seen) : NULL;
    posted = seen ? PyObject_GetAttr(srq, s_posted) : NULL;
    key = posted && PyDict_Check(posted) ? PyLong_FromUnsignedLongLong(wc->wr_id) : NULL;
    Py_ssize_t count = key ? PyObject_Length(eps) : -1;
    long long noted = count >= 0 ? PyLong_AsLongLong(seen) : -1;
    if (count < 0 || PyErr_Occurred())
        goto done;
    if (count != noted) {
        taken = 0;  /* an EP came or went since: srq.py notes its EVD */
        goto done;
    }
    entry = PyDict_GetItemWithError(posted, key);
    if (entry == NULL) {
        taken = PyErr_Occurred() ? -1 : 0;  /* not the SRQ's: wr.py's */
        goto done;
    }
    Py_INCREF(entry);  /* (the dictionary's reference goes below) */
    if (!PyTuple_Check(entry) || PyTuple_Size(entry) != 2 || !PyTuple_Check(PyTuple_GetItem(entry, 1)))
        goto done;
    int lowers = lower_segments(&counts, PyTuple_GetItem(entry, 1), 1);
    if (lowers <= 0) {
        taken = lowers;
        goto done;
    }
    event = recv_event(evd, ep, wc, PyTuple_GetItem(entry, 0));
    if (event == NULL || lowered_values(&counts) < 0 || queue_event(queue, event) < 0)
        goto done;
    if (!srq_plan_holds(&counts, posted, key, entry)) {
        unqueue_event(queue);  /* (a finalizer posted on or closed the SRQ since the plan: wr.py works it out again) */
        taken = 0;
        goto done;
    }
    /* taken from here, allocating nothing: the entry is held (entry), so its delete runs no finalizer */
    if (PyDict_DelItem(posted, key) < 0) {  /* (the key is there: checked just above) */
        unqueue_event(queue);
        goto done;
    }
    lowered_set(&counts);
    taken = 1;
done:
    lowered_clear(&counts);
    Py_XDECREF(event); Py_XDECREF(entry); Py_XDECREF(key); Py_XDECREF(posted); Py_XDECREF(seen); Py_XDECREF(eps); Py_DECREF(srq);
    return taken;
}

/* Queue the event of one completion and take its request's entry if it is the common case (1),
 * else 0 with nothing changed; -1 on error (nothing changed either). */
static int common_event(PyObject *evd, PyObject *ep, const struct aiodat_wc *wc, PyObject *queue)
{
    int recv = (int)(wc->wr_id & 1);
    int taken = 0;
    Py_ssize_t retire = 0;  /* suppressed sends before this one, retired with it */
    Py_ssize_t requests = 0;  /* a run's: how many requests its last completion takes */
    struct lowered counts;
    lowered_init(&counts);
    PyObject *q = NULL, *quiet = NULL, *head = NULL, *wr_id = NULL, *event = NULL, *planned = NULL;
    q = PyObject_GetAttr(ep, recv ? s_recv_q : s_send_q);
    quiet = q ? PyObject_GetAttr(ep, s_quiet) : NULL;
    if (quiet == NULL)
        goto error;
    if (PySet_Size(quiet) != 0)  /* UNSIGNALLED requests about */
        goto done;
    Py_ssize_t queued = PyObject_Length(q);
    if (queued <= 0) {  /* an SRQ's EP (or an error) */
        taken = queued < 0 ? -1 : recv ? srq_event(evd, ep, wc, queue) : 0;
        goto done;
    }
    head = PySequence_GetItem(q, 0);
    if (head == NULL || !PyTuple_Check(head))
        goto error;
    planned = head;  /* (what the plan reads: lowered_holds checks it is still the head) */
    Py_INCREF(planned);
    wr_id = PyTuple_GetItem(head, 0);
    PyObject *cookie = PyTuple_GetItem(head, 1);
    unsigned long long first = wr_id ? PyLong_AsUnsignedLongLong(wr_id) : (unsigned long long)-1;
    if (PyErr_Occurred())
        goto error;
    PyObject *target = !recv && PyTuple_Size(head) == 5 ? PyTuple_GetItem(head, 4) : NULL;
    if (target != NULL && send_run_cls != NULL && (PyObject *)Py_TYPE(target) == send_run_cls) {
        /* a run (wr.SendRun): a batch's last completion takes the whole entry; wr.py's _take_from_run */
        unsigned long long base, last;
        if (attr_ull(target, s_base, &base) < 0 || attr_ull(target, s_last, &last) < 0 || !PyTuple_Check(cookie))
            goto error;
        if (wc->wr_id != last || first > last || last < base
            || (last - base) / 2 >= (unsigned long long)PyTuple_Size(cookie))
            goto done;  /* a completion inside the run: an error or a flush, wr.py's */
        cookie = PyTuple_GetItem(cookie, (Py_ssize_t)((last - base) / 2));
        requests = (Py_ssize_t)((last - first) / 2 + 1);
    } else if (first != wc->wr_id) {
        /* not the oldest request: selective signalling, plain sends posted suppressed before it.
         * The send queue is ordered, so they finished first: they are retired with it, as wr.py's
         * _plan_send and _retired do; anything else before it (a run, a target) is wr.py's */
        Py_ssize_t found = recv || target != Py_None ? 0 : suppressed_before(q, wc->wr_id);
        if (found <= 0) {
            if (found < 0)
                goto error;
            goto done;
        }
        Py_DECREF(head);
        head = PySequence_GetItem(q, found);
        if (head == NULL || !PyTuple_Check(head) || PyTuple_Size(head) != 5)
            goto error;
        cookie = PyTuple_GetItem(head, 1);
        target = PyTuple_GetItem(head, 4);
        retire = found;
    }
    PyObject *op = NULL, *segs;  /* (a receive's operation is recv_event's) */
    if (recv) {
        if (PyTuple_Size(head) != 3)
            goto error;
        segs = PyTuple_GetItem(head, 2);
    } else {
        if (PyTuple_Size(head) != 5)
            goto error;
        op = PyTuple_GetItem(head, 2);
        segs = PyTuple_GetItem(head, 3);
        if (requests == 0 && target != Py_None)
            goto done;  /* a drain marker or a window bind: wr.py's business */
        if (!is_plain_send(op))
            goto done;  /* an RDMA read or atomic: its length comes from the completion */
    }
    if (segs == NULL || !PyTuple_Check(segs))
        goto error;
    /* everything that can fail comes before the entry is taken (the new counts made, the event
     * queued): a failure leaves it for wr.py */
    int lowers = lower_segments(&counts, segs, requests ? requests : 1);
    if (lowers > 0 && retire)
        lowers = lower_head(&counts, q, retire);
    if (lowers <= 0) {
        if (lowers < 0)
            goto error;
        goto done;  /* its requests span more LMRs than C notes: wr.py's */
    }
    if (recv) {
        event = recv_event(evd, ep, wc, cookie);
    } else {
        long long length = segments_length(segs);
        event = length < 0 ? NULL : make_event(evd, ep, cookie, length, op, Py_None, wc->vendor_err, Py_None);
    }
    if (event == NULL || lowered_values(&counts) < 0 || queue_event(queue, event) < 0)
        goto error;
    if (!lowered_holds(&counts, q, planned)) {
        unqueue_event(queue);  /* (a finalizer changed the EP since the plan: wr.py works it out again) */
        goto done;
    }
    /* taken from here, by steps that allocate nothing: the counts, then the suppressed sends
     * before it and its own entry, which are held (counts.held, head) until all is taken: their
     * release may run a finalizer (a cookie's) that posts on, or resets, this EP */
    lowered_set(&counts);
    pop_head(q, retire + 1);
    taken = 1;
    goto done;
error:
    taken = -1;
done:
    lowered_clear(&counts);
    Py_XDECREF(q); Py_XDECREF(quiet); Py_XDECREF(head); Py_XDECREF(event); Py_XDECREF(planned);
    return taken;
}

/* The EVDs whose polled completions C is taking now (queue_events): a finalizer the take runs (a
 * collection started by an allocation, a retired entry's cookie let go) may look at, wait on or
 * drain the same EVD, which must then leave the CQ alone: a poll would write over the array the
 * take reads (C's look refuses them, common_cq; Python's drain asks taking(evd)).  Noted here by
 * identity, not as an attribute of the EVD: an attribute set and cleared around every take and
 * read by every look cost about 5% of the callback ping-pong's round trip (three attribute
 * operations of the generic kind per look, ~1,200 instructions, where a look with its
 * completion's take is ~9,000).  Python's own takes (evd._taking) have their backlog noted
 * meanwhile (evd._backlog), which C's look refuses already.  A set, not a stack: with the GIL
 * let go in a finalizer another thread's take may begin and end inside this one's. */
#define MAX_TAKING 32
static PyObject *taking_now[MAX_TAKING];  /* (borrowed: each take's caller holds its EVD) */
static int n_taking;

static int taking_in(PyObject *evd)
{
    for (int k = 0; k < n_taking; k++)
        if (taking_now[k] == evd)
            return 1;
    return 0;
}

/* 1: noted; 0: no room (32 takes under way: the caller leaves the completions to Python) */
static int taking_begin(PyObject *evd)
{
    if (n_taking == MAX_TAKING)
        return 0;
    taking_now[n_taking++] = evd;
    return 1;
}

static void taking_end(PyObject *evd)
{
    for (int k = n_taking - 1; k >= 0; k--)
        if (taking_now[k] == evd) {
            taking_now[k] = taking_now[--n_taking];
            return;
        }
}

/* taking(evd) -> bool: C is taking polled completions of evd now */
static PyObject *taking(PyObject *self, PyObject *evd)
{
    return PyBool_FromLong(taking_in(evd));
}

/* The completions wcs[taken:count] are polled and not taken: they are the EVD's backlog
 * (evd._wc_next, evd._backlog), which the next drain takes first, in Python.  Both are ints of
 * at most 64, which Python caches: setting them allocates nothing. */
static void note_backlog(PyObject *evd, int taken, int count)
{
    PyObject *next = PyLong_FromLong(taken), *end = PyLong_FromLong(count);
    if (next == NULL || end == NULL || PyObject_SetAttr(evd, s_wc_next, next) < 0
        || PyObject_SetAttr(evd, s_backlog, end) < 0)
        drop_error();
    Py_XDECREF(next); Py_XDECREF(end);
}

/* Turn the leading common-case completions of wcs[0:count] into events appended to queue;
 * returns how many were taken, and sets *notified when any was.  Never raises: whatever failed,
 * Python meets it again on the same completion. */
static int queue_events(PyObject *evd, const struct aiodat_wc *wcs, int count, PyObject *refs, PyObject *queue,
                        int *notified)
{
    int i;
    uint32_t last_qpn = 0;
    PyObject *ep = NULL;  /* the EP of last_qpn, held while it is used */
    *notified = 0;
    if (!taking_begin(evd)) {  /* (32 takes under way already: this one is left to Python's path) */
        note_backlog(evd, 0, count);
        return 0;
    }
    for (i = 0; i < count; i++) {
        const struct aiodat_wc *wc = &wcs[i];
        if (wc->status != 0)
            break;  /* failures: wr.py */
        if (i == 0 || wc->qp_num != last_qpn) {
            last_qpn = wc->qp_num;
            PyObject *key = PyLong_FromUnsignedLong(wc->qp_num);
            if (key == NULL)
                break;
            PyObject *ref = PyDict_GetItemWithError(refs, key);
            Py_DECREF(key);
            /* this EP is taken (borrowed, then held) before the last one is let go: its finalizer may
             * run Python that changes the table ref is borrowed from */
            PyObject *next = ref ? PyWeakref_GetObject(ref) : NULL;
            if (next == Py_None)
                next = NULL;
            if (next == NULL && PyErr_Occurred())
                break;
            Py_XINCREF(next);
            PyObject *last = ep;
            ep = next;
            Py_XDECREF(last);
        }
        if (ep == NULL)
            continue;  /* the EP is gone: its completion makes no event (as in evd.py) */
        if (common_event(evd, ep, wc, queue) <= 0)
            break;
        *notified = 1;
    }
    Py_XDECREF(ep);  /* (a finalizer it runs still finds the take under way) */
    /* Never raises (Python meets the same completion again), but a Ctrl-C that a signal handler
     * raised in here (any Python run on the way) is not lost: it comes again at the next check */
    if (PyErr_Occurred())
        drop_error();
    if (i < count)
        note_backlog(evd, i, count);  /* (noted first: the backlog then keeps any drain off wcs) */
    taking_end(evd);
    return i;
}

/* queue_common's answers (taken, notified) for a batch of up to 64, made once: a call (a batch
 * of one, mostly) allocates none */
#define MAX_ANSWER 64
static PyObject *answers[MAX_ANSWER + 1][2];

/* queue_common(evd, wcs_address, count, qpn_refs, queue) -> (taken, notified) */
static PyObject *queue_common(PyObject *self, PyObject *args)
{
    PyObject *evd, *refs, *queue;
    unsigned long long address;
    int count, notified;
    if (!PyArg_ParseTuple(args, "OKiO!O", &evd, &address, &count, &PyDict_Type, &refs, &queue))
        return NULL;
    if (event_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._completions is not configured");
        return NULL;
    }
    int taken = queue_events(evd, (const struct aiodat_wc *)(uintptr_t)address, count, refs, queue, &notified);
    /* (the caller noted them all as its backlog: what is left of it is noted on the EVD, not only
     * returned, as the tuple below may fail to be made; an object that is no EVD has none) */
    if (taken == count && count > 0 && PyObject_SetAttr(evd, s_backlog, s_zero) < 0)
        drop_error();
    if (taken >= 0 && taken <= MAX_ANSWER) {
        PyObject *answer = answers[taken][notified != 0];
        Py_INCREF(answer);
        return answer;
    }
    return Py_BuildValue("(ii)", taken, notified);
}

/* After a poll of got completions into wcs: queue the events of the common ones.  1 when an event
 * that notifies arrived, 0 when none did; -2: completions were polled that Python must finish (a
 * failed poll, a full batch, or one C did not take): evd._polled is (got, taken, notified); -1: an
 * error (the polled completions stay in wcs: Python raises). */
static int queue_or_leave(PyObject *evd, PyObject *queue, unsigned long long wcs, int got)
{
    int taken = 0, notified = 0;
    if (got > 0) {
        PyObject *refs = PyObject_GetAttr(evd, s_qpn_refs);
        if (refs != NULL && PyDict_Check(refs)) {  /* (queue_events notes the take under way: taking_now) */
            taken = queue_events(evd, (struct aiodat_wc *)(uintptr_t)wcs, got, refs, queue, &notified);
        } else {  /* (all of them Python's; the error of a failed lookup is kept across the note) */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            note_backlog(evd, 0, got);
            PyErr_Restore(type, value, tb);
        }
        if (refs == NULL)
            return -1;
        Py_DECREF(refs);
    }
    if (got >= 0 && taken == got && got < 64)
        return notified;
    PyObject *polled = Py_BuildValue("(iii)", got, taken, notified);
    int rc = polled != NULL && PyObject_SetAttr(evd, s_polled, polled) == 0 ? -2 : -1;
    Py_XDECREF(polled);
    return rc;
}

/* What a look, the wake-up's drain and the poller's arm read of an EVD, in the common case that C
 * takes: open, with a CQ, no backlog, no awaited request, no take under way (taking_in); for a drain (``draining``: it reads the
 * channel or arms), also no solicited wait or arm.  1 with the addresses, the room in the queue
 * (at most 64) and a new reference to the queue; 0: Python's path (EVD._poll_rest, EVD._drain_cq);
 * -1: an error. */
struct evd_cq {
    unsigned long long cq, wcs, channel, status;
    int room;
    PyObject *queue;
};

static int common_cq(PyObject *evd, struct evd_cq *out, int draining)
{
    /* (a truth that could not be read ends the chain with its exception set: checked below) */
    int plain = attr_true(evd, s_closed) == 0 && attr_true(evd, s_backlog) == 0 && attr_true(evd, s_awaited) == 0
                && !taking_in(evd)  /* (a finalizer run by C's take: it must not poll into wcs; a Python take has a backlog) */
                && (!draining || (attr_true(evd, s_solicited) == 0 && attr_true(evd, s_armed_solicited) == 0));
    unsigned long long qlen;
    if (plain && (attr_ull(evd, s_cq_address, &out->cq) < 0 || attr_ull(evd, s_wcs_address, &out->wcs) < 0
                  || attr_ull(evd, s_qlen, &qlen) < 0
                  || (draining && (attr_ull(evd, s_channel_address, &out->channel) < 0
                                   || attr_ull(evd, s_status_address, &out->status) < 0))))
        return -1;
    if (PyErr_Occurred())
        return -1;
    if (!plain || !out->cq || !out->wcs || (draining && (!out->channel || !out->status)))
        return 0;
    out->queue = PyObject_GetAttr(evd, s_queue);
    Py_ssize_t queued = out->queue ? PyObject_Length(out->queue) : -1;
    if (queued < 0) {
        Py_CLEAR(out->queue);
        return -1;
    }
    long long room = (long long)qlen - queued;
    out->room = room <= 0 ? 0 : room > 64 ? 64 : (int)room;
    return 1;
}

/* look(evd) -> 1, 0, -1 or -2: EVD._poll's common case (evd.py).  It polls the EVD's CQ through
 * the shim's own aiodat_cq_poll (so the shim's fault injection still applies) and queues what
 * came: 1 when an event that notifies arrived, 0 when none did.  -1: not the common case
 * (closed, a backlog, an awaited request): nothing was polled and Python looks instead.  -2:
 * completions were polled that Python must finish (a failed poll, a full batch, or one C did
 * not take): evd._polled is (got, taken, notified). */
static PyObject *look(PyObject *self, PyObject *evd)
{
    if (poll_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._completions is not configured");
        return NULL;
    }
    struct evd_cq c = {0};
    int common = common_cq(evd, &c, 0);
    if (common <= 0)
        return common < 0 ? NULL : PyLong_FromLong(-1);
    PyObject *result;
    if (c.room == 0) {
        result = PyLong_FromLong(0);
    } else {
        int got = poll_fn((struct ibv_cq *)(uintptr_t)c.cq, (struct aiodat_wc *)(uintptr_t)c.wcs, c.room);
        int found = queue_or_leave(evd, c.queue, c.wcs, got);
        result = found == -1 ? NULL : PyLong_FromLong(found);
    }
    Py_DECREF(c.queue);
    return result;
}


/* Call evd.<method>(before, exc) or evd.<method>(exc, after) with the exception being raised;
 * 0 when the method took it, -1 with an exception set when it raised. */
static int hand_raised(PyObject *evd, PyObject *method, PyObject *before, PyObject *after)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *res = before
        ? PyObject_CallMethodObjArgs(evd, method, before, value, NULL)
        : PyObject_CallMethodObjArgs(evd, method, value, after, NULL);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* hand_raised, if the exception being raised is an Exception (else leave it raised: -1). */
static int hand_exception(PyObject *evd, PyObject *method, PyObject *before, PyObject *after)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;  /* KeyboardInterrupt and the like go on up, as from the Python path */
    return hand_raised(evd, method, before, after);
}

/* Empty the queue whose events were copied out (there is room again: the next overflow is
 * reported).  0, or -1 with the queue as it was. */
static int taken_all(PyObject *evd, PyObject *queue)
{
    if (PyObject_SetAttr(evd, s_overflow_reported, Py_False) < 0)
        return -1;
    PyObject *cleared = PyObject_CallMethodObjArgs(queue, s_clear, NULL);  /* (allocates nothing) */
    Py_XDECREF(cleared);
    return cleared == NULL ? -1 : 0;
}

/* EVD._take(None): every queued event, as a new list; the queue is empty afterwards.  Raises
 * with the queue as it was: the list is made before anything is taken. */
static PyObject *take_all(PyObject *evd, PyObject *queue)
{
    PyObject *events = PySequence_List(queue);
    if (events != NULL && taken_all(evd, queue) < 0)
        Py_CLEAR(events);
    return events;
}

/* EVD._deliver: every queued event to the callback fn, once. */
static int deliver(PyObject *evd, PyObject *fn, PyObject *queue)
{
    PyObject *events = take_all(evd, queue);
    if (events == NULL)
        return -1;
    PyObject *res = PyObject_CallFunctionObjArgs(fn, events, NULL);
    Py_DECREF(events);
    if (res != NULL) {
        Py_DECREF(res);
        return 0;
    }
    /* as asyncio's own callbacks, anything but SystemExit and KeyboardInterrupt goes to the loop's
     * handler (EVD._deliver): a CancelledError from fn going on up would leave the CQ unarmed
     * with nobody polling it, and the EVD deaf */
    if (PyErr_ExceptionMatches(PyExc_SystemExit) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        return -1;
    return hand_raised(evd, s_callback_raised, fn, NULL);
}

/* Whether a drain's end may wake the waiting task: an event that notifies came, or the queue is
 * full (UNSIGNALLED completions that meet the wait's threshold notify no one, and with no room
 * the completion that would cannot leave the CQ).  1, 0, or -1 with an exception set.  (Python's
 * twin: EVD._wake_due.) */
static int wake_due(PyObject *evd, PyObject *queue, int notified)
{
    if (notified)
        return 1;
    unsigned long long qlen;
    Py_ssize_t queued = PyObject_Length(queue);
    if (queued <= 0)
        return (int)queued;  /* (the poller's idle look: nothing queued, no qlen to read) */
    if (attr_ull(evd, s_qlen, &qlen) < 0)
        return -1;
    return (unsigned long long)queued >= qlen;
}

/* 1 when fut's loop is closed, 0 when not, -1 when that cannot be told (the exception being
 * handled is kept either way) */
static int loop_of_is_closed(PyObject *fut)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *fut_loop = PyObject_CallMethod(fut, "get_loop", NULL);
    PyObject *closed = fut_loop ? PyObject_CallMethod(fut_loop, "is_closed", NULL) : NULL;
    int is_closed = closed ? PyObject_IsTrue(closed) : -1;
    Py_XDECREF(closed); Py_XDECREF(fut_loop);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return is_closed;
}

/* EVD._wake() with no exception: complete the waiting task's future if the wait is satisfied. */
static int wake(PyObject *evd, PyObject *queue)
{
    PyObject *fut = PyObject_GetAttr(evd, s_waiter);
    if (fut == NULL)
        return -1;
    int rc = 0;
    if (fut != Py_None) {
        PyObject *done = PyObject_CallMethodObjArgs(fut, s_done, NULL);
        int is_done = done ? PyObject_IsTrue(done) : -1;
        Py_XDECREF(done);
        int satisfied = -1;
        if (is_done == 0) {
            unsigned long long threshold;
            Py_ssize_t queued = PyObject_Length(queue);
            if (queued >= 0 && attr_ull(evd, s_threshold, &threshold) == 0) {
                satisfied = (unsigned long long)queued >= threshold;
                if (!satisfied) {
                    satisfied = attr_true(evd, s_solicited);
                    if (satisfied == 1)
                        satisfied = attr_true(evd, s_solicited_hit);
                }
            }
        }
        if (is_done < 0 || (is_done == 0 && satisfied < 0)) {
            rc = -1;
        } else if (is_done == 0 && satisfied) {
            PyObject *res = PyObject_CallMethodObjArgs(fut, s_set_result, Py_None, NULL);
            rc = res ? 0 : -1;
            Py_XDECREF(res);
            if (rc < 0 && PyErr_ExceptionMatches(PyExc_RuntimeError) && loop_of_is_closed(fut) == 1) {
                PyErr_Clear();  /* a waiter of a loop since closed: nobody to wake, as EVD._wake */
                rc = 0;
            }
        }
    }
    Py_DECREF(fut);
    return rc;
}

/* EVD._hand_over: after a look, deliver to the callback or wake the waiting task. */
static int hand_over(PyObject *evd, int notified)
{
    if (notified) {
        unsigned long long busy_us;
        if (attr_ull(evd, s_busy_poll_us, &busy_us) < 0)
            return -1;
        if (busy_us) {  /* time.monotonic() is CLOCK_MONOTONIC */
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            PyObject *until = PyFloat_FromDouble((double)now.tv_sec + now.tv_nsec * 1e-9 + busy_us * 1e-6);
            int err = until == NULL || PyObject_SetAttr(evd, s_busy_until, until) < 0;
            Py_XDECREF(until);
            if (err)
                return -1;
        }
    }
    PyObject *fn = PyObject_GetAttr(evd, s_callback), *queue = fn ? PyObject_GetAttr(evd, s_queue) : NULL;
    int rc = -1;
    if (queue != NULL) {
        if (fn != Py_None) {
            Py_ssize_t queued = PyObject_Length(queue);
            rc = queued < 0 ? -1 : queued ? deliver(evd, fn, queue) : 0;
        } else {
            int due = wake_due(evd, queue, notified);
            rc = due < 0 ? -1 : due ? wake(evd, queue) : 0;
        }
    }
    Py_XDECREF(fn); Py_XDECREF(queue);
    return rc;
}

/* EVD._poll_rest(found): Python finishes a look that C left to it (found: -1 or -2, see look).
 * 1 (an event that notifies came), 0, or -1 with an exception set. */
static int poll_rest(PyObject *evd, long found)
{
    PyObject *arg = PyLong_FromLong(found);
    PyObject *res = arg ? PyObject_CallMethodObjArgs(evd, s_poll_rest, arg, NULL) : NULL;
    Py_XDECREF(arg);
    int truth = res ? PyObject_IsTrue(res) : -1;
    Py_XDECREF(res);
    return truth;
}

/* EVD._poll in one call: C's look, and Python's _poll_rest for what the look left to it.
 * 1 (an event that notifies came), 0, or -1 with an exception set. */
static int poll_evd(PyObject *evd)
{
    PyObject *found = look(NULL, evd);
    long f = found ? PyLong_AsLong(found) : -1;
    Py_XDECREF(found);
    if (f == -1 && PyErr_Occurred())
        return -1;
    return f >= 0 ? f == 1 : poll_rest(evd, f);
}

/* The poller's look at an open EVD and its hand-over (EVD._napi_spin's, with no spin): 1 (an
 * event that notifies came), 0, or -1 with an exception that is not an Exception (any other
 * failure went to the EVD's _napi_failed, as in Python). */
static int napi_poll_evd(PyObject *evd)
{
    int notified = poll_evd(evd);
    if (notified < 0 || hand_over(evd, notified) < 0)
        return hand_exception(evd, s_napi_failed, NULL, s_polling_the_cq) < 0 ? -1 : 0;
    return notified;
}

/* Queue what a drain polled (got completions): C's common case, then Python's _poll_rest for
 * the rest (which goes on draining after a full batch).  1 (an event that notifies came), 0, or
 * -1 with an exception set. */
static int queue_drained(PyObject *evd, struct evd_cq *c, int got)
{
    if (got == 0)
        return 0;
    int found = queue_or_leave(evd, c->queue, c->wcs, got);
    return found >= -1 ? found : poll_rest(evd, found);
}

/* The poller arms an EVD's CQ (EVD._napi_arm): arm it, then poll what raced the arm, hand that
 * over, and when the arm failed let Python decide whether to try again.  The common case in C
 * (what EVD._drain_cq(rearm=False) does for an unarmed CQ, _note_arm's common case inline); any
 * other EVD goes to EVD._napi_arm.  1 (keep polling: the arm is tried again), 0, or -1 with an
 * exception that is not an Exception (any other failure went to the EVD's _napi_failed). */
static int napi_arm(PyObject *evd)
{
    struct evd_cq c = {0};
    int common = attr_true(evd, s_unarmed);
    if (common == 1)
        common = common_cq(evd, &c, 1);
    if (common <= 0) {
        PyErr_Clear();  /* (any doubt: the Python method, which says what went wrong) */
        PyObject *res = PyObject_CallMethodObjArgs(evd, s_napi_arm, NULL);
        int truth = res ? PyObject_IsTrue(res) : -1;
        Py_XDECREF(res);
        return truth;
    }
    int *status = (int *)(uintptr_t)c.status;  /* the EVD's own: _note_arm reads the errno there */
    int got = drain_fn(NULL, (struct ibv_cq *)(uintptr_t)c.cq, 0, (struct aiodat_wc *)(uintptr_t)c.wcs,
                       c.room, status);
    /* the arm is noted first, while status is the drain's (queueing a full batch may drain again,
     * into the same status) */
    int noted = 0;
    if (status[1]) {
        PyObject *res = PyObject_CallMethodObjArgs(evd, s_note_arm, Py_False, Py_False, NULL);
        noted = res ? 0 : -1;
        Py_XDECREF(res);
    } else {
        unsigned long long rearms;
        PyObject *more = NULL;
        if (attr_ull(evd, s_rearms, &rearms) < 0 || (more = PyLong_FromUnsignedLongLong(rearms + 1)) == NULL
            || PyObject_SetAttr(evd, s_rearms, more) < 0 || PyObject_SetAttr(evd, s_unarmed, Py_False) < 0)
            noted = -1;
        Py_XDECREF(more);
    }
    /* what was polled becomes events even when noting the arm failed (a KeyboardInterrupt in
     * _note_arm): that failure is held meanwhile, and reported rather than the queue's */
    PyObject *err_type = NULL, *err_value = NULL, *err_tb = NULL;
    if (noted < 0)
        PyErr_Fetch(&err_type, &err_value, &err_tb);
    int notified = queue_drained(evd, &c, got);
    Py_DECREF(c.queue);
    if (noted < 0) {
        if (notified < 0)
            PyErr_Clear();
        PyErr_Restore(err_type, err_value, err_tb);
        notified = -1;
    }
    if ((notified < 0 || hand_over(evd, notified) < 0)
        && hand_exception(evd, s_napi_failed, NULL, s_polling_the_cq) < 0)
        return -1;
    int unarmed = attr_true(evd, s_unarmed);
    if (unarmed == 0)
        return PyObject_SetAttr(evd, s_arm_retried, Py_False) < 0 ? -1 : 0;
    PyObject *res = unarmed == 1 ? PyObject_CallMethodObjArgs(evd, s_napi_arm_retry, NULL) : NULL;
    int truth = res ? PyObject_IsTrue(res) : -1;
    Py_XDECREF(res);
    return truth;
}

/* hot[evd] = value */
static int set_turns(PyObject *hot, PyObject *evd, long value)
{
    PyObject *v = PyLong_FromLong(value);
    int rc = v ? PyDict_SetItem(hot, evd, v) : -1;
    Py_XDECREF(v);
    return rc;
}

/* sweep(hot, idle_turns) -> (found_any, callbacks, rest, idle): the first pass of the poller's turn
 * over hot (EVD -> turns in a row with nothing found).  Drops closed EVDs, looks at each other
 * one, counts its idle turns, and returns those whose fate is decided after the looks: the EVDs
 * that busy-poll (rest, Python's Poller._decide) and the others idle for idle_turns turns (idle,
 * armed by the turn). */
static PyObject *sweep(PyObject *self, PyObject *args)
{
    PyObject *hot;
    int idle_turns;
    if (!PyArg_ParseTuple(args, "O!i", &PyDict_Type, &hot, &idle_turns))
        return NULL;
    PyObject *evds = PyDict_Keys(hot), *rest = PyList_New(0), *idle_ones = PyList_New(0), *result = NULL;
    int found_any = 0, callbacks = 0;
    if (evds == NULL || rest == NULL || idle_ones == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < PyList_Size(evds); i++) {
        PyObject *evd = PyList_GetItem(evds, i);  /* (borrowed: evds holds it) */
        int closed = attr_true(evd, s_closed);
        if (closed < 0)
            goto out;
        if (closed) {
            if (PyDict_DelItem(hot, evd) < 0) {
                if (!PyErr_ExceptionMatches(PyExc_KeyError))
                    goto out;
                PyErr_Clear();  /* (already discarded by its free) */
            }
            continue;
        }
        int found = napi_poll_evd(evd);
        if (found < 0)
            goto out;
        int still = PyDict_Contains(hot, evd);
        if (still < 0)
            goto out;
        if (found) {
            found_any = 1;
            if (still && set_turns(hot, evd, 0) < 0)
                goto out;
            PyObject *fn = PyObject_GetAttr(evd, s_callback);
            if (fn == NULL)
                goto out;
            callbacks |= fn != Py_None;
            Py_DECREF(fn);
            continue;
        }
        PyObject *turns = still ? PyDict_GetItemWithError(hot, evd) : NULL;  /* (borrowed) */
        if (turns == NULL) {
            if (PyErr_Occurred())
                goto out;
            continue;  /* freed by a callback in this turn */
        }
        long idle = PyLong_AsLong(turns);
        unsigned long long busy_us;
        if ((idle == -1 && PyErr_Occurred()) || attr_ull(evd, s_busy_poll_us, &busy_us) < 0)
            goto out;
        if (!busy_us && idle + 1 < idle_turns) {
            if (set_turns(hot, evd, idle + 1) < 0)
                goto out;
        } else if (PyList_Append(busy_us ? rest : idle_ones, evd) < 0) {  /* its turn is counted later */
            goto out;
        }
    }
    result = Py_BuildValue("(OOOO)", found_any ? Py_True : Py_False, callbacks ? Py_True : Py_False, rest, idle_ones);
out:
    Py_XDECREF(evds); Py_XDECREF(rest); Py_XDECREF(idle_ones);
    return result;
}


/* After a callback ran in the poller's turn: look again at the EVDs with a callback, up to passes - 1
 * times while something comes (a callback may have posted, and on one device the peer's completion
 * may be there already; a woken task runs only at the next turn).  0, or -1 with an exception. */
static int look_again(PyObject *hot, int passes)
{
    for (int pass = 1; pass < passes; pass++) {
        int again = 0;
        PyObject *evds = PyDict_Keys(hot);
        if (evds == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < PyList_Size(evds); i++) {
            PyObject *evd = PyList_GetItem(evds, i);  /* (borrowed: evds holds it) */
            int plain = attr_is(evd, s_callback, Py_None), closed = plain == 0 ? attr_true(evd, s_closed) : 0;
            int found = plain == 0 && closed == 0 ? napi_poll_evd(evd) : 0;
            int still = found > 0 ? PyDict_Contains(hot, evd) : 0;
            if (plain < 0 || closed < 0 || found < 0 || still < 0 || (still && set_turns(hot, evd, 0) < 0)) {
                Py_DECREF(evds);
                return -1;
            }
            again |= found;
        }
        Py_DECREF(evds);
        if (!again)
            break;
    }
    return 0;
}

/* The poller's next turn: loop.call_soon(poller._turn), unless the loop is closed.  1 (scheduled),
 * 0 (the loop is closed), -1 (an error). */
static int schedule_turn(PyObject *poller, PyObject *loop)
{
    PyObject *closed = PyObject_CallMethodObjArgs(loop, s_is_closed, NULL);
    int is_closed = closed ? PyObject_IsTrue(closed) : -1;
    Py_XDECREF(closed);
    if (is_closed != 0)
        return is_closed < 0 ? -1 : 0;
    PyObject *next = PyObject_GetAttr(poller, s_turn);
    PyObject *handle = next ? PyObject_CallMethodObjArgs(loop, s_call_soon, next, NULL) : NULL;
    Py_XDECREF(next);
    if (handle == NULL || PyObject_SetAttr(poller, s_scheduled, Py_True) < 0) {
        Py_XDECREF(handle);
        return -1;
    }
    Py_DECREF(handle);
    return 1;
}

/* After the looks of a turn: count this turn for the EVDs that were idle for idle_turns turns in
 * the sweep, and arm those still idle (Poller._decide's plain case); one whose arm failed stays,
 * to be tried again.  0, or -1 with an exception. */
static int arm_idle(PyObject *hot, PyObject *idle_ones, int idle_turns)
{
    for (Py_ssize_t i = 0; i < PyList_Size(idle_ones); i++) {
        PyObject *evd = PyList_GetItem(idle_ones, i);  /* (borrowed: the list holds it) */
        PyObject *turns = PyDict_GetItemWithError(hot, evd);  /* (borrowed) */
        if (turns == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;  /* freed by a callback in this turn */
        }
        long idle = PyLong_AsLong(turns) + 1;  /* (a look again may have found something: 0) */
        if (idle == 0 && PyErr_Occurred())
            return -1;
        if (idle < idle_turns) {
            if (set_turns(hot, evd, idle) < 0)
                return -1;
            continue;
        }
        if (PyDict_DelItem(hot, evd) < 0)
            return -1;
        int again = napi_arm(evd);
        if (again < 0 || (again && set_turns(hot, evd, 0) < 0))
            return -1;
    }
    return 0;
}

/* turn(poller, idle_turns, passes): one turn of the loop's poller (Poller._turn): the sweep above,
 * the looks again after callbacks, the arms of the EVDs that stayed idle, then Poller._decide for
 * the EVDs that busy-poll only when there are any, then the next turn's call_soon while the
 * poller holds EVDs.  A turn so runs no Python of the poller unless an EVD busy-polls. */
static PyObject *turn(PyObject *self, PyObject *args)
{
    PyObject *poller;
    int idle_turns, passes;
    if (!PyArg_ParseTuple(args, "Oii", &poller, &idle_turns, &passes))
        return NULL;
    if (PyObject_SetAttr(poller, s_scheduled, Py_False) < 0)
        return NULL;
    PyObject *hot = PyObject_GetAttr(poller, s_hot), *swept = NULL, *result = NULL;
    if (hot == NULL)
        return NULL;
    PyObject *sweep_args = Py_BuildValue("(Oi)", hot, idle_turns);
    swept = sweep_args ? sweep(NULL, sweep_args) : NULL;
    Py_XDECREF(sweep_args);
    if (swept == NULL)
        goto out;
    PyObject *callbacks = PyTuple_GetItem(swept, 1), *rest = PyTuple_GetItem(swept, 2);  /* (borrowed) */
    PyObject *idle_ones = PyTuple_GetItem(swept, 3);
    if (callbacks == NULL || rest == NULL || idle_ones == NULL)
        goto out;
    if (callbacks == Py_True && look_again(hot, passes) < 0)
        goto out;
    if (arm_idle(hot, idle_ones, idle_turns) < 0)
        goto out;
    if (PyList_Size(rest) > 0) {
        PyObject *res = PyObject_CallMethodObjArgs(poller, s_decide, PyTuple_GetItem(swept, 0), rest, NULL);
        if (res == NULL)
            goto out;
        Py_DECREF(res);
    }
    /* the next turn, while the poller holds EVDs (Poller._schedule_next) */
    Py_ssize_t held = PyDict_Size(hot);
    int scheduled = held > 0 ? attr_true(poller, s_scheduled) : 1;
    if (scheduled < 0)
        goto out;
    if (!scheduled) {
        PyObject *loop = PyObject_GetAttr(poller, s_loop);
        int rc = loop ? schedule_turn(poller, loop) : -1;
        Py_XDECREF(loop);
        if (rc < 0)
            goto out;
    }
    Py_INCREF(Py_None);
    result = Py_None;
out:
    Py_XDECREF(swept);
    Py_DECREF(hot);
    return result;
}

/* Hand an unarmed EVD to its loop's poller (EVD._napi_add, Poller.add): a wake-up's, or a wait's
 * about to sleep on an EVD that is unarmed or busy-polls.  Done here when the EVD's poller is the
 * loop's and it does not busy-poll: the poller holds it from its next turn on, which is scheduled
 * if it is not yet; anything else (the first hand-over, a closed loop, busy polling) is the Python
 * method's. */
static int napi_add(PyObject *evd, PyObject *loop, unsigned long long busy_us)
{
    int held = 0;
    PyObject *poller = busy_us ? NULL : PyObject_GetAttr(evd, s_poller);
    if (poller != NULL && poller != Py_None) {
        PyObject *hot = PyObject_GetAttr(poller, s_hot);
        if (hot != NULL && PyDict_Check(hot) && attr_is(poller, s_loop, loop) == 1) {
            int in = PyDict_Contains(hot, evd);
            if (in == 0)
                in = set_turns(hot, evd, 0) == 0;
            int scheduled = in == 1 ? attr_true(poller, s_scheduled) : -1;
            held = scheduled == 1 || (scheduled == 0 && schedule_turn(poller, loop) == 1);
        }
        Py_XDECREF(hot);
    }
    Py_XDECREF(poller);
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
        return -1;  /* a KeyboardInterrupt (asyncio's loop methods are Python): raised, not lost */
    PyErr_Clear();  /* (any doubt: the Python method, which says what went wrong) */
    if (held)
        return 0;
    PyObject *res = PyObject_CallMethodObjArgs(evd, s_napi_add, NULL);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

/* How many times a callback EVD's wake-up looks at the CQ again after delivering (the module's
 * CALLBACK_ROUNDS: evd.py's Python path reads it there) */
#define CALLBACK_ROUNDS 8

/* The rest of a wake-up after its drain: deliver to the callback and look again while the
 * callback's own posts keep completions coming (up to CALLBACK_ROUNDS looks), or wake the waiting
 * task.  notified: what the drain found.  1, 0, or -1 with an exception set. */
static int wakeup_hand_over(PyObject *evd, PyObject *queue, int notified)
{
    PyObject *fn = PyObject_GetAttr(evd, s_callback);
    if (fn == NULL)
        return -1;
    if (fn == Py_None) {
        Py_DECREF(fn);
        int due = wake_due(evd, queue, notified);
        return due < 0 ? -1 : due ? wake(evd, queue) : 0;
    }
    for (int round = 0; round < CALLBACK_ROUNDS; round++) {
        Py_ssize_t queued = PyObject_Length(queue);
        if (queued < 0 || (!notified && !queued))
            break;
        if (queued && deliver(evd, fn, queue) < 0) {
            queued = -1;
            break;
        }
        Py_DECREF(fn);
        fn = PyObject_GetAttr(evd, s_callback);  /* (the callback may have changed or freed its EVD) */
        int closed = fn != NULL && fn != Py_None ? attr_true(evd, s_closed) : 1;
        if (closed)
            break;
        notified = poll_evd(evd);
        if (notified <= 0)
            break;
    }
    Py_XDECREF(fn);
    return PyErr_Occurred() ? -1 : 0;
}

/* wakeup(evd): the loop's reader callback for an EVD's completion channel (EVD._on_readable), in
 * one call.  Its common case (see common_cq): read and ack the channel's event and drain the CQ
 * without arming it (the next sleeper arms: EVD._drain_cq's lazy case), deliver to the callback or
 * wake the waiting task, then hand the unarmed CQ to the loop's poller.  Anything else is
 * EVD._woken's, the same in Python.  Never raises an Exception: failures go to the EVD's
 * _napi_failed (the callback's on_error, or the waiting task). */
static PyObject *wakeup(PyObject *self, PyObject *evd)
{
    struct evd_cq c = {0};
    int common = common_cq(evd, &c, 1);
    if (common <= 0) {
        PyErr_Clear();  /* (any doubt: the Python path, which says what went wrong) */
        return PyObject_CallMethodObjArgs(evd, s_woken, NULL);
    }
    /* the wake-up consumes the arm: whoever sleeps next arms first.  Noted before the drain (no
     * Python runs between): a failure after the poll would drop what it polled (no backlog is
     * noted), one before it polls nothing, and the unread channel event wakes the loop again */
    int notified = PyObject_SetAttr(evd, s_unarmed, Py_True) < 0 || PyObject_SetAttr(evd, s_arm_error, Py_None) < 0
                   ? -1 : 0;
    if (notified == 0) {
        int status[3];  /* (aiodat_cq_drain's: channel events read, arm errno, completions copied) */
        int got = drain_fn((struct ibv_comp_channel *)(uintptr_t)c.channel, (struct ibv_cq *)(uintptr_t)c.cq, -1,
                           (struct aiodat_wc *)(uintptr_t)c.wcs, c.room, status);
        notified = queue_drained(evd, &c, got);
    }
    if (notified >= 0)
        notified = wakeup_hand_over(evd, c.queue, notified);
    Py_DECREF(c.queue);
    /* a callback's SystemExit or KeyboardInterrupt goes on up, but after the hand-over below */
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (notified < 0 && hand_exception(evd, s_napi_failed, NULL, s_draining_the_cq) < 0)
        PyErr_Fetch(&et, &ev, &etb);
    /* the poller takes the unarmed CQ (also after a failure: it must be armed or polled) */
    int failed = 0;
    int unarmed = attr_true(evd, s_unarmed), closed = unarmed == 1 ? attr_true(evd, s_closed) : 1;
    if (unarmed < 0 || closed < 0)
        failed = 1;
    else if (!closed) {
        /* the loop watching its channel (none, or an attribute that failed: napi_add leaves it
         * to the Python method, which says what) */
        unsigned long long busy_us = 0;
        PyObject *watch = PyObject_GetAttr(evd, s_watch);
        PyObject *loop = watch && watch != Py_None ? PyObject_GetAttr(watch, s_loop) : NULL;
        if (loop == NULL || attr_ull(evd, s_busy_poll_us, &busy_us) < 0) {
            PyErr_Clear();
            Py_CLEAR(loop);
        }
        int rc = napi_add(evd, loop ? loop : Py_None, busy_us);
        Py_XDECREF(watch); Py_XDECREF(loop);
        failed = rc < 0;
    }
    if (et != NULL) {
        if (failed)
            PyErr_Clear();
        PyErr_Restore(et, ev, etb);
        return NULL;
    }
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* the loop's running task: configure_waits() sets it; NULL: no wait records its task, none spins */
static PyObject *task_of;

/* Task.cancelling() as a truth value: 1 (being cancelled), 0, or -1 (an error) */
static int task_cancelling(PyObject *task)
{
    PyObject *count = PyObject_CallMethodObjArgs(task, s_cancelling, NULL);
    int cancelling = count ? PyObject_IsTrue(count) : -1;
    Py_XDECREF(count);
    return cancelling;
}

/* The EVD's waiter (not None) no longer waits: 1, it still does: 0, an error: -1 (EVD._waited's
 * test).  A wait sleeping, spinning, or woken and not run again yet still waits (the events are
 * the woken wait's until it takes them).  It is gone once its Future is cancelled, or its task is
 * being cancelled (a spinning wait awaits no Future, a woken one's is done: its task raises
 * CancelledError and takes nothing), or its loop is closed (its task never runs again). */
static int waiter_gone(PyObject *evd, PyObject *waiter)
{
    PyObject *cancelled = PyObject_CallMethodObjArgs(waiter, s_cancelled, NULL);
    int gone = cancelled ? PyObject_IsTrue(cancelled) : -1;
    Py_XDECREF(cancelled);
    if (gone != 0)
        return gone;
    PyObject *loop = PyObject_CallMethodObjArgs(waiter, s_get_loop, NULL);
    PyObject *closed = loop ? PyObject_CallMethodObjArgs(loop, s_is_closed, NULL) : NULL;
    gone = closed ? PyObject_IsTrue(closed) : -1;
    Py_XDECREF(closed);
    Py_XDECREF(loop);
    if (gone != 0)
        return gone;
    PyObject *task = PyObject_GetAttr(evd, s_waiter_task);
    if (task == NULL)
        return -1;
    if (task != Py_None)
        gone = task_cancelling(task);
    Py_DECREF(task);
    return gone;
}

/* The task a wait beginning in loop records (EVD._task_of_wait's twin): the running task, or None
 * when it is being cancelled already (a clean-up that waits, a cancel it swallowed: its wait would
 * count as gone from its start) or none can be told (task_of NULL).  A new reference; NULL: an
 * error. */
static PyObject *waiting_task(PyObject *loop)
{
    if (task_of == NULL)
        Py_RETURN_NONE;
    PyObject *task = PyObject_CallFunctionObjArgs(task_of, loop, NULL);
    if (task == NULL || task == Py_None)
        return task;
    int cancelling = task_cancelling(task);
    if (cancelling == 0)
        return task;
    Py_DECREF(task);
    if (cancelling < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The checks of EVD.wait that let the common case through: 1 (go on), 0 (Python's general path),
 * -1 (an error). */
static int can_wait_here(PyObject *evd, long threshold, PyObject *timeout, PyObject *loop)
{
    unsigned long long qlen;
    if (threshold < 1 || attr_ull(evd, s_qlen, &qlen) < 0 || (unsigned long long)threshold > qlen)
        return PyErr_Occurred() ? -1 : 0;
    if (timeout != Py_None) {
        if (!PyFloat_CheckExact(timeout) && !PyLong_CheckExact(timeout))
            return 0;
        double seconds = PyFloat_AsDouble(timeout);
        if (seconds == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();  /* (too large an int: Python's path says what it thinks of it) */
            return 0;
        }
        if (!(seconds >= 0))
            return 0;
    }
    int ok = attr_true(evd, s_closed) == 0 && attr_is(evd, s_callback, Py_None) == 1
             && attr_is(evd, s_pending_error, Py_None) == 1 && attr_true(evd, s_armed_solicited) == 0
             && attr_true(evd, s_solicited) == 0 && attr_true(evd, s_sharers) == 0
             && attr_is(evd, s_attached_loop, loop) == 1;
    if (!ok)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *waiter = PyObject_GetAttr(evd, s_waiter);
    if (waiter == NULL)
        return -1;
    int free = waiter == Py_None ? 1 : waiter_gone(evd, waiter);
    Py_DECREF(waiter);
    return free;
}

/* A spinning wait's look, once per turn of the loop (Spin, below).  While the EVD's CQ is
 * unarmed, the loop's poller holds it, so the waiting task yields its turn (a bare yield: no
 * Future to complete and no wake-up to schedule) and looks itself: after a task that ran before it
 * in the same turn posted, the peer's completion is already there.  The look and its hand-over
 * are the poller's (they complete fut when the wait is satisfied); one that found something
 * renews the poller's count of idle turns, which arms the CQ when nothing comes.  1: not done and
 * the CQ still unarmed (yield and look again); 0: await fut (done, or sleeping until the channel
 * wakes it); -1: an error. */
static int spin_look(PyObject *evd, PyObject *fut)
{
    PyObject *done = PyObject_CallMethodObjArgs(fut, s_done, NULL);
    int stop = done ? PyObject_IsTrue(done) : -1;
    Py_XDECREF(done);
    if (stop == 0)
        stop = attr_true(evd, s_closed);
    if (stop != 0)
        return stop < 0 ? -1 : 0;
    int found = napi_poll_evd(evd);
    if (found < 0)
        return -1;
    if (found) {
        PyObject *poller = PyObject_GetAttr(evd, s_poller);
        PyObject *hot = poller && poller != Py_None ? PyObject_GetAttr(poller, s_hot) : NULL;
        int held = hot != NULL && PyDict_Check(hot) ? PyDict_Contains(hot, evd) : 0;
        int err = held < 0 || (held == 1 && set_turns(hot, evd, 0) < 0);
        Py_XDECREF(hot); Py_XDECREF(poller);
        if (err || PyErr_Occurred())
            return -1;
    }
    done = PyObject_CallMethodObjArgs(fut, s_done, NULL);
    stop = done ? PyObject_IsTrue(done) : -1;
    Py_XDECREF(done);
    if (stop == 0)
        stop = !attr_true(evd, s_unarmed);  /* (-1 -> 0 with the exception set: checked below) */
    return PyErr_Occurred() ? -1 : !stop;
}

/* The rest of a wait that wait_begin began: ``await`` it for the events.  It spins first when
 * wait_begin found the CQ with the poller (see spin_look): it yields the turn at once (the wait
 * has just looked), then looks at each turn and yields again; then, unless the wait is satisfied,
 * it yields the Future as the Future's own __await__ does, and the task sleeps on it.  At the end
 * it frees the EVD for the next wait and returns the events taken (its StopIteration's value); a
 * failed wait raises the Future's exception, and the wait's Python calls abandon() on any way
 * out by an exception.  An iterator in C: a turn runs no Python frame but the awaiting one. */
typedef struct {
    PyObject_HEAD
    PyObject *evd, *fut;
    int state;  /* SPIN_FIRST, SPIN_LOOKING or SPIN_SLEEPING */
} Spin;

enum { SPIN_FIRST, SPIN_LOOKING, SPIN_SLEEPING };

static PyTypeObject *spin_type;

static PyObject *spin_make(PyObject *evd, PyObject *fut, int state)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(spin_type, Py_tp_alloc);
    Spin *spin = (Spin *)alloc(spin_type, 0);
    if (spin == NULL)
        return NULL;
    Py_INCREF(evd); Py_INCREF(fut);
    spin->evd = evd; spin->fut = fut; spin->state = state;
    return (PyObject *)spin;
}

/* A sleeping wait is a cycle (the Spin, its Future, the task's wake-up on it, the task, its
 * coroutine, the Spin): the collector must see through it, or a task left pending with its
 * loop would never be freed */
static int spin_traverse(PyObject *self, visitproc visit, void *arg)
{
    Spin *spin = (Spin *)self;
    Py_VISIT(spin->evd);
    Py_VISIT(spin->fut);
    return 0;
}

static int spin_clear(PyObject *self)
{
    Spin *spin = (Spin *)self;
    Py_CLEAR(spin->evd);
    Py_CLEAR(spin->fut);
    return 0;
}

static void spin_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    spin_clear(self);
    PyTypeObject *type = Py_TYPE(self);
    freefunc release = (freefunc)PyType_GetSlot(type, Py_tp_free);
    release(self);
    Py_DECREF(type);
}

static PyObject *spin_self(PyObject *self)
{
    Py_INCREF(self);
    return self;
}

/* the wait is over: if the EVD's waiter is still this wait's, the EVD is free for the next one */
static int spin_release(Spin *spin)
{
    if (spin->evd == NULL)  /* (cleared by the collector) */
        return 0;
    int mine = attr_is(spin->evd, s_waiter, spin->fut);
    if (mine != 1)
        return mine;
    return PyObject_SetAttr(spin->evd, s_waiter, Py_None) < 0 || PyObject_SetAttr(spin->evd, s_waiter_task, Py_None) < 0
           || PyObject_SetAttr(spin->evd, s_deadline, Py_None) < 0 ? -1 : 0;
}

/* next(spin): None (yield the turn), the Future (sleep on it), or the end: StopIteration(events),
 * or the Future's exception */
static PyObject *spin_next(PyObject *self)
{
    Spin *spin = (Spin *)self;
    if (spin->evd == NULL || spin->fut == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this EVD wait was cleared by the garbage collector");
        return NULL;
    }
    if (spin->state == SPIN_FIRST) {
        spin->state = SPIN_LOOKING;
        Py_RETURN_NONE;
    }
    if (spin->state == SPIN_LOOKING) {
        int again = spin_look(spin->evd, spin->fut);
        if (again < 0)
            return NULL;
        if (again)
            Py_RETURN_NONE;
        spin->state = SPIN_SLEEPING;
    }
    PyObject *done = PyObject_CallMethodObjArgs(spin->fut, s_done, NULL);
    int is_done = done ? PyObject_IsTrue(done) : -1;
    Py_XDECREF(done);
    if (is_done < 0)
        return NULL;
    if (!is_done) {  /* as Future.__await__: the task sleeps on it, then calls next() again */
        if (PyObject_SetAttr(spin->fut, s_future_blocking, Py_True) < 0)
            return NULL;
        Py_INCREF(spin->fut);
        return spin->fut;
    }
    PyObject *result = PyObject_CallMethodObjArgs(spin->fut, s_result, NULL);  /* (raises the wait's failure) */
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    if (spin_release(spin) < 0)
        return NULL;
    /* the events leave the queue only once their StopIteration is made: a MemoryError before
     * leaves them queued for the next wait */
    PyObject *queue = PyObject_GetAttr(spin->evd, s_queue);
    PyObject *events = queue ? PySequence_List(queue) : NULL;
    PyObject *stop = events ? PyObject_CallFunctionObjArgs(PyExc_StopIteration, events, NULL) : NULL;
    if (stop != NULL && taken_all(spin->evd, queue) < 0)
        Py_CLEAR(stop);
    Py_XDECREF(events);
    Py_XDECREF(queue);
    if (stop != NULL) {
        PyErr_SetObject(PyExc_StopIteration, stop);
        Py_DECREF(stop);
    }
    return NULL;
}

/* abandon(): the wait ends by an exception (a cancellation, its timeout, the EVD freed): free the
 * EVD for the next wait, if no new wait has taken it meanwhile; the events stay queued */
static PyObject *spin_abandon(PyObject *self, PyObject *unused)
{
    if (spin_release((Spin *)self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef spin_methods[] = {
    {"abandon", spin_abandon, METH_NOARGS,
     "abandon(): the wait ends by an exception: free the EVD for the next wait (if no new wait has taken it)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot spin_slots[] = {
    {Py_tp_doc, "The rest of an EVD wait begun by wait_begin: await it for the events (EVD.wait)."},
    {Py_tp_dealloc, spin_dealloc},
    {Py_tp_traverse, spin_traverse},
    {Py_tp_clear, spin_clear},
    {Py_tp_iter, spin_self},
    {Py_tp_iternext, spin_next},
    {Py_am_await, spin_self},
    {Py_tp_methods, spin_methods},
    {0, NULL},
};

static PyType_Spec spin_spec = {"aiodat._shim._completions.Spin", sizeof(Spin), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, spin_slots};

/* configure_waits(task_of): the function giving a loop's running task (None: waits never spin) */
static PyObject *configure_waits(PyObject *self, PyObject *fn)
{
    PyObject *before = task_of;
    task_of = fn == Py_None ? NULL : fn;
    Py_XINCREF(task_of);
    Py_XDECREF(before);
    Py_RETURN_NONE;
}

/* wait_begin(evd, threshold, timeout) -> list, Spin or None: EVD.wait's common case (no
 * max_events, not solicited, the EVD attached to the running loop, nothing pending) up to its
 * sleep.  A list: the events queued (at least threshold), taken.  A Spin: the rest of the wait,
 * to await for the events, with a new Future as the EVD's waiter, which the poller, the reader
 * callback or the wait's own looks complete.  None: not the common case, and nothing was done
 * (Python's general path decides, and raises what it raises). */
static PyObject *wait_begin(PyObject *self, PyObject *args)
{
    PyObject *evd, *threshold, *timeout;
    if (!PyArg_ParseTuple(args, "OOO", &evd, &threshold, &timeout))
        return NULL;
    if (poll_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._completions is not configured");
        return NULL;
    }
    if (get_running_loop == NULL
            && (get_running_loop = module_attr("asyncio.events", "_get_running_loop")) == NULL)
        return NULL;
    if (!PyLong_CheckExact(threshold))
        Py_RETURN_NONE;
    long wanted = PyLong_AsLong(threshold);
    if (wanted == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *loop = PyObject_CallObject(get_running_loop, NULL);
    if (loop == NULL)
        return NULL;
    PyObject *result = NULL, *queue = NULL;
    int go = loop == Py_None ? 0 : can_wait_here(evd, wanted, timeout, loop);
    if (go <= 0) {
        if (go == 0) {
            Py_INCREF(Py_None);
            result = Py_None;
        }
        goto out;
    }
    if (poll_evd(evd) < 0)  /* the look, with no system call */
        goto out;
    queue = PyObject_GetAttr(evd, s_queue);
    Py_ssize_t queued = queue ? PyObject_Length(queue) : -1;
    if (queued < 0)
        goto out;
    if (queued >= wanted) {
        result = take_all(evd, queue);
        goto out;
    }
    PyObject *fut = PyObject_CallMethodObjArgs(loop, s_create_future, NULL);
    if (fut == NULL)
        goto out;
    PyObject *task = waiting_task(loop);
    int napi = task == NULL || PyObject_SetAttr(evd, s_waiter, fut) < 0 || PyObject_SetAttr(evd, s_waiter_task, task) < 0
               || PyObject_SetAttr(evd, s_threshold, threshold) < 0 ? -1 : 0;
    if (napi == 0 && timeout != Py_None) {
        PyObject *res = PyObject_CallMethodObjArgs(evd, s_set_deadline, loop, timeout, NULL);
        napi = res ? 0 : -1;
        Py_XDECREF(res);
    } else if (napi == 0) {  /* no deadline: not a cancelled wait's, whose task never ran again */
        napi = PyObject_SetAttr(evd, s_deadline, Py_None);
    }
    int state = SPIN_SLEEPING;
    if (napi == 0) {
        unsigned long long busy_us;
        int unarmed = attr_true(evd, s_unarmed);
        if (unarmed < 0 || attr_ull(evd, s_busy_poll_us, &busy_us) < 0)
            napi = -1;
        else if (unarmed || busy_us)
            napi = napi_add(evd, loop, busy_us);
        /* the CQ is with the poller: spin, if the wait has a task whose cancel frees the EVD (a task
         * being cancelled already sleeps on its Future instead, which the poller completes: a
         * spinning wait of no task, never woken, would outlive its timeout) */
        if (napi == 0 && unarmed && task != Py_None)
            state = SPIN_FIRST;
    }
    Py_XDECREF(task);
    result = napi == 0 ? spin_make(evd, fut, state) : NULL;
    if (result == NULL) {  /* as the general path's finally: the EVD is free again, with no deadline */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyObject_SetAttr(evd, s_waiter, Py_None) < 0 || PyObject_SetAttr(evd, s_deadline, Py_None) < 0
            || PyObject_SetAttr(evd, s_waiter_task, Py_None) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    Py_DECREF(fut);
out:
    Py_XDECREF(queue);
    Py_DECREF(loop);
    return result;
}

/* configure_send_run(cls): wr.SendRun, so that a batch's last completion takes the C path too */
static PyObject *configure_send_run(PyObject *self, PyObject *cls)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "configure_send_run(wr.SendRun)");
        return NULL;
    }
    PyObject *before = send_run_cls;
    Py_INCREF(cls);
    send_run_cls = cls;
    Py_XDECREF(before);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(event_cls, dto_completion, recv_op, recv_imm_op, plain_send_ops, cq_poll_address): the classes and "
     "values events carry, and the shim's poll."},
    {"configure_send_run", configure_send_run, METH_O,
     "configure_send_run(cls): the class of a batch's one send-queue entry (wr.SendRun)."},
    {"look", look, METH_O,
     "look(evd) -> 1 (an event that notifies came), 0 (none), -1 (Python looks), -2 (Python finishes evd._polled)."},
    {"wakeup", wakeup, METH_O,
     "wakeup(evd): the loop's reader callback for the EVD's completion channel (EVD._on_readable)."},
    {"turn", turn, METH_VARARGS,
     "turn(poller, idle_turns, passes): one turn of the loop's poller: the sweep, the looks again after "
     "callbacks, the arms of the EVDs that stayed idle, Poller._decide for those that busy-poll, and the next "
     "turn's call_soon."},
    {"wait_begin", wait_begin, METH_VARARGS,
     "wait_begin(evd, threshold, timeout) -> list, Spin or None: EVD.wait's common case up to its sleep "
     "(the events, the rest of the wait to await for them, or None for Python's general path)."},
    {"configure_waits", configure_waits, METH_O,
     "configure_waits(task_of): task_of(loop) is the loop's running task, which a wait on a CQ the poller "
     "holds records before it spins; None: waits never spin."},
    {"taking", taking, METH_O,
     "taking(evd) -> bool: C is taking polled completions of evd now (a finalizer the take runs must not drain it)."},
    {"queue_common", queue_common, METH_VARARGS,
     "queue_common(evd, wcs_address, count, qpn_refs, queue) -> (taken, notified): turn the leading common-case "
     "completions into events appended to queue; the rest is left to Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiodat._shim._completions",
    "The common case of turning polled completions into events, in C (see evd.py).", -1, methods,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__completions(void)
{
    INTERN(s_recv_q, "_recv_q"); INTERN(s_send_q, "_send_q"); INTERN(s_quiet, "_quiet"); INTERN(s_ud, "_ud");
    INTERN(s_srq, "_srq"); INTERN(s_eps, "_eps"); INTERN(s_eps_seen, "_eps_seen"); INTERN(s_posted, "_posted");
    INTERN(s_lmr, "lmr"); INTERN(s_inflight, "_inflight"); INTERN(s_length, "length");
    INTERN(s_popleft, "popleft"); INTERN(s_pop, "pop"); INTERN(s_append, "append"); INTERN(s_base, "base"); INTERN(s_last, "last");
    INTERN(s_closed, "_closed"); INTERN(s_backlog, "_backlog"); INTERN(s_awaited, "_awaited");
    INTERN(s_cq_address, "_cq_address"); INTERN(s_wcs_address, "_wcs_address"); INTERN(s_qlen, "_qlen");
    INTERN(s_queue, "_queue"); INTERN(s_qpn_refs, "_qpn_refs"); INTERN(s_polled, "_polled"); INTERN(s_wc_next, "_wc_next");
    INTERN(s_dict, "__dict__");
    if ((s_zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    for (int k = 0; k <= MAX_ANSWER; k++)
        for (int n = 0; n < 2; n++)
            if ((answers[k][n] = Py_BuildValue("(ii)", k, n)) == NULL)
                return NULL;
    INTERN(k_type, "type"); INTERN(k_evd, "evd"); INTERN(k_ep, "ep"); INTERN(k_cookie, "cookie");
    INTERN(k_status, "status"); INTERN(k_length, "transferred_length"); INTERN(k_operation, "operation");
    INTERN(k_imm, "imm_data"); INTERN(k_vendor_err, "vendor_err"); INTERN(k_src_qp, "src_qp");
    INTERN(s_callback, "_callback"); INTERN(s_waiter, "_waiter"); INTERN(s_threshold, "_threshold");
    INTERN(s_solicited, "_solicited"); INTERN(s_solicited_hit, "_solicited_hit");
    INTERN(s_busy_poll_us, "_busy_poll_us"); INTERN(s_busy_until, "_busy_until");
    INTERN(s_overflow_reported, "_overflow_reported"); INTERN(s_done, "done"); INTERN(s_set_result, "set_result");
    INTERN(s_clear, "clear"); INTERN(s_napi_failed, "_napi_failed");
    INTERN(s_callback_raised, "_callback_raised"); INTERN(s_polling_the_cq, "polling the CQ");
    INTERN(s_attached_loop, "_attached_loop"); INTERN(s_sharers, "_sharers");
    INTERN(s_pending_error, "_pending_error"); INTERN(s_armed_solicited, "_armed_solicited");
    INTERN(s_unarmed, "_unarmed"); INTERN(s_poller, "_poller"); INTERN(s_loop, "_loop"); INTERN(s_hot, "_hot");
    INTERN(s_scheduled, "_scheduled"); INTERN(s_create_future, "create_future");
    INTERN(s_set_deadline, "_set_deadline"); INTERN(s_napi_add, "_napi_add"); INTERN(s_poll_rest, "_poll_rest");
    INTERN(s_deadline, "_deadline"); INTERN(s_waiter_task, "_waiter_task"); INTERN(s_cancelling, "cancelling");
    INTERN(s_cancelled, "cancelled");
    INTERN(s_future_blocking, "_asyncio_future_blocking"); INTERN(s_result, "result");
    INTERN(s_decide, "_decide"); INTERN(s_is_closed, "is_closed"); INTERN(s_get_loop, "get_loop"); INTERN(s_turn, "_turn");
    INTERN(s_call_soon, "call_soon"); INTERN(s_channel_address, "_channel_address");
    INTERN(s_status_address, "_status_address"); INTERN(s_arm_error, "_arm_error"); INTERN(s_rearms, "_rearms");
    INTERN(s_arm_retried, "_arm_retried"); INTERN(s_note_arm, "_note_arm"); INTERN(s_napi_arm, "_napi_arm");
    INTERN(s_napi_arm_retry, "_napi_arm_retry"); INTERN(s_woken, "_woken"); INTERN(s_watch, "_watch");
    INTERN(s_draining_the_cq, "draining the CQ");
    INTERN(k_notify, "notify"); INTERN(success, "IBV_WC_SUCCESS");
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "CALLBACK_ROUNDS", CALLBACK_ROUNDS) < 0)
        Py_CLEAR(mod);
    spin_type = mod ? (PyTypeObject *)PyType_FromSpec(&spin_spec) : NULL;
    if (spin_type == NULL) {
        Py_XDECREF(mod);
        return NULL;
    }
    return mod;
}
