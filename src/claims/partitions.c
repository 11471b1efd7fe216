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
PG_FUNCTION_INFO_V1(idem_current_settings);

/* Registry columns */
#define Anum_registry_relid		1
#define Anum_registry_lower		2
#define Anum_registry_upper		3
#define Anum_registry_sealed	4
#define Anum_registry_bloom		5
#define Anum_registry_nkeys		6
#define Anum_registry_max_claimed_at 7
#define Anum_registry_closed	8
#define Anum_registry_held_by	9

/* Settings columns (all NOT NULL) */
#define Anum_settings_retention	2
#define Anum_settings_interval	3
#define Anum_settings_premake	4

/*---- GUC variables ----*/

/* testing only: shifts the extension's clock (seconds) */
static int	idem_debug_clock_offset = 0;

/* testing only: name of a point where the code pauses (see idem_debug_wait) */
static char *idem_debug_wait_point = NULL;

/*---- the cache ----*/

static MemoryContext partition_cxt = NULL;
static IdemPartitionSet *partition_cache = NULL;
static Oid	cached_registry_relid = InvalidOid;
static uint64 partition_generation = 0;

/* invalidations of the registry seen; a build that sees this move restarts */
static uint64 registry_invals = 0;

static void
partition_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == cached_registry_relid)
	{
		partition_cache = NULL;
		registry_invals++;
	}
}

void
idem_partitions_init(void)
{
	DefineCustomIntVariable("idempotency.debug_clock_offset",
							"Shifts the clock of claims and maintenance (for tests only).",
							NULL,
							&idem_debug_clock_offset,
							0, INT_MIN, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S | GUC_NOT_IN_SAMPLE,
							NULL, NULL, NULL);
	DefineCustomStringVariable("idempotency.debug_wait_point",
							   "Names a point where the extension waits for advisory lock 7370 (for tests only).",
							   NULL,
							   &idem_debug_wait_point,
							   "",
							   PGC_SUSET,
							   GUC_NOT_IN_SAMPLE,
							   NULL, NULL, NULL);
	CacheRegisterRelcacheCallback(partition_cache_callback, (Datum) 0);
}

/* The extension's clock: the wall clock, shifted in tests. */
TimestampTz
idem_now(void)
{
	return GetCurrentTimestamp() + (int64) idem_debug_clock_offset * USECS_PER_SEC;
}

/*
 * Injection point for isolation tests: when idempotency.debug_wait_point
 * names this point, wait until no other session holds advisory lock 7370
 * (pg_advisory_lock(7370)), so a test can hold this backend here while
 * another session commits something.
 */
void
idem_debug_wait(const char *point)
{
	LOCKTAG		tag;

	if (idem_debug_wait_point == NULL || strcmp(idem_debug_wait_point, point) != 0)
		return;
	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 7370, 1);
	(void) LockAcquire(&tag, ShareLock, false, false);
	LockRelease(&tag, ShareLock, false);
}

/* An interval in seconds, months counting as 30 days. */
int64
idem_interval_seconds(Interval *iv)
{
	/* months count as 30 days, as in EXTRACT(EPOCH FROM interval) */
	return iv->time / USECS_PER_SEC +
		(int64) iv->day * SECS_PER_DAY +
		(int64) iv->month * DAYS_PER_MONTH * SECS_PER_DAY;
}

/*
 * Open one of the extension's own tables; a clear error (not "could not open
 * relation with OID") if DROP EXTENSION removed it meanwhile.
 */
static Relation
open_internal(Oid relid)
{
	Relation	rel = try_table_open(relid, AccessShareLock);

	if (rel == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idempotency\" is not installed in this database"),
				 errdetail("Its tables were dropped while this statement ran.")));
	return rel;
}

/* A whole number of seconds as an interval of days and time. */
static Interval
seconds_interval(int64 secs)
{
	Interval	iv;

	iv.month = 0;
	iv.day = (int32) (secs / SECS_PER_DAY);
	iv.time = (secs % SECS_PER_DAY) * USECS_PER_SEC;
	return iv;
}

static IdemSettings
settings_from_scan(Relation rel, Snapshot snap)
{
	IdemSettings s;
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	HeapTuple	tup = heap_getnext(scan, ForwardScanDirection);

	s.retention_iv = seconds_interval(IDEM_DEFAULT_RETENTION_SECS);
	s.interval_iv = seconds_interval(IDEM_DEFAULT_INTERVAL_SECS);
	s.premake = IDEM_DEFAULT_PREMAKE;
	if (tup != NULL)
	{
		TupleDesc	desc = RelationGetDescr(rel);
		bool		isnull;

		s.retention_iv = *DatumGetIntervalP(heap_getattr(tup, Anum_settings_retention, desc, &isnull));
		s.interval_iv = *DatumGetIntervalP(heap_getattr(tup, Anum_settings_interval, desc, &isnull));
		s.premake = DatumGetInt32(heap_getattr(tup, Anum_settings_premake, desc, &isnull));
	}
	table_endscan(scan);
	s.retention = idem_interval_seconds(&s.retention_iv);
	s.interval = idem_interval_seconds(&s.interval_iv);
	return s;
}

/* The settings as a snapshot sees them (defaults when there is no row). */
IdemSettings
idem_read_settings(Snapshot snap)
{
	Relation	rel = open_internal(idem_internal_relid("settings"));
	IdemSettings s;

	snap = RegisterSnapshot(snap);
	s = settings_from_scan(rel, snap);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	return s;
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
}

/* Read the registry into a new cache. */
static IdemPartitionSet *
build_partition_set(void)
{
	Oid			regid = idem_internal_relid("partition_registry");
	Oid			setid = idem_internal_relid("settings");
	Oid			claimsid = idem_internal_relid("claims");

	cached_registry_relid = regid;
	for (;;)
	{
		Relation	rel;
		Relation	setrel;
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
		rel = open_internal(regid);
		setrel = open_internal(setid);
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

		s = settings_from_scan(setrel, snap);
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
		MemoryContextSwitchTo(oldcxt);

		UnregisterSnapshot(snap);
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
 * The partition a claim made at "now" goes into: the open one whose range
 * covers it (the newest such, should ranges overlap), else -- while
 * maintenance lags -- the newest open one that has begun, else the oldest
 * open one.  Maintenance extends the same partition after a lag, so
 * claimers and maintenance always agree on it.  Closed partitions (sealed,
 * or to be sealed next round) take no claims.
 */
IdemPartition *
idem_target_partition(IdemPartitionSet *set, TimestampTz now, bool *covers)
{
	IdemPartition *begun = NULL;
	IdemPartition *oldest = NULL;

	*covers = false;
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];

		if (p->closed)
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
 * True if every claim in a partition is older than the retention window, so
 * nobody needs to look there (maintenance may drop it once it is no longer
 * held).  Only sealed partitions expire, held ones included: an unsealed
 * one may still receive claims, and its newest claim is not known.
 */
bool
idem_partition_expired(IdemPartitionSet *set, IdemPartition *p, TimestampTz now)
{
	if (!p->sealed)
		return false;
	return p->empty || p->keep_until <= now - set->retention;
}

/*---- the invalidation trigger ----*/

static Datum
invalidate_partition_cache(FunctionCallInfo fcinfo)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	Oid			regid;
	Oid			relid;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"partition_cache_invalidate\" was not called by the trigger manager")));
	regid = idem_internal_relid("partition_registry");
	relid = RelationGetRelid(trigdata->tg_relation);
	/* the other stores' registries have caches of their own (store.c) */
	if (idem_store_is_registry(relid))
		regid = relid;
	else if (relid != regid && relid != idem_internal_relid("settings"))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"partition_cache_invalidate\" serves only the tables of schema \"%s\"",
						IDEM_SCHEMA)));
	CacheInvalidateRelcacheByRelid(regid);
	PG_RETURN_POINTER(NULL);
}

/*
 * Statement trigger on the registry and the settings: make every backend
 * drop its cached partition set (sent at commit, applied locally at the
 * next command).
 */
Datum
idem_partition_cache_invalidate(PG_FUNCTION_ARGS)
{
	return invalidate_partition_cache(fcinfo);
}

/* The same under its 1.0 name (idempotency.registry_changed). */
Datum
idem_registry_changed(PG_FUNCTION_ARGS)
{
	return invalidate_partition_cache(fcinfo);
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

/*
 * idempotency.current_settings(): the settings in force, the defaults where
 * idempotency.settings has no row, as this transaction sees them.
 */
Datum
idem_current_settings(PG_FUNCTION_ARGS)
{
	TupleDesc	desc;
	IdemSettings s = idem_read_settings(GetActiveSnapshot());
	Datum		values[3];
	bool		nulls[3] = {false, false, false};
	Interval   *retention = palloc(sizeof(Interval));
	Interval   *interval = palloc(sizeof(Interval));

	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	*retention = s.retention_iv;
	*interval = s.interval_iv;
	values[0] = IntervalPGetDatum(retention);
	values[1] = IntervalPGetDatum(interval);
	values[2] = Int32GetDatum(s.premake);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, values, nulls)));
}
