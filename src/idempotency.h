/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  What every file of the idempotency extension may use: the PostgreSQL
 *	  version it is built for, the SQLSTATEs of class IK, the limits of
 *	  keys and scopes, and the field values of its advisory locktags.
 *
 * Everything else sits with its wing, one folder each, and files include
 * only downhill (doc/design.md, "Wings and the include rule"; .ci/run
 * checks it):
 *	common/			used by all: catalog, SQL, clock, arguments, keys,
 *					rows written without the executor, ownership, caches
 *	stats/			the counters behind idempotency.stats
 *	claims/			the claim protocol, its partitions, settings, filters
 *	guards/			version and transition guards, idem_upsert
 *	delivery/		the stores, outbox, inbox and requests
 *	shards/			scale-out with PL/Proxy
 *	maintenance/	the round, its steps, the worker
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#if PG_VERSION_NUM < 150000 || PG_VERSION_NUM >= 160000
#error "idempotency is built and tested for PostgreSQL 15 (a port starts in src/common/compat.h)"
#endif

#include "fmgr.h"

/* SQLSTATEs of class IK (doc/reference.md lists them) */
#define ERRCODE_IDEM_KEY_REUSED			MAKE_SQLSTATE('I','K','0','0','1')
#define ERRCODE_IDEM_REQUEST_IN_PROGRESS	MAKE_SQLSTATE('I','K','0','0','2')
#define ERRCODE_IDEM_LEASE_LOST			MAKE_SQLSTATE('I','K','0','0','3')
#define ERRCODE_IDEM_STALE_VERSION		MAKE_SQLSTATE('I','K','0','0','4')
#define ERRCODE_IDEM_INVALID_TRANSITION	MAKE_SQLSTATE('I','K','0','0','5')
#define ERRCODE_IDEM_WRONG_SHARD		MAKE_SQLSTATE('I','K','0','0','6')
#define ERRCODE_IDEM_SHARD_FROZEN		MAKE_SQLSTATE('I','K','0','0','7')
#define ERRCODE_IDEM_LATE_DUPLICATE		MAKE_SQLSTATE('I','K','0','0','8')

/* Longest key and scope stored as they are (a btree tuple must fit). */
#define IDEM_MAX_KEY_BYTES		2000
#define IDEM_MAX_SCOPE_BYTES	63

/*
 * field4 values of our advisory locktags, side by side so they never
 * collide; user advisory locks use 1 and 2.
 */
#define IDEM_LOCKTAG_CLAIM		0x4943	/* value lock of one (scope, key) */
#define IDEM_LOCKTAG_MAINTAIN	0x494D	/* one maintenance round per database */
#define IDEM_LOCKTAG_REQUEST	0x4952	/* making a request's row again */
#define IDEM_LOCKTAG_DELIVERY	0x4944	/* making a subscription's deliveries row */
#define IDEM_LOCKTAG_DELIVERY_ROWS	0x4941	/* who makes a subscription's rows: relays or an operator */
#define IDEM_LOCKTAG_SUBSCRIPTION	0x4953	/* a subscription's name: in use, or changing */
#define IDEM_LOCKTAG_EMIT		0x4945	/* emitting to an outbox aggregate */

#endif							/* IDEMPOTENCY_H */
