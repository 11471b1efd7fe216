/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  Declarations shared by the subsystems of the idempotency extension.
 *
 * Each subsystem lives in its own file: claims.c (the claim protocol),
 * partitions.c (the per-backend cache of the partition registry that every
 * claim reads), filters.c (Bloom filters of sealed partitions, in shared or
 * backend memory), retention.c (the maintenance round and idem_configure),
 * worker.c (the background worker), outbox.c (the transactional outbox:
 * emit and the relay API), inbox.c (the inbox: receive, claim, done, fail,
 * replay), leases.c (what the outbox and the inbox share: row ids, lease
 * tokens, backoff, argument checks; the requests use its argument checks
 * too), requests.c (stored responses for Idempotency-Key requests), store.c
 * (the time partitions of the outbox's events, the inbox's messages and the
 * requests), rows.c (rows written without the executor, for claims,
 * events, messages and requests) and stats.c (the shared-memory counters
 * behind idempotency.stats); guarded writes take three,
 * guard_rules.c, guard_triggers.c and guard_helpers.c, which share guards.h.
 * idempotency.c holds only _PG_init and the few helpers every subsystem
 * uses.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "utils/elog.h"
#include "fmgr.h"
#include "utils/relcache.h"
#include "access/transam.h"
#include "utils/snapshot.h"
#include "utils/jsonb.h"
#include "utils/uuid.h"

/* Name of the schema that holds the extension's tables and internals. */
#define IDEM_SCHEMA "idempotency"

/* SQLSTATEs of class IK (SPEC.md section 7). */
#define ERRCODE_IDEM_KEY_REUSED			MAKE_SQLSTATE('I','K','0','0','1')
#define ERRCODE_IDEM_REQUEST_IN_PROGRESS	MAKE_SQLSTATE('I','K','0','0','2')
#define ERRCODE_IDEM_LEASE_LOST			MAKE_SQLSTATE('I','K','0','0','3')
#define ERRCODE_IDEM_STALE_VERSION		MAKE_SQLSTATE('I','K','0','0','4')
#define ERRCODE_IDEM_INVALID_TRANSITION	MAKE_SQLSTATE('I','K','0','0','5')
#define ERRCODE_IDEM_WRONG_SHARD		MAKE_SQLSTATE('I','K','0','0','6')
#define ERRCODE_IDEM_SHARD_FROZEN		MAKE_SQLSTATE('I','K','0','0','7')

/* idempotency.c: helpers shared by the subsystems */
extern Oid	idem_schema_oid(void);
extern Oid	idem_internal_relid(const char *relname);
extern int	idem_pin_search_path(void);

/* ownership.c: which relations are ours, and acting as the extension's owner */
typedef struct IdemAsOwner
{
	Oid			save_userid;
	int			save_sec_context;
	int			nestlevel;
} IdemAsOwner;

extern Oid	idem_extension_owner(void);
extern const char *idem_relation_distrust(Oid relid, Oid parent);
extern void idem_check_members_owned(void);
extern void idem_become_owner(IdemAsOwner *as);
extern void idem_unbecome_owner(IdemAsOwner *as);

/* scopes.c: claims per scope of a partition, counted without the planner */
#define IDEM_SCOPE_COUNT_KEY_BYTES 128	/* longest scope a count keeps, + 1 */

typedef struct IdemScopeCount
{
	char		scope[IDEM_SCOPE_COUNT_KEY_BYTES];	/* the hash key */
	TimestampTz first_claim_at;
	TimestampTz last_claim_at;
	int64		claims;
} IdemScopeCount;

struct HTAB;
extern struct HTAB *idem_scope_counts_create(void);
extern void idem_scope_counts_add(struct HTAB *counts, Relation rel, Snapshot snap);

/* A fixed SQL statement of a subsystem, prepared once per backend. */
typedef struct IdemStatement
{
	const char *sql;
	int			nargs;
	Oid			argtypes[10];
} IdemStatement;

struct _SPI_plan;
extern struct _SPI_plan *idem_statement_plan(const IdemStatement *st, struct _SPI_plan **slot);
extern Datum idem_spi_col(uint64 row, int col, bool *isnull);
extern uint64 idem_statement_exec(const IdemStatement *st, struct _SPI_plan **slot, Datum *values,
								  const char *nulls, int expected);

/*---- limits shared by C, SQL and messages ----*/

/* Longest key and scope stored as they are (a btree tuple must fit). */
#define IDEM_MAX_KEY_BYTES		2000
#define IDEM_MAX_SCOPE_BYTES	63

/*
 * Most partitions a configuration may keep live (retention / interval +
 * premake + 1): every claim consults each live sealed partition's filter.
 */
#define IDEM_MAX_LIVE_PARTITIONS	100

/*
 * Partitions starting this far in the future are still probed, so that a
 * claimer whose clock reads slightly behind another's sees its claims.
 */
#define IDEM_CLOCK_SKEW_USECS	USECS_PER_SEC

/*
 * field4 values of our advisory locktags, side by side so they never
 * collide; user advisory locks use 1 and 2.
 */
#define IDEM_LOCKTAG_CLAIM		0x4943	/* value lock of one (scope, key) */
#define IDEM_LOCKTAG_MAINTAIN	0x494D	/* one maintenance round per database */
#define IDEM_LOCKTAG_REQUEST	0x4952	/* making a request's row again */

/* claims.c */
extern uint64 idem_key_hash(text *scope, text *key);
/* claims.c: the claim protocol, for the subsystems built on it */
extern void idem_check_key(text *key);
extern void idem_check_scope(text *scope, int maxbytes);
extern bool idem_claim_key(text *scope, text *key, Jsonb *payload, const char *fname);
extern char *idem_key_for_message(text *key);
extern void idem_payload_digest(Jsonb *payload, uint8 *digest);

/*---- rows.c: rows written without the executor ----*/

typedef struct IdemIndexSet
{
	Relation	heap;
	int			n;
	Relation   *indexes;
	struct IndexInfo **infos;
} IdemIndexSet;

extern void idem_open_insert_indexes(Relation heap, IdemIndexSet *set, const char *what);
extern void idem_close_insert_indexes(IdemIndexSet *set);
extern void idem_insert_index_entries(IdemIndexSet *set, Datum *values, bool *nulls,
									  ItemPointer tid, Oid unique_index);
extern void idem_insert_row(IdemIndexSet *set, Datum *values, bool *nulls, Oid unique_index);

/*---- partitions.c: the partition registry and its per-backend cache ----*/

typedef struct IdemPartition
{
	Oid			relid;			/* partition table */
	TimestampTz lower;			/* claims made at or after ... */
	TimestampTz upper;			/* ... and before this go here */
	bool		closed;			/* no more claims will go here (sealed, or
								 * closed until the next round seals it) */
	bool		sealed;			/* closed, and its claims (in progress ones
								 * too) are summarised: filter, keep_until */
	bool		held;			/* sealed while transactions that claimed
								 * there were open: not yet counted in the
								 * scope history, not droppable */
	bool		empty;			/* sealed without a single claim */
	TimestampTz keep_until;		/* sealed: no claim in it is younger than
								 * keep_until - retention */
	bool		has_filter;		/* the registry holds a Bloom filter */
	TransactionId filter_xmin;	/* names that filter (its registry row) */
	Oid			indexid;		/* last seen (scope, key) index, a hint */
	/* where this backend found the filter (filters.c) */
	const uint8 *filter_bits;
	uint32		filter_nbits;
	uint64		filter_epoch;
	bool		filter_missing; /* not loadable now: probe instead */
	uint32		local_lookups;	/* consulted without a filter in memory */
} IdemPartition;

typedef struct IdemPartitionSet
{
	Oid			claims_relid;	/* idempotency.claims, the parent */
	Oid			registry_relid; /* idempotency.partition_registry */
	int64		retention;		/* microseconds */
	int64		interval;		/* microseconds */
	int			premake;
	uint64		generation;		/* changes whenever the set is rebuilt */
	int			nparts;
	IdemPartition *parts;		/* sorted by lower, newest first */
} IdemPartitionSet;

/*
 * Settings: in seconds, and as stored (intervals are kept as given).  The
 * defaults and bounds below are the only place they are written down: the
 * SQL objects ask idempotency.current_settings(), and messages print these.
 */
typedef struct IdemSettings
{
	int64		retention;
	int64		interval;
	int			premake;
	Interval	retention_iv;
	Interval	interval_iv;
} IdemSettings;

#define IDEM_DEFAULT_RETENTION_SECS	(7 * SECS_PER_DAY)
#define IDEM_DEFAULT_INTERVAL_SECS	SECS_PER_DAY
#define IDEM_DEFAULT_PREMAKE		4
#define IDEM_MAX_PREMAKE			1000
#define IDEM_MAX_INTERVAL_YEARS		10
#define IDEM_MAX_RETENTION_YEARS	100
#define IDEM_MAX_INTERVAL_SECS		((int64) IDEM_MAX_INTERVAL_YEARS * DAYS_PER_YEAR * SECS_PER_DAY)
#define IDEM_MAX_RETENTION_SECS		((int64) IDEM_MAX_RETENTION_YEARS * DAYS_PER_YEAR * SECS_PER_DAY)

extern IdemPartitionSet *idem_partition_set(void);
extern IdemPartitionSet *idem_partition_set_fresh(void);
extern IdemPartition *idem_target_partition(IdemPartitionSet *set, TimestampTz now,
											bool *covers);
extern bool idem_partition_expired(IdemPartitionSet *set, IdemPartition *p,
								   TimestampTz now);
extern IdemSettings idem_read_settings(Snapshot snap);
extern int64 idem_interval_seconds(Interval *iv);
extern TimestampTz idem_now(void);
extern void idem_debug_wait(const char *point);
extern void idem_partitions_init(void);

/*---- filters.c: Bloom filters of sealed partitions ----*/

#define IDEM_BLOOM_HASHES		7
#define IDEM_BLOOM_BITS_PER_KEY	10
#define IDEM_BLOOM_BLOCK_BITS	512		/* one cache line; sizes are multiples */

/* what idem_filter_build() learned about a partition while scanning it */
typedef struct IdemSealInfo
{
	int64		nkeys;
	TimestampTz max_claimed_at; /* DT_NOBEGIN when empty */
	int			nholders;		/* transactions whose claims there are not
								 * visible yet (see idem_filter_build) */
	FullTransactionId *holders; /* their top-level ids */
} IdemSealInfo;

extern bytea *idem_filter_build(Relation rel, Snapshot visible, IdemSealInfo *info);
extern bool idem_filter_maybe(IdemPartitionSet *set, IdemPartition *p, uint64 hash);
extern void idem_filter_prefetch(IdemPartition *p, uint64 hash);
extern void idem_filters_forget_others(IdemPartitionSet *set);
extern void idem_filters_init(void);

/*---- retention.c: maintenance, and what store.c shares of it ----*/

/*
 * lock_timeout of a maintenance round: its DDL waits at most this long for
 * a lock (any role that may LOCK a parent can hold one), then the action is
 * reported as "skip ... (in use)" and the round goes on.
 */
#define IDEM_MAINTENANCE_LOCK_TIMEOUT_MS	1000

extern int	idem_maintain_round(int elevel);

/* Where a maintenance round reports its actions: rows, or the log. */
typedef struct MaintainReport
{
	struct Tuplestorestate *store;	/* NULL: log instead */
	struct TupleDescData *desc;
	int			elevel;
	int			nactions;
} MaintainReport;

typedef bool (*IdemGuardedAction) (void *arg);

extern void idem_report_action(MaintainReport *rep, const char *action, const char *object);
extern bool idem_run_guarded(MaintainReport *rep, const char *verb, const char *object,
							 IdemGuardedAction fn, void *arg);
extern bool idem_round_caller_trusted(void);
extern bool idem_partition_trusted(MaintainReport *rep, const char *verb, Oid relid, Oid parent,
								   const char *name);
extern void idem_spi_exec(const char *sql, int nargs, Oid *types, Datum *values, int expected);
extern void idem_exec_ddl_as_data(const char *sql);
extern void idem_forget_missing(MaintainReport *rep, const char *registry);
extern char *idem_partition_name(const char *prefix, TimestampTz lower);
extern TimestampTz idem_next_boundary(TimestampTz now, int64 interval_secs);

/*---- store.c: time partitions of the stores beside the claims ----*/

typedef enum IdemStoreId
{
	IDEM_STORE_OUTBOX,
	IDEM_STORE_REQUESTS,
	IDEM_STORE_INBOX,
	IDEM_NSTORES
} IdemStoreId;

/* partition buckets are 1 .. IDEM_STORE_BUCKETS; event ids carry 24 bits */
#define IDEM_STORE_BUCKETS		((1 << 24) - 1)

extern void idem_store_init(void);
extern int32 idem_store_target(IdemStoreId id, TimestampTz now, Oid *relid, Oid *parent);
extern void idem_store_forget(IdemStoreId id);
extern bool idem_store_is_registry(Oid relid);
extern Relation idem_store_open_target(IdemStoreId id, TimestampTz ts, int32 *bucket,
									   const char *const *columns, int ncolumns);
extern void idem_stores_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now);

/*---- leases.c: what the outbox and the inbox share ----*/
extern void idem_row_id(TimestampTz ts, int32 bucket, FullTransactionId txid, pg_uuid_t *id);
extern bool idem_row_id_parts(const pg_uuid_t *id, TimestampTz *ts, int32 *bucket,
							  FullTransactionId *txid);
extern void idem_row_id_bound(TimestampTz ts, pg_uuid_t *id);
extern TimestampTz idem_row_time(FullTransactionId txid);
extern void idem_lease_token(pg_uuid_t *token);
extern int64 idem_backoff_usecs(int32 attempts);
extern bool idem_attempt_failed(int32 attempts, int max_attempts, int64 retry_after,
								TimestampTz now, TimestampTz *retry_at);
extern void idem_null_argument(const char *what) pg_attribute_noreturn();
extern char *idem_check_name(text *t, const char *what, int maxbytes);
extern char *idem_name_arg(FunctionCallInfo fcinfo, int argno, const char *what, int maxbytes);
extern Jsonb *idem_check_object(Jsonb *j, const char *what);
extern Jsonb *idem_empty_object(void);
extern int64 idem_positive_interval_arg(FunctionCallInfo fcinfo, int argno, const char *what);
extern int64 idem_retry_after_arg(FunctionCallInfo fcinfo, int argno, const char *what);
extern int32 idem_batch_arg(FunctionCallInfo fcinfo, int argno, const char *what, int32 max);
extern int	idem_array_arg(FunctionCallInfo fcinfo, int argno, const char *what, Oid elemtype,
						   Datum **elems);
extern Datum idem_build_array(Datum *elems, bool *nulls, int n, Oid elemtype);
extern struct TupleDescData *idem_result_tupdesc(FunctionCallInfo fcinfo);

/*---- outbox.c: the transactional outbox ----*/
extern bool idem_outbox_keep_undelivered;
extern void idem_outbox_init(void);

/*---- inbox.c: the inbox ----*/
extern void idem_inbox_init(void);

/*---- stats.c: the counters behind idempotency.stats ----*/

/* in the column order of idempotency.stats_counters() */
typedef enum IdemStatCounter
{
	IDEM_STAT_CLAIMS,
	IDEM_STAT_DUPLICATES,
	IDEM_STAT_PAYLOAD_MISMATCHES,
	IDEM_STAT_RELEASES,
	IDEM_STAT_STALE_SKIPS,
	IDEM_STAT_INVALID_TRANSITIONS,
	IDEM_STAT_REQUESTS_STARTED,
	IDEM_STAT_REQUESTS_COMPLETED,
	IDEM_STAT_REQUESTS_CONFLICTED,
	IDEM_STAT_NCOUNTERS
} IdemStatCounter;

extern void idem_stats_count_scope(text *scope, IdemStatCounter counter, int64 n);
extern void idem_stats_count_relation(Oid relid, IdemStatCounter counter);
extern void idem_stats_maintained(void);
extern void idem_stats_init(void);

/* worker.c: the maintenance background worker */
extern void idem_worker_init(void);
extern PGDLLEXPORT void idem_launcher_main(Datum main_arg);
extern PGDLLEXPORT void idem_worker_main(Datum main_arg);

/* guard_triggers.c: per-backend counters of guarded writes */
typedef struct IdemGuardCounters
{
	int64		stale_skipped;		/* version guard, 'skip' */
	int64		stale_rejected;		/* version guard, 'error' (IK004) */
	int64		upsert_stale;		/* idem_upsert() returned 'stale' */
	int64		invalid_skipped;	/* transition guard, 'skip' */
	int64		invalid_rejected;	/* transition guard, 'error' (IK005) */
	int64		already_applied;	/* transition to the state a row had */
} IdemGuardCounters;

extern void idem_guards_init(void);
extern void idem_guard_counters(IdemGuardCounters *out);

#endif							/* IDEMPOTENCY_H */
