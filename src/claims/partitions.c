/*-------------------------------------------------------------------------
 *
 * partitions.c
 *	  The per-backend cache of the partition registry that every claim
 *	  reads, the settings reader, and the extension's clock.
 *
 * idempotency.partition_registry lists the time partitions of
 * idempotency.claims with their ranges and seal state.  Claimers never read
 * it per claim: each backend keeps an IdemPartitionSet, dropped by a
 * relcache invalidation of the registry that statement triggers on the
 * registry and the settings send at the writer's commit.
 *
 * Locking rules:
 *	- Building the cache takes AccessShareLock on the registry and the
 *	  settings BEFORE taking its snapshot, so the invalidations that taking
 *	  those locks processes are already reflected in what it reads; an
 *	  invalidation that arrives anyway while the cache is being built (some
 *	  catalog access processes the queue) is counted, and the build starts
 *	  over, so a registry change is never consumed by a build that could not
 *	  see it (the relcache's in-progress list works the same way).
 *	- Nothing here waits for another transaction.
 *
 * Why a stale cache is still safe for claimers: a partition that a claim
 * can go into is either known to every backend already, or was created by a
 * maintenance transaction that holds AccessExclusiveLock on it until after
 * its invalidation was sent; the claimer's RowExclusiveLock on it therefore
 * waits for that invalidation, and so does every later holder of the same
 * value lock (claims.c).  And a claimer whose cache still lists a partition
 * as open after it was sealed or closed looks at the registry again after
 * taking RowExclusiveLock, under its value lock: a seal under ShareLock
 * waits for that lock, a seal after a close waits for that value lock
 * (retention.c), so the claim is either redirected or in the seal's scan.
 *
 * A partition is open (takes claims), closed (takes none; sealed by the
 * next round, probed through its index until then), held (sealed while
 * transactions that claimed there were open: claimers treat it as sealed)
 * or sealed.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/partitions.h"
#include "common/catalog.h"
#include "common/clock.h"
#include "common/cache.h"
#include "claims/settings.h"
#include "claims/classes.h"
#include "common/args.h"
#include "common/store_retention.h"

#include <limits.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "commands/trigger.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_partition_cache_invalidate);
PG_FUNCTION_INFO_V1(idem_registry_changed);
PG_FUNCTION_INFO_V1(idem_cached_partitions);

/*---- GUC variables ----*/

/*---- the cache ----*/

static MemoryContext partition_cxt = NULL;
static IdemPartitionSet *partition_cache = NULL;
static Oid	cached_registry_relid = InvalidOid;
static Oid	cached_settings_relid = InvalidOid;
static Oid	cached_scopes_relid = InvalidOid;
static Oid	cached_stores_relid = InvalidOid;
static uint64 partition_generation = 0;

/* invalidations of the registry seen; a build that sees this move restarts */
static uint64 registry_invals = 0;

static void
partition_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == cached_registry_relid ||
		relid == cached_settings_relid || relid == cached_scopes_relid ||
		relid == cached_stores_relid)
	{
		partition_cache = NULL;
		registry_invals++;
	}
}

void
idem_partitions_init(void)
{
	CacheRegisterRelcacheCallback(partition_cache_callback, (Datum) 0);
}

static int
partition_newest_first(const void *a, const void *b)
{
	const IdemPartition *pa = a;
	const IdemPartition *pb = b;

	if (pa->lower != pb->lower)
		return pa->lower > pb->lower ? -1 : 1;
	return pa->relid > pb->relid ? -1 : (pa->relid < pb->relid ? 1 : 0);
}

static void
read_registry_row(Relation rel, HeapTuple tup, IdemPartition *p)
{
	TupleDesc	desc = RelationGetDescr(rel);
	bool		isnull;
	Datum		d;

	memset(p, 0, sizeof(IdemPartition));
	p->relid = DatumGetObjectId(heap_getattr(tup, Anum_registry_relid, desc, &isnull));
	p->lower = DatumGetTimestampTz(heap_getattr(tup, Anum_registry_lower, desc, &isnull));
	p->upper = DatumGetTimestampTz(heap_getattr(tup, Anum_registry_upper, desc, &isnull));
	p->sealed = DatumGetBool(heap_getattr(tup, Anum_registry_sealed, desc, &isnull));
	if (desc->natts >= Anum_registry_held_by)
	{
		/* sealed with claims of open transactions in it: held, to claimers sealed */
		(void) heap_getattr(tup, Anum_registry_held_by, desc, &isnull);
		p->held = !p->sealed && !isnull;
		p->sealed |= p->held;
		d = heap_getattr(tup, Anum_registry_closed, desc, &isnull);
		p->closed = !isnull && DatumGetBool(d);
	}
	p->closed |= p->sealed;
	/* only whether there is a filter: it is loaded when first needed */
	(void) heap_getattr(tup, Anum_registry_bloom, desc, &isnull);
	p->has_filter = p->sealed && !isnull;
	p->filter_xmin = HeapTupleHeaderGetRawXmin(tup->t_data);

	/*
	 * A sealed partition's claims are kept for the retention after the later
	 * of its upper bound and its newest claim (claims made while maintenance
	 * lagged lie past the upper bound).  Partitions sealed before this was
	 * recorded count from their upper bound.
	 */
	p->keep_until = p->upper;
	if (desc->natts >= Anum_registry_max_claimed_at)
	{
		d = heap_getattr(tup, Anum_registry_nkeys, desc, &isnull);
		p->empty = p->sealed && !isnull && DatumGetInt64(d) == 0;
		d = heap_getattr(tup, Anum_registry_max_claimed_at, desc, &isnull);
		if (!isnull && DatumGetTimestampTz(d) > p->keep_until)
			p->keep_until = DatumGetTimestampTz(d);
	}
	/* its retention class, and how long its claims of other classes need */
	if (desc->natts >= Anum_registry_keep_retention)
	{
		d = heap_getattr(tup, Anum_registry_retention, desc, &isnull);
		if (!isnull)
			p->class_retention = idem_interval_seconds(DatumGetIntervalP(d)) * USECS_PER_SEC;
		d = heap_getattr(tup, Anum_registry_keep_retention, desc, &isnull);
		if (!isnull)
			p->keep_retention = idem_interval_seconds(DatumGetIntervalP(d)) * USECS_PER_SEC;
	}
	if (desc->natts >= Anum_registry_keep_default)
	{
		d = heap_getattr(tup, Anum_registry_keep_default, desc, &isnull);
		p->keep_default = !isnull && DatumGetBool(d);
	}
}

/* Read the registry into a new cache. */
static IdemPartitionSet *
build_partition_set(void)
{
	Oid			regid = idem_internal_relid("partition_registry");
	Oid			setid = idem_internal_relid("settings");
	Oid			claimsid = idem_internal_relid("claims");
	Oid			scopesid = get_relname_relid("scope_retention", idem_schema_oid());

	cached_registry_relid = regid;
	cached_settings_relid = setid;
	cached_scopes_relid = scopesid;
	cached_stores_relid = get_relname_relid("store_settings", idem_schema_oid());
	for (;;)
	{
		Relation	rel;
		Relation	setrel;
		Relation	scopesrel = NULL;
		Snapshot	snap;
		TableScanDesc scan;
		HeapTuple	tup;
		IdemPartitionSet *set;
		MemoryContext oldcxt;
		IdemSettings s;
		uint64		invals;
		int			cap = 16;

		/* locks first: taking them processes what is already queued */
		idem_debug_wait("partition_set_open");
		rel = idem_open_internal(regid);
		setrel = idem_open_internal(setid);
		if (OidIsValid(scopesid))	/* none before the update to 1.1 */
			scopesrel = idem_open_internal(scopesid);
		invals = registry_invals;
		snap = RegisterSnapshot(GetLatestSnapshot());
		idem_debug_wait("partition_set_build");

		if (partition_cxt == NULL)
			partition_cxt = AllocSetContextCreate(CacheMemoryContext,
												  "idempotency partitions",
												  ALLOCSET_SMALL_SIZES);
		else
			MemoryContextReset(partition_cxt);
		partition_cache = NULL;

		s = idem_settings_from_scan(setrel, snap);
		oldcxt = MemoryContextSwitchTo(partition_cxt);
		set = palloc0(sizeof(IdemPartitionSet));
		set->claims_relid = claimsid;
		set->registry_relid = regid;
		set->retention = s.retention * USECS_PER_SEC;
		set->interval = s.interval * USECS_PER_SEC;
		set->premake = s.premake;
		set->generation = ++partition_generation;
		set->parts = palloc(cap * sizeof(IdemPartition));

		scan = table_beginscan(rel, snap, 0, NULL);
		while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
		{
			if (set->nparts == cap)
			{
				cap *= 2;
				set->parts = repalloc(set->parts, cap * sizeof(IdemPartition));
			}
			read_registry_row(rel, tup, &set->parts[set->nparts++]);
		}
		table_endscan(scan);
		if (scopesrel != NULL)
		{
			IdemStoreOverride stores[IDEM_NSTORES];

			idem_scope_retentions_read(scopesrel, snap, set);
			/* the dedup claims of the inbox and the requests follow their stores */
			idem_store_overrides(snap, stores);
			if (stores[IDEM_STORE_INBOX].set)
				idem_scope_retention_add(set, IDEM_INBOX_SCOPE_PREFIX,
										 stores[IDEM_STORE_INBOX].retention * USECS_PER_SEC);
			if (stores[IDEM_STORE_REQUESTS].set)
				idem_scope_retention_add(set, IDEM_REQUEST_SCOPE_PREFIX,
										 stores[IDEM_STORE_REQUESTS].retention * USECS_PER_SEC);
		}
		MemoryContextSwitchTo(oldcxt);

		UnregisterSnapshot(snap);
		if (scopesrel != NULL)
			table_close(scopesrel, AccessShareLock);
		table_close(setrel, AccessShareLock);
		table_close(rel, AccessShareLock);

		qsort(set->parts, set->nparts, sizeof(IdemPartition), partition_newest_first);
		if (invals != registry_invals)
			continue;			/* changed while we read: read again */
		partition_cache = set;
		return set;
	}
}

/*
 * The partitions as this backend knows them, newest first.  Valid until the
 * next call.
 */
IdemPartitionSet *
idem_partition_set(void)
{
	AcceptInvalidationMessages();
	if (partition_cache == NULL)
		return build_partition_set();
	return partition_cache;
}

/* The same, re-read from the registry whatever the cache holds. */
IdemPartitionSet *
idem_partition_set_fresh(void)
{
	AcceptInvalidationMessages();
	return build_partition_set();
}

/*
 * The partition a claim of a retention class (classes.c; 0: the default)
 * made at "now" goes into: the class's open one whose range covers it (the
 * newest such, should ranges overlap), else -- while maintenance lags --
 * its newest open one that has begun, else its oldest open one.
 * Maintenance extends the same partition after a lag, so claimers and
 * maintenance always agree on it.  Closed partitions (sealed, or to be
 * sealed next round) take no claims.  A class without a partition yet (it
 * was configured, and no round has run since) claims into the default
 * class: the seal keeps such a partition for its claims' retention.
 */
IdemPartition *
idem_target_partition(IdemPartitionSet *set, int64 class_retention, TimestampTz now,
					  bool *covers)
{
	IdemPartition *p = idem_class_partition(set, class_retention, now, covers);

	if (p == NULL && class_retention != 0)
		p = idem_class_partition(set, 0, now, covers);
	return p;
}

/* The same within the class alone: NULL if it has no open partition. */
IdemPartition *
idem_class_partition(IdemPartitionSet *set, int64 class_retention, TimestampTz now,
					 bool *covers)
{
	IdemPartition *begun = NULL;
	IdemPartition *oldest = NULL;

	*covers = false;
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];

		if (p->closed || p->class_retention != class_retention)
			continue;
		if (p->lower <= now && now < p->upper)
		{
			*covers = true;
			return p;
		}
		if (begun == NULL && p->lower <= now)
			begun = p;
		oldest = p;
	}
	return begun != NULL ? begun : oldest;
}

/*
 * True if every claim in a partition is older than its retention (classes.c), so
 * nobody needs to look there (maintenance may drop it once it is no longer
 * held).  Only sealed partitions expire, held ones included: an unsealed
 * one may still receive claims, and its newest claim is not known.
 */
bool
idem_partition_expired(IdemPartitionSet *set, IdemPartition *p, TimestampTz now)
{
	if (!p->sealed)
		return false;
	return p->empty || p->keep_until <= now - idem_partition_retention(set, p);
}

/*---- the invalidation trigger ----*/

/*
 * Statement trigger on the registry, the settings and the stores'
 * registries: make every backend drop its cache of the table at commit
 * (common/cache.c).
 */
Datum
idem_partition_cache_invalidate(PG_FUNCTION_ARGS)
{
	return idem_cache_invalidate_trigger(fcinfo, "partition_cache_invalidate", false);
}

/* The same under its 1.0 name (idempotency.registry_changed). */
Datum
idem_registry_changed(PG_FUNCTION_ARGS)
{
	return idem_cache_invalidate_trigger(fcinfo, "registry_changed", false);
}

/*
 * idempotency.cached_partitions(): the partitions as this backend's cache
 * has them, with where their filter was found.  For diagnosis and tests.
 */
Datum
idem_cached_partitions(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemPartitionSet *set;

	InitMaterializedSRF(fcinfo, 0);
	set = idem_partition_set();
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];
		Datum		values[6];
		bool		nulls[6] = {false, false, false, false, false, false};

		values[0] = ObjectIdGetDatum(p->relid);
		values[1] = TimestampTzGetDatum(p->lower);
		values[2] = TimestampTzGetDatum(p->upper);
		values[3] = BoolGetDatum(p->sealed);
		values[4] = TimestampTzGetDatum(p->keep_until);
		nulls[4] = !p->sealed;
		values[5] = UInt64GetDatum(set->generation);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
