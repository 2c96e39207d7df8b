/* cm_peer: a plain librdmacm program, written as any C application would be, that uses
 * connection private data both ways.  tests/test_interop_cm.py builds it and runs it
 * against aiodat.
 *
 *   cm_peer server ADDR PORT accept PDATA   listen; accept the first request with PDATA
 *   cm_peer server ADDR PORT reject PDATA   listen; reject the first request with PDATA
 *   cm_peer client ADDR PORT PDATA          connect with PDATA
 *
 * It prints "pdata <len> <hex>" for the private data the CM delivered (the request's on the
 * server, the accept's or the reject's on the client), then, once connected, receives one
 * message, prints "recv <text>", and answers "reply:<text>".  Exit status 0 on success.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <rdma/rdma_cma.h>

static struct rdma_event_channel *channel;

static void die(const char *what)
{
    fprintf(stderr, "cm_peer: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* "<label> <len> <hex>": the private data of a CM event, as the CM delivered it. */
static void print_pdata(const char *label, const struct rdma_cm_event *ev)
{
    const unsigned char *p = ev->param.conn.private_data;
    printf("%s %d ", label, ev->param.conn.private_data_len);
    for (int i = 0; i < ev->param.conn.private_data_len; i++)
        printf("%02x", p[i]);
    printf("\n");
    fflush(stdout);
}

/* The next CM event, which must be `want`; its private data is printed when `show`. */
static struct rdma_cm_event *expect(enum rdma_cm_event_type want, int show)
{
    struct rdma_cm_event *ev;
    if (rdma_get_cm_event(channel, &ev))
        die("rdma_get_cm_event");
    if (ev->event != want) {
        fprintf(stderr, "cm_peer: got %s (status %d), wanted %s\n", rdma_event_str(ev->event),
                ev->status, rdma_event_str(want));
        exit(1);
    }
    if (show)
        print_pdata("pdata", ev);
    return ev;
}

static struct ibv_mr *mr;
static struct { char in[128]; char out[128]; } msg;  /* one registration for both */

/* A QP on the id (librdmacm's own PD and a CQ), with one receive posted. */
static void make_qp(struct rdma_cm_id *id)
{
    struct ibv_qp_init_attr attr = { .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
                                     .cap = { .max_send_wr = 4, .max_recv_wr = 4,
                                              .max_send_sge = 1, .max_recv_sge = 1 } };
    attr.send_cq = attr.recv_cq = ibv_create_cq(id->verbs, 8, NULL, NULL, 0);
    if (!attr.send_cq || rdma_create_qp(id, NULL, &attr))
        die("creating the QP");
    mr = ibv_reg_mr(id->pd, &msg, sizeof(msg), IBV_ACCESS_LOCAL_WRITE);
    if (!mr)
        die("ibv_reg_mr");
    struct ibv_sge sge = { (uintptr_t)msg.in, sizeof(msg.in) - 1, mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
    if (ibv_post_recv(id->qp, &wr, &bad))
        die("ibv_post_recv");
}

static struct ibv_wc poll_one(struct rdma_cm_id *id)
{
    struct ibv_wc wc;
    time_t deadline = time(NULL) + 60;
    while (ibv_poll_cq(id->qp->recv_cq, 1, &wc) == 0)
        if (time(NULL) > deadline) {
            fprintf(stderr, "cm_peer: no completion within 60 s\n");
            exit(1);
        }
    if (wc.status != IBV_WC_SUCCESS) {
        fprintf(stderr, "cm_peer: completion failed: %s\n", ibv_wc_status_str(wc.status));
        exit(1);
    }
    return wc;
}

/* Receive one message, print it, answer "reply:<it>", wait for the peer's disconnect. */
static void converse(struct rdma_cm_id *id)
{
    struct ibv_wc wc = poll_one(id);
    msg.in[wc.byte_len] = '\0';
    printf("recv %s\n", msg.in);
    fflush(stdout);
    int n = snprintf(msg.out, sizeof(msg.out), "reply:%s", msg.in);
    struct ibv_sge sge = { (uintptr_t)msg.out, n, mr->lkey };
    struct ibv_send_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND }, *bad;
    if (ibv_post_send(id->qp, &wr, &bad))
        die("ibv_post_send");
    poll_one(id);
    rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, 0));
    rdma_disconnect(id);
}

static struct rdma_conn_param param_with(const char *pdata)
{
    struct rdma_conn_param p = { .private_data = pdata, .private_data_len = (uint8_t)strlen(pdata),
                                 .responder_resources = 1, .initiator_depth = 1, .retry_count = 6,
                                 .rnr_retry_count = 7 };
    return p;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: cm_peer server ADDR PORT accept|reject PDATA | client ADDR PORT PDATA\n");
        return 2;
    }
    int server = strcmp(argv[1], "server") == 0;
    struct rdma_addrinfo hints = { .ai_port_space = RDMA_PS_TCP, .ai_flags = server ? RAI_PASSIVE : 0 }, *ai;
    if (rdma_getaddrinfo(argv[2], argv[3], &hints, &ai))
        die("rdma_getaddrinfo");
    channel = rdma_create_event_channel();
    struct rdma_cm_id *id;
    if (!channel || rdma_create_id(channel, &id, NULL, RDMA_PS_TCP))
        die("rdma_create_id");

    if (server) {
        if (argc < 6)
            return 2;
        if (rdma_bind_addr(id, ai->ai_src_addr) || rdma_listen(id, 1))
            die("listening");
        printf("listening\n");
        fflush(stdout);
        struct rdma_cm_event *req = expect(RDMA_CM_EVENT_CONNECT_REQUEST, 1);
        struct rdma_cm_id *conn = req->id;
        rdma_ack_cm_event(req);
        struct rdma_conn_param param = param_with(argv[5]);
        if (strcmp(argv[4], "reject") == 0) {
            if (rdma_reject(conn, param.private_data, param.private_data_len))
                die("rdma_reject");
            return 0;
        }
        make_qp(conn);
        if (rdma_accept(conn, &param))
            die("rdma_accept");
        rdma_ack_cm_event(expect(RDMA_CM_EVENT_ESTABLISHED, 0));
        converse(conn);
        return 0;
    }

    if (rdma_resolve_addr(id, NULL, ai->ai_dst_addr, 2000))
        die("rdma_resolve_addr");
    rdma_ack_cm_event(expect(RDMA_CM_EVENT_ADDR_RESOLVED, 0));
    if (rdma_resolve_route(id, 2000))
        die("rdma_resolve_route");
    rdma_ack_cm_event(expect(RDMA_CM_EVENT_ROUTE_RESOLVED, 0));
    make_qp(id);
    struct rdma_conn_param param = param_with(argv[4]);
    if (rdma_connect(id, &param))
        die("rdma_connect");
    struct rdma_cm_event *ev;
    if (rdma_get_cm_event(channel, &ev))
        die("rdma_get_cm_event");
    if (ev->event == RDMA_CM_EVENT_REJECTED) {
        print_pdata("rejected", ev);
        return 0;
    }
    if (ev->event != RDMA_CM_EVENT_ESTABLISHED) {
        fprintf(stderr, "cm_peer: got %s (status %d)\n", rdma_event_str(ev->event), ev->status);
        return 1;
    }
    print_pdata("pdata", ev);
    rdma_ack_cm_event(ev);
    converse(id);
    return 0;
}
