/* aiodat/_shim/shim.c: the C half of aiodat (see shim.h for what Python sees).
 *
 * Only the work that runs per request or per event lives here, so Python pays
 * one crossing per batch: posting a list of requests, draining a completion
 * channel and its CQ, and copying rdma_cm and async events out of the
 * libraries (then acking them at once, so librdmacm never waits on Python).
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <stdlib.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <stdio.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include "shim.h"

#include "postcommon.h"

int aiodat_set_nonblocking(int fd)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return errno;
    return 0;
}

int aiodat_alloc_mw(struct ibv_pd *pd, struct ibv_mw **cell)
{
    *cell = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    return *cell ? 0 : errno;
}

int aiodat_dealloc_mw_at(struct ibv_mw **cell)
{
    struct ibv_mw *mw = *cell;
    *cell = NULL;
    return mw ? ibv_dealloc_mw(mw) : 0;
}

static void fill_sges(struct ibv_sge *dst, const struct aiodat_sge *src, int n)
{
    for (int i = 0; i < n; i++) {
        dst[i].addr = src[i].addr;
        dst[i].length = src[i].length;
        dst[i].lkey = src[i].lkey;
    }
}

/* Post n send requests, AIODAT_CHUNK at a time.  Returns 0 or the errno of
 * the first failure; *n_posted says how many were accepted before it. */
int aiodat_post_send(struct ibv_qp *qp, const struct aiodat_send_wr *wrs, int n,
                     const struct aiodat_sge *sges, int *n_posted)
{
    struct ibv_send_wr wr[AIODAT_CHUNK], *bad;
    struct ibv_sge sg[AIODAT_CHUNK * 32];
    int done = 0;

    *n_posted = 0;
    while (done < n) {
        int count = 0, sg_used = 0;
        while (done + count < n && count < AIODAT_CHUNK) {
            const struct aiodat_send_wr *w = &wrs[done + count];
            struct ibv_send_wr *d = &wr[count];
            if (w->num_sge < 0 || w->num_sge > 32)
                return EINVAL;
            /* a UD request names its address handle, whose place an RDMA request's fields share: the
             * provider would read a NULL or made-up one (post.py refuses first; this is the floor) */
            if (qp->qp_type == IBV_QPT_UD && !w->ah && w->opcode != IBV_WR_BIND_MW && w->opcode != IBV_WR_LOCAL_INV)
                return EINVAL;
            if (sg_used + w->num_sge > AIODAT_CHUNK * 32)
                break;
            memset(d, 0, sizeof(*d));
            d->wr_id = w->wr_id;
            d->opcode = (enum ibv_wr_opcode)w->opcode;
            d->send_flags = w->send_flags;
            d->imm_data = htonl(w->imm_data);
            d->num_sge = w->num_sge;
            d->sg_list = w->num_sge ? &sg[sg_used] : NULL;
            fill_sges(&sg[sg_used], &sges[w->sge_start], w->num_sge);
            sg_used += w->num_sge;
            switch (d->opcode) {
            case IBV_WR_ATOMIC_CMP_AND_SWP:
            case IBV_WR_ATOMIC_FETCH_AND_ADD:
                d->wr.atomic.remote_addr = w->remote_addr;
                d->wr.atomic.rkey = w->rkey;
                d->wr.atomic.compare_add = w->compare_add;
                d->wr.atomic.swap = w->swap;
                break;
            case IBV_WR_BIND_MW:
                d->bind_mw.mw = w->mw;
                d->bind_mw.rkey = w->mw_rkey;
                d->bind_mw.bind_info.mr = w->bind_mr;
                d->bind_mw.bind_info.addr = w->bind_addr;
                d->bind_mw.bind_info.length = w->bind_length;
                d->bind_mw.bind_info.mw_access_flags = w->bind_access;
                break;
            case IBV_WR_LOCAL_INV:
                d->invalidate_rkey = w->mw_rkey;
                break;
            default:
                if (w->ah) {
                    d->wr.ud.ah = w->ah;
                    d->wr.ud.remote_qpn = w->remote_qpn;
                    d->wr.ud.remote_qkey = w->remote_qkey;
                } else {
                    d->wr.rdma.remote_addr = w->remote_addr;
                    d->wr.rdma.rkey = w->rkey;
                }
            }
            d->next = NULL;
            if (count)
                wr[count - 1].next = d;
            count++;
        }
        bad = NULL;
        int rc = post_errno(ibv_post_send(qp, wr, &bad));
        if (rc) {
            *n_posted = done + TAKEN(bad, wr, count);
            return rc;
        }
        done += count;
        *n_posted = done;
    }
    return 0;
}

/* n copies of one request (a stream on one buffer): only the wr_ids differ,
 * first_wr_id, first_wr_id + step, ..., and the last request's flags.  Returns
 * 0 or the errno of the first failed post; *n_posted says how many went. */
int aiodat_post_send_same(struct ibv_qp *qp, const struct aiodat_send_wr *tmpl, unsigned int last_send_flags,
                          const struct aiodat_sge *sges, uint64_t first_wr_id, uint64_t step, int n,
                          int *n_posted)
{
    struct aiodat_send_wr w[AIODAT_CHUNK];
    int done = 0;

    *n_posted = 0;
    while (done < n) {
        int count = n - done < AIODAT_CHUNK ? n - done : AIODAT_CHUNK, posted = 0;
        for (int i = 0; i < count; i++) {
            w[i] = *tmpl;
            w[i].wr_id = first_wr_id + (uint64_t)(done + i) * step;
            if (done + i == n - 1)
                w[i].send_flags = last_send_flags;  /* e.g. the one signalled request of a batch */
        }
        int rc = aiodat_post_send(qp, w, count, sges, &posted);
        done += posted;
        *n_posted = done;
        if (rc)
            return rc;
    }
    return 0;
}

/* n receives into the same scatter list (num_sge entries), wr_ids as above. */
int aiodat_post_recv_same(struct ibv_qp *qp, struct ibv_srq *srq, uint64_t first_wr_id, uint64_t step, int n,
                          const struct aiodat_sge *sges, int num_sge, int *n_posted)
{
    struct ibv_recv_wr wr[AIODAT_CHUNK], *bad;
    struct ibv_sge sg[32];
    int done = 0;

    *n_posted = 0;
    if (num_sge < 0 || num_sge > 32)
        return EINVAL;
    fill_sges(sg, sges, num_sge);
    while (done < n) {
        int count = n - done < AIODAT_CHUNK ? n - done : AIODAT_CHUNK;
        for (int i = 0; i < count; i++) {
            wr[i].wr_id = first_wr_id + (uint64_t)(done + i) * step;
            wr[i].sg_list = num_sge ? sg : NULL;  /* the provider copies it at post time */
            wr[i].num_sge = num_sge;
            wr[i].next = i + 1 < count ? &wr[i + 1] : NULL;
        }
        bad = NULL;
        int rc = post_errno(srq ? ibv_post_srq_recv(srq, wr, &bad) : ibv_post_recv(qp, wr, &bad));
        if (rc) {
            *n_posted = done + TAKEN(bad, wr, count);
            return rc;
        }
        done += count;
        *n_posted = done;
    }
    return 0;
}

/* The hot path of a single-segment request: scalars in, no arrays for Python to fill.
 * remote_addr/rkey are used by RDMA opcodes only. */
int aiodat_post_send1(struct ibv_qp *qp, uint64_t wr_id, int opcode, unsigned int send_flags,
                      uint32_t imm_data, uint64_t addr, uint32_t length, uint32_t lkey,
                      uint64_t remote_addr, uint32_t rkey)
{
    struct ibv_sge sge = { .addr = addr, .length = length, .lkey = lkey };
    struct ibv_send_wr wr, *bad;

    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = (enum ibv_wr_opcode)opcode;
    wr.send_flags = send_flags;
    wr.imm_data = htonl(imm_data);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    return post_errno(ibv_post_send(qp, &wr, &bad));
}

int aiodat_post_recv1(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length, uint32_t lkey)
{
    struct ibv_sge sge = { .addr = addr, .length = length, .lkey = lkey };
    struct ibv_recv_wr wr = { .wr_id = wr_id, .next = NULL, .sg_list = &sge, .num_sge = 1 }, *bad;

    return post_errno(ibv_post_recv(qp, &wr, &bad));
}

/* Post n receives to a QP (srq NULL) or to an SRQ. */
int aiodat_post_recv(struct ibv_qp *qp, struct ibv_srq *srq, const uint64_t *wr_ids,
                     const int *sge_starts, const int *num_sges, int n,
                     const struct aiodat_sge *sges, int *n_posted)
{
    struct ibv_recv_wr wr[AIODAT_CHUNK], *bad;
    struct ibv_sge sg[AIODAT_CHUNK * 32];
    int done = 0;

    *n_posted = 0;
    while (done < n) {
        int count = 0, sg_used = 0;
        while (done + count < n && count < AIODAT_CHUNK) {
            int i = done + count;
            if (num_sges[i] < 0 || num_sges[i] > 32)
                return EINVAL;
            if (sg_used + num_sges[i] > AIODAT_CHUNK * 32)
                break;
            wr[count].wr_id = wr_ids[i];
            wr[count].num_sge = num_sges[i];
            wr[count].sg_list = num_sges[i] ? &sg[sg_used] : NULL;
            fill_sges(&sg[sg_used], &sges[sge_starts[i]], num_sges[i]);
            sg_used += num_sges[i];
            wr[count].next = NULL;
            if (count)
                wr[count - 1].next = &wr[count];
            count++;
        }
        bad = NULL;
        int rc = post_errno(srq ? ibv_post_srq_recv(srq, wr, &bad) : ibv_post_recv(qp, wr, &bad));
        if (rc) {
            *n_posted = done + TAKEN(bad, wr, count);
            return rc;
        }
        done += count;
        *n_posted = done;
    }
    return 0;
}

static void copy_wc(struct aiodat_wc *d, const struct ibv_wc *s)
{
    d->wr_id = s->wr_id;
    d->status = s->status;
    d->opcode = s->opcode;
    d->vendor_err = s->vendor_err;
    d->byte_len = s->byte_len;
    d->imm_data = (s->wc_flags & IBV_WC_WITH_IMM) ? ntohl(s->imm_data) : 0;
    d->qp_num = s->qp_num;
    d->src_qp = s->src_qp;
    d->wc_flags = s->wc_flags;
    d->slid = s->slid;
    d->sl = s->sl;
}

static int inject_notify_failures, inject_poll_failures, inject_later_chunk_failures;

/* Poll up to max completions without touching the channel. */
int aiodat_cq_poll(struct ibv_cq *cq, struct aiodat_wc *out, int max)
{
    struct ibv_wc wc[32];
    int total = 0;
    while (total < max) {
        int want = max - total < 32 ? max - total : 32;
        int got = total && inject_later_chunk_failures > 0 ? (inject_later_chunk_failures--, -1)
                                                           : ibv_poll_cq(cq, want, wc);
        if (got < 0)  /* what earlier polls took is in out already: return it; the next call fails */
            return total ? total : -EIO;
        for (int i = 0; i < got; i++)
            copy_wc(&out[total + i], &wc[i]);
        total += got;
        if (got < want)
            break;
    }
    return total;
}

/* Busy polling (an EVD's busy_poll_us): poll the CQ without sleeping until a
 * completion arrives or `usec` microseconds pass, whichever is first.  Python
 * calls it in short slices and yields to its event loop in between; cffi
 * releases the GIL around the call, so other threads run meanwhile.
 * status[2]: the number of completions copied, as aiodat_cq_drain's. */
int aiodat_cq_spin(struct ibv_cq *cq, struct aiodat_wc *out, int max, int usec, int *status)
{
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    status[2] = 0;
    for (;;) {
        int got = aiodat_cq_poll(cq, out, max);
        if (got != 0 || max == 0) {
            status[2] = got > 0 ? got : 0;
            return got;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        long elapsed = (now.tv_sec - start.tv_sec) * 1000000L + (now.tv_nsec - start.tv_nsec) / 1000;
        if (elapsed >= usec)
            return 0;
    }
}

/* Fault injection for aiodat's own tests (tests/test_wakeups.py): the next `count`
 * calls of one kind fail as the device could make them fail (POLL_LATER_CHUNK: an
 * ibv_poll_cq after the first of one aiodat_cq_poll).  Never set otherwise. */
void aiodat_inject_fault(int what, int count)
{
    if (what == AIODAT_FAULT_NOTIFY)
        inject_notify_failures = count;
    else if (what == AIODAT_FAULT_POLL)
        inject_poll_failures = count;
    else if (what == AIODAT_FAULT_POLL_LATER_CHUNK)
        inject_later_chunk_failures = count;
}

static int arm_cq(struct ibv_cq *cq, int solicited_only)
{
    if (inject_notify_failures > 0) {
        inject_notify_failures--;
        return EIO;
    }
    return ibv_req_notify_cq(cq, solicited_only);
}

/* The loop's reader callback for a completion channel, in one call: read and
 * ack the pending channel event (when `channel` is given; the fd is
 * non-blocking), arm the CQ (arm: -1 no, 0 every completion, 1 solicited
 * only), then poll it.  Arming before polling means a completion that lands
 * after the poll raises a new channel event, so none is stranded.  A failed
 * arm is retried once, then reported in status[1] (an errno) with the
 * completions still polled: the caller must arm again before it sleeps.
 * status[0] is the number of channel events read.  Returns the number of
 * completions copied (== max means: call again, without channel or arm) or
 * -errno when polling failed.  status[2] is that number too (0 on failure):
 * a KeyboardInterrupt raised by a signal handler at the call's return loses
 * the return value, and Python takes the count from there instead. */
int aiodat_cq_drain(struct ibv_comp_channel *channel, struct ibv_cq *cq, int arm,
                    struct aiodat_wc *out, int max, int *status)
{
    struct ibv_cq *ev_cq;
    void *ev_ctx;

    status[0] = status[1] = status[2] = 0;
    /* One read is enough: aiodat arms a CQ only here and at its creation, always
     * after reading, and an armed CQ raises one channel event; so at most one is
     * pending, and a second read would only return EAGAIN (a system call saved
     * per wake-up). */
    if (channel && ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) {
        /* one CQ per channel in aiodat; ack on the CQ the event named */
        ibv_ack_cq_events(ev_cq, 1);
        status[0] = 1;
    }
    if (arm >= 0 && arm_cq(cq, arm) && (status[1] = arm_cq(cq, arm)))
        status[1] = status[1] > 0 ? status[1] : EIO;
    if (inject_poll_failures > 0) {
        inject_poll_failures--;
        return -EIO;
    }
    int got = aiodat_cq_poll(cq, out, max);
    status[2] = got > 0 ? got : 0;
    return got;
}

/* Copy out up to max pending rdma_cm events and ack each at once.  For UD
 * and multicast events an address handle is created on pd (when given). */
int aiodat_cm_get_events(struct rdma_event_channel *channel, struct ibv_pd *pd,
                         struct aiodat_cm_event *out, int max)
{
    struct rdma_cm_event *ev;
    int n = 0;

    while (n < max) {
        if (rdma_get_cm_event(channel, &ev)) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return n ? n : -errno;
        }
        struct aiodat_cm_event *d = &out[n++];
        memset(d, 0, sizeof(*d));
        d->id = ev->id;
        d->listen_id = ev->listen_id;
        d->event = ev->event;
        d->status = ev->status;
        int is_ud = ev->id && (ev->id->ps == RDMA_PS_UDP || ev->id->ps == RDMA_PS_IPOIB);
        const void *pdata = is_ud ? ev->param.ud.private_data : ev->param.conn.private_data;
        int plen = is_ud ? ev->param.ud.private_data_len : ev->param.conn.private_data_len;
        if (pdata && plen > 0) {
            if (plen > AIODAT_CM_PRIVATE_DATA_MAX)
                plen = AIODAT_CM_PRIVATE_DATA_MAX;
            memcpy(d->private_data, pdata, plen);
            d->private_data_len = plen;
        }
        if (is_ud) {
            d->ud_qp_num = ev->param.ud.qp_num;
            d->ud_qkey = ev->param.ud.qkey;
            if (ev->event == RDMA_CM_EVENT_ESTABLISHED || ev->event == RDMA_CM_EVENT_MULTICAST_JOIN) {
                /* librdmacm's id->pd is its own (on its own context): the AH must be made on
                 * the PD of the QP that sends, which only the caller knows */
                memcpy(d->ah_attr, &ev->param.ud.ah_attr, sizeof(struct ibv_ah_attr));
                d->has_ah_attr = 1;
                if (pd)
                    d->ah = ibv_create_ah(pd, &ev->param.ud.ah_attr);
            }
        } else {
            d->responder_resources = ev->param.conn.responder_resources;
            d->initiator_depth = ev->param.conn.initiator_depth;
            d->retry_count = ev->param.conn.retry_count;
            d->rnr_retry_count = ev->param.conn.rnr_retry_count;
            d->srq = ev->param.conn.srq;
            d->qp_num = ev->param.conn.qp_num;
        }
        if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST && ev->id) {
            if (aiodat_sockaddr_str(rdma_get_local_addr(ev->id), d->local_host, sizeof(d->local_host),
                                    &d->local_port))
                d->local_host[0] = 0;
            if (aiodat_sockaddr_str(rdma_get_peer_addr(ev->id), d->remote_host, sizeof(d->remote_host),
                                    &d->remote_port))
                d->remote_host[0] = 0;
        }
        rdma_ack_cm_event(ev);
    }
    return n;
}

_Static_assert(sizeof(struct ibv_ah_attr) <= sizeof(((struct aiodat_cm_event *)0)->ah_attr),
               "aiodat_cm_event.ah_attr too small");

/* An address handle on pd from the path a UD/multicast rdma_cm event carried. */
struct ibv_ah *aiodat_create_ah(struct ibv_pd *pd, const struct aiodat_cm_event *ev)
{
    struct ibv_ah_attr attr;
    if (!ev->has_ah_attr) {
        errno = EINVAL;
        return NULL;
    }
    memcpy(&attr, ev->ah_attr, sizeof(attr));
    return ibv_create_ah(pd, &attr);
}

/* Copy out up to max pending device events from the context's async fd. */
int aiodat_async_get_events(struct ibv_context *context, struct aiodat_async_event *out, int max)
{
    struct ibv_async_event ev;
    int n = 0;

    while (n < max) {
        if (ibv_get_async_event(context, &ev)) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return n ? n : -errno;
        }
        struct aiodat_async_event *d = &out[n++];
        d->event_type = ev.event_type;
        d->element = NULL;
        d->port_num = 0;
        d->qp_num = 0;
        switch (ev.event_type) {
        case IBV_EVENT_CQ_ERR:
            d->element = ev.element.cq;
            break;
        case IBV_EVENT_QP_FATAL: case IBV_EVENT_QP_REQ_ERR: case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_COMM_EST: case IBV_EVENT_SQ_DRAINED: case IBV_EVENT_PATH_MIG:
        case IBV_EVENT_PATH_MIG_ERR: case IBV_EVENT_QP_LAST_WQE_REACHED:
            d->element = ev.element.qp;
            d->qp_num = ev.element.qp->qp_num;
            break;
        case IBV_EVENT_SRQ_ERR: case IBV_EVENT_SRQ_LIMIT_REACHED:
            d->element = ev.element.srq;
            break;
        case IBV_EVENT_PORT_ACTIVE: case IBV_EVENT_PORT_ERR: case IBV_EVENT_LID_CHANGE:
        case IBV_EVENT_PKEY_CHANGE: case IBV_EVENT_SM_CHANGE: case IBV_EVENT_CLIENT_REREGISTER:
        case IBV_EVENT_GID_CHANGE:
            d->port_num = ev.element.port_num;
            break;
        default:
            break;
        }
        ibv_ack_async_event(&ev);
    }
    return n;
}

/* Let librdmacm drive a QP aiodat created itself (as rdma_create_qp would
 * have): it then moves the QP through RTR/RTS on connect and accept and to
 * ERR on disconnect.  The QP must be on the id's device; librdmacm opens its
 * own ibv_context for it, so compare devices, not contexts. */
/* librdmacm's QP-less flow (the QP is the caller's, never id->qp): take `qp` through INIT,
 * RTR and RTS with the attributes rdma_cm negotiated for `id` (rdma_init_qp_attr), exactly
 * as librdmacm does for a QP it owns, then apply the caller's choices: responder resources
 * and initiator depth (-1: the CM's), the RNR NAK timer and the ACK timeout (-1: the CM's).
 * The active side calls it on CONNECT_RESPONSE (then rdma_establish), the passive side
 * before rdma_accept.  `port_num` and `link_layer` are the port the QP was taken to INIT on
 * (aiodat_create_qp) and that port's link layer as the caller knows it (-1: ask the device).
 * Two system calls librdmacm makes are left out when they change nothing, since a connection
 * makes them on each side: the INIT to INIT transition when rdma_cm asks for exactly what
 * aiodat_create_qp set, and the port query when the caller knows the link layer.
 * On failure the QP is left in ERR.  Returns 0 or an errno. */
int aiodat_cm_ready_qp(struct rdma_cm_id *id, struct ibv_qp *qp, int resp_res, int init_depth,
                       int min_rnr_timer, int ack_timeout, int port_num, int link_layer)
{
    const int init_mask = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
    const int all_remote = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    struct ibv_qp_attr attr;
    struct ibv_port_attr port;
    int mask, err;

    if (qp->context != id->verbs && id->verbs &&
        strcmp(qp->context->device->name, id->verbs->device->name) != 0)
        return EXDEV;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_INIT;
    if (rdma_init_qp_attr(id, &attr, &mask))  /* negative: the QP is untouched (see shim.h) */
        return -(errno ? errno : EINVAL);
    if (!(qp->state == IBV_QPS_INIT && (mask & ~init_mask) == 0 && attr.port_num == port_num &&
          attr.pkey_index == 0 && attr.qp_access_flags == all_remote) &&
        (err = ibv_modify_qp(qp, &attr, mask)))
        goto fail;

    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTR;
    if (rdma_init_qp_attr(id, &attr, &mask)) {
        err = errno ? errno : EINVAL;
        goto fail;
    }
    /* librdmacm's work-around for an rdma_ucm bug: bits 21-24 are RoCE-only */
    if (id->port_num != port_num || link_layer < 0)
        link_layer = ibv_query_port(qp->context, id->port_num, &port) ? -1 : port.link_layer;
    if (link_layer == IBV_LINK_LAYER_INFINIBAND)
        mask &= ~0xe00000;
    if (resp_res >= 0)
        attr.max_dest_rd_atomic = resp_res;
    attr.min_rnr_timer = min_rnr_timer;
    mask |= IBV_QP_MIN_RNR_TIMER;
    if ((err = ibv_modify_qp(qp, &attr, mask)))
        goto fail;

    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTS;
    if (rdma_init_qp_attr(id, &attr, &mask)) {
        err = errno ? errno : EINVAL;
        goto fail;
    }
    if (init_depth >= 0)
        attr.max_rd_atomic = init_depth;
    if (ack_timeout >= 0) {
        attr.timeout = ack_timeout;
        mask |= IBV_QP_TIMEOUT;
    }
    if ((err = ibv_modify_qp(qp, &attr, mask)))
        goto fail;
    return 0;
fail:
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp, &attr, IBV_QP_STATE);
    return err;
}

/* Create an EP's QP and take it to INIT (RC: remote write, read and atomic allowed), so receives
 * can be posted before it connects, as DAT allows (rdma_cm takes it on to RTR and RTS when the
 * connection forms); a UD QP goes on to RTS with rdma_cm's UDP Q_Key, as librdmacm's
 * ucma_init_ud_qp does.  One call: an EP is made per connection, and building the attribute
 * structures in Python cost more than the verbs calls.  max_inline < 0 asks for
 * `default_inline` and, if the device refuses that, for none; out[0] gets the inline size the
 * device gave.  Returns the QP, or NULL with errno set and
 * out[1] saying which step failed (0 creating, 1 the state changes: the QP is destroyed then). */
struct ibv_qp *aiodat_create_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
                                struct ibv_srq *srq, int max_send_wr, int max_recv_wr, int max_send_sge,
                                int max_recv_sge, int max_inline, int default_inline, int ud, int port_num,
                                int *out)
{
    struct ibv_qp_init_attr init;
    struct ibv_qp_attr attr;
    struct ibv_qp *qp;
    int err, mask;

    memset(&init, 0, sizeof(init));
    init.send_cq = send_cq;
    init.recv_cq = recv_cq;
    init.srq = srq;
    init.cap.max_send_wr = max_send_wr;
    init.cap.max_recv_wr = srq ? 0 : max_recv_wr;
    init.cap.max_send_sge = max_send_sge;
    init.cap.max_recv_sge = srq ? 0 : max_recv_sge;
    init.cap.max_inline_data = max_inline < 0 ? default_inline : max_inline;
    init.qp_type = ud ? IBV_QPT_UD : IBV_QPT_RC;
    init.sq_sig_all = 0;
    out[1] = 0;
    qp = ibv_create_qp(pd, &init);
    if (!qp && max_inline < 0) {  /* a device without (that much) inline data */
        init.cap.max_inline_data = 0;
        qp = ibv_create_qp(pd, &init);
    }
    if (!qp)
        return NULL;
    out[0] = init.cap.max_inline_data;

    out[1] = 1;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port_num;
    mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
    if (ud) {
        attr.qkey = RDMA_UDP_QKEY;
        mask |= IBV_QP_QKEY;
    } else {
        attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        mask |= IBV_QP_ACCESS_FLAGS;
    }
    err = ibv_modify_qp(qp, &attr, mask);
    if (!err && ud) {
        memset(&attr, 0, sizeof(attr));
        attr.qp_state = IBV_QPS_RTR;
        err = ibv_modify_qp(qp, &attr, IBV_QP_STATE);
        if (!err) {
            attr.qp_state = IBV_QPS_RTS;
            attr.sq_psn = 0;
            err = ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN);
        }
    }
    if (err) {
        ibv_destroy_qp(qp);
        errno = err;
        return NULL;
    }
    return qp;
}

/* rdma_connect (accept == 0) or rdma_accept with the rdma_conn_param built here: the caller's
 * private data (sent as given), RDMA read depths, retry counts, and its own QP's number (the
 * QP-less flow).  Returns what the rdma_cm call returns: 0, or -1 with errno set. */
int aiodat_cm_connect(struct rdma_cm_id *id, int accept, const char *pdata, int plen, int responder,
                      int initiator, int retry_count, int rnr_retry_count, uint32_t qp_num, int srq)
{
    struct rdma_conn_param param;

    memset(&param, 0, sizeof(param));
    param.private_data = plen ? pdata : NULL;
    param.private_data_len = plen;
    param.responder_resources = responder;
    param.initiator_depth = initiator;
    param.retry_count = retry_count;
    param.rnr_retry_count = rnr_retry_count;
    param.qp_num = qp_num;
    param.srq = srq;
    return accept ? rdma_accept(id, &param) : rdma_connect(id, &param);
}

/* Attach (or detach) a UD QP to the multicast group of a MULTICAST_JOIN event, as librdmacm
 * does for id->qp: the group's GID and LID are in the event's path. */
int aiodat_mcast_attach(struct ibv_qp *qp, const struct aiodat_cm_event *ev, int attach)
{
    struct ibv_ah_attr attr;
    if (!ev->has_ah_attr)
        return EINVAL;
    memcpy(&attr, ev->ah_attr, sizeof(attr));
    return attach ? ibv_attach_mcast(qp, &attr.grh.dgid, attr.dlid)
                  : ibv_detach_mcast(qp, &attr.grh.dgid, attr.dlid);
}

/* A numeric address, IPv4 or IPv6; an IPv6 one may name its scope ("fe80::1%ib0"), which
 * link-local addresses need to say which interface they are on. */
int aiodat_sockaddr(const char *host, uint16_t port, struct sockaddr_storage *out)
{
    memset(out, 0, sizeof(*out));
    struct sockaddr_in *v4 = (struct sockaddr_in *)out;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
        return 0;
    }
    char text[INET6_ADDRSTRLEN + IF_NAMESIZE + 1];
    if (strlen(host) >= sizeof(text))
        return EINVAL;
    strcpy(text, host);
    char *scope = strchr(text, '%');
    if (scope)
        *scope++ = '\0';
    if (inet_pton(AF_INET6, text, &v6->sin6_addr) != 1)
        return EINVAL;
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    if (scope) {
        char *end;
        unsigned long index = strtoul(scope, &end, 10);
        v6->sin6_scope_id = (*scope && !*end) ? (uint32_t)index : if_nametoindex(scope);
        if (!v6->sin6_scope_id)
            return ENODEV;
    }
    return 0;
}

/* An address as text; a scoped IPv6 address (link-local) gets its "%interface". */
int aiodat_sockaddr_str(const struct sockaddr *addr, char *host, int host_len, uint16_t *port)
{
    if (!addr)
        return EINVAL;
    if (addr->sa_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)addr;
        if (!inet_ntop(AF_INET, &v4->sin_addr, host, host_len))
            return errno;
        *port = ntohs(v4->sin_port);
        return 0;
    }
    if (addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)addr;
        if (!inet_ntop(AF_INET6, &v6->sin6_addr, host, host_len))
            return errno;
        char name[IF_NAMESIZE];
        size_t used = strlen(host);
        if (v6->sin6_scope_id && if_indextoname(v6->sin6_scope_id, name) &&
            used + 1 + strlen(name) < (size_t)host_len)
            sprintf(host + used, "%%%s", name);
        *port = ntohs(v6->sin6_port);
        return 0;
    }
    return EAFNOSUPPORT;
}

/* The IP addresses of network interface `ifname`, as text, one per line, in getifaddrs'
 * order (IPv4 before IPv6); link-local IPv6 addresses carry their "%ifname".  0, or an
 * errno (ENOSPC when `out` is too small for all of them). */
int aiodat_if_addresses(const char *ifname, char *out, int out_len)
{
    struct ifaddrs *all;
    if (getifaddrs(&all))
        return errno;
    int used = 0, err = 0;
    out[0] = '\0';
    for (struct ifaddrs *ifa = all; ifa && !err; ifa = ifa->ifa_next) {
        if (!ifa->ifa_addr || strcmp(ifa->ifa_name, ifname) != 0)
            continue;
        int family = ifa->ifa_addr->sa_family;
        if (family != AF_INET && family != AF_INET6)
            continue;
        char text[INET6_ADDRSTRLEN + IF_NAMESIZE + 1];
        uint16_t port;
        if (aiodat_sockaddr_str(ifa->ifa_addr, text, sizeof(text), &port))
            continue;
        int n = snprintf(out + used, out_len - used, "%s\n", text);
        if (n >= out_len - used)
            err = ENOSPC;
        else
            used += n;
    }
    freeifaddrs(all);
    return err;
}

int aiodat_gid_str(const union ibv_gid *gid, char *out, int out_len)
{
    return inet_ntop(AF_INET6, gid->raw, out, out_len) ? 0 : errno;
}

/* The valid GIDs of one port, in one call: ibv_query_gid_table reads the kernel's GID cache
 * with one ioctl, where asking index by index costs a system call per index (rxe has 1024 of
 * them: about 30 ms of an IA's open in the TCG guest).  Fills indexes[] and gids[] (each of
 * table_len entries) and returns how many, or -errno: the caller then asks index by index. */
int aiodat_port_gids(struct ibv_context *context, int port_num, int table_len, int ports, int *indexes,
                     union ibv_gid *gids)
{
    if (table_len <= 0 || ports <= 0)
        return 0;
    /* room for every port's table full, if the ports' tables are this size (if one is larger and
     * fuller, the call fails and the caller asks index by index) */
    size_t max = (size_t)table_len * (size_t)ports;
    struct ibv_gid_entry *all = calloc(max, sizeof(*all));
    if (!all)
        return -ENOMEM;
    ssize_t n = ibv_query_gid_table(context, all, max, 0);
    int count = 0;
    for (ssize_t i = 0; i < n; i++) {
        if (all[i].port_num != (uint32_t)port_num || all[i].gid_index >= (uint32_t)table_len)
            continue;
        indexes[count] = (int)all[i].gid_index;
        gids[count] = all[i].gid;
        count++;
    }
    free(all);
    return n < 0 ? (int)n : count;
}

size_t aiodat_sockaddr_storage_size(void)
{
    return sizeof(struct sockaddr_storage);
}
