/* aiodat/_shim/postcommon.h: what the two posting paths share, the cffi module's (shim.c) and the
 * hot-path extension's (posts.c), so that they chain and count requests alike.  Plain C: it is not
 * part of the declarations cffi reads (shim.h). */
#ifndef AIODAT_POSTCOMMON_H
#define AIODAT_POSTCOMMON_H

#include <infiniband/verbs.h>

#define AIODAT_CHUNK 64  /* requests chained per ibv_post_* call */

/* a post's errno as a positive number: older rxe providers (rdma-core < 44) return -errno */
static inline int post_errno(int rc)
{
    return rc < 0 ? -rc : rc;
}

/* how many of the ``count`` chained requests from ``wr`` an ibv_post_* that failed took: those before
 * ``bad``; none when it left ``bad`` NULL or out of the chain (rxe 44 does, for some errors) */
#define TAKEN(bad, wr, count) ((bad) != NULL && (bad) >= (wr) && (bad) < (wr) + (count) ? (int)((bad) - (wr)) : 0)

#endif
