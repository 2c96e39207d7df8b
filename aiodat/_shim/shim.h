/* aiodat/_shim/shim.h: the declarations of the C shim, shared by shim.c and cffi.
 *
 * The C compiler sees the system headers and the shim's own types and
 * functions.  cffi (build_shim.py, which defines AIODAT_CFFI_CDEF) sees instead
 * a subset of the verbs and rdma_cm declarations that Python calls directly for
 * set-up and tear-down; "..." marks a struct or constant whose real layout or
 * value cffi takes from the system headers at compile time (API mode), so only
 * the fields aiodat uses are named.  The shim's own part is common to both:
 * batch posting, CQ draining, and copying out CM and async events.
 */
#ifndef AIODAT_CFFI_CDEF
#ifndef AIODAT_SHIM_H
#define AIODAT_SHIM_H
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#define AIODAT_CM_PRIVATE_DATA_MAX 256
#define AIODAT_FAULT_NOTIFY 1
#define AIODAT_FAULT_POLL 2
#define AIODAT_FAULT_POLL_LATER_CHUNK 3
#endif
#else /* AIODAT_CFFI_CDEF */
/* ---- (1) libibverbs ---------------------------------------------------- */
struct sockaddr { ...; };
struct sockaddr_storage { ...; };

#define IBV_QPS_RESET ...
#define IBV_QPS_INIT ...
#define IBV_QPS_RTR ...
#define IBV_QPS_RTS ...
#define IBV_QPS_SQD ...
#define IBV_QPS_SQE ...
#define IBV_QPS_ERR ...
#define IBV_QPT_RC ...
#define IBV_QPT_UC ...
#define IBV_QPT_UD ...
#define IBV_QP_STATE ...
#define IBV_QP_PKEY_INDEX ...
#define IBV_QP_PORT ...
#define IBV_QP_ACCESS_FLAGS ...
#define IBV_QP_QKEY ...
#define IBV_QP_SQ_PSN ...
#define IBV_QP_MIN_RNR_TIMER ...
#define IBV_QP_TIMEOUT ...
#define IBV_QP_RETRY_CNT ...
#define IBV_QP_RNR_RETRY ...
#define IBV_QP_CAP ...
#define IBV_ACCESS_LOCAL_WRITE ...
#define IBV_ACCESS_REMOTE_WRITE ...
#define IBV_ACCESS_REMOTE_READ ...
#define IBV_ACCESS_REMOTE_ATOMIC ...
#define IBV_ACCESS_MW_BIND ...
#define IBV_ACCESS_ZERO_BASED ...
#define IBV_MW_TYPE_1 ...
#define IBV_MW_TYPE_2 ...
#define IBV_SRQ_MAX_WR ...
#define IBV_SRQ_LIMIT ...
#define IBV_LINK_LAYER_UNSPECIFIED ...
#define IBV_LINK_LAYER_INFINIBAND ...
#define IBV_LINK_LAYER_ETHERNET ...

struct ibv_device { char name[64]; char dev_name[64]; char dev_path[256]; char ibdev_path[256]; ...; };
struct ibv_context { struct ibv_device *device; int cmd_fd; int async_fd; int num_comp_vectors; ...; };
struct ibv_pd { struct ibv_context *context; uint32_t handle; ...; };
struct ibv_mr { struct ibv_context *context; struct ibv_pd *pd; void *addr; size_t length;
                uint32_t handle; uint32_t lkey; uint32_t rkey; ...; };
struct ibv_mw { struct ibv_context *context; struct ibv_pd *pd; uint32_t rkey; uint32_t handle; int type; ...; };
struct ibv_comp_channel { struct ibv_context *context; int fd; int refcnt; ...; };
struct ibv_cq { struct ibv_context *context; struct ibv_comp_channel *channel; void *cq_context;
                uint32_t handle; int cqe; ...; };
struct ibv_srq { struct ibv_context *context; void *srq_context; struct ibv_pd *pd; uint32_t handle; ...; };
struct ibv_ah { struct ibv_context *context; struct ibv_pd *pd; uint32_t handle; ...; };
struct ibv_qp { struct ibv_context *context; void *qp_context; struct ibv_pd *pd; struct ibv_cq *send_cq;
                struct ibv_cq *recv_cq; struct ibv_srq *srq; uint32_t handle; uint32_t qp_num; int state;
                int qp_type; ...; };

struct ibv_device_attr {
    char fw_ver[64]; uint64_t node_guid; uint64_t sys_image_guid; uint64_t max_mr_size;
    uint64_t page_size_cap; uint32_t vendor_id; uint32_t vendor_part_id; uint32_t hw_ver;
    int max_qp; int max_qp_wr; unsigned int device_cap_flags; int max_sge; int max_sge_rd;
    int max_cq; int max_cqe; int max_mr; int max_pd; int max_qp_rd_atom; int max_ee_rd_atom;
    int max_res_rd_atom; int max_qp_init_rd_atom; int max_ee_init_rd_atom; int atomic_cap;
    int max_ee; int max_rdd; int max_mw; int max_raw_ipv6_qp; int max_raw_ethy_qp;
    int max_mcast_grp; int max_mcast_qp_attach; int max_total_mcast_qp_attach; int max_ah;
    int max_fmr; int max_map_per_fmr; int max_srq; int max_srq_wr; int max_srq_sge;
    uint16_t max_pkeys; uint8_t local_ca_ack_delay; uint8_t phys_port_cnt;
};
struct ibv_port_attr {
    int state; int max_mtu; int active_mtu; int gid_tbl_len; uint32_t port_cap_flags;
    uint32_t max_msg_sz; uint32_t bad_pkey_cntr; uint32_t qkey_viol_cntr; uint16_t pkey_tbl_len;
    uint16_t lid; uint16_t sm_lid; uint8_t lmc; uint8_t max_vl_num; uint8_t sm_sl;
    uint8_t subnet_timeout; uint8_t init_type_reply; uint8_t active_width; uint8_t active_speed;
    uint8_t phys_state; uint8_t link_layer; uint8_t flags; uint16_t port_cap_flags2;
};
union ibv_gid { uint8_t raw[16]; ...; };

struct ibv_qp_cap { uint32_t max_send_wr; uint32_t max_recv_wr; uint32_t max_send_sge;
                    uint32_t max_recv_sge; uint32_t max_inline_data; };
struct ibv_qp_init_attr { void *qp_context; struct ibv_cq *send_cq; struct ibv_cq *recv_cq;
                          struct ibv_srq *srq; struct ibv_qp_cap cap; int qp_type; int sq_sig_all; };
struct ibv_qp_attr { int qp_state; int cur_qp_state; uint32_t qkey; unsigned int qp_access_flags;
                     struct ibv_qp_cap cap; uint16_t pkey_index; uint8_t max_rd_atomic;
                     uint8_t max_dest_rd_atomic; uint8_t port_num; uint8_t timeout; uint8_t retry_cnt;
                     uint8_t rnr_retry; uint32_t sq_psn; uint8_t min_rnr_timer; ...; };
struct ibv_srq_attr { uint32_t max_wr; uint32_t max_sge; uint32_t srq_limit; };
struct ibv_srq_init_attr { void *srq_context; struct ibv_srq_attr attr; };

struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
uint64_t ibv_get_device_guid(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *port_attr);
int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
const char *ibv_port_state_str(int port_state);
const char *ibv_wc_status_str(int status);
const char *ibv_event_type_str(int event);

struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_mw *ibv_alloc_mw(struct ibv_pd *pd, int type);
int ibv_dealloc_mw(struct ibv_mw *mw);

struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_resize_cq(struct ibv_cq *cq, int cqe);
int ibv_destroy_cq(struct ibv_cq *cq);
int ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only);

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                 struct ibv_qp_init_attr *init_attr);
int ibv_destroy_qp(struct ibv_qp *qp);

struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);
int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr, int srq_attr_mask);
int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr);
int ibv_destroy_srq(struct ibv_srq *srq);
int ibv_destroy_ah(struct ibv_ah *ah);
uint32_t ibv_inc_rkey(uint32_t rkey);
int ibv_fork_init(void);
int ibv_is_fork_initialized(void);  /* enum ibv_fork_status: 0 disabled, 1 enabled, 2 unneeded */

/* ---- (1) librdmacm ----------------------------------------------------- */
#define RDMA_PS_TCP ...
#define RDMA_PS_UDP ...
#define RDMA_PS_IPOIB ...
#define RDMA_UDP_QKEY ...

struct rdma_event_channel { int fd; };
struct rdma_cm_id { struct ibv_context *verbs; struct rdma_event_channel *channel; void *context;
                    struct ibv_qp *qp; int ps; uint8_t port_num; struct ibv_pd *pd; int qp_type; ...; };
struct rdma_conn_param { const void *private_data; uint8_t private_data_len; uint8_t responder_resources;
                         uint8_t initiator_depth; uint8_t flow_control; uint8_t retry_count;
                         uint8_t rnr_retry_count; uint8_t srq; uint32_t qp_num; };

struct rdma_event_channel *rdma_create_event_channel(void);
void rdma_destroy_event_channel(struct rdma_event_channel *channel);
int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, void *context, int ps);
int rdma_destroy_id(struct rdma_cm_id *id);
int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr);
int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src_addr, struct sockaddr *dst_addr,
                      int timeout_ms);
int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);
int rdma_listen(struct rdma_cm_id *id, int backlog);
int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_reject(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);
int rdma_disconnect(struct rdma_cm_id *id);
int rdma_establish(struct rdma_cm_id *id);
int rdma_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *channel);
int rdma_join_multicast(struct rdma_cm_id *id, struct sockaddr *addr, void *context);
int rdma_leave_multicast(struct rdma_cm_id *id, struct sockaddr *addr);
uint16_t rdma_get_src_port(struct rdma_cm_id *id);
uint16_t rdma_get_dst_port(struct rdma_cm_id *id);
struct sockaddr *rdma_get_local_addr(struct rdma_cm_id *id);
struct sockaddr *rdma_get_peer_addr(struct rdma_cm_id *id);
const char *rdma_event_str(int event);
int rdma_set_option(struct rdma_cm_id *id, int level, int optname, void *optval, size_t optlen);
#define RDMA_OPTION_ID ...
#define RDMA_OPTION_ID_ACK_TIMEOUT ...

#define AIODAT_CM_PRIVATE_DATA_MAX ...
#define AIODAT_FAULT_NOTIFY ...
#define AIODAT_FAULT_POLL ...
#define AIODAT_FAULT_POLL_LATER_CHUNK ...
#endif /* AIODAT_CFFI_CDEF */

/* ---- (2) the shim ------------------------------------------------------ */

/* One scatter/gather element: an LMR slice. */
struct aiodat_sge { uint64_t addr; uint32_t length; uint32_t lkey; };

/* One send-queue request.  Its segments are sges[sge_start : sge_start+num_sge]
 * of the array passed beside it, so a batch is two flat arrays. */
struct aiodat_send_wr {
    uint64_t wr_id; int opcode; unsigned int send_flags; uint32_t imm_data; /* host order */
    int sge_start; int num_sge;
    uint64_t remote_addr; uint32_t rkey;          /* RDMA and atomics */
    uint64_t compare_add; uint64_t swap;          /* atomics */
    struct ibv_ah *ah; uint32_t remote_qpn; uint32_t remote_qkey;   /* UD */
    struct ibv_mw *mw; uint32_t mw_rkey; struct ibv_mr *bind_mr;    /* type-2 window bind */
    uint64_t bind_addr; uint64_t bind_length; unsigned int bind_access;
};

/* One completion, copied out of struct ibv_wc (immediate data in host order). */
struct aiodat_wc {
    uint64_t wr_id; int status; int opcode; uint32_t vendor_err; uint32_t byte_len;
    uint32_t imm_data; uint32_t qp_num; uint32_t src_qp; unsigned int wc_flags;
    uint16_t slid; uint8_t sl;
};

/* One rdma_cm event, copied out of librdmacm and already acked. */
struct aiodat_cm_event {
    struct rdma_cm_id *id; struct rdma_cm_id *listen_id; int event; int status;
    int private_data_len; uint8_t private_data[256];
    uint8_t responder_resources; uint8_t initiator_depth; uint8_t retry_count;
    uint8_t rnr_retry_count; uint8_t srq; uint32_t qp_num;
    /* UD/multicast: an address handle made from the event's path, owned by the caller
     * (only when a PD is passed to aiodat_cm_get_events), and the path itself
     * (a struct ibv_ah_attr, opaque) for aiodat_create_ah on the PD the caller chooses. */
    struct ibv_ah *ah; uint32_t ud_qp_num; uint32_t ud_qkey;
    int has_ah_attr; uint8_t ah_attr[64];
    /* CONNECT_REQUEST: the request's addresses, formatted here (its CR's local and remote
     * address; "" when rdma_cm has none) */
    char local_host[64]; char remote_host[64]; uint16_t local_port; uint16_t remote_port;
};

/* One asynchronous (device) event, copied out and acked. */
struct aiodat_async_event {
    int event_type; void *element;   /* qp, cq or srq pointer (a key only: never dereferenced); NULL for port events */
    int port_num;
    uint32_t qp_num;                 /* copied out before the ack: the QP may be gone afterwards */
};

int aiodat_set_nonblocking(int fd);
/* A type-2 memory window into *cell, which the caller made first: if making the Python object for
 * the pointer then fails (MemoryError), the window is still reachable through the cell.  0 or errno. */
int aiodat_alloc_mw(struct ibv_pd *pd, struct ibv_mw **cell);
/* Deallocate the window in *cell (from aiodat_alloc_mw) without a new Python object; 0 or errno. */
int aiodat_dealloc_mw_at(struct ibv_mw **cell);
int aiodat_post_send(struct ibv_qp *qp, const struct aiodat_send_wr *wrs, int n,
                     const struct aiodat_sge *sges, int *n_posted);
int aiodat_post_send1(struct ibv_qp *qp, uint64_t wr_id, int opcode, unsigned int send_flags,
                      uint32_t imm_data, uint64_t addr, uint32_t length, uint32_t lkey,
                      uint64_t remote_addr, uint32_t rkey);
int aiodat_post_send_same(struct ibv_qp *qp, const struct aiodat_send_wr *tmpl, unsigned int last_send_flags,
                          const struct aiodat_sge *sges, uint64_t first_wr_id, uint64_t step, int n,
                          int *n_posted);
int aiodat_post_recv_same(struct ibv_qp *qp, struct ibv_srq *srq, uint64_t first_wr_id, uint64_t step, int n,
                          const struct aiodat_sge *sges, int num_sge, int *n_posted);
int aiodat_post_recv1(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t length, uint32_t lkey);
int aiodat_post_recv(struct ibv_qp *qp, struct ibv_srq *srq, const uint64_t *wr_ids,
                     const int *sge_starts, const int *num_sges, int n,
                     const struct aiodat_sge *sges, int *n_posted);
int aiodat_cq_drain(struct ibv_comp_channel *channel, struct ibv_cq *cq, int arm,
                    struct aiodat_wc *out, int max, int *status);
void aiodat_inject_fault(int what, int count);
int aiodat_cq_poll(struct ibv_cq *cq, struct aiodat_wc *out, int max);
int aiodat_cq_spin(struct ibv_cq *cq, struct aiodat_wc *out, int max, int usec, int *status);
int aiodat_cm_get_events(struct rdma_event_channel *channel, struct ibv_pd *pd,
                         struct aiodat_cm_event *out, int max);
struct ibv_ah *aiodat_create_ah(struct ibv_pd *pd, const struct aiodat_cm_event *ev);
int aiodat_async_get_events(struct ibv_context *context, struct aiodat_async_event *out, int max);
struct ibv_qp *aiodat_create_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
                                struct ibv_srq *srq, int max_send_wr, int max_recv_wr, int max_send_sge,
                                int max_recv_sge, int max_inline, int default_inline, int ud, int port_num,
                                int *out);
int aiodat_cm_connect(struct rdma_cm_id *id, int accept, const char *pdata, int plen, int responder,
                      int initiator, int retry_count, int rnr_retry_count, uint32_t qp_num, int srq);
/* 0; an errno with the QP in ERR; or minus an errno when the id refused the first step, the QP
 * untouched (on the passive side: a request its peer gave up, which the kernel does not report) */
int aiodat_cm_ready_qp(struct rdma_cm_id *id, struct ibv_qp *qp, int resp_res, int init_depth,
                       int min_rnr_timer, int ack_timeout, int port_num, int link_layer);
int aiodat_mcast_attach(struct ibv_qp *qp, const struct aiodat_cm_event *ev, int attach);
int aiodat_sockaddr(const char *host, uint16_t port, struct sockaddr_storage *out);
int aiodat_sockaddr_str(const struct sockaddr *addr, char *host, int host_len, uint16_t *port);
int aiodat_if_addresses(const char *ifname, char *out, int out_len);
int aiodat_gid_str(const union ibv_gid *gid, char *out, int out_len);
int aiodat_port_gids(struct ibv_context *context, int port_num, int table_len, int ports, int *indexes,
                     union ibv_gid *gids);
size_t aiodat_sockaddr_storage_size(void);
