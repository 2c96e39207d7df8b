/* aiodat/_shim/streamcore.c: the extension module aiodat._shim._streamcore.
 *
 * StreamState, the base class of the stream protocol's state machine
 * (aiodat.streams.protocol.StreamCore): it holds the state a message touches
 * in C and does a small message's common steps, the ones every round trip of a
 * request/response stream takes, without the interpreter:
 *
 *   write_bytes(data)        buffer a bytes object to send;
 *   take_data(dest, base, slot_size)
 *                            commit one DATA send of the pending bytes and copy
 *                            its header and payload into its send slot;
 *   on_data(slot, buf, offset, length)
 *                            take a received DATA message's credits;
 *   data_consumed(slot, length)
 *                            its slot is re-posted: owe the peer its credit.
 *
 * Each does what the Python it replaced did, step for step; a case that is not
 * theirs (a window write, a flag, a paused reader, anything unusual) changes
 * nothing and says so, and StreamCore's Python takes it (next_send/sent,
 * on_received/consumed), so the protocol's rules stay in protocol.py.  The
 * state is plain members, which StreamCore's Python reads and writes as
 * attributes (``self._credits``...); StreamCore.__init__ sets every one.
 *
 * Two more types are the transport's side of the same messages
 * (streams/transport.py), made once per connection: Receiver is the stream
 * EVD's callback, and takes a received DATA message from its completion event
 * to the protocol's data_received, the slot's re-post and the credit owed;
 * Sender takes a small write from write() to its post, with the flush of the
 * loop iteration's writes scheduled in between.  They too take only the common
 * case and leave everything else to the transport's Python, which they reach
 * through a weak reference (a stream the program drops is still collected).
 *
 * Limited API (abi3), as completions.c and posts.c; buffers are read as bytes
 * and bytearray objects (the 3.9 limited API has no buffer protocol).
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 8
#define MSG_DATA 1
#define KEEP_FROM 16384 /* protocol.py's _KEEP_FROM: bytes kept by reference from this size on */

static PyObject *s_data_msgs, *s_bytes_sent, *s_bytes_received;
static PyObject *state_type;  /* StreamState, set at import */

typedef struct {
    PyObject_HEAD
    long long credits, owed, pending, head, unsignalled, signal_every, low_slots, payload_max, bulk_from,
        release_pending, peer_credits, nslots;
    char eof_requested, eof_sent, eof_received, reading;
    PyObject *free_slots, *chunks, *posted, *recv_posted, *held, *stats, *send_cookies;
} State;

#define OBJ_MEMBERS(X) X(free_slots) X(chunks) X(posted) X(recv_posted) X(held) X(stats) X(send_cookies)

/* The collector's three functions of a type whose object members are listed by OBJECTS(X) */
#define VISIT(f) Py_VISIT(self->f);
#define CLEAR(f) Py_CLEAR(self->f);
#define IS_NULL(f) || self->f == NULL
#define GC_FUNCTIONS(prefix, Type, OBJECTS) \
    static int prefix##_traverse(PyObject *op, visitproc visit, void *arg) \
    { \
        Type *self = (Type *)op; \
        OBJECTS(VISIT) \
        Py_VISIT(Py_TYPE(op));  /* a heap type's instances own a reference to it */ \
        return 0; \
    } \
    static int prefix##_clear(PyObject *op) \
    { \
        Type *self = (Type *)op; \
        OBJECTS(CLEAR) \
        return 0; \
    } \
    static void prefix##_dealloc(PyObject *op) \
    { \
        PyTypeObject *type = Py_TYPE(op); \
        PyObject_GC_UnTrack(op); \
        prefix##_clear(op); \
        ((freefunc)PyType_GetSlot(type, Py_tp_free))(op); \
        Py_DECREF(type); \
    }

GC_FUNCTIONS(state, State, OBJ_MEMBERS)

/* -1 with a TypeError when a constructor that takes positional arguments only got keywords */
static int positional_only(PyObject *kwds, const char *name)
{
    if (kwds != NULL && PyObject_Size(kwds) > 0) {
        PyErr_Format(PyExc_TypeError, "%s() takes positional arguments only", name);
        return -1;
    }
    return 0;
}

/* a new, zeroed instance of ``type`` */
static void *alloc_instance(PyTypeObject *type)
{
    return ((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
}

/* 0 when every container member is set and of the type the methods rely on, else -1 with an error */
static int check_members(State *self)
{
    if (self->free_slots && PyList_Check(self->free_slots) && self->chunks && PyList_Check(self->chunks)
        && self->posted && PyList_Check(self->posted) && self->recv_posted && PyList_Check(self->recv_posted)
        && self->held && self->stats && PyDict_Check(self->stats) && self->send_cookies
        && PyList_Check(self->send_cookies))
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "StreamState: the state's containers are not set up (StreamCore.__init__ "
                                        "sets them: _free_slots, _chunks, _posted, _recv_posted, _send_cookies "
                                        "lists, _held, stats dict)");
    return -1;
}

/* stats[key] += by */
static void stat_add(State *self, PyObject *key, long long by)
{
    /* Called once the state has changed: a count never fails the stream.  A value the program put
     * there that is not an int starts again from 0; a failed allocation leaves the count behind. */
    PyObject *old = PyDict_GetItem(self->stats, key);  /* borrowed */
    long long value = old && PyLong_Check(old) ? PyLong_AsLongLong(old) : 0;
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        value = 0;
    }
    PyObject *now = PyLong_FromLongLong(value + by);
    if (now == NULL || PyDict_SetItem(self->stats, key, now) < 0)
        PyErr_Clear();
    Py_XDECREF(now);
}

/* the bytes of a bytes or bytearray object, else NULL (no error set) */
static char *bytes_of(PyObject *obj, Py_ssize_t *size)
{
    if (PyBytes_CheckExact(obj)) {
        *size = PyBytes_Size(obj);
        return PyBytes_AsString(obj);
    }
    if (PyByteArray_CheckExact(obj)) {
        *size = PyByteArray_Size(obj);
        return PyByteArray_AsString(obj);
    }
    return NULL;
}

/* write_bytes(data): buffer a bytes object (StreamCore.write's case for bytes) */
static PyObject *write_bytes(PyObject *op, PyObject *data)
{
    State *self = (State *)op;
    if (check_members(self) < 0)
        return NULL;
    if (!PyBytes_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "write_bytes() takes a bytes object");
        return NULL;
    }
    if (self->eof_requested) {
        PyErr_SetString(PyExc_RuntimeError, "Cannot write after write_eof()");
        return NULL;
    }
    Py_ssize_t n = PyBytes_Size(data), nchunks = PyList_Size(self->chunks);
    PyObject *last = nchunks ? PyList_GetItem(self->chunks, nchunks - 1) : NULL;  /* borrowed */
    if (n >= KEEP_FROM) {
        if (PyList_Append(self->chunks, data) < 0)
            return NULL;
    } else if (last != NULL && PyByteArray_CheckExact(last)) {
        /* several small writes become one chunk (and so one DATA message) */
        Py_ssize_t before = PyByteArray_Size(last);
        if (PyByteArray_Resize(last, before + n) < 0)
            return NULL;
        memcpy(PyByteArray_AsString(last) + before, PyBytes_AsString(data), (size_t)n);
    } else {
        PyObject *copy = PyByteArray_FromStringAndSize(PyBytes_AsString(data), n);
        int err = copy ? PyList_Append(self->chunks, copy) : -1;
        Py_XDECREF(copy);
        if (err < 0)
            return NULL;
    }
    self->pending += n;
    Py_RETURN_NONE;
}

/* take_data(dest, base, slot_size) -> (slot, wire_length, signalled) | None */
static PyObject *take_data(PyObject *op, PyObject *args)
{
    State *self = (State *)op;
    PyObject *dest;
    Py_ssize_t base, slot_size;
    if (!PyArg_ParseTuple(args, "Onn:take_data", &dest, &base, &slot_size) || check_members(self) < 0)
        return NULL;
    Py_ssize_t nfree = PyList_Size(self->free_slots);
    long long n = self->pending, owed = self->owed;
    if (!nfree || !n || self->credits <= 0 || PyList_Size(self->chunks) != 1 || self->head || n > self->payload_max
        || n >= self->bulk_from || self->eof_requested || self->release_pending || owed > 0xFFFF)
        Py_RETURN_NONE;
    PyObject *chunk = PyList_GetItem(self->chunks, 0);  /* borrowed */
    Py_ssize_t chunk_len, dest_len;
    char *src = bytes_of(chunk, &chunk_len);
    if (src == NULL || chunk_len != n)
        Py_RETURN_NONE;
    if (!PyByteArray_CheckExact(dest)) {
        PyErr_SetString(PyExc_TypeError, "take_data(): dest must be a bytearray (the registered arena)");
        return NULL;
    }
    PyObject *slot_obj = PyList_GetItem(self->free_slots, nfree - 1);  /* borrowed */
    long long slot = PyLong_AsLongLong(slot_obj);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    dest_len = PyByteArray_Size(dest);
    if (slot < 0 || slot >= PyList_Size(self->send_cookies) || base < 0 || slot_size < HEADER_SIZE + n
        || base > dest_len || slot_size > dest_len || (slot + 1) * (long long)slot_size > dest_len - base) {
        PyErr_Format(PyExc_ValueError, "take_data(): send slot %lld of %zd bytes at %zd does not fit a "
                     "%zd-byte dest, or a %lld-byte message does not fit the slot",
                     slot, slot_size, base, dest_len, (long long)HEADER_SIZE + n);
        return NULL;
    }
    int signalled = self->unsignalled >= self->signal_every || nfree - 1 < self->low_slots;
    /* what can fail first, then the state changes, which cannot */
    PyObject *result = Py_BuildValue("(LnO)", slot, (Py_ssize_t)(HEADER_SIZE + n), signalled ? Py_True : Py_False);
    if (result == NULL || PyList_Append(self->posted, PyList_GetItem(self->send_cookies, (Py_ssize_t)slot)) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    /* those allocations may have run a finalizer that wrote to this stream (a bytearray chunk grows,
     * and may move): if what was looked at changed, the Python path takes it */
    if (PyList_Size(self->chunks) != 1 || PyList_GetItem(self->chunks, 0) != chunk
        || PyList_Size(self->free_slots) != nfree || self->pending != n
        || (src = bytes_of(chunk, &chunk_len)) == NULL || chunk_len != n) {
        Py_ssize_t posted = PyList_Size(self->posted);
        PyList_SetSlice(self->posted, posted - 1, posted, NULL);
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    unsigned char *out = (unsigned char *)PyByteArray_AsString(dest) + base + slot * slot_size;
    out[0] = MSG_DATA;
    out[1] = 0;
    out[2] = (unsigned char)(owed >> 8);
    out[3] = (unsigned char)owed;
    out[4] = (unsigned char)(n >> 24);
    out[5] = (unsigned char)(n >> 16);
    out[6] = (unsigned char)(n >> 8);
    out[7] = (unsigned char)n;
    memcpy(out + HEADER_SIZE, src, (size_t)n);
    PyList_SetSlice(self->free_slots, nfree - 1, nfree, NULL);
    PyList_SetSlice(self->chunks, 0, 1, NULL);
    self->unsignalled = signalled ? 0 : self->unsignalled + 1;
    self->owed = 0;
    self->credits -= 1;
    self->pending = 0;
    stat_add(self, s_data_msgs, 1);
    stat_add(self, s_bytes_sent, n);
    return result;
}

/* copy_pending_into(dest, offset, n) -> bool: copy_pending()'s copy of the first n pending bytes into a
 * bytearray at ``offset`` (a window write's staging), in C: the Python loop over the chunks and their
 * views cost more than the memcpy on a 64 KiB chunk.  False, with nothing copied, when a chunk is
 * anything but bytes or a bytearray or fewer than n bytes are pending (copy_pending takes it). */
static PyObject *copy_pending_into(PyObject *op, PyObject *args)
{
    State *self = (State *)op;
    PyObject *dest;
    Py_ssize_t offset, n;
    if (!PyArg_ParseTuple(args, "Onn:copy_pending_into", &dest, &offset, &n) || check_members(self) < 0)
        return NULL;
    if (!PyByteArray_CheckExact(dest)) {
        PyErr_SetString(PyExc_TypeError, "copy_pending_into(): dest must be a bytearray (the registered arena)");
        return NULL;
    }
    Py_ssize_t dest_len = PyByteArray_Size(dest);
    if (n < 0 || offset < 0 || offset > dest_len || n > dest_len - offset) {
        PyErr_Format(PyExc_ValueError, "copy_pending_into(): %zd bytes at %zd do not fit a %zd-byte dest",
                     n, offset, dest_len);
        return NULL;
    }
    if (n > self->pending || self->head < 0)
        Py_RETURN_FALSE;
    /* first every chunk it takes checked, then the copies: nothing between them allocates or runs Python,
     * so the chunks cannot change under the copy */
    Py_ssize_t nchunks = PyList_Size(self->chunks), head = (Py_ssize_t)self->head, need = n, i;
    for (i = 0; i < nchunks && need; i++, head = 0) {
        Py_ssize_t len;
        if (bytes_of(PyList_GetItem(self->chunks, i), &len) == NULL || head > len)
            Py_RETURN_FALSE;
        need -= len - head < need ? len - head : need;
    }
    if (need)
        Py_RETURN_FALSE;
    char *out = PyByteArray_AsString(dest) + offset;
    head = (Py_ssize_t)self->head;
    need = n;
    for (i = 0; need; i++, head = 0) {
        Py_ssize_t len = 0;
        char *src = bytes_of(PyList_GetItem(self->chunks, i), &len);
        Py_ssize_t take = len - head < need ? len - head : need;
        memmove(out, src + head, (size_t)take);
        out += take;
        need -= take;
    }
    Py_RETURN_TRUE;
}

/* A DATA message's payload length when it is on_data()'s case (and its credits taken), -1 when it is
 * not (nothing changed), -2 on an error (set). */
static long long take_message(State *self, Py_ssize_t slot, PyObject *buf, Py_ssize_t offset, Py_ssize_t length)
{
    Py_ssize_t buf_len;
    if (length < HEADER_SIZE || !self->reading || self->eof_received || slot < 0 || slot >= self->nslots
        || slot >= PyList_Size(self->recv_posted))
        return -1;
    Py_ssize_t held = PyObject_Size(self->held);
    if (held < 0)
        return -2;
    PyObject *posted = PyList_GetItem(self->recv_posted, slot);  /* borrowed */
    int is_posted = posted ? PyObject_IsTrue(posted) : -1;
    if (is_posted < 0)
        return -2;
    if (held || !is_posted)
        return -1;
    const unsigned char *in = (const unsigned char *)bytes_of(buf, &buf_len);
    if (in == NULL) {
        PyErr_SetString(PyExc_TypeError, "on_data(): buf must be bytes or a bytearray");
        return -2;
    }
    if (offset < 0 || offset > buf_len - HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "on_data(): a header at %zd does not fit a %zd-byte buffer", offset, buf_len);
        return -2;
    }
    in += offset;
    long long credits = (long long)in[2] << 8 | in[3];
    long long plen = (long long)in[4] << 24 | (long long)in[5] << 16 | (long long)in[6] << 8 | in[7];
    if (in[0] != MSG_DATA || in[1] || plen > length - HEADER_SIZE || self->credits + credits > self->peer_credits)
        return -1;
    Py_INCREF(Py_False);
    if (PyList_SetItem(self->recv_posted, slot, Py_False) < 0)  /* (steals the reference) */
        return -2;
    self->credits += credits;
    return plen;
}

/* data_consumed's work: the slot is posted again, one credit owed */
static int consume_message(State *self, Py_ssize_t slot, long long length)
{
    Py_INCREF(Py_True);
    if (PyList_SetItem(self->recv_posted, slot, Py_True) < 0)  /* (steals the reference) */
        return -1;
    self->owed += 1;
    stat_add(self, s_bytes_received, length);
    return 0;
}

/* on_data(slot, buf, offset, length) -> payload length | -1 */
static PyObject *on_data(PyObject *op, PyObject *args)
{
    State *self = (State *)op;
    PyObject *buf;
    Py_ssize_t slot, offset, length;
    if (!PyArg_ParseTuple(args, "nOnn:on_data", &slot, &buf, &offset, &length) || check_members(self) < 0)
        return NULL;
    long long n = take_message(self, slot, buf, offset, length);
    return n == -2 ? NULL : PyLong_FromLongLong(n);
}

/* data_consumed(slot, length) */
static PyObject *data_consumed(PyObject *op, PyObject *args)
{
    State *self = (State *)op;
    Py_ssize_t slot;
    long long length;
    if (!PyArg_ParseTuple(args, "nL:data_consumed", &slot, &length) || check_members(self) < 0)
        return NULL;
    if (slot < 0 || slot >= PyList_Size(self->recv_posted)) {
        PyErr_Format(PyExc_IndexError, "data_consumed(): no receive slot %zd", slot);
        return NULL;
    }
    if (consume_message(self, slot, length) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef state_methods[] = {
    {"write_bytes", write_bytes, METH_O,
     "write_bytes(data): buffer a bytes object to send (write()'s case for bytes); RuntimeError after "
     "write_eof()."},
    {"take_data", take_data, METH_VARARGS,
     "take_data(dest, base, slot_size) -> (slot, wire_length, signalled) or None.\n\n"
     "next_send(), copy_pending() and sent() in one step for a small write's common case: every pending byte is "
     "one buffered chunk that fits one DATA message, a credit and a send slot are free, and no EOF or window "
     "release is due.  Commits that DATA send and writes its header and payload into send slot ``slot`` of "
     "``dest`` (a bytearray; slot i starts at base + i * slot_size): post ``wire_length`` bytes from there, "
     "signalled or not.  None when it is not that case (nothing changed: use next_send)."},
    {"copy_pending_into", copy_pending_into, METH_VARARGS,
     "copy_pending_into(dest, offset, n) -> bool.\n\n"
     "copy_pending() into the bytearray ``dest`` at ``offset``, in C: True when the first ``n`` pending bytes "
     "were copied there (nothing else changes: sent() commits them); False, with nothing copied, when it is "
     "not its case (a chunk that is not bytes or a bytearray, fewer than ``n`` bytes pending): use copy_pending."},
    {"on_data", on_data, METH_VARARGS,
     "on_data(slot, buf, offset, length) -> payload length, or -1.\n\n"
     "on_received()'s common case, with no Message made: a well-formed DATA message with no flags, whose header "
     "is at ``offset`` in ``buf`` (bytes or a bytearray), into a posted slot while reading with nothing held.  "
     "Takes its credits and returns its payload length; hand the payload over, re-post the slot, then call "
     "data_consumed().  -1 when it is not that case (nothing changed: call on_received, which also says what "
     "is wrong)."},
    {"data_consumed", data_consumed, METH_VARARGS,
     "data_consumed(slot, length): consumed() for a DATA message of ``length`` payload bytes taken by on_data()."},
    {NULL, NULL, 0, NULL},
};

/* the underscored members are StreamCore's private state; the others are public, and documented */
#define LL(name, field) {name, T_LONGLONG, offsetof(State, field), 0, NULL}
#define BOOL(name, field) {name, T_BOOL, offsetof(State, field), 0, NULL}
#define OBJ(name, field) {name, T_OBJECT_EX, offsetof(State, field), 0, NULL}
#define DOC_LL(name, field, doc) {name, T_LONGLONG, offsetof(State, field), 0, doc}
#define DOC_BOOL(name, field, doc) {name, T_BOOL, offsetof(State, field), 0, doc}
#define DOC_OBJ(name, field, doc) {name, T_OBJECT_EX, offsetof(State, field), 0, doc}

static PyMemberDef state_members[] = {
    LL("_credits", credits), LL("_owed", owed), LL("_pending", pending), LL("_head", head),
    LL("_unsignalled", unsignalled), LL("_signal_every", signal_every), LL("_low_slots", low_slots),
    LL("_payload_max", payload_max), LL("_bulk_from", bulk_from), LL("_release_pending", release_pending),
    LL("_peer_credits", peer_credits),
    DOC_LL("nslots", nslots, "Send slots and receive slots this side has (StreamConfig.slots)."),
    DOC_BOOL("eof_requested", eof_requested, "write_eof() or close() was called: EOF goes once the buffer is empty."),
    DOC_BOOL("eof_sent", eof_sent, "The EOF message was sent: this side writes no more."),
    DOC_BOOL("eof_received", eof_received, "The peer's EOF arrived: it writes no more."),
    BOOL("_reading", reading),
    OBJ("_free_slots", free_slots), OBJ("_chunks", chunks), OBJ("_posted", posted), OBJ("_recv_posted", recv_posted),
    OBJ("_held", held),
    DOC_OBJ("stats", stats, "Messages and bytes moved, a dict: data_msgs, window_writes, window_writes_overlapped, "
                            "window_wraps, credit_msgs, bytes_sent, bytes_received (the transport's ``stats``)."),
    OBJ("_send_cookies", send_cookies),
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot state_slots[] = {
    {Py_tp_doc, "The state of one side of an aiodat stream and a small message's steps in C (base of StreamCore)."},
    {Py_tp_methods, state_methods},
    {Py_tp_members, state_members},
    {Py_tp_traverse, state_traverse},
    {Py_tp_clear, state_clear},
    {Py_tp_dealloc, state_dealloc},
    {0, NULL},
};

static PyType_Spec state_spec = {
    "aiodat._shim._streamcore.StreamState", sizeof(State), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, state_slots,
};

/* -- what the Receiver and the Sender share ------------------------------------------------------- */

static PyObject *s_cookie, *s_status, *s_transferred_length, *s_r, *s_data_received, *s_length, *s__protocol,
    *s__lost, *s__flush, *s__on_events, *s__batch_failed, *s__post_failed, *s__after_flush,
    *s__protocol_paused, *s__idle, *s_scheduled_flush, *s__qp_address, *s_post_recv, *s_post_send;
static PyObject *sender_type;  /* Sender, set at import */

/* a new reference to None (Py_NewRef is not in the 3.9 limited API) */
static PyObject *new_none(void)
{
    Py_INCREF(Py_None);
    return Py_None;
}

/* the transport a weak reference points to (a new reference), Py_None once it was collected, NULL on an error */
static PyObject *owner_of(PyObject *ref)
{
    return PyObject_CallObject(ref, NULL);
}

/* owner.<name>(arg) (arg may be NULL: no argument), its result or NULL */
static PyObject *call_owner(PyObject *owner, PyObject *name, PyObject *arg)
{
    return PyObject_CallMethodObjArgs(owner, name, arg, NULL);
}

/* owner.<name>(the exception being raised), which must be one of ``kinds``; else it propagates (NULL) */
static PyObject *hand_exception(PyObject *owner, PyObject *name, PyObject *kinds)
{
    if (!PyErr_ExceptionMatches(kinds))
        return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *result = call_owner(owner, name, value);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    return result;
}

/* A post on ``ep``: hot(ep, ep._qp_address, a, b[, c]), the EP's C hot path (aiodat._shim._posts, as post.py
 * calls it), and when that is not its case (or the post was refused) the EP's Python method ``name``, which
 * takes every other case and raises what is wrong.  A new reference to None, or NULL. */
static PyObject *post(PyObject *ep, PyObject *hot, PyObject *name, PyObject *a, PyObject *b, PyObject *c)
{
    if (a == NULL || b == NULL)  /* (a list item the caller could not get: its error is set) */
        return NULL;
    /* held: the callers pass list items, and the post's allocations may run a finalizer that changes the list */
    Py_INCREF(a);
    Py_INCREF(b);
    PyObject *result = NULL, *qp = PyObject_GetAttr(ep, s__qp_address);
    PyObject *err = qp ? PyObject_CallFunctionObjArgs(hot, ep, qp, a, b, c, NULL) : NULL;
    Py_XDECREF(qp);
    long code = err == NULL ? -2 : PyLong_Check(err) ? PyLong_AsLong(err) : -1;
    Py_XDECREF(err);
    if (code == 0)
        result = new_none();
    else if (!PyErr_Occurred())
        result = PyObject_CallMethodObjArgs(ep, name, a, b, c, NULL);
    Py_DECREF(a);
    Py_DECREF(b);
    return result;
}

/* -- Sender: a small write, from the core's take_data to the post, and the flush's scheduling ------- */

typedef struct {
    PyObject_HEAD
    PyObject *core, *take_args, *ep, *hot_post, *segs, *cookies, *slot_segment, *signalled, *suppress, *owner,
        *call_soon, *post_errors;
    char scheduled;
} Sender;

#define SENDER_OBJECTS(X) X(core) X(take_args) X(ep) X(hot_post) X(segs) X(cookies) X(slot_segment) X(signalled) \
    X(suppress) X(owner) X(call_soon) X(post_errors)

GC_FUNCTIONS(sender, Sender, SENDER_OBJECTS)

static PyObject *sender_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *core, *arena, *ep, *hot_post, *segs, *cookies, *slot_segment, *signalled, *suppress, *owner, *call_soon,
        *post_errors;
    Py_ssize_t send_base, slot_size;
    if (positional_only(kwds, "Sender") < 0 || !PyArg_ParseTuple(args, "OOnnOOOOOOOOOO:Sender", &core, &arena,
                          &send_base, &slot_size, &ep, &hot_post, &segs, &cookies, &slot_segment, &signalled,
                          &suppress, &owner, &call_soon, &post_errors))
        return NULL;
    if (PyObject_IsInstance(core, state_type) != 1 || !PyByteArray_CheckExact(arena) || !PyList_Check(segs)
        || !PyList_Check(cookies) || slot_size <= HEADER_SIZE || send_base < 0 || !PyCallable_Check(hot_post)
        || !PyCallable_Check(slot_segment) || !PyWeakref_CheckRef(owner) || !PyCallable_Check(call_soon)) {
        PyErr_SetString(PyExc_TypeError, "Sender(core: StreamState, arena: bytearray, send_base >= 0, slot_size > 8, "
                                         "ep, hot_post, segs: list, cookies: list, slot_segment, signalled, suppress, "
                                         "owner: weakref.ref, call_soon, post_errors)");
        return NULL;
    }
    PyObject *take_args = Py_BuildValue("(Onn)", arena, send_base, slot_size);
    if (take_args == NULL)
        return NULL;
    Sender *self = (Sender *)alloc_instance(type);
    if (self == NULL) {
        Py_DECREF(take_args);
        return NULL;
    }
    self->take_args = take_args;
#define KEEP(f) Py_INCREF(f); self->f = f;
    KEEP(core) KEEP(ep) KEEP(hot_post) KEEP(segs) KEEP(cookies) KEEP(slot_segment) KEEP(signalled) KEEP(suppress) KEEP(owner)
    KEEP(call_soon) KEEP(post_errors)
    return (PyObject *)self;
}

/* flush() -> True when a DATA send was committed and posted */
static PyObject *sender_flush(PyObject *op, PyObject *unused)
{
    Sender *self = (Sender *)op;
    if (0 SENDER_OBJECTS(IS_NULL))
        Py_RETURN_FALSE;  /* (its references were cleared by the collector) */
    PyObject *taken = take_data(self->core, self->take_args);
    if (taken == NULL)
        return NULL;
    if (taken == Py_None) {  /* not its case */
        Py_DECREF(taken);
        Py_RETURN_FALSE;
    }
    /* (slot, wire, signalled): committed; from here the send must be posted, or its failure raised */
    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GetItem(taken, 0));
    PyObject *wire = PyTuple_GetItem(taken, 1);  /* borrowed, as long as taken lives */
    int signalled = PyTuple_GetItem(taken, 2) == Py_True;
    PyObject *result = NULL, *seg = NULL;
    if (slot < 0 || slot >= PyList_Size(self->segs) || slot >= PyList_Size(self->cookies)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_IndexError, "Sender: no send slot %zd among its segments", slot);
        goto done;
    }
    seg = PyList_GetItem(self->segs, slot);
    Py_INCREF(seg);
    PyObject *length = PyObject_GetAttr(seg, s_length);
    int same = length ? PyObject_RichCompareBool(length, wire, Py_EQ) : -1;
    Py_XDECREF(length);
    if (same < 0)
        goto done;
    if (!same) {  /* a new length: the transport's Segment for it, kept for the next send of the slot */
        Py_DECREF(seg);
        seg = PyObject_CallFunctionObjArgs(self->slot_segment, PyTuple_GetItem(taken, 0), wire, NULL);
        if (seg == NULL)
            goto done;
    }
    result = post(self->ep, self->hot_post, s_post_send, seg, PyList_GetItem(self->cookies, slot),
                  signalled ? self->signalled : self->suppress);
done:
    Py_XDECREF(seg);
    Py_DECREF(taken);
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

/* schedule()'s work: call_soon(self.scheduled_flush) unless one is already scheduled; 0, or -1 with an error */
static int schedule_flush(Sender *self)
{
    if (self->scheduled || self->call_soon == NULL)
        return 0;
    PyObject *callback = PyObject_GetAttr((PyObject *)self, s_scheduled_flush);
    PyObject *handle = callback ? PyObject_CallFunctionObjArgs(self->call_soon, callback, NULL) : NULL;
    Py_XDECREF(callback);
    if (handle == NULL)
        return -1;
    Py_DECREF(handle);
    self->scheduled = 1;
    return 0;
}

static PyObject *sender_schedule(PyObject *op, PyObject *unused)
{
    if (schedule_flush((Sender *)op) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* write(data) -> bytes buffered: the core's write_bytes, then schedule() */
static PyObject *sender_write(PyObject *op, PyObject *data)
{
    Sender *self = (Sender *)op;
    if (self->core == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Sender: cleared by the collector");
        return NULL;
    }
    PyObject *done = write_bytes(self->core, data);
    if (done == NULL)
        return NULL;
    Py_DECREF(done);
    if (schedule_flush(self) < 0)
        return NULL;
    return PyLong_FromLongLong(((State *)self->core)->pending);
}

/* the truth of owner.<name>: 1, 0, or -1 with an error */
static int owner_flag(PyObject *owner, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(owner, name);
    int truth = value ? PyObject_IsTrue(value) : -1;
    Py_XDECREF(value);
    return truth;
}

/* scheduled_flush(): the flush call_soon runs (see the method's doc) */
static PyObject *sender_scheduled_flush(PyObject *op, PyObject *unused)
{
    Sender *self = (Sender *)op;
    self->scheduled = 0;
    if (0 SENDER_OBJECTS(IS_NULL))
        Py_RETURN_NONE;
    PyObject *owner = owner_of(self->owner), *result = NULL;
    if (owner == NULL || owner == Py_None)
        return owner;
    int lost = owner_flag(owner, s__lost);
    if (lost) {
        if (lost > 0)
            result = new_none();
        goto done;
    }
    PyObject *posted = sender_flush(op, NULL);
    if (posted == NULL) {
        result = hand_exception(owner, s__post_failed, self->post_errors);
        goto done;
    }
    Py_DECREF(posted);
    if (posted == Py_False) {  /* not the common case: the transport's Python flush */
        result = call_owner(owner, s__flush, NULL);
        goto done;
    }
    /* posted: what follows a flush, only when the protocol is paused or close() waits for the sends */
    int paused = owner_flag(owner, s__protocol_paused);
    PyObject *idle = paused < 0 ? NULL : PyObject_GetAttr(owner, s__idle);
    if (idle != NULL) {
        result = paused || idle != Py_None ? call_owner(owner, s__after_flush, NULL) : new_none();
        Py_DECREF(idle);
    }
done:
    Py_DECREF(owner);
    return result;
}

static PyMethodDef sender_methods[] = {
    {"flush", sender_flush, METH_NOARGS,
     "flush() -> bool.\n\n"
     "The core's take_data() into the arena's send slot and its post: hot_post(ep, ep._qp_address, segment, "
     "cookies[slot], signalled or suppress), the EP's C hot path, else (not its case) ep.post_send(the same), where segment is segs[slot] when its length is the wire length, else "
     "slot_segment(slot, wire) (which the transport keeps in segs).  True when posted; False, with nothing "
     "changed, when take_data() does not take the case.  An exception of the post (or of slot_segment) "
     "propagates with the DATA send committed, as the transport's Python path leaves it."},
    {"write", sender_write, METH_O,
     "write(data) -> int.\n\n"
     "The transport's write() of a bytes object: the core's write_bytes(data), then schedule(); returns the "
     "bytes now buffered (the core's ``buffered``)."},
    {"schedule", sender_schedule, METH_NOARGS,
     "schedule(): call_soon(scheduled_flush) unless a flush is already scheduled (``scheduled``): the writes of "
     "one loop iteration go out together."},
    {"scheduled_flush", sender_scheduled_flush, METH_NOARGS,
     "scheduled_flush(): the flush schedule() queued.  Nothing once the owner is collected or lost "
     "(``owner()._lost``).  Else flush(); a post_errors exception of it goes to owner()._post_failed(exc); when "
     "flush() does not take the case, owner()._flush() does the rest; after a post, owner()._after_flush() runs "
     "only when the owner's protocol is paused (``_protocol_paused``) or close() waits (``_idle`` is set)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef sender_members[] = {
    {"scheduled", T_BOOL, offsetof(Sender, scheduled), READONLY,
     "A flush of this loop iteration's writes is scheduled (call_soon) and has not run yet."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot sender_slots[] = {
    {Py_tp_doc, "Sender(core, arena, send_base, slot_size, ep, hot_post, segs, cookies, slot_segment, signalled, "
                "suppress, owner, call_soon, post_errors): a small write's DATA send, from the core's take_data() to "
                "the post, and the scheduling of the flush of a loop iteration's writes, in C (the stream transport's "
                "common case).  ``owner`` is a weak reference to the transport, whose Python takes every other "
                "case."},
    {Py_tp_new, sender_new},
    {Py_tp_methods, sender_methods},
    {Py_tp_members, sender_members},
    {Py_tp_traverse, sender_traverse},
    {Py_tp_clear, sender_clear},
    {Py_tp_dealloc, sender_dealloc},
    {0, NULL},
};

static PyType_Spec sender_spec = {
    "aiodat._shim._streamcore.Sender", sizeof(Sender), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, sender_slots,
};

/* -- Receiver: a batch of completions, and a received DATA message from its completion to the re-post -- */

typedef struct {
    PyObject_HEAD
    PyObject *core, *arena, *view, *owner, *ep, *hot_post, *segs, *cookies, *event_type, *post_errors, *sender;
    Py_ssize_t slot_size;
    char as_view, open, alive, delivered, protocol_failed;
} Receiver;

/* (the transport is reached through ``owner``, a weak reference: the EVD that holds on_events as its
 * callback must not keep a dropped stream alive) */
#define RECEIVER_OBJECTS(X) X(core) X(arena) X(view) X(owner) X(ep) X(hot_post) X(segs) X(cookies) X(event_type) \
    X(post_errors) X(sender)

GC_FUNCTIONS(receiver, Receiver, RECEIVER_OBJECTS)

static PyObject *receiver_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *core, *arena, *view, *owner, *ep, *hot_post, *segs, *cookies, *event_type, *post_errors, *sender;
    Py_ssize_t slot_size;
    int as_view;
    if (positional_only(kwds, "Receiver") < 0 || !PyArg_ParseTuple(args, "OOOnOpOOOOOOO:Receiver", &core, &arena, &view,
                          &slot_size, &owner, &as_view, &ep, &hot_post, &segs, &cookies, &event_type, &post_errors,
                          &sender))
        return NULL;
    if (PyObject_IsInstance(core, state_type) != 1 || !PyByteArray_CheckExact(arena) || !PyList_Check(segs)
        || !PyList_Check(cookies) || !PyType_Check(event_type) || slot_size <= HEADER_SIZE
        || !PyCallable_Check(hot_post) || !PyWeakref_CheckRef(owner) || (PyObject *)Py_TYPE(sender) != sender_type) {
        PyErr_SetString(PyExc_TypeError, "Receiver(core: StreamState, arena: bytearray, view, slot_size > 8, "
                                         "owner: weakref.ref, as_view, ep, hot_post, segs: list, cookies: list, "
                                         "event_type, post_errors, sender: Sender)");
        return NULL;
    }
    Receiver *self = (Receiver *)alloc_instance(type);
    if (self == NULL)
        return NULL;
    RECEIVER_OBJECTS(KEEP)
    self->slot_size = slot_size;
    self->as_view = (char)as_view;
    self->open = self->alive = 1;
    return (PyObject *)self;
}

/* attribute ``name`` of ``obj`` as a Py_ssize_t: 0, or -1 with an error */
static int attr_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* the receive slot of a successful receive completion of the stream's own (cookie ("r", slot)), -1 when it
 * is anything else, -2 on an error */
static Py_ssize_t own_receive(Receiver *self, PyObject *event)
{
    if ((PyObject *)Py_TYPE(event) != self->event_type)
        return -1;
    PyObject *cookie = PyObject_GetAttr(event, s_cookie);
    if (cookie == NULL)
        return -2;
    Py_ssize_t slot = -1;
    if (PyTuple_Check(cookie) && PyTuple_Size(cookie) == 2) {
        PyObject *kind = PyTuple_GetItem(cookie, 0), *index = PyTuple_GetItem(cookie, 1);
        int is_r = PyUnicode_Check(kind) ? PyObject_RichCompareBool(kind, s_r, Py_EQ) : 0;
        if (is_r < 0)
            slot = -2;
        else if (is_r && PyLong_Check(index)) {
            slot = PyLong_AsSsize_t(index);
            if (slot == -1 && PyErr_Occurred())
                PyErr_Clear();  /* (a huge index: not the stream's) */
            if (slot < 0)
                slot = -1;
        }
    }
    Py_DECREF(cookie);
    if (slot < 0)
        return slot;
    PyObject *status = PyObject_GetAttr(event, s_status);
    if (status == NULL)
        return -2;
    int ok = PyUnicode_Check(status) && PyUnicode_CompareWithASCIIString(status, "IBV_WC_SUCCESS") == 0;
    Py_DECREF(status);
    return ok ? slot : -1;
}

/* receive()'s work for the transport ``owner``: 1 when taken, 0 when not its case (nothing changed), -1 on
 * an error (protocol_failed set when data_received raised) */
static int receive_one(Receiver *self, PyObject *owner, PyObject *event)
{
    State *core = (State *)self->core;
    self->protocol_failed = 0;
    if (!self->open)
        return 0;  /* (closing: the Python path knows what is still delivered) */
    if (check_members(core) < 0)
        return -1;
    Py_ssize_t slot = own_receive(self, event), length;
    if (slot == -2 || (slot >= 0 && attr_ssize(event, s_transferred_length, &length) < 0))
        return -1;
    if (slot < 0 || slot >= PyList_Size(self->segs) || slot >= PyList_Size(self->cookies))
        return 0;
    Py_ssize_t base = slot * self->slot_size;
    long long n = take_message(core, slot, self->arena, base, length);
    if (n < 0)
        return n == -1 ? 0 : -1;
    base += HEADER_SIZE;
    PyObject *payload;
    if (self->as_view) {
        PyObject *start = PyLong_FromSsize_t(base), *stop = PyLong_FromLongLong(base + n);
        PyObject *slice = start && stop ? PySlice_New(start, stop, NULL) : NULL;
        payload = slice ? PyObject_GetItem(self->view, slice) : NULL;
        Py_XDECREF(slice); Py_XDECREF(start); Py_XDECREF(stop);
    } else {
        Py_ssize_t arena_len = 0;
        char *bytes = bytes_of(self->arena, &arena_len);
        payload = base + n <= arena_len ? PyBytes_FromStringAndSize(bytes + base, (Py_ssize_t)n) : NULL;
        if (payload == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Receiver: the payload runs past the arena");
    }
    if (payload == NULL)
        return -1;
    self->delivered = 1;
    /* looked up each time, as the transport's Python does: set_protocol() may change the protocol, and a
     * protocol may rebind its data_received */
    PyObject *protocol = PyObject_GetAttr(owner, s__protocol);
    PyObject *data_received = protocol ? PyObject_GetAttr(protocol, s_data_received) : NULL;
    PyObject *result = data_received ? PyObject_CallFunctionObjArgs(data_received, payload, NULL) : NULL;
    Py_XDECREF(data_received);
    Py_XDECREF(protocol);
    Py_DECREF(payload);
    if (result == NULL) {
        self->protocol_failed = 1;
        return -1;
    }
    Py_DECREF(result);
    if (!self->alive)  /* data_received ended the stream: the slot stays unposted, as the Python path leaves it */
        return 1;
    result = post(self->ep, self->hot_post, s_post_recv, PyList_GetItem(self->segs, slot),
                  PyList_GetItem(self->cookies, slot), NULL);
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(self->post_errors))
            return -1;
        PyErr_Clear();  /* the EP left CONNECTED or was freed: the connection's end follows */
        return 1;
    }
    Py_DECREF(result);
    return consume_message(core, slot, n) < 0 ? -1 : 1;
}

/* receive(event) -> True when taken: see the method's doc */
static PyObject *receiver_receive(PyObject *op, PyObject *event)
{
    Receiver *self = (Receiver *)op;
    self->protocol_failed = 0;
    if (!self->open RECEIVER_OBJECTS(IS_NULL))
        Py_RETURN_FALSE;  /* (closing; or its references were cleared by the collector) */
    PyObject *owner = owner_of(self->owner);
    if (owner == NULL)
        return NULL;
    int taken = owner == Py_None ? 0 : receive_one(self, owner, event);
    Py_DECREF(owner);
    if (taken < 0)
        return NULL;
    return PyBool_FromLong(taken);
}

/* on_events(events): the EVD's callback (see the method's doc) */
static PyObject *receiver_on_events(PyObject *op, PyObject *events)
{
    Receiver *self = (Receiver *)op;
    if (!PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "on_events() takes the EVD's list of events");
        return NULL;
    }
    if (0 RECEIVER_OBJECTS(IS_NULL))
        Py_RETURN_NONE;
    PyObject *owner = owner_of(self->owner), *result = NULL;
    if (owner == NULL || owner == Py_None)
        return owner;  /* (collected: nothing is left to deliver to) */
    if (!self->alive) {  /* (lost: its events are of no use) */
        result = new_none();
        goto done;
    }
    self->delivered = 0;
    for (Py_ssize_t i = 0; i < PyList_Size(events); i++) {
        PyObject *event = PyList_GetItem(events, i);
        Py_INCREF(event);
        int taken = receive_one(self, owner, event);
        Py_DECREF(event);
        if (taken < 0) {
            /* as asyncio's transports: any exception is the stream's (a protocol's CancelledError too),
             * but SystemExit and KeyboardInterrupt go on up */
            result = PyErr_ExceptionMatches(PyExc_SystemExit) || PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)
                ? NULL : hand_exception(owner, s__batch_failed, PyExc_BaseException);
            goto done;
        }
        if (!taken) {  /* the transport's Python takes this event and the rest */
            PyObject *start = PyLong_FromSsize_t(i);
            result = start ? PyObject_CallMethodObjArgs(owner, s__on_events, events, start, NULL) : NULL;
            Py_XDECREF(start);
            goto done;
        }
    }
    if (!self->alive) {
        result = new_none();
        goto done;
    }
    /* As the transport's _handle ends a batch: with data delivered, a flush after this loop iteration's
     * callbacks (the reader woken by data_received replies before it), and one now only for what
     * data_received wrote itself; with nothing delivered, a flush now. */
    if (!self->delivered || ((State *)self->core)->pending) {
        result = call_owner(owner, s__flush, NULL);
        if (result == NULL || !self->delivered)
            goto done;
        Py_DECREF(result);
        result = NULL;
    }
    if (schedule_flush((Sender *)self->sender) == 0)
        result = new_none();
done:
    Py_DECREF(owner);
    return result;
}

static PyMethodDef receiver_methods[] = {
    {"receive", receiver_receive, METH_O,
     "receive(event) -> bool.\n\n"
     "Take ``event`` when it is the common case: a successful receive completion of the stream's own (cookie "
     "(\"r\", slot)) holding a DATA message that core.on_data() takes, while the receiver is open.  Hands the "
     "payload to owner()._protocol.data_received (a memoryview of ``view`` when as_view, else bytes), re-posts the "
     "slot with hot_post(ep, ep._qp_address, segs[slot], cookies[slot]) (the EP's C hot path; else "
     "ep.post_recv(segs[slot], cookies[slot])) and calls the core's data_consumed; True.  False, with "
     "nothing changed, for anything else, and once the owner was collected.  An exception of data_received "
     "propagates with protocol_failed set; a post_errors exception of the re-post is swallowed (the slot stays "
     "unposted, and the connection's end follows); when data_received ends the connection (alive set False), no "
     "re-post is made."},
    {"on_events", receiver_on_events, METH_O,
     "on_events(events).\n\n"
     "The stream's EVD callback (evd.set_callback): a batch of events, taken with receive() one by one.  "
     "Nothing once the owner was collected or the connection ended (``alive`` False).  The first event receive() "
     "does not take goes, with the rest of the batch, to owner()._on_events(events, index); an exception raised "
     "in a receive() (any but SystemExit and KeyboardInterrupt) goes to owner()._batch_failed(exc).  When receive() "
     "took the whole batch: owner()._flush() "
     "when data_received wrote (the core has bytes buffered), and sender.schedule() (the reply the "
     "woken reader writes goes out in this loop iteration)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef receiver_members[] = {
    {"open", T_BOOL, offsetof(Receiver, open), 0,
     "False once the transport starts to close: receive() then takes nothing."},
    {"alive", T_BOOL, offsetof(Receiver, alive), 0, "False once the connection ended: a batch is then ignored."},
    {"as_view", T_BOOL, offsetof(Receiver, as_view), 0,
     "Hand data_received a memoryview of the slot (a BufferedProtocol's copy) instead of a bytes object."},
    {"delivered", T_BOOL, offsetof(Receiver, delivered), 0,
     "A payload went to data_received in this batch (on_events resets it per batch)."},
    {"protocol_failed", T_BOOL, offsetof(Receiver, protocol_failed), READONLY,
     "The last receive() failed in the protocol's data_received (not in the steps around it)."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot receiver_slots[] = {
    {Py_tp_doc, "Receiver(core, arena, view, slot_size, owner, as_view, ep, hot_post, segs, cookies, event_type, "
                "post_errors, sender): the stream's EVD callback and a received DATA message's steps, from its completion "
                "to the re-post, in C (the stream transport's common case).  ``owner`` is a weak reference to the "
                "transport, whose Python takes every other case.  ``open``: set False when the transport starts "
                "to close (receive() then takes nothing); ``alive``: set False when the connection ends; "
                "``delivered``: set when a payload went to data_received (on_events resets it per batch)."},
    {Py_tp_new, receiver_new},
    {Py_tp_methods, receiver_methods},
    {Py_tp_members, receiver_members},
    {Py_tp_traverse, receiver_traverse},
    {Py_tp_clear, receiver_clear},
    {Py_tp_dealloc, receiver_dealloc},
    {0, NULL},
};

static PyType_Spec receiver_spec = {
    "aiodat._shim._streamcore.Receiver", sizeof(Receiver), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    receiver_slots,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "aiodat._shim._streamcore",
    "StreamState, Sender and Receiver: the stream protocol's state and a small message's steps in C (see streams/).", -1, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__streamcore(void)
{
    INTERN(s_data_msgs, "data_msgs"); INTERN(s_bytes_sent, "bytes_sent"); INTERN(s_bytes_received, "bytes_received");
    INTERN(s_cookie, "cookie"); INTERN(s_status, "status"); INTERN(s_transferred_length, "transferred_length");
    INTERN(s_r, "r"); INTERN(s_data_received, "data_received"); INTERN(s_length, "length");
    INTERN(s__protocol, "_protocol"); INTERN(s__lost, "_lost"); INTERN(s__flush, "_flush");
    INTERN(s__on_events, "_on_events"); INTERN(s__batch_failed, "_batch_failed"); INTERN(s__post_failed, "_post_failed");
    INTERN(s__after_flush, "_after_flush"); INTERN(s__protocol_paused, "_protocol_paused"); INTERN(s__idle, "_idle");
    INTERN(s_scheduled_flush, "scheduled_flush"); INTERN(s__qp_address, "_qp_address");
    INTERN(s_post_recv, "post_recv"); INTERN(s_post_send, "post_send");
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    PyObject *state = PyType_FromSpec(&state_spec);
    if (state == NULL || PyModule_AddObject(mod, "StreamState", state) < 0) {
        Py_XDECREF(state);
        Py_DECREF(mod);
        return NULL;
    }
    state_type = state;  /* (the module holds it for good) */
    PyObject *receiver = PyType_FromSpec(&receiver_spec);
    if (receiver == NULL || PyModule_AddObject(mod, "Receiver", receiver) < 0) {
        Py_XDECREF(receiver);
        Py_DECREF(mod);
        return NULL;
    }
    PyObject *sender = PyType_FromSpec(&sender_spec);
    if (sender == NULL || PyModule_AddObject(mod, "Sender", sender) < 0) {
        Py_XDECREF(sender);
        Py_DECREF(mod);
        return NULL;
    }
    sender_type = sender;  /* (the module holds it for good) */
    return mod;
}
