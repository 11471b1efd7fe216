/*-------------------------------------------------------------------------
 *
 * store.c
 *	  The time partitions of the stores that keep rows by time apart from the
 *	  claims: the outbox's events, the inbox's messages and the stored
 *	  requests.  This file describes the stores
 *	  (StoreDesc) and keeps the writers' cache of their registries; the
 *	  maintenance round creates and drops their partitions
 *	  (maintenance/store_partitions.c).
 *
 * Each store is a declarative LIST-partitioned table on "bucket": each
 * partition takes one random bucket, and the store's registry gives it the
 * time range of the rows it takes.  So writers insert through the parent (a
 * publication with publish_via_partition_root covers partitions made later),
 * and partitions restored from a dump never clash with those CREATE
 * EXTENSION made in the target.  Writers choose the partition from a
 * per-backend cache of the registry, dropped by the registry's invalidation
 * trigger: the one whose range covers the time, else (maintenance lagging)
 * the newest that has begun, so a row always has a partition.  Each
 * partition carries its own indexes (the parent has none, so that
 * pg_restore can attach dumped partitions to the parent the extension made).
 *
 * The partitions follow the settings of the claims store (partition_interval,
 * premake) and each store's retention (common/store_retention.c: its own,
 * else the claims'); a partition is kept for the retention after
 * its upper bound or its newest row, whichever is later, and longer while
 * pinned (for the outbox, unless idempotency.outbox_keep_undelivered is off,
 * for change data capture without a relay).
 *
 * Locking rules: a writer opens its target partition with RowExclusiveLock
 * (idem_store_open_target()); one dropped since its cache was read is
 * found missing and the registry read again.  Creating and dropping
 * partitions is maintenance's (maintenance/store_partitions.c, whose
 * banner has its locking rules).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/store.h"
#include "common/catalog.h"

#include "access/table.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "common/pg_prng.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"


const StoreDesc idem_stores[IDEM_NSTORES] = {
	[IDEM_STORE_OUTBOX] = {
		"outbox", "outbox_events", "outbox_partitions",
		{"CREATE INDEX ON %s (txid, id)",
		 "CREATE INDEX ON %s (aggregate_type, aggregate_id, seq)"},
		/* rows that went in late come from the newest transactions */
		"SELECT max(created_at) FROM (SELECT created_at FROM %s"
		" ORDER BY txid DESC, id DESC LIMIT 1000) e",
		"outbox_partition_pinned", "idempotency.outbox_keep_undelivered",
		"SELECT EXISTS (SELECT FROM %s WHERE txid >= $1)",
		"outbox_detach_lagging", "idempotency.outbox_max_lag",
		/*
		 * An emit takes seq from the events (outbox_emit.c): an aggregate
		 * whose newest event goes with the partition keeps its seq in the
		 * counter.
		 */
		"INSERT INTO " IDEM_SCHEMA ".outbox_sequences AS q"
		" (aggregate_type, aggregate_id, last_seq, stored_seq)"
		" SELECT e.aggregate_type, e.aggregate_id, max(e.seq), max(e.seq) FROM %s e"
		" GROUP BY e.aggregate_type, e.aggregate_id"
		" HAVING NOT EXISTS (SELECT FROM " IDEM_SCHEMA ".outbox_events o"
		"   WHERE o.aggregate_type = e.aggregate_type AND o.aggregate_id = e.aggregate_id"
		"     AND o.seq > max(e.seq))"
		" ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE"
		" SET last_seq = greatest(q.last_seq, excluded.last_seq),"
		"     stored_seq = greatest(q.stored_seq, excluded.stored_seq)",
		"outbox_sequences",
	},
	[IDEM_STORE_REQUESTS] = {
		"requests", "requests", "request_partitions",
		{"CREATE UNIQUE INDEX ON %s (scope, key)"},
		"SELECT max(created_at) FROM %s",
		NULL, NULL, NULL,
	},
	[IDEM_STORE_INBOX] = {
		"inbox", "inbox_messages", "inbox_partitions",
		/* done and fail find a message by id; claims by key and by state */
		{"CREATE INDEX ON %s (id)",
		 "CREATE INDEX ON %s (source, ordering_key, seq)",
		 "CREATE INDEX ON %s (done_at, dead_at)"},
		/* ids sort by received_at */
		"SELECT max(received_at) FROM (SELECT received_at FROM %s"
		" ORDER BY id DESC LIMIT 1) m",
		/* the pin is an index probe on (done_at, dead_at): checked again */
		"inbox_partition_pinned", NULL, NULL,
	},
};

/* the writers' cache of each registry, newest first */
typedef struct StoreCache
{
	StorePartition *parts;
	int			nparts;			/* -1: not read */
	Oid			registry;
	Oid			parent;
} StoreCache;

static StoreCache caches[IDEM_NSTORES];

static void
store_cache_callback(Datum arg, Oid relid)
{
	for (int i = 0; i < IDEM_NSTORES; i++)
		if (relid == InvalidOid || relid == caches[i].registry)
			caches[i].nparts = -1;
}

/* Read the registry again at the next write. */
void
idem_store_forget(IdemStoreId id)
{
	caches[id].nparts = -1;
}

void
idem_store_init(void)
{
	for (int i = 0; i < IDEM_NSTORES; i++)
		caches[i].nparts = -1;
	CacheRegisterRelcacheCallback(store_cache_callback, (Datum) 0);
}

/*---- the writers' side ----*/

static int
newest_first(const void *a, const void *b)
{
	const StorePartition *pa = a;
	const StorePartition *pb = b;

	if (pa->lower != pb->lower)
		return pa->lower > pb->lower ? -1 : 1;
	return pa->relid > pb->relid ? -1 : (pa->relid < pb->relid ? 1 : 0);
}

/* Read a store's registry into its cache (the caller is connected to SPI). */
static void
load_cache(IdemStoreId id)
{
	StoreCache *c = &caches[id];
	StorePartition *parts;
	int			n;
	MemoryContext old;

	c->registry = idem_internal_relid(idem_stores[id].registry);
	c->parent = idem_internal_relid(idem_stores[id].parent);

	/*
	 * Under a snapshot of its own (in READ COMMITTED): a writer reads the
	 * registry again after finding its cached partition dropped, and the
	 * snapshot of the statement it runs in (which may have waited, say for
	 * a claim) can predate that drop and list the partition still.
	 */
	PushActiveSnapshot(GetTransactionSnapshot());
	parts = idem_store_read_partitions(&idem_stores[id], &n);
	PopActiveSnapshot();
	qsort(parts, n, sizeof(StorePartition), newest_first);
	old = MemoryContextSwitchTo(CacheMemoryContext);
	if (c->parts != NULL)
		pfree(c->parts);
	c->parts = palloc(sizeof(StorePartition) * Max(n, 1));
	MemoryContextSwitchTo(old);
	memcpy(c->parts, parts, sizeof(StorePartition) * n);
	c->nparts = n;
}

/*
 * Of parts (newest first, as the cache holds them), the one a row made at
 * ts goes into: the one whose range covers it (the newest such), else the
 * newest that has begun, else the oldest.
 */
int
idem_store_pick(const StorePartition *parts, int n, TimestampTz ts)
{
	int			begun = -1;

	for (int i = 0; i < n; i++)
	{
		if (parts[i].lower <= ts && ts < parts[i].upper)
			return i;
		if (begun < 0 && parts[i].lower <= ts)
			begun = i;
	}
	return begun >= 0 ? begun : n - 1;
}

/* Whether a comes before b in the cache's order (newest first). */
bool
idem_store_newer(const StorePartition *a, const StorePartition *b)
{
	return newest_first(a, b) < 0;
}

/* The cache of store id, read again if invalidated (the caller is connected to SPI). */
static StoreCache *
current_cache(IdemStoreId id)
{
	StoreCache *c = &caches[id];

	AcceptInvalidationMessages();
	if (c->nparts < 0)
		load_cache(id);
	if (c->nparts == 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s.%s has no partition", IDEM_SCHEMA, idem_stores[id].parent),
				 errhint("Run SELECT idem_maintain() as the owner of the extension.")));
	return c;
}

/*
 * A copy of store id's partitions, newest first, as the registry lists them
 * now (after the invalidations that arrived so far); the caller is
 * connected to SPI.
 */
StorePartition *
idem_store_partitions(IdemStoreId id, int *n)
{
	StoreCache *c = current_cache(id);
	StorePartition *parts = palloc(sizeof(StorePartition) * c->nparts);

	memcpy(parts, c->parts, sizeof(StorePartition) * c->nparts);
	*n = c->nparts;
	return parts;
}

/*
 * The partition a row of store "id" made at "now" goes into (see
 * idem_store_pick()).  Sets its table and the parent (cached with the
 * registry: no catalog look-up per write) and returns its bucket.  The
 * caller is connected to SPI.
 */
int32
idem_store_target(IdemStoreId id, TimestampTz now, Oid *relid, Oid *parent)
{
	StoreCache *c = current_cache(id);
	StorePartition *target = &c->parts[idem_store_pick(c->parts, c->nparts, now)];

	if (relid != NULL)
		*relid = target->relid;
	if (parent != NULL)
		*parent = c->parent;
	return target->bucket;
}

/*
 * Partition relid of store id, opened with RowExclusiveLock for a write
 * without the executor (rows.c) and checked for the columns its rows must
 * have, in order; NULL if it is gone.
 */
Relation
idem_store_open_partition(IdemStoreId id, Oid relid, const char *const *columns, int ncolumns)
{
	Relation	rel = try_table_open(relid, RowExclusiveLock);
	TupleDesc	desc;

	if (rel == NULL)
		return NULL;
	desc = RelationGetDescr(rel);
	for (int i = 0; i < ncolumns; i++)
		if (desc->natts != ncolumns ||
			TupleDescAttr(desc, i)->attisdropped ||
			strcmp(NameStr(TupleDescAttr(desc, i)->attname), columns[i]) != 0)
			elog(ERROR, "%s partition \"%s\" does not have the columns of %s.%s",
				 idem_stores[id].name, RelationGetRelationName(rel), IDEM_SCHEMA, idem_stores[id].parent);
	return rel;
}

/*
 * The partition a row of store "id" made at ts goes into, opened with
 * RowExclusiveLock for a write without the executor (rows.c) and checked
 * for the columns its rows must have, in order; sets its bucket.  No right
 * on the parent is checked: the caller checked the capability that allows
 * the write (capabilities.c).  The caller is connected to SPI.
 */
Relation
idem_store_open_target(IdemStoreId id, TimestampTz ts, int32 *bucket,
					   const char *const *columns, int ncolumns)
{
	for (int attempt = 0;; attempt++)
	{
		Oid			relid;
		Relation	rel;

		*bucket = idem_store_target(id, ts, &relid, NULL);
		rel = idem_store_open_partition(id, relid, columns, ncolumns);
		if (rel != NULL)
			return rel;
		/* dropped since this backend read the registry: read it again */
		if (attempt > 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the %s partition for bucket %d is gone", idem_stores[id].name, *bucket),
					 errhint("Run SELECT idem_maintain(); if it was dropped by hand, the next round forgets it.")));
		idem_store_forget(id);
	}
}

StorePartition *
idem_store_read_partitions(const StoreDesc *d, int *n)
{
	StorePartition *parts;

	if (SPI_execute(psprintf("SELECT relid::pg_catalog.oid, bucket, lower, upper"
							 " FROM %s.%s ORDER BY lower, relid::pg_catalog.oid",
							 IDEM_SCHEMA, d->registry),
					true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read %s.%s", IDEM_SCHEMA, d->registry);
	*n = (int) SPI_processed;
	parts = palloc(sizeof(StorePartition) * Max(*n, 1));
	for (int i = 0; i < *n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		isnull;

		parts[i].relid = DatumGetObjectId(SPI_getbinval(tup, desc, 1, &isnull));
		parts[i].bucket = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));
		parts[i].lower = DatumGetTimestampTz(SPI_getbinval(tup, desc, 3, &isnull));
		parts[i].upper = DatumGetTimestampTz(SPI_getbinval(tup, desc, 4, &isnull));
	}
	return parts;
}
