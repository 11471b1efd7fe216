/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Cluster-wide counters behind idempotency.stats: claims, duplicates,
 *	  payload mismatches and releases per scope, stale and invalid writes per
 *	  guarded table, started, completed and conflicting requests; and
 *	  idempotency.live_scopes(), the claims per scope of the partitions not
 *	  sealed yet, behind idempotency.consumers.
 *
 * With shared_preload_libraries = 'idempotency' the counters live in one
 * shared hash table for the whole cluster, keyed by (database, relation,
 * scope); every backend adds to them.  Without preload there is no shared
 * memory, counting costs a pointer test, and the view answers from the
 * tables instead (sql/ext/65_stats.sql).
 *
 * The table is bounded by idempotency.stats_max_scopes (scopes and guarded
 * tables, all databases together).  A scope or table that finds no room
 * counts in its database's overflow row, which always has room: each
 * database's first counted event takes one of IDEM_STATS_DATABASES slots
 * kept for these rows, which also hold when the database's counters were
 * last reset.  A database beyond those counts nowhere (stats_info() reports
 * how many events were dropped so).  Counters start at zero when the server
 * starts: nothing is written to disk.  idempotency.track_stats = off stops
 * the counting (for one session, or everywhere).
 *
 * Counters are not transactional (like PostgreSQL's own statistics): a
 * claim counts when it is made, even if its transaction then rolls back,
 * and a payload mismatch counts although its error aborts the transaction.
 *
 * Locking rules: one LWLock guards the hash table's shape, taken shared to
 * find an entry and exclusive to add or remove one.  Counting itself takes
 * no lock: each backend keeps pointers to the entries it used, and adds to
 * their atomic counters.  idem_stats_reset() removes a database's entries
 * and advances the table's epoch, which makes every backend drop its
 * pointers before its next count; a count that races with the reset may
 * land in the old or the new period (or, rarely, in an entry reused a
 * moment later), never outside the table.
 *
 * live_scopes() reads the registry and each unsealed partition under the
 * caller's snapshot with AccessShareLock, and only a partition that
 * idem_relation_distrust() accepts (checked before the lock, so another
 * owner's lock cannot stall it, and again under it).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include <limits.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_stats_counters);
PG_FUNCTION_INFO_V1(idem_stats_info);
PG_FUNCTION_INFO_V1(idem_stats_reset);
PG_FUNCTION_INFO_V1(idem_live_scopes);

/* Slots kept for the overflow rows of this many databases. */
#define IDEM_STATS_DATABASES	64

/* Most pointers a backend keeps (scopes past the bound have one each too). */
#define IDEM_STATS_LOCAL_MAX	4096

/* What identifies a row: a scope (relid 0) or a table (scope ""), or neither: the overflow row. */
typedef struct StatsKey
{
	Oid			dboid;
	Oid			relid;
	char		scope[IDEM_MAX_SCOPE_BYTES + 1];
} StatsKey;

typedef struct StatsEntry
{
	StatsKey	key;
	pg_atomic_uint64 counters[IDEM_STAT_NCOUNTERS];
	pg_atomic_uint64 last_claim_at; /* 0: none yet */
	pg_atomic_uint64 last_duplicate_at;
	/* overflow rows only: the database's last reset and maintenance round */
	TimestampTz reset_at;
	pg_atomic_uint64 maintained_at; /* 0: none since the server started */
} StatsEntry;

typedef struct StatsArea
{
	LWLock	   *lock;
	pg_atomic_uint64 epoch;		/* advanced when entries are removed */
	pg_atomic_uint64 dropped;	/* events of databases without an overflow slot */
	int			nentries;		/* scope and table entries (not overflow rows) */
	int			ndatabases;		/* overflow rows */
	TimestampTz started_at;
} StatsArea;

static int	stats_max_scopes = 1000;
static bool stats_track = true;
static StatsArea *stats_area = NULL;
static HTAB *stats_hash = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*
 * This backend's pointers into the shared table, valid while the epoch they
 * were found in lasts; the last one used is tried first (a handler claims
 * in one scope, over and over).
 */
typedef struct LocalEntry
{
	StatsKey	key;
	StatsEntry *shared;
} LocalEntry;

static HTAB *local_hash = NULL;
static bool maintained_pending = false;
static uint64 local_epoch = 0;
static LocalEntry *local_last = NULL;

/*---- shared memory ----*/

static Size
stats_area_size(void)
{
	return add_size(MAXALIGN(sizeof(StatsArea)),
					hash_estimate_size(stats_max_scopes + IDEM_STATS_DATABASES,
									   sizeof(StatsEntry)));
}

static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(stats_area_size());
	RequestNamedLWLockTranche("idempotency stats", 1);
}

static void
stats_shmem_startup(void)
{
	HASHCTL		info;
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats_area = ShmemInitStruct("idempotency stats", sizeof(StatsArea), &found);
	if (!found)
	{
		memset(stats_area, 0, sizeof(StatsArea));
		stats_area->lock = &(GetNamedLWLockTranche("idempotency stats"))->lock;
		pg_atomic_init_u64(&stats_area->epoch, 1);
		pg_atomic_init_u64(&stats_area->dropped, 0);
		stats_area->started_at = GetCurrentTimestamp();
	}
	info.keysize = sizeof(StatsKey);
	info.entrysize = sizeof(StatsEntry);
	stats_hash = ShmemInitHash("idempotency stats entries",
							   stats_max_scopes + IDEM_STATS_DATABASES,
							   stats_max_scopes + IDEM_STATS_DATABASES,
							   &info, HASH_ELEM | HASH_BLOBS);
	LWLockRelease(AddinShmemInitLock);
}

static bool
is_overflow_key(const StatsKey *key)
{
	return key->relid == InvalidOid && key->scope[0] == '\0';
}

/* A new entry's counters; the caller holds the lock exclusively. */
static void
init_entry(StatsEntry *e)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		pg_atomic_init_u64(&e->counters[i], 0);
	pg_atomic_init_u64(&e->last_claim_at, 0);
	pg_atomic_init_u64(&e->last_duplicate_at, 0);
	e->reset_at = stats_area->started_at;
}

/* A new overflow row; the caller holds the lock exclusively. */
static void
init_database_entry(StatsEntry *e)
{
	init_entry(e);
	pg_atomic_init_u64(&e->maintained_at, 0);
}

/*
 * The shared entry of a key, made if there is room; for a scope or table
 * without room, its database's overflow row; NULL if even that has none.
 */
static StatsEntry *
shared_entry(const StatsKey *key)
{
	StatsEntry *e;
	bool		found;
	bool		overflow = is_overflow_key(key);
	StatsKey	okey;

	LWLockAcquire(stats_area->lock, LW_SHARED);
	e = hash_search(stats_hash, key, HASH_FIND, NULL);
	LWLockRelease(stats_area->lock);
	if (e != NULL)
		return e;

	LWLockAcquire(stats_area->lock, LW_EXCLUSIVE);
	e = hash_search(stats_hash, key, HASH_FIND, NULL);
	if (e == NULL && !overflow && stats_area->nentries < stats_max_scopes)
	{
		e = hash_search(stats_hash, key, HASH_ENTER, &found);
		init_entry(e);
		stats_area->nentries++;
	}
	if (e == NULL)
	{
		/* no room (or it is the overflow row itself): the database's overflow row */
		memset(&okey, 0, sizeof(okey));
		okey.dboid = key->dboid;
		e = hash_search(stats_hash, &okey, HASH_FIND, NULL);
		if (e == NULL && stats_area->ndatabases < IDEM_STATS_DATABASES)
		{
			e = hash_search(stats_hash, &okey, HASH_ENTER, &found);
			init_database_entry(e);
			stats_area->ndatabases++;
		}
	}
	LWLockRelease(stats_area->lock);
	return e;
}

/* This backend's entry for a key (see LocalEntry). */
static StatsEntry *
find_entry(const StatsKey *key)
{
	uint64		epoch = pg_atomic_read_u64(&stats_area->epoch);
	LocalEntry *le;
	bool		found;

	/* start afresh after a reset, or when a backend used very many scopes */
	if (epoch != local_epoch || local_hash == NULL ||
		hash_get_num_entries(local_hash) >= IDEM_STATS_LOCAL_MAX)
	{
		HASHCTL		info;

		if (local_hash != NULL)
			hash_destroy(local_hash);
		info.keysize = sizeof(StatsKey);
		info.entrysize = sizeof(LocalEntry);
		info.hcxt = TopMemoryContext;
		local_hash = hash_create("idempotency stats pointers", 64, &info,
								 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
		local_epoch = epoch;
		local_last = NULL;
	}
	else if (local_last != NULL && memcmp(&local_last->key, key, sizeof(StatsKey)) == 0)
		return local_last->shared;

	/* NULL (no room even in the overflow rows) is kept too: only a reset makes room */
	le = hash_search(local_hash, key, HASH_ENTER, &found);
	if (!found)
		le->shared = shared_entry(key);
	local_last = le;
	return le->shared;
}

static void
add(StatsEntry *e, IdemStatCounter counter, int64 n)
{
	if (e == NULL)
	{
		pg_atomic_fetch_add_u64(&stats_area->dropped, n);
		return;
	}
	pg_atomic_fetch_add_u64(&e->counters[counter], n);
	if (counter == IDEM_STAT_CLAIMS)
		pg_atomic_write_u64(&e->last_claim_at, (uint64) idem_now());
	else if (counter == IDEM_STAT_DUPLICATES)
		pg_atomic_write_u64(&e->last_duplicate_at, (uint64) idem_now());
}

/*---- counting ----*/

/* Count n events of a scope (at most IDEM_MAX_SCOPE_BYTES bytes). */
void
idem_stats_count_scope(text *scope, IdemStatCounter counter, int64 n)
{
	StatsKey	key;
	int			len;

	if (stats_area == NULL || !stats_track)
		return;
	len = VARSIZE_ANY_EXHDR(scope);
	Assert(len > 0 && len <= IDEM_MAX_SCOPE_BYTES);
	len = Min(len, IDEM_MAX_SCOPE_BYTES);
	memset(&key, 0, sizeof(key));
	key.dboid = MyDatabaseId;
	memcpy(key.scope, VARDATA_ANY(scope), len);
	add(find_entry(&key), counter, n);
}

/* Count an event of a guarded table. */
void
idem_stats_count_relation(Oid relid, IdemStatCounter counter)
{
	StatsKey	key;

	if (stats_area == NULL || !stats_track)
		return;
	memset(&key, 0, sizeof(key));
	key.dboid = MyDatabaseId;
	key.relid = relid;
	add(find_entry(&key), counter, 1);
}

/*
 * A maintenance round ran in this transaction: as it commits, record the
 * time in the database's overflow row (idempotency.stats_info()), for
 * monitoring that alerts when maintenance stops.
 */
void
idem_stats_maintained(void)
{
	if (stats_area != NULL)
		maintained_pending = true;
}

static void
stats_xact_callback(XactEvent event, void *arg)
{
	StatsKey	okey;
	StatsEntry *e;

	if (!maintained_pending)
		return;
	/* before the commit record: nothing may fail after it */
	if (event == XACT_EVENT_PRE_COMMIT || event == XACT_EVENT_PARALLEL_PRE_COMMIT)
	{
		memset(&okey, 0, sizeof(okey));
		okey.dboid = MyDatabaseId;
		e = shared_entry(&okey);
		if (e != NULL)
			pg_atomic_write_u64(&e->maintained_at, (uint64) GetCurrentTimestamp());
	}
	/* a prepared round is not recorded (its commit may come from anywhere) */
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
		event == XACT_EVENT_PREPARE)
		maintained_pending = false;
}

/*---- SQL functions ----*/

static bool
counted_any(StatsEntry *e)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		if (pg_atomic_read_u64(&e->counters[i]) != 0)
			return true;
	return false;
}

static Datum
timestamp_or_null(pg_atomic_uint64 *v, bool *isnull)
{
	uint64		t = v != NULL ? pg_atomic_read_u64(v) : 0;

	*isnull = t == 0;
	return TimestampTzGetDatum((TimestampTz) t);
}

/*
 * idempotency.stats_counters(): this database's rows, as counted since the
 * last reset; none without preload.  Columns: scope, relation, the counters
 * in IdemStatCounter order, last_claim_at, last_duplicate_at.
 */
Datum
idem_stats_counters(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	HASH_SEQ_STATUS seq;
	StatsEntry *e;

	InitMaterializedSRF(fcinfo, 0);
	if (stats_area == NULL)
		return (Datum) 0;

	LWLockAcquire(stats_area->lock, LW_SHARED);
	hash_seq_init(&seq, stats_hash);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		Datum		values[IDEM_STAT_NCOUNTERS + 4];
		bool		nulls[IDEM_STAT_NCOUNTERS + 4] = {false};
		int			col = 0;

		if (e->key.dboid != MyDatabaseId)
			continue;
		if (is_overflow_key(&e->key) && !counted_any(e))
			continue;			/* nothing overflowed (it holds the reset time) */
		values[col] = CStringGetTextDatum(e->key.scope);
		nulls[col++] = e->key.scope[0] == '\0';
		values[col] = ObjectIdGetDatum(e->key.relid);
		nulls[col++] = e->key.relid == InvalidOid;
		for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
			values[col++] = Int64GetDatum((int64) pg_atomic_read_u64(&e->counters[i]));
		values[col] = timestamp_or_null(&e->last_claim_at, &nulls[col]);
		col++;
		values[col] = timestamp_or_null(&e->last_duplicate_at, &nulls[col]);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	LWLockRelease(stats_area->lock);
	return (Datum) 0;
}

/*
 * idempotency.stats_info(): whether the counters are kept, the bound, how
 * much of it is used (all databases), events that found no row, when
 * this database's counters were last reset (or the server started), and
 * when its last maintenance round committed (since the server started).
 */
Datum
idem_stats_info(PG_FUNCTION_ARGS)
{
	TupleDesc	desc = idem_result_tupdesc(fcinfo);
	Datum		values[7];
	bool		nulls[7] = {false};

	values[0] = BoolGetDatum(stats_area != NULL);
	values[1] = Int32GetDatum(stats_max_scopes);
	if (stats_area != NULL)
	{
		StatsKey	okey;
		StatsEntry *e;

		memset(&okey, 0, sizeof(okey));
		okey.dboid = MyDatabaseId;
		LWLockAcquire(stats_area->lock, LW_SHARED);
		values[2] = Int32GetDatum(stats_area->nentries);
		values[3] = Int32GetDatum(stats_area->ndatabases);
		e = hash_search(stats_hash, &okey, HASH_FIND, NULL);
		values[5] = TimestampTzGetDatum(e != NULL ? e->reset_at : stats_area->started_at);
		values[6] = timestamp_or_null(e != NULL ? &e->maintained_at : NULL, &nulls[6]);
		LWLockRelease(stats_area->lock);
		values[4] = Int64GetDatum((int64) pg_atomic_read_u64(&stats_area->dropped));
	}
	else
	{
		for (int i = 1; i < 7; i++)
			nulls[i] = true;
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, values, nulls)));
}

/*
 * idem_stats_reset(): start this database's counters afresh.  Its scopes
 * and tables give their room back (an overflowing scope may find room
 * again); its overflow row is zeroed and records the time.
 */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	HASH_SEQ_STATUS seq;
	StatsEntry *e;
	StatsKey	okey;

	if (stats_area == NULL)
	{
		ereport(NOTICE,
				(errmsg("idempotency statistics are not kept"),
				 errdetail("The library is not in shared_preload_libraries.")));
		PG_RETURN_VOID();
	}
	memset(&okey, 0, sizeof(okey));
	okey.dboid = MyDatabaseId;
	(void) shared_entry(&okey);

	LWLockAcquire(stats_area->lock, LW_EXCLUSIVE);
	hash_seq_init(&seq, stats_hash);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		if (e->key.dboid != MyDatabaseId)
			continue;
		if (is_overflow_key(&e->key))
		{
			init_entry(e);
			e->reset_at = GetCurrentTimestamp();
		}
		else
		{
			(void) hash_search(stats_hash, &e->key, HASH_REMOVE, NULL);
			stats_area->nentries--;
		}
	}
	pg_atomic_fetch_add_u64(&stats_area->epoch, 1);
	LWLockRelease(stats_area->lock);
	PG_RETURN_VOID();
}

/*---- idempotency.consumers: the claims of the partitions not sealed yet ----*/

/* columns of idempotency.partition_registry read here */
#define REGISTRY_RELID_COL	1
#define REGISTRY_SEALED_COL	4

/*
 * The unsealed partitions the registry lists in snap, and that are ours
 * (idem_relation_distrust()): each locked AccessShareLock and checked
 * again under the lock, which keeps it as it was checked.  A registry
 * entry that names anything else is skipped without a word: a scraper
 * reads this, and idempotency.partitions and maintenance report it.
 */
static List *
trusted_unsealed_partitions(Oid claims, Snapshot snap)
{
	Relation	registry = table_open(idem_internal_relid("partition_registry"), AccessShareLock);
	TupleDesc	desc = RelationGetDescr(registry);
	TableScanDesc scan = table_beginscan(registry, snap, 0, NULL);
	List	   *relids = NIL;
	List	   *trusted = NIL;
	HeapTuple	tup;
	ListCell   *lc;

	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Oid			relid = DatumGetObjectId(heap_getattr(tup, REGISTRY_RELID_COL, desc, &isnull));

		if (!DatumGetBool(heap_getattr(tup, REGISTRY_SEALED_COL, desc, &isnull)))
			relids = lappend_oid(relids, relid);
	}
	table_endscan(scan);
	table_close(registry, AccessShareLock);

	foreach(lc, relids)
	{
		Oid			relid = lfirst_oid(lc);

		/* not even locked unless it is ours: another owner's lock could stall us */
		if (idem_relation_distrust(relid, claims) != NULL)
			continue;
		LockRelationOid(relid, AccessShareLock);
		if (idem_relation_distrust(relid, claims) != NULL)
		{
			UnlockRelationOid(relid, AccessShareLock);
			continue;
		}
		trusted = lappend_oid(trusted, relid);
	}
	list_free(relids);
	return trusted;
}

/*
 * idempotency.live_scopes(): per scope, the claims of the unsealed
 * partitions, in the caller's snapshot -- the one in which the view reads
 * idempotency.scope_history, so a seal that committed is seen in both or
 * in neither.  A heap scan of each partition (scopes.c): nothing of a
 * partition is planned, so no rule, policy or index expression runs; and
 * no SECURITY DEFINER is needed, since reading in C checks no table
 * privilege (EXECUTE is granted to pg_monitor only).
 */
Datum
idem_live_scopes(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			claims = idem_internal_relid("claims");
	Snapshot	snap = GetActiveSnapshot();
	HTAB	   *counts = idem_scope_counts_create();
	List	   *parts;
	ListCell   *lc;
	HASH_SEQ_STATUS seq;
	IdemScopeCount *c;

	InitMaterializedSRF(fcinfo, 0);
	parts = trusted_unsealed_partitions(claims, snap);
	foreach(lc, parts)
	{
		Relation	rel = table_open(lfirst_oid(lc), NoLock);

		idem_scope_counts_add(counts, rel, snap);
		table_close(rel, NoLock);
	}

	hash_seq_init(&seq, counts);
	while ((c = hash_seq_search(&seq)) != NULL)
	{
		Datum		values[4];
		bool		nulls[4] = {false};

		values[0] = CStringGetTextDatum(c->scope);
		values[1] = TimestampTzGetDatum(c->first_claim_at);
		values[2] = TimestampTzGetDatum(c->last_claim_at);
		values[3] = Int64GetDatum(c->claims);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	hash_destroy(counts);
	list_free(parts);
	return (Datum) 0;
}

/*---- set-up ----*/

void
idem_stats_init(void)
{
	DefineCustomBoolVariable("idempotency.track_stats",
							 "Counts claims, duplicates and guarded writes for idempotency.stats.",
							 "Has effect only when the library is in shared_preload_libraries.",
							 &stats_track,
							 true,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	/* a postmaster setting can only be defined while preloading */
	if (!process_shared_preload_libraries_in_progress)
		return;
	DefineCustomIntVariable("idempotency.stats_max_scopes",
							"Scopes and guarded tables whose counters idempotency.stats keeps.",
							"All databases together; others count in their database's overflow row.",
							&stats_max_scopes,
							1000, 0, 1000000,
							PGC_POSTMASTER,
							0,
							NULL, NULL, NULL);
	RegisterXactCallback(stats_xact_callback, NULL);
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}
