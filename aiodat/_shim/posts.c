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
 * when it is not the hot path.
 *
 * The batch fast paths of post_send_batch, post_rdma_write_batch,
 * post_rdma_read_batch, post_recv_batch and an SRQ's post_recv_batch are here
 * too: every item on one segment, the very same one (and remote region), as a
 * stream on one buffer posts, or one of its own (and a remote region of its
 * own), as a pool of buffers is used.  They return how many were posted,
 * (posted, n, errno) when the queue refused part of the batch (what went is
 * recorded), or None when it is not their case.
 *
 * Built with the limited API (abi3); verbs' posting calls are inline functions
 * of the provider's ops, so it links to no library.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include "postcommon.h"
#include "pyattrs.h"

/* the Global Route Header the device writes at the start of every UD receive (post.py's GRH_SIZE) */
#define UD_GRH_SIZE 40

/* set once by configure() */
static PyObject *segment_type, *flags_type, *send_bits, *op_send, *state_connected, *state_disconnected,
                *state_error, *send_run_type, *remote_type;
static PyObject *srq_operational;  /* SRQState.OPERATIONAL, set by configure_srq() */
static PyObject *count_type;  /* itertools.count: a batch reserves its request numbers as wr.py's _take_ids */
static PyObject *s_writable, *s_srq, *s_closed, *s_lmr, *s_pz, *s_conn, *s_state, *s_ids, *s_address, *s_offset,
                *s_length, *s_lkey, *s_inflight, *s_recv_q, *s_send_q, *s_quiet, *s_rc, *s_max_inline,
                *s_append, *s_add, *s_extend, *s_pop, *s_discard, *s_qp_address, *s_srq_address, *s_rmr_context,
                *s_srq_state, *s_posted, *s_send_limit, *s_recv_limit, *s_max_wr;

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *seg, *flags, *bits, *send, *conn, *disc, *err, *run, *remote;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &seg, &flags, &bits, &send, &conn, &disc, &err, &run, &remote))
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
    Py_INCREF(conn); Py_INCREF(disc); Py_INCREF(err); Py_INCREF(run); Py_INCREF(remote);
    segment_type = seg; flags_type = flags; send_bits = bits; op_send = send;
    state_connected = conn; state_disconnected = disc; state_error = err; send_run_type = run; remote_type = remote;
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

/* The last LMR a post's segments were checked on (borrowed: the caller holds it): open and of the
 * owner's PZ (and writable, for a post the device ``writes`` into: a receive, an RDMA read), with its
 * address and lkey, so that the segments of a pool on one LMR check it once */
struct lmr_seen {
    PyObject *lmr;
    unsigned long long address, lkey;
    int writes;
};

/* A segment's checks once its owner (EP or SRQ) is known open, ``pz`` its PZ: its LMR open and of
 * that PZ (unless it is ``seen``'s, which is then updated).  Fills the LMR (a new reference) and the
 * scatter/gather element.  1: go on; 0: not the hot path; -1: error. */
static int segment_sge(PyObject *pz, PyObject *seg, PyObject **lmr, struct ibv_sge *sge, struct lmr_seen *seen)
{
    unsigned long long offset = 0, length = 0;  /* (set below; -O1 cannot tell) */
    *lmr = PyObject_GetAttr(seg, s_lmr);
    if (*lmr == NULL)
        return -1;
    int ok = 1;
    if (*lmr != seen->lmr) {
        seen->lmr = NULL;
        ok = attr_is(*lmr, s_pz, pz);
        if (ok == 1)
            ok = attr_is(*lmr, s_closed, Py_False);
        if (ok == 1 && seen->writes)  /* (not writable: the general path raises PrivilegesViolation) */
            ok = attr_is(*lmr, s_writable, Py_True);
        if (ok == 1 && (attr_ull(*lmr, s_address, &seen->address) < 0 || attr_ull(*lmr, s_lkey, &seen->lkey) < 0))
            ok = -1;
        if (ok == 1)
            seen->lmr = *lmr;
    }
    if (ok == 1 && (attr_ull(seg, s_offset, &offset) < 0 || attr_ull(seg, s_length, &length) < 0))
        ok = -1;
    if (ok == 1 && length > UINT32_MAX)
        ok = 0;  /* more than one scatter/gather element holds: the general path says so */
    if (ok <= 0) {
        Py_CLEAR(*lmr);
        return ok;
    }
    sge->addr = seen->address + offset;
    sge->length = (uint32_t)length;
    sge->lkey = (uint32_t)seen->lkey;
    return 1;
}

/* The owner (an EP or an SRQ: both have _closed and _pz) is open: its PZ (a new reference), or NULL
 * with *ok 0 (closed: not the hot path) or -1 (error). */
static PyObject *open_owner_pz(PyObject *owner, int *ok)
{
    *ok = attr_is(owner, s_closed, Py_False);
    PyObject *pz = *ok == 1 ? PyObject_GetAttr(owner, s_pz) : NULL;
    if (*ok == 1 && pz == NULL)
        *ok = -1;
    return pz;
}

/* What every hot post checks: the EP is open, the segment's LMR is open and of the EP's PZ.
 * Fills the LMR (a new reference) and the scatter/gather element.  1: go on; 0: not the hot path. */
static int check_segment(PyObject *ep, PyObject *seg, PyObject **lmr, struct ibv_sge *sge, int writes)
{
    int ok;
    PyObject *pz = open_owner_pz(ep, &ok);
    struct lmr_seen seen = { NULL, 0, 0, writes };
    if (ok == 1)
        ok = segment_sge(pz, seg, lmr, sge, &seen);
    Py_XDECREF(pz);
    return ok;
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

/* lmr._inflight += n: 0, or -1 on error */
static int add_inflight(PyObject *lmr, Py_ssize_t n)
{
    return attr_add(lmr, s_inflight, n);
}

static int queue_call(PyObject *ep, PyObject *queue_name, PyObject *method, PyObject *arg);
static void unrecord(PyObject *ep, PyObject *queue_name, Py_ssize_t unposted, PyObject *quiet_id);
static void unpost(PyObject *ep, PyObject *lmr, PyObject *queue_name, PyObject *entry, PyObject *quiet_id);
static int unrecord_last(PyObject *ep, PyObject *queue_name, Py_ssize_t count, PyObject *last, PyObject *quiet_id);

/* Pop ``count`` items off the right of the queue ``q`` (a deque's pop allocates nothing), each
 * error cleared: the records being taken back here go back whatever else fails. */
static void pop_back(PyObject *q, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *popped = PyObject_CallMethodObjArgs(q, s_pop, NULL);
        if (popped == NULL)
            PyErr_Clear();
        Py_XDECREF(popped);
    }
}

/* The LMR's in-flight count goes up before a post (which then cannot leave it short: lmr.free()
 * would let the buffer go under a posted request) and back down by what did not go.  A decrement
 * that fails (an int's allocation under memory pressure) leaves it high: that refuses a free, it
 * loses nothing.  0, or -1 (before a post: nothing is done). */
static int count_before_post(PyObject *lmr, Py_ssize_t n)
{
    return add_inflight(lmr, n);
}

static void uncount_unposted(PyObject *lmr, Py_ssize_t unposted)
{
    if (unposted > 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (add_inflight(lmr, -unposted) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
}

/* Record requests before their post, so that nothing after it needs memory (a failure there
 * would leave a request the device has without its entry, and its completion unmatched):
 * ep.<queue>.<method>(arg), append or extend, and the UNSIGNALLED mark.  0, or -1 with nothing
 * recorded (-2: nor counted, the entry retired by a close or reset meanwhile: see unrecord_last). */
static int record_before_post(PyObject *ep, PyObject *queue_name, PyObject *method, PyObject *arg,
                              PyObject *quiet_id)
{
    if (queue_call(ep, queue_name, method, arg) < 0)
        return -1;
    if (quiet_id != NULL && queue_call(ep, s_quiet, s_add, quiet_id) < 0)  /* -2: retired already */
        return unrecord_last(ep, queue_name, 1, arg, NULL) ? -1 : -2;
    return 0;
}

/* Take back the records of the last ``unposted`` requests, which did not go: a deque's pop and a
 * set's discard allocate nothing.  Any error set stays the one raised. */
static void unrecord(PyObject *ep, PyObject *queue_name, Py_ssize_t unposted, PyObject *quiet_id)
{
    if (unposted <= 0)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *q = PyObject_GetAttr(ep, queue_name);
    if (q != NULL)
        pop_back(q, unposted);
    Py_XDECREF(q);
    PyErr_Clear();  /* (the getattr's, if any) */
    if (quiet_id != NULL && queue_call(ep, s_quiet, s_discard, quiet_id) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* The owner (an EP, or an SRQ) still has the QP (SRQ) the post goes to, just before it: the post's own
 * allocations may have run a finalizer that closed the EP or reset it (a reset makes a new QP), and
 * freed the one whose address the caller passed.  1, 0 (changed: post.py's path says how), or -1. */
static int still_at(PyObject *owner, PyObject *address_name, const void *target)
{
    unsigned long long now;
    if (attr_ull(owner, address_name, &now) < 0)
        return -1;
    return now == (unsigned long long)(uintptr_t)target;
}

/* How many more records the owner takes: its limit (``limit_name``: EPAttr's max_request_dtos or
 * max_recv_dtos, the SRQ's max_recv_dtos) less its records whose completions are not taken yet
 * (``queue_name``: an EP's deque, an SRQ's dict), as post.py's _room.  A device may take more (rxe
 * frees a queue slot as it writes the completion, not when it is polled), but the CQs are sized
 * for the limits (cqsize.py): past them a CQ overruns and its completions are lost.  A post past
 * it is refused as the device refuses a full queue: ENOMEM, a batch's first ``room`` posted.
 * -1 on error. */
static Py_ssize_t room_in(PyObject *owner, PyObject *queue_name, PyObject *limit_name)
{
    unsigned long long limit;
    PyObject *q = PyObject_GetAttr(owner, queue_name);
    Py_ssize_t held = q != NULL ? PyObject_Length(q) : -1;
    Py_XDECREF(q);
    if (held < 0 || attr_ull(owner, limit_name, &limit) < 0)
        return -1;
    return limit > (unsigned long long)held ? (Py_ssize_t)(limit - (unsigned long long)held) : 0;
}

/* A batch of ``n`` against the owner's room (room_in): 1 with ``*take``, how many go (all, or the
 * first that fit; a run, one entry, goes ``whole``); 0 when nothing fits (nothing done: the caller
 * answers ENOMEM); -1 on error. */
static int batch_room(PyObject *owner, PyObject *queue_name, PyObject *limit_name, Py_ssize_t n, int whole,
                      Py_ssize_t *take)
{
    Py_ssize_t room = room_in(owner, queue_name, limit_name);
    if (room <= 0)
        return room < 0 ? -1 : 0;
    *take = whole || room >= n ? n : room;
    return 1;
}

/* A single post's records, all made before it (count_before_post, record_before_post), and a last
 * look that the EP is open.  1: post; 0: closed (nothing done: post.py's path says so); -1: error. */
static int prepare_post(PyObject *ep, struct ibv_qp *qp, PyObject *lmr, PyObject *queue_name, PyObject *method,
                        PyObject *entry, PyObject *quiet_id)
{
    if (count_before_post(lmr, 1) < 0)
        return -1;
    int recorded = record_before_post(ep, queue_name, method, entry, quiet_id);
    if (recorded < 0) {
        if (recorded == -1)  /* (-2: a close or reset retired the entry and its count meanwhile) */
            uncount_unposted(lmr, 1);
        return -1;
    }
    int open = still_at(ep, s_qp_address, qp);
    if (open <= 0)
        unpost(ep, lmr, queue_name, entry, quiet_id);
    return open;
}

/* Pop the last ``count`` entries of ep.<queue>, the records of requests that did not go, if they
 * are still there: its last item is ``last`` (the same object).  They may not be: an allocation
 * after the records could run a finalizer that closed or reset the EP, whose _retire_all (wr.py)
 * took every entry off the queue and lowered its LMR counts already; then nothing is popped and the
 * caller must not lower the counts again (they would end short: lmr.free() could release a buffer
 * the device uses).  The UNSIGNALLED mark ``quiet_id`` is discarded either way (_retire_all clears
 * them all).  1 when popped, else 0.  A deque's pop and item read, a set's discard allocate
 * nothing; any error set stays the one raised. */
static int unrecord_last(PyObject *ep, PyObject *queue_name, Py_ssize_t count, PyObject *last, PyObject *quiet_id)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int there = 0;
    PyObject *q = PyObject_GetAttr(ep, queue_name);
    Py_ssize_t len = q != NULL ? PyObject_Length(q) : -1;
    if (count > 0 && len >= count) {
        PyObject *item = PySequence_GetItem(q, len - 1);
        there = item != NULL && item == last;
        Py_XDECREF(item);
    }
    if (there)
        pop_back(q, count);
    Py_XDECREF(q);
    if (quiet_id != NULL && queue_call(ep, s_quiet, s_discard, quiet_id) < 0)
        PyErr_Clear();
    if (PyErr_Occurred())
        PyErr_Clear();
    PyErr_Restore(type, value, tb);
    return there;
}

/* Undo prepare_post: the request ``entry`` did not go.  Its count is lowered only with its entry
 * taken off here (unrecord_last): else a close or reset retired both already. */
static void unpost(PyObject *ep, PyObject *lmr, PyObject *queue_name, PyObject *entry, PyObject *quiet_id)
{
    if (unrecord_last(ep, queue_name, 1, entry, quiet_id))
        uncount_unposted(lmr, 1);
}

/* A batch's records before its post, as prepare_post's: ep.<queue>.<method>(arg), one run entry
 * (append) or ``entries`` of them (extend, of a list or tuple), and a last look that the EP is open.
 * (The LMR counts are the caller's.)  On 0 or -1 nothing is recorded, and *uncount says whether the
 * caller takes its counts back: not when a close or reset (a finalizer run by an allocation here)
 * retired the entries, and their counts, already. */
static int prepare_batch(PyObject *ep, struct ibv_qp *qp, PyObject *queue_name, PyObject *method, PyObject *arg,
                         Py_ssize_t entries, int *uncount)
{
    *uncount = 1;
    PyObject *q = PyObject_GetAttr(ep, queue_name);
    if (q == NULL)
        return -1;
    PyObject *res = PyObject_CallMethodObjArgs(q, method, arg, NULL);
    if (res == NULL) {
        /* extend can fail part way (a deque takes a new block every 64 entries): the entries it
         * added, arg[0..k], stay, and are popped back here (from the right: that allocates
         * nothing), else their later retirement would lower the counts the caller takes back now
         * a second time.  How many: the place in ``arg`` of the queue's last item (its own new
         * tuples: no other entry is the same object), not a length taken before, which a
         * finalizer's _retire_all (run by extend's allocation of its iterator) could clear. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_ssize_t len = PyObject_Length(q), added = 0;
        PyObject *tail = len > 0 ? PySequence_GetItem(q, len - 1) : NULL;
        if (tail != NULL && method == s_append)
            added = tail == arg;
        else if (tail != NULL)
            for (Py_ssize_t j = entries - 1; added == 0 && j >= 0; j--) {
                PyObject *mine = PySequence_GetItem(arg, j);  /* (a list's or tuple's: no allocation) */
                if (mine == tail)
                    added = j + 1;
                Py_XDECREF(mine);
            }
        Py_XDECREF(tail);
        pop_back(q, added);
        if (PyErr_Occurred())
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        Py_DECREF(q);
        return -1;
    }
    Py_DECREF(res);
    Py_DECREF(q);
    int open = still_at(ep, s_qp_address, qp);
    if (open <= 0) {
        PyObject *last = method == s_append ? arg : PySequence_GetItem(arg, entries - 1);
        *uncount = unrecord_last(ep, queue_name, method == s_append ? 1 : entries, last, NULL);
        if (method != s_append)
            Py_XDECREF(last);
    }
    return open;
}

/* An SRQ batch's records before its post: _posted[wr_id] = (cookie, (seg,)) for each of
 * ``records`` ((wr_id, record) pairs), and a last look that the SRQ is open.  1, 0 or -1, as
 * prepare_post. */
static void unrecord_srq(PyObject *map, PyObject *records, Py_ssize_t start, Py_ssize_t stop);

static int prepare_srq_batch(PyObject *srq, struct ibv_srq *queue, PyObject *map, PyObject *records, int *uncount)
{
    *uncount = 1;
    Py_ssize_t n = PyTuple_Size(records), i;
    for (i = 0; i < n; i++) {
        PyObject *record = PyTuple_GetItem(records, i);
        if (PyDict_SetItem(map, PyTuple_GetItem(record, 0), PyTuple_GetItem(record, 1)) < 0) {
            unrecord_srq(map, records, 0, i);
            return -1;
        }
    }
    int open = still_at(srq, s_srq_address, queue);
    if (open <= 0) {
        /* A finalizer run by an allocation here that closed the SRQ cleared _posted and lowered
         * the counts of all it held (srq.py's _release_posted): then the caller must not lower
         * them again.  Our records are all there or all gone; the first one tells. */
        PyObject *first = n > 0 ? PyDict_GetItem(map, PyTuple_GetItem(PyTuple_GetItem(records, 0), 0)) : NULL;
        *uncount = first != NULL && first == PyTuple_GetItem(PyTuple_GetItem(records, 0), 1);
        if (*uncount)
            unrecord_srq(map, records, 0, n);
    }
    return open;
}

/* Take back the SRQ records [start, stop): they did not go (a dictionary's delete allocates nothing) */
static void unrecord_srq(PyObject *map, PyObject *records, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (Py_ssize_t i = start; i < stop; i++)
        if (PyDict_DelItem(map, PyTuple_GetItem(PyTuple_GetItem(records, i), 0)) < 0)
            PyErr_Clear();
    PyErr_Restore(type, value, tb);
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
        ok = check_segment(ep, seg, &lmr, &sge, 1);
    if (ok == 1 && sge.length < UD_GRH_SIZE) {  /* a UD receive too small for the GRH: post.py refuses it */
        ok = attr_is(ep, s_rc, Py_True);
        if (ok != 1)
            Py_DECREF(lmr);
    }
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    struct ibv_qp *qp = qp_at(address);
    if (qp == NULL) {  /* (an open EP always has its QP's address) */
        Py_DECREF(lmr);
        return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    }
    Py_ssize_t room = room_in(ep, s_recv_q, s_recv_limit);
    if (room <= 0) {
        Py_DECREF(lmr);
        return room < 0 ? NULL : PyLong_FromLong(ENOMEM);
    }
    long long id = next_id(ep);
    unsigned long long wr_id = (unsigned long long)id * 2 + 1;
    if (id >= 0)  /* the entry first: once the request is posted, recording it must not need memory */
        entry = Py_BuildValue("(KO(O))", wr_id, cookie, seg);
    if (entry == NULL) {
        Py_DECREF(lmr);
        return NULL;
    }
    int open = prepare_post(ep, qp, lmr, s_recv_q, s_append, entry, NULL);
    if (open <= 0) {
        Py_DECREF(entry);
        Py_DECREF(lmr);
        return open < 0 ? NULL : PyLong_FromLong(-1);  /* (post.py's path says it is closed) */
    }
    struct ibv_recv_wr wr = { .wr_id = wr_id, .next = NULL, .sg_list = &sge, .num_sge = 1 }, *bad;
    int err = post_errno(ibv_post_recv(qp, &wr, &bad));
    if (err)
        unpost(ep, lmr, s_recv_q, entry, NULL);
    Py_DECREF(entry);
    Py_DECREF(lmr);
    return PyLong_FromLong(err);
}

/* (ibv_send_flags, posted UNSIGNALLED) of a request's CompletionFlags, as post.py's _SEND_BITS
 * has them: 1, or 0 when ``flags`` is not a CompletionFlags (the general path says why), -1 on error */
static int flag_bits(PyObject *flags, long *send_flags, int *quiet)
{
    if ((PyObject *)Py_TYPE(flags) != flags_type)
        return 0;
    long bits = PyLong_AsLong(flags);
    if (bits < 0 || bits >= 16)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *pair = PyList_GetItem(send_bits, bits);
    if (pair == NULL || !PyTuple_Check(pair) || PyTuple_Size(pair) != 2)  /* (post.py's list, changed) */
        return pair == NULL ? -1 : 0;
    *send_flags = PyLong_AsLong(PyTuple_GetItem(pair, 0));
    *quiet = PyObject_IsTrue(PyTuple_GetItem(pair, 1));
    return *send_flags < 0 || *quiet < 0 ? -1 : 1;
}

/* An RC EP that may post sends now: it is connected; *qp is its QP.  1: go on; 0: not the hot path; -1: error. */
static int ep_sends(PyObject *ep, PyObject *address, struct ibv_qp **qp)
{
    int ok = attr_is(ep, s_rc, Py_True);
    if (ok == 1)
        ok = state_allows(ep, 1);
    if (ok == 1 && (*qp = qp_at(address)) == NULL)  /* (an open EP always has its QP's address) */
        ok = PyErr_Occurred() ? -1 : 0;
    return ok;
}

/* The checks of a send-side post on an RC EP (ep_sends), and its segment open and of its PZ
 * (check_segment fills ``lmr`` and ``sge``).  1: go on; 0: not the hot path; -1: error. */
static int send_side_ready(PyObject *ep, PyObject *address, PyObject *seg, PyObject **lmr, struct ibv_sge *sge,
                           struct ibv_qp **qp)
{
    int ok = ep_sends(ep, address, qp);
    return ok == 1 ? check_segment(ep, seg, lmr, sge, 0) : ok;
}

/* post_send's work on its one segment ``seg`` (not NULL: the caller checked) */
static PyObject *post_send_one(PyObject *ep, PyObject *address, PyObject *seg, PyObject *cookie, PyObject *flags)
{
    PyObject *lmr = NULL, *entry = NULL, *quiet_id = NULL;
    long send_flags;
    int quiet;
    struct ibv_sge sge;
    struct ibv_qp *qp;
    int ok = flag_bits(flags, &send_flags, &quiet);
    if (ok == 1)
        ok = send_side_ready(ep, address, seg, &lmr, &sge, &qp);
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    Py_ssize_t room = room_in(ep, s_send_q, s_send_limit);
    if (room <= 0) {
        Py_DECREF(lmr);
        return room < 0 ? NULL : PyLong_FromLong(ENOMEM);
    }
    unsigned long long max_inline;
    long long id = -1;
    if (attr_ull(ep, s_max_inline, &max_inline) == 0)
        id = next_id(ep);
    unsigned long long wr_id = (unsigned long long)id * 2;
    if (id >= 0) {
        entry = Py_BuildValue("(KOO(O)O)", wr_id, cookie, op_send, seg, Py_None);
        if (entry != NULL && quiet && (quiet_id = PyLong_FromUnsignedLongLong(wr_id)) == NULL)
            Py_CLEAR(entry);
    }
    int open = entry == NULL ? -1 : prepare_post(ep, qp, lmr, s_send_q, s_append, entry, quiet_id);
    if (open <= 0) {
        Py_XDECREF(entry);
        Py_XDECREF(quiet_id);
        Py_DECREF(lmr);
        return open < 0 ? NULL : PyLong_FromLong(-1);  /* (post.py's path says it is closed) */
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
    int err = post_errno(ibv_post_send(qp, &wr, &bad));
    if (err)
        unpost(ep, lmr, s_send_q, entry, quiet_id);
    Py_DECREF(entry);
    Py_XDECREF(quiet_id);
    Py_DECREF(lmr);
    return PyLong_FromLong(err);
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

/* -- the batch fast paths: every request on the very same one segment (and remote region) -- */

/* A batch's items when every one is an exact tuple of ``width`` whose first element (and, with width
 * 3, second) is the very object of the first item's: sets *shared and *remote to those (new
 * references; *remote NULL with width 2) and returns the cookies (each item's last element) as a
 * new tuple.  NULL: not the fast path, or an error (then an exception is set).  Nothing here runs
 * Python, so the items cannot change under the loop. */
static PyObject *same_items(PyObject *items, Py_ssize_t width, PyObject **shared, PyObject **remote)
{
    int is_list = PyList_CheckExact(items);
    if (!is_list && !PyTuple_CheckExact(items))
        return NULL;
    Py_ssize_t n = is_list ? PyList_Size(items) : PyTuple_Size(items);
    if (n < 1)
        return NULL;
    PyObject *cookies = PyTuple_New(n), *first = NULL, *second = NULL;
    for (Py_ssize_t i = 0; cookies != NULL && i < n; i++) {
        PyObject *item = is_list ? PyList_GetItem(items, i) : PyTuple_GetItem(items, i);
        if (!PyTuple_CheckExact(item) || PyTuple_Size(item) != width) {
            Py_CLEAR(cookies);
            break;
        }
        PyObject *a = PyTuple_GetItem(item, 0), *b = width == 3 ? PyTuple_GetItem(item, 1) : NULL;
        if (i == 0) {
            first = a;
            second = b;
        } else if (a != first || b != second) {
            Py_CLEAR(cookies);
            break;
        }
        PyObject *cookie = PyTuple_GetItem(item, width - 1);
        Py_INCREF(cookie);
        PyTuple_SetItem(cookies, i, cookie);
    }
    if (cookies != NULL) {
        Py_INCREF(first);
        Py_XINCREF(second);
        *shared = first;
        *remote = second;
    }
    return cookies;
}

/* Reserve ``n`` consecutive request numbers, as wr.py's _take_ids: the first, or -1 on error */
static long long take_ids(PyObject *ep, Py_ssize_t n)
{
    long long first = next_id(ep);
    if (first < 0)
        return -1;
    PyObject *rest = PyObject_CallFunction(count_type, "L", first + (long long)n);
    int err = rest == NULL || PyObject_SetAttr(ep, s_ids, rest) < 0;
    Py_XDECREF(rest);
    return err ? -1 : first;
}

/* One send-queue entry per request, wr_ids first, first + 2, ...: (wr_id, cookie, op, segs, None),
 * ``segs`` every request's, or with ``each`` a tuple of each request's own.  A new list, NULL on error. */
static PyObject *entries(unsigned long long first, PyObject *cookies, Py_ssize_t count, PyObject *op,
                         PyObject *segs, int each)
{
    PyObject *list = PyList_New(count);
    for (Py_ssize_t i = 0; list != NULL && i < count; i++) {
        PyObject *wr_id = PyLong_FromUnsignedLongLong(first + 2 * (unsigned long long)i);
        PyObject *cookie = PyTuple_GetItem(cookies, i), *entry = NULL, *own = each ? PyTuple_GetItem(segs, i) : segs;
        if (wr_id != NULL)
            entry = PyTuple_Pack(5, wr_id, cookie, op, own, Py_None);
        Py_XDECREF(wr_id);
        if (entry == NULL)
            Py_CLEAR(list);
        else
            PyList_SetItem(list, i, entry);
    }
    return list;
}

/* A run's entry (wr.SendRun): (first, cookies, op, segs, SendRun(first, last)); NULL on error */
static PyObject *run_entry(unsigned long long first, PyObject *cookies, PyObject *op, PyObject *segs)
{
    unsigned long long last = first + 2 * (unsigned long long)(PyTuple_Size(cookies) - 1);
    PyObject *run = PyObject_CallFunction(send_run_type, "KK", first, last);
    PyObject *wr_id = run ? PyLong_FromUnsignedLongLong(first) : NULL;
    PyObject *entry = wr_id ? PyTuple_Pack(5, wr_id, cookies, op, segs, run) : NULL;
    Py_XDECREF(wr_id);
    Py_XDECREF(run);
    return entry;
}

/* ep.<queue>.<method>(arg): 0, or -1 on error */
static int queue_call(PyObject *ep, PyObject *queue_name, PyObject *method, PyObject *arg)
{
    PyObject *queue = PyObject_GetAttr(ep, queue_name);
    PyObject *res = queue ? PyObject_CallMethodObjArgs(queue, method, arg, NULL) : NULL;  /* (arg NULL: none) */
    Py_XDECREF(queue);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

/* Mark the wr_ids first, first + 2, ... (``count`` of them) UNSIGNALLED: 0, or -1 on error */
static int mark_quiet(PyObject *ep, unsigned long long first, Py_ssize_t count)
{
    PyObject *quiet = PyObject_GetAttr(ep, s_quiet);
    int err = quiet == NULL;
    for (Py_ssize_t i = 0; !err && i < count; i++) {
        PyObject *wr_id = PyLong_FromUnsignedLongLong(first + 2 * (unsigned long long)i);
        PyObject *res = wr_id ? PyObject_CallMethodObjArgs(quiet, s_add, wr_id, NULL) : NULL;
        err = res == NULL;
        Py_XDECREF(res);
        Py_XDECREF(wr_id);
    }
    Py_XDECREF(quiet);
    return err ? -1 : 0;
}

/* Where one RDMA request of a batch goes: its remote address and rkey */
struct remote_at {
    unsigned long long addr;
    uint32_t rkey;
};

/* Post ``n`` copies of ``tmpl`` (a send) or ``rtmpl`` (a receive, to ``srq`` when it is not NULL),
 * wr_ids first, first + 2, ...  With ``each``, request i gathers or scatters each[i] (else a send
 * takes the template's element); with ``remotes``, an RDMA request i goes to remotes[i] (else to
 * the template's).  A send's last request gets ``last_flags`` (e.g. the one signalled request of a
 * batch), and a send whose bytes fit ``max_inline`` (-1: none may) goes inline.  Returns 0 or the
 * errno of the refused post; *posted says how many went. */
static int post_copies(struct ibv_qp *qp, struct ibv_srq *srq, const struct ibv_send_wr *tmpl,
                       const struct ibv_recv_wr *rtmpl, struct ibv_sge *each, const struct remote_at *remotes,
                       long long max_inline, unsigned int last_flags, unsigned long long first, Py_ssize_t n,
                       Py_ssize_t *posted)
{
    struct ibv_send_wr wr[AIODAT_CHUNK], *bad;
    struct ibv_recv_wr rwr[AIODAT_CHUNK], *rbad;
    *posted = 0;
    while (*posted < n) {
        int count = n - *posted < AIODAT_CHUNK ? (int)(n - *posted) : AIODAT_CHUNK, err;
        for (int i = 0; i < count; i++) {
            Py_ssize_t k = *posted + i;
            unsigned long long wr_id = first + 2 * (unsigned long long)k;
            if (tmpl) {
                wr[i] = *tmpl;
                wr[i].wr_id = wr_id;
                wr[i].next = i + 1 < count ? &wr[i + 1] : NULL;
                if (each)
                    wr[i].sg_list = &each[k];
                if (remotes) {
                    wr[i].wr.rdma.remote_addr = remotes[k].addr;
                    wr[i].wr.rdma.rkey = remotes[k].rkey;
                }
                if (k + 1 == n)
                    wr[i].send_flags = last_flags;
                if (max_inline >= 0 && wr[i].sg_list->length <= (unsigned long long)max_inline)
                    wr[i].send_flags |= IBV_SEND_INLINE;
            } else {
                rwr[i] = *rtmpl;
                rwr[i].wr_id = wr_id;
                rwr[i].sg_list = &each[k];
                rwr[i].next = i + 1 < count ? &rwr[i + 1] : NULL;
            }
        }
        bad = NULL;
        rbad = NULL;
        err = post_errno(tmpl ? ibv_post_send(qp, wr, &bad)
                         : srq ? ibv_post_srq_recv(srq, rwr, &rbad) : ibv_post_recv(qp, rwr, &rbad));
        if (err) {
            *posted += tmpl ? TAKEN(bad, wr, count) : TAKEN(rbad, rwr, count);
            return err;
        }
        *posted += count;
    }
    return 0;
}

/* What a batch returns once posted: n, or (posted, n, errno) when the queue refused part of it */
static PyObject *batch_result(Py_ssize_t posted, Py_ssize_t n, int err)
{
    return err ? Py_BuildValue("(nni)", posted, n, err) : PyLong_FromSsize_t(n);
}

/* The check of an RDMA batch's item beyond check_segment: ``remote`` (NULL for a send) is a RemoteRegion
 * long enough for the segment; fills its address and rkey.  1: go on; 0: not the fast path; -1. */
static int batch_ready(PyObject *remote, const struct ibv_sge *sge, unsigned long long *remote_addr,
                       unsigned long long *rkey)
{
    unsigned long long length;
    if (remote == NULL)
        return 1;
    if ((PyObject *)Py_TYPE(remote) != remote_type)
        return 0;
    if (attr_ull(remote, s_address, remote_addr) < 0 || attr_ull(remote, s_length, &length) < 0
            || attr_ull(remote, s_rmr_context, rkey) < 0)
        return -1;
    return sge->length <= length;  /* else LengthError, from the general path */
}

/* A batch's answer when its owner is not ready (``ready`` 0: None, the general path's; -1: the error) */
static PyObject *not_ready(int ready)
{
    if (ready < 0)
        return NULL;
    Py_INCREF(Py_None);
    return Py_None;
}

/* The items of a batch on one segment each (the same one, or one of their own as a pool of buffers
 * gives), checked as check_segment checks against ``owner`` (the EP, or the SRQ: both have _closed
 * and _pz): every item an exact tuple of ``width`` (segments, [remote,] cookie), the segments a
 * Segment or a list of one; with ``remotes`` (width 3), the remote region a RemoteRegion long
 * enough for the segment (batch_ready).  An item repeating the previous one's objects is checked
 * once.  Fills segs[i] ((seg,)), lmrs[i], sges[i] and remotes[i].  1: go on; 0: not this case
 * (the general path's, which says why); -1: error. */
static int check_items(PyObject *owner, PyObject *items, Py_ssize_t width, PyObject *segs, PyObject *lmrs,
                       struct ibv_sge *sges, struct remote_at *remotes, int writes)
{
    int ok;
    PyObject *pz = open_owner_pz(owner, &ok), *previous = NULL, *previous_remote = NULL;
    struct lmr_seen seen = { NULL, 0, 0, writes };
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_Size(items); i++) {
        PyObject *item = PyTuple_GetItem(items, i);
        if (!PyTuple_CheckExact(item) || PyTuple_Size(item) != width) {
            ok = 0;
            break;
        }
        PyObject *segments = PyTuple_GetItem(item, 0), *remote = remotes ? PyTuple_GetItem(item, 1) : NULL;
        PyObject *one = NULL, *lmr = NULL, *seg = NULL;
        if (segments == previous) {  /* checked already: the previous item's */
            sges[i] = sges[i - 1];
            one = PyTuple_GetItem(segs, i - 1);
            lmr = PyTuple_GetItem(lmrs, i - 1);
            Py_INCREF(one);
            Py_INCREF(lmr);
        } else if ((seg = one_segment(segments)) == NULL) {
            ok = 0;
        } else {
            ok = segment_sge(pz, seg, &lmr, &sges[i], &seen);
            one = ok == 1 ? PyTuple_Pack(1, seg) : NULL;
            Py_DECREF(seg);
            if (ok == 1 && one == NULL)
                ok = -1;
        }
        if (ok != 1) {
            Py_XDECREF(one);
            Py_XDECREF(lmr);
            break;
        }
        PyTuple_SetItem(segs, i, one);
        PyTuple_SetItem(lmrs, i, lmr);  /* (holds the LMR ``seen`` borrows) */
        if (remotes && segments == previous && remote == previous_remote) {
            remotes[i] = remotes[i - 1];
        } else if (remotes) {
            unsigned long long addr = 0, rkey = 0;
            ok = batch_ready(remote, &sges[i], &addr, &rkey);
            remotes[i].addr = addr;
            remotes[i].rkey = (uint32_t)rkey;
        }
        previous = segments;
        previous_remote = remote;
    }
    Py_XDECREF(pz);
    return ok;
}

/* A batch's items on one segment each, taken apart and checked by take_items */
struct items {
    PyObject *snapshot, *segs, *lmrs, *cookies;  /* tuples: the items, then each's (seg,), LMR and cookie */
    struct ibv_sge *sges;
    struct remote_at *remotes;  /* an RDMA batch's (width 3), else NULL */
    Py_ssize_t n;
};

/* Take ``items`` (an exact list or tuple of tuples of ``width``) apart into ``out``: a snapshot first
 * (the checks read attributes, which may run Python that changes the caller's list), then every
 * item checked by check_items against ``owner``, its cookie its last element.  1: go on; 0: not
 * this case; -1: error.  release_items(out) afterwards in every case. */
static int take_items(PyObject *owner, PyObject *items, Py_ssize_t width, int writes, struct items *out)
{
    memset(out, 0, sizeof(*out));
    out->snapshot = PySequence_Tuple(items);
    Py_ssize_t n = out->n = out->snapshot ? PyTuple_Size(out->snapshot) : -1;
    if (n <= 0)
        return n == 0 ? 0 : -1;
    out->segs = PyTuple_New(n);
    out->lmrs = PyTuple_New(n);
    out->cookies = PyTuple_New(n);
    out->sges = PyMem_Calloc((size_t)n, sizeof(*out->sges));
    out->remotes = width == 3 ? PyMem_Calloc((size_t)n, sizeof(*out->remotes)) : NULL;
    if (!out->segs || !out->lmrs || !out->cookies || !out->sges || (width == 3 && !out->remotes)) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    int ok = check_items(owner, out->snapshot, width, out->segs, out->lmrs, out->sges, out->remotes, writes);
    for (Py_ssize_t i = 0; ok == 1 && i < n; i++) {
        PyObject *cookie = PyTuple_GetItem(PyTuple_GetItem(out->snapshot, i), width - 1);
        Py_INCREF(cookie);
        PyTuple_SetItem(out->cookies, i, cookie);
    }
    return ok;
}

static void release_items(struct items *it)
{
    PyMem_Free(it->sges);
    PyMem_Free(it->remotes);
    Py_XDECREF(it->cookies); Py_XDECREF(it->lmrs); Py_XDECREF(it->segs); Py_XDECREF(it->snapshot);
}

/* lmrs[i]._inflight += 1 for the items in [0, n), once per run of items on one LMR, before a
 * batch's post (as count_before_post): 0, or -1 with none of them counted. */
static void uncount_items(PyObject *lmrs, Py_ssize_t start, Py_ssize_t stop);

static int count_items(PyObject *lmrs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0, run; i < n; i += run) {
        PyObject *lmr = PyTuple_GetItem(lmrs, i);
        for (run = 1; i + run < n && PyTuple_GetItem(lmrs, i + run) == lmr; run++)
            ;
        if (add_inflight(lmr, run) < 0) {
            uncount_items(lmrs, 0, i);
            return -1;
        }
    }
    return 0;
}

/* Take back the counts of the items in [start, stop) (they were not posted), as uncount_unposted */
static void uncount_items(PyObject *lmrs, Py_ssize_t start, Py_ssize_t stop)
{
    for (Py_ssize_t i = start, run; i < stop; i += run) {
        PyObject *lmr = PyTuple_GetItem(lmrs, i);
        for (run = 1; i + run < stop && PyTuple_GetItem(lmrs, i + run) == lmr; run++)
            ;
        uncount_unposted(lmr, run);
    }
}

/* What a send-side batch's requests share: the opcode (a send, RDMA write or RDMA read), their
 * send flags and UNSIGNALLED marks (the last request's apart), and the inline limit (-1: none) */
struct batch_bits {
    enum ibv_wr_opcode opcode;
    unsigned int flags, last_flags;
    int quiet, last_quiet;
    long long max_inline;
};

/* The UNSIGNALLED marks of a send batch of which ``posted`` of ``n`` went: the requests before the
 * last when they are quiet, the last when it is.  0 or -1. */
static int mark_batch_quiet(PyObject *ep, unsigned long long first, Py_ssize_t posted, Py_ssize_t n,
                            const struct batch_bits *bits)
{
    if (bits->quiet && mark_quiet(ep, first, posted < n ? posted : n - 1) < 0)
        return -1;
    if (bits->last_quiet && posted == n && mark_quiet(ep, first + 2 * (unsigned long long)(n - 1), 1) < 0)
        return -1;
    return 0;
}

/* A run (one send-queue entry for the n requests of a batch) of which the queue took only ``posted``
 * (at least 1): its entry is swapped for one of what went (a deque's item assignment allocates
 * nothing), and the others' counts are taken back.  If that entry cannot be made (memory), or
 * Python run meanwhile added to the queue, the run stays whole and counted whole: that refuses a
 * free and loses nothing. */
static void shorten_run(PyObject *ep, PyObject *lmr, PyObject *run, unsigned long long first, PyObject *cookies,
                        PyObject *op, PyObject *segs, Py_ssize_t posted, Py_ssize_t n)
{
    PyObject *went = PyTuple_GetSlice(cookies, 0, posted), *made = NULL, *entry = NULL;
    if (went != NULL)
        made = posted > 1 ? run_entry(first, went, op, segs) : entries(first, went, 1, op, segs, 0);
    entry = made == NULL ? NULL : posted > 1 ? made : PyList_GetItem(made, 0);
    PyObject *q = entry ? PyObject_GetAttr(ep, s_send_q) : NULL;
    Py_ssize_t len = q ? PyObject_Length(q) : -1;
    PyObject *last = len > 0 ? PySequence_GetItem(q, len - 1) : NULL;
    if (last != NULL && last == run && PySequence_SetItem(q, len - 1, entry) == 0)
        uncount_unposted(lmr, n - posted);
    if (PyErr_Occurred())
        drop_error();
    Py_XDECREF(last); Py_XDECREF(q); Py_XDECREF(made); Py_XDECREF(went);
}

/* A send-side batch every item of which is on the very same one segment (and remote region): the
 * requests are one template posted n times, and when all but the last are suppressed the batch is
 * one send-queue entry, which its last completion retires whole (wr.SendRun).  ``cookies``,
 * ``segments`` and ``remote`` are same_items'. */
static PyObject *same_send_batch(PyObject *ep, struct ibv_qp *qp, const struct batch_bits *bits, PyObject *op,
                                 PyObject *cookies, PyObject *segments, PyObject *remote)
{
    PyObject *seg = one_segment(segments), *lmr = NULL, *segs = NULL, *queued = NULL, *result = NULL;
    unsigned long long remote_addr = 0, rkey = 0;
    struct ibv_sge sge;
    int ok = seg != NULL;
    if (ok == 1)
        ok = check_segment(ep, seg, &lmr, &sge, bits->opcode == IBV_WR_RDMA_READ);
    if (ok == 1)
        ok = batch_ready(remote, &sge, &remote_addr, &rkey);
    Py_ssize_t n = PyTuple_Size(cookies), posted = 0;
    int as_run = n > 1 && !(bits->flags & IBV_SEND_SIGNALED);  /* all but the last suppressed: a run */
    Py_ssize_t take = n;
    if (ok == 1 && (ok = batch_room(ep, s_send_q, s_send_limit, n, as_run, &take)) == 0) {
        result = batch_result(0, n, ENOMEM);  /* nothing fits: nothing done */
        goto done;
    }
    long long id = ok == 1 ? take_ids(ep, n) : -1;
    if (id >= 0)
        segs = PyTuple_Pack(1, seg);
    unsigned long long first = (unsigned long long)id * 2;
    if (segs != NULL)  /* made before the post: once it is posted, recording it must not need memory */
        queued = as_run ? run_entry(first, cookies, op, segs) : entries(first, cookies, n, op, segs, 0);
    int counted = queued != NULL && count_before_post(lmr, n) == 0, uncount = 1;
    if (queued != NULL && (ok = counted ? prepare_batch(ep, qp, s_send_q, as_run ? s_append : s_extend, queued,
                                                        as_run ? 1 : n, &uncount)
                                        : -1) != 1) {
        if (counted && uncount)
            uncount_unposted(lmr, n);
        Py_CLEAR(queued);
    }
    if (queued == NULL) {
        if (ok == 0)
            result = not_ready(0);  /* not the fast path (or closed: post.py's path says so) */
        goto done;
    }
    struct ibv_send_wr tmpl = { .opcode = bits->opcode, .send_flags = bits->flags, .sg_list = &sge, .num_sge = 1,
                                .wr.rdma.remote_addr = remote_addr, .wr.rdma.rkey = (uint32_t)rkey };
    /* (past the EP's room, what fits goes, its last request with last_flags: the batch's one
     * completion, which retires the others, is not lost with the rest) */
    int err = post_copies(qp, NULL, &tmpl, NULL, NULL, NULL, bits->max_inline, bits->last_flags, first, take, &posted);
    if (!err && posted < n)
        err = ENOMEM;
    if (posted < n && (!as_run || posted == 0)) {  /* refused part way (rare): take back what did not go */
        unrecord(ep, s_send_q, as_run ? 1 : n - posted, NULL);
        uncount_unposted(lmr, n - posted);
    } else if (posted < n) {
        shorten_run(ep, lmr, queued, first, cookies, op, segs, posted, n);
    }
    if (posted > 0 && mark_batch_quiet(ep, first, posted, take, bits) < 0)
        drop_error();  /* (the batch went: a mark missing only makes a flushed request report) */
    result = batch_result(posted, n, err);
done:
    Py_XDECREF(queued); Py_XDECREF(segs); Py_XDECREF(lmr); Py_XDECREF(seg);
    return result;
}

/* A send-side batch whose items are each on a segment (and remote region) of their own, as a pool
 * of buffers gives: checked by check_items, each request its own entry (wr_id, cookie, op, (seg,),
 * None), as post.py's _post_many records them. */
static PyObject *each_send_batch(PyObject *ep, struct ibv_qp *qp, const struct batch_bits *bits, PyObject *op,
                                 PyObject *items)
{
    PyObject *result = NULL, *queued = NULL;
    struct items it;
    int ok = take_items(ep, items, bits->opcode == IBV_WR_SEND ? 2 : 3, bits->opcode == IBV_WR_RDMA_READ, &it);
    Py_ssize_t n = it.n, posted = 0;
    Py_ssize_t take = n;
    if (ok == 1 && (ok = batch_room(ep, s_send_q, s_send_limit, n, 0, &take)) == 0) {
        result = batch_result(0, n, ENOMEM);  /* nothing fits: nothing done */
        goto done;
    }
    long long id = ok == 1 ? take_ids(ep, n) : -1;
    unsigned long long first = (unsigned long long)id * 2;
    if (id >= 0)  /* made before the post: once it is posted, recording it must not need memory */
        queued = entries(first, it.cookies, n, op, it.segs, 1);
    int counted = queued != NULL && count_items(it.lmrs, n) == 0, uncount = 1;
    if (queued != NULL && (ok = counted ? prepare_batch(ep, qp, s_send_q, s_extend, queued, n, &uncount) : -1) != 1) {
        if (counted && uncount)
            uncount_items(it.lmrs, 0, n);
        Py_CLEAR(queued);
    }
    if (queued == NULL) {
        if (ok == 0)
            result = not_ready(0);  /* not the fast path (or closed: post.py's path says so) */
        goto done;
    }
    struct ibv_send_wr tmpl = { .opcode = bits->opcode, .send_flags = bits->flags, .num_sge = 1 };
    int err = post_copies(qp, NULL, &tmpl, NULL, it.sges, it.remotes, bits->max_inline, bits->last_flags, first, take,
                          &posted);  /* (past the EP's room, what fits goes: see same_send_batch) */
    if (!err && posted < n)
        err = ENOMEM;
    uncount_items(it.lmrs, posted, n);
    unrecord(ep, s_send_q, n - posted, NULL);
    if (posted > 0 && mark_batch_quiet(ep, first, posted, take, bits) < 0)
        drop_error();  /* (the batch went: a mark missing only makes a flushed request report) */
    result = batch_result(posted, n, err);
done:
    Py_XDECREF(queued);
    release_items(&it);
    return result;
}

/* post_batch(ep, qp_address, opcode, op, items, flags, last_flags): post_send_batch (items
 * (segments, cookie)) and post_rdma_write_batch / post_rdma_read_batch (items (segments, remote,
 * cookie)), every item on one segment: the very same one (same_send_batch) or one each
 * (each_send_batch) -> n | (posted, n, errno) | None */
static PyObject *post_batch(PyObject *self, PyObject *args)
{
    PyObject *ep, *address, *opcode_obj, *op, *items, *flags, *last_flags, *segments = NULL, *remote = NULL;
    if (!PyArg_UnpackTuple(args, "post_batch", 7, 7, &ep, &address, &opcode_obj, &op, &items, &flags, &last_flags))
        return NULL;
    long opcode = PyLong_AsLong(opcode_obj);
    if (opcode != IBV_WR_SEND && opcode != IBV_WR_RDMA_WRITE && opcode != IBV_WR_RDMA_READ) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "post_batch: the opcode of a send, RDMA write or RDMA read");
        return NULL;
    }
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    long flag_word = 0, last_flag_word = 0;
    unsigned long long inline_limit = 0;
    struct batch_bits bits = { .opcode = (enum ibv_wr_opcode)opcode, .max_inline = -1 };
    struct ibv_qp *qp = NULL;
    int ok = flag_bits(flags, &flag_word, &bits.quiet);
    if (ok == 1 && last_flags == Py_None)
        last_flag_word = flag_word, bits.last_quiet = bits.quiet;
    else if (ok == 1)
        ok = flag_bits(last_flags, &last_flag_word, &bits.last_quiet);
    if (ok == 1)
        ok = ep_sends(ep, address, &qp);
    if (ok == 1 && opcode != IBV_WR_RDMA_READ && attr_ull(ep, s_max_inline, &inline_limit) < 0)
        ok = -1;
    if (ok != 1)
        return not_ready(ok);
    bits.flags = (unsigned int)flag_word;
    bits.last_flags = (unsigned int)last_flag_word;
    if (opcode != IBV_WR_RDMA_READ)
        bits.max_inline = (long long)inline_limit;
    PyObject *cookies = same_items(items, opcode == IBV_WR_SEND ? 2 : 3, &segments, &remote);
    if (cookies == NULL)
        return PyErr_Occurred() ? NULL : each_send_batch(ep, qp, &bits, op, items);
    PyObject *result = same_send_batch(ep, qp, &bits, op, cookies, segments, remote);
    Py_DECREF(segments); Py_XDECREF(remote); Py_DECREF(cookies);
    return result;
}

/* An EP's receive batch may go: it has no SRQ, is neither DISCONNECTED nor ERROR; *qp is its QP.
 * 1: go on; 0: the general path's (which says why); -1: error. */
static int ep_receives(PyObject *ep, PyObject *address, struct ibv_qp **qp)
{
    int ok = attr_is(ep, s_srq, Py_None);
    if (ok == 1)
        ok = attr_is(ep, s_rc, Py_True);  /* (a UD EP's receives must hold the GRH: post.py checks them) */
    if (ok == 1)
        ok = state_allows(ep, 0);
    if (ok == 1 && (*qp = qp_at(address)) == NULL)  /* (an open EP always has its QP's address) */
        ok = PyErr_Occurred() ? -1 : 0;
    return ok;
}

/* An SRQ's receive batch may go: it is OPERATIONAL and has its address (0 once freed). */
static int srq_receives(PyObject *srq, PyObject *address, struct ibv_srq **out)
{
    int ok = attr_is(srq, s_srq_state, srq_operational);
    unsigned long long at = ok == 1 ? PyLong_AsUnsignedLongLong(address) : 0;
    if (ok == 1 && (at == 0 || at == (unsigned long long)-1))
        ok = PyErr_Occurred() ? -1 : 0;
    *out = (struct ibv_srq *)(uintptr_t)at;
    return ok;
}

/* A receive batch whose items are each on one segment (the very same one, as a stream on one buffer
 * posts, or one each, as a pool of buffers is refilled), checked by check_items against ``owner``
 * (the EP or the SRQ).  Posted to ``qp``, or ``srq`` when not NULL, and recorded as the general
 * path records: the EP's _recv_q entries (wr_id, cookie, (seg,)), or the SRQ's
 * _posted[wr_id] = (cookie, (seg,)), and each LMR's in-flight count.
 * n | (posted, n, errno) | None (not this case; nothing done). */
static PyObject *each_recv_batch(PyObject *owner, struct ibv_qp *qp, struct ibv_srq *srq, PyObject *items)
{
    PyObject *result = NULL, *records = NULL, *map = NULL;
    struct items it;
    /* (``items`` is an exact list or tuple: the callers looked before reading the owner's state) */
    int ok = take_items(owner, items, 2, 1, &it);
    Py_ssize_t n = it.n, posted = 0;
    if (ok == 1 && srq != NULL) {
        map = PyObject_GetAttr(owner, s_posted);
        ok = map == NULL ? -1 : PyDict_Check(map);
    }
    Py_ssize_t take = n;
    if (ok == 1 && (ok = batch_room(owner, srq != NULL ? s_posted : s_recv_q, srq != NULL ? s_max_wr : s_recv_limit,
                                    n, 0, &take)) == 0) {
        result = batch_result(0, n, ENOMEM);  /* nothing fits: nothing done */
        goto done;
    }
    long long id = ok == 1 ? take_ids(owner, n) : -1;
    unsigned long long first = (unsigned long long)id * 2 + 1;
    if (id >= 0)  /* the records before the post: once it is posted, recording must not need memory */
        records = PyTuple_New(n);
    for (Py_ssize_t i = 0; records != NULL && i < n; i++) {
        PyObject *cookie = PyTuple_GetItem(it.cookies, i), *segs = PyTuple_GetItem(it.segs, i), *record = NULL;
        PyObject *wr_id = PyLong_FromUnsignedLongLong(first + 2 * (unsigned long long)i);
        if (wr_id != NULL)
            record = srq ? PyTuple_Pack(2, cookie, segs) : PyTuple_Pack(3, wr_id, cookie, segs);
        if (record != NULL && srq != NULL) {  /* (the SRQ's record is keyed by the wr_id: kept beside it) */
            PyObject *keyed = PyTuple_Pack(2, wr_id, record);
            Py_DECREF(record);
            record = keyed;
        }
        Py_XDECREF(wr_id);
        if (record == NULL)
            Py_CLEAR(records);
        else
            PyTuple_SetItem(records, i, record);
    }
    int counted = records != NULL && count_items(it.lmrs, n) == 0, uncount = 1;
    if (records != NULL && (ok = !counted ? -1 : srq != NULL ? prepare_srq_batch(owner, srq, map, records, &uncount)
                                                              : prepare_batch(owner, qp, s_recv_q, s_extend, records, n,
                                                                              &uncount)) != 1) {
        if (counted && uncount)
            uncount_items(it.lmrs, 0, n);
        Py_CLEAR(records);
    }
    if (records == NULL) {
        if (ok == 0)
            result = not_ready(0);  /* not the fast path (or closed: post.py's path says so) */
        goto done;
    }
    struct ibv_recv_wr tmpl = { .next = NULL, .sg_list = NULL, .num_sge = 1 };
    int err = post_copies(qp, srq, NULL, &tmpl, it.sges, NULL, -1, 0, first, take, &posted);
    if (!err && posted < n)
        err = ENOMEM;  /* (past the owner's room: room_in) */
    uncount_items(it.lmrs, posted, n);
    if (srq != NULL)
        unrecord_srq(map, records, posted, n);
    else
        unrecord(owner, s_recv_q, n - posted, NULL);
    result = batch_result(posted, n, err);
done:
    Py_XDECREF(records); Py_XDECREF(map);
    release_items(&it);
    return result;
}

/* post_recv_batch(ep, qp_address, items) -> n | (posted, n, errno) | None: EP.post_recv_batch's fast
 * path (post.py), every item on one segment (each_recv_batch) */
static PyObject *post_recv_batch(PyObject *self, PyObject *args)
{
    PyObject *ep, *address, *items;
    struct ibv_qp *qp = NULL;
    if (!PyArg_UnpackTuple(args, "post_recv_batch", 3, 3, &ep, &address, &items))
        return NULL;
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    int ready = ep_receives(ep, address, &qp);
    return ready == 1 ? each_recv_batch(ep, qp, NULL, items) : not_ready(ready);
}

/* srq_post_recv_batch(srq, srq_address, items) -> n | (posted, n, errno) | None: SRQ.post_recv_batch's
 * fast path (srq.py), every item on one segment (each_recv_batch), the SRQ not in error */
static PyObject *srq_post_recv_batch(PyObject *self, PyObject *args)
{
    PyObject *srq, *address, *items;
    struct ibv_srq *queue = NULL;
    if (!PyArg_UnpackTuple(args, "srq_post_recv_batch", 3, 3, &srq, &address, &items))
        return NULL;
    if (srq_operational == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._posts: configure_srq() first");
        return NULL;
    }
    if (!PyList_CheckExact(items) && !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    int ready = srq_receives(srq, address, &queue);
    return ready == 1 ? each_recv_batch(srq, NULL, queue, items) : not_ready(ready);
}

/* configure_srq(SRQState.OPERATIONAL): the state srq_post_recv_batch posts in */
static PyObject *configure_srq(PyObject *self, PyObject *state)
{
    if (srq_operational != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aiodat._shim._posts.configure_srq is called once");
        return NULL;
    }
    Py_INCREF(state);
    srq_operational = state;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Segment, CompletionFlags, send_bits, DTOOp.SEND, CONNECTED, DISCONNECTED, ERROR, SendRun, "
     "RemoteRegion)."},
    {"post_recv", post_recv, METH_VARARGS,
     "post_recv(ep, qp_address, segments, cookie) -> 0 posted, errno refused, -1 not the hot path."},
    {"post_send", post_send, METH_VARARGS,
     "post_send(ep, qp_address, segments, cookie, flags) -> 0 posted, errno refused, -1 not the hot path."},
    {"post_batch", post_batch, METH_VARARGS,
     "post_batch(ep, qp_address, opcode, op, items, flags, last_flags) -> n posted, (posted, n, errno) "
     "refused part way, None not the fast path."},
    {"post_recv_batch", post_recv_batch, METH_VARARGS,
     "post_recv_batch(ep, qp_address, items) -> n posted, (posted, n, errno) refused part way, None not the "
     "fast path."},
    {"configure_srq", configure_srq, METH_O, "configure_srq(SRQState.OPERATIONAL)."},
    {"srq_post_recv_batch", srq_post_recv_batch, METH_VARARGS,
     "srq_post_recv_batch(srq, srq_address, items) -> n posted, (posted, n, errno) refused part way, None not "
     "the fast path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiodat._shim._posts",
    "The hot paths of EP.post_recv, EP.post_send and the batch posts on one segment, in C (see post.py).", -1,
    methods,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__posts(void)
{
    INTERN(s_srq, "_srq"); INTERN(s_closed, "_closed"); INTERN(s_lmr, "lmr"); INTERN(s_pz, "_pz");
    INTERN(s_conn, "_conn"); INTERN(s_state, "state"); INTERN(s_ids, "_ids"); INTERN(s_address, "address");
    INTERN(s_offset, "offset"); INTERN(s_length, "length"); INTERN(s_lkey, "lmr_context");
    INTERN(s_writable, "_writable");
    INTERN(s_inflight, "_inflight"); INTERN(s_recv_q, "_recv_q"); INTERN(s_send_q, "_send_q");
    INTERN(s_quiet, "_quiet"); INTERN(s_rc, "_rc"); INTERN(s_max_inline, "max_inline");
    INTERN(s_append, "append"); INTERN(s_add, "add"); INTERN(s_extend, "extend"); INTERN(s_pop, "pop"); INTERN(s_discard, "discard");
    INTERN(s_qp_address, "_qp_address"); INTERN(s_srq_address, "_srq_address");
    INTERN(s_rmr_context, "rmr_context"); INTERN(s_srq_state, "_state"); INTERN(s_posted, "_posted");
    INTERN(s_send_limit, "_send_limit"); INTERN(s_recv_limit, "_recv_limit"); INTERN(s_max_wr, "_max_wr");
    if (count_type == NULL && (count_type = module_attr("itertools", "count")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
