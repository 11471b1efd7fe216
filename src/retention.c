/*-------------------------------------------------------------------------
 *
 * retention.c
 *	  Time partitions of the claims table: the registry, its per-backend
 *	  cache, partition creation, idem_configure() and idem_maintain().
 *
 * Claims are stored in plain tables that inherit from idempotency.claims,
 * one per time range.  idempotency.partition_registry lists them with their
 * ranges; claimers never read it per claim but keep a cache that a statement
 * trigger on the registry invalidates (a relcache invalidation of the
 * registry, delivered to every backend at the registry writer's commit).
 *
 * Locking rules:
 *	- Claimers take only AccessShareLock on the registry (while rebuilding
 *	  the cache) and weak locks on partitions; nothing here makes them wait.
 *	- Creating a partition takes ShareUpdateExclusiveLock on the parent
 *	  (CREATE TABLE ... INHERITS), which claimers never lock.
 *	- A partition is dropped only after it has been marked expired in the
 *	  registry, and only under a conditional AccessExclusiveLock: a claimer
 *	  or reader still using it makes maintenance skip it until a later round,
 *	  so claimers never queue behind a drop.
 *	- Concurrent idem_maintain() calls are serialised by a transaction-level
 *	  advisory lock taken with try semantics: the loser returns at once.
 *
 * Claims must never fail for want of a partition: when maintenance lags and
 * no partition covers the current time, claims go into the newest partition,
 * and the next maintenance round extends that partition's upper bound before
 * creating new ones, so retention still counts from the last claim in it.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "common/pg_prng.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "commands/trigger.h"

PG_FUNCTION_INFO_V1(idem_registry_changed);
PG_FUNCTION_INFO_V1(idem_configure);
PG_FUNCTION_INFO_V1(idem_maintain);

/* Registry columns */
#define Anum_registry_relid		1
#define Anum_registry_lower		2
#define Anum_registry_upper		3
#define Anum_registry_sealed	4
#define Anum_registry_bloom		5
#define Natts_registry			5

/* Settings columns (all NOT NULL) */
#define Anum_settings_retention	2
#define Anum_settings_interval	3
#define Anum_settings_premake	4

/* Defaults when idempotency.settings has no row (SPEC.md section 2) */
#define DEFAULT_RETENTION_SECS		(7 * SECS_PER_DAY)
#define DEFAULT_INTERVAL_SECS		SECS_PER_DAY
#define DEFAULT_PREMAKE				4
#define MAX_PREMAKE					1000
/* keep every partition bound far inside the timestamp range */
#define MAX_INTERVAL_SECS			(10 * DAYS_PER_YEAR * SECS_PER_DAY)
#define MAX_RETENTION_SECS			(100 * DAYS_PER_YEAR * SECS_PER_DAY)

/* field4 of our advisory locktags; user advisory locks use 1 and 2 */
#define IDEM_LOCKTAG_MAINTAIN		0x494D

/*
 * Sealed partitions with more claims than this get no Bloom filter (every
 * backend keeps the filters in memory: 1.25 bytes per claim); claims probe
 * their index instead.
 */
#define IDEM_BLOOM_MAX_KEYS			(1024 * 1024)

typedef struct IdemSettings
{
	int64		retention;		/* seconds */
	int64		interval;		/* seconds */
	int			premake;
} IdemSettings;

static int64
interval_seconds(Interval *iv)
{
	/* months count as 30 days, as in EXTRACT(EPOCH FROM interval) */
	return iv->time / USECS_PER_SEC +
		(int64) iv->day * SECS_PER_DAY +
		(int64) iv->month * DAYS_PER_MONTH * SECS_PER_DAY;
}

/*---- per-backend cache of the registry ----*/
static MemoryContext partition_cxt = NULL;
static IdemPartitionSet *partition_cache = NULL;
static Oid	registry_relid = InvalidOid;
static uint64 partition_generation = 0;

static void
partition_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == registry_relid)
		partition_cache = NULL;
}

void
idem_retention_init(void)
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

/*
 * The settings as a snapshot sees them (defaults when there is no row).
 * Read without SPI: claimers rebuilding their cache use it too.
 */
static IdemSettings
read_settings(Snapshot snap)
{
	IdemSettings s = {DEFAULT_RETENTION_SECS, DEFAULT_INTERVAL_SECS, DEFAULT_PREMAKE};
	Relation	rel = table_open(idem_internal_relid("settings"), AccessShareLock);
	TableScanDesc scan;
	HeapTuple	tup;

	snap = RegisterSnapshot(snap);
	scan = table_beginscan(rel, snap, 0, NULL);
	tup = heap_getnext(scan, ForwardScanDirection);
	if (tup != NULL)
	{
		TupleDesc	desc = RelationGetDescr(rel);
		bool		isnull;

		s.retention = interval_seconds(DatumGetIntervalP(heap_getattr(tup, Anum_settings_retention, desc, &isnull)));
		s.interval = interval_seconds(DatumGetIntervalP(heap_getattr(tup, Anum_settings_interval, desc, &isnull)));
		s.premake = DatumGetInt32(heap_getattr(tup, Anum_settings_premake, desc, &isnull));
	}
	table_endscan(scan);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	return s;
}

/* Read the registry with a fresh snapshot into a new cache. */
static IdemPartitionSet *
build_partition_set(void)
{
	Oid			nspid = idem_schema_oid();
	Oid			regid = idem_internal_relid("partition_registry");
	Relation	rel;
	Snapshot	snap;
	TableScanDesc scan;
	HeapTuple	tup;
	IdemPartitionSet *set;
	MemoryContext oldcxt;
	int			cap = 16;

	if (partition_cxt == NULL)
		partition_cxt = AllocSetContextCreate(CacheMemoryContext,
											  "idempotency partitions",
											  ALLOCSET_SMALL_SIZES);
	else
		MemoryContextReset(partition_cxt);
	partition_cache = NULL;
	registry_relid = regid;

	rel = table_open(regid, AccessShareLock);
	snap = RegisterSnapshot(GetLatestSnapshot());

	oldcxt = MemoryContextSwitchTo(partition_cxt);
	set = palloc0(sizeof(IdemPartitionSet));
	set->claims_relid = get_relname_relid("claims", nspid);
	set->retention = read_settings(snap).retention * USECS_PER_SEC;
	set->generation = ++partition_generation;
	set->parts = palloc(cap * sizeof(IdemPartition));

	scan = table_beginscan(rel, snap, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		Datum		values[Natts_registry];
		bool		nulls[Natts_registry];
		IdemPartition *p;

		heap_deform_tuple(tup, RelationGetDescr(rel), values, nulls);
		if (set->nparts == cap)
		{
			cap *= 2;
			set->parts = repalloc(set->parts, cap * sizeof(IdemPartition));
		}
		p = &set->parts[set->nparts++];
		p->relid = DatumGetObjectId(values[Anum_registry_relid - 1]);
		p->indexid = InvalidOid;
		p->lower = DatumGetTimestampTz(values[Anum_registry_lower - 1]);
		p->upper = DatumGetTimestampTz(values[Anum_registry_upper - 1]);
		p->sealed = DatumGetBool(values[Anum_registry_sealed - 1]);
		p->bloom = NULL;
		p->bloom_bits = 0;
		if (p->sealed && !nulls[Anum_registry_bloom - 1])
		{
			bytea	   *b = DatumGetByteaPCopy(values[Anum_registry_bloom - 1]);

			p->bloom = (uint8 *) VARDATA(b);
			p->bloom_bits = (uint32) VARSIZE(b) * 8 - VARHDRSZ * 8;
		}
	}
	table_endscan(scan);
	MemoryContextSwitchTo(oldcxt);

	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);

	qsort(set->parts, set->nparts, sizeof(IdemPartition), partition_newest_first);
	partition_cache = set;
	return set;
}

/*
 * The live partitions, newest first.  With fresh = true the registry is
 * re-read even if no invalidation arrived (claimers do this when no cached
 * partition covers the current time).  The result stays valid until the
 * next call.
 */
IdemPartitionSet *
idem_partition_set(bool fresh)
{
	AcceptInvalidationMessages();
	if (partition_cache == NULL || fresh)
		return build_partition_set();
	return partition_cache;
}

/*
 * Statement trigger on the registry and the settings: make every backend
 * drop its cached partition set when either changes (a relcache invalidation
 * of the registry, sent at commit and applied locally at the next command).
 */
Datum
idem_registry_changed(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("idempotency.registry_changed() must be called as a trigger")));
	(void) trigdata;
	CacheInvalidateRelcacheByRelid(idem_internal_relid("partition_registry"));
	PG_RETURN_POINTER(NULL);
}

/*---- settings ----*/


/* Only the owner of idempotency.claims (or a superuser) may reshape storage. */
static void
check_maintenance_privilege(const char *what)
{
	Oid			claims = idem_internal_relid("claims");

	if (!pg_class_ownercheck(claims, GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to %s", what),
				 errdetail("Only the owner of table idempotency.claims may manage its partitions.")));
}

/*---- partition creation ----*/

/* Run one utility or DML statement through SPI, with arguments. */
static void
spi_exec(const char *sql, int nargs, Oid *types, Datum *values, int expected)
{
	int			rc = SPI_execute_with_args(sql, nargs, types, values, NULL, false, 0);

	if (rc != expected)
		elog(ERROR, "SPI_execute_with_args failed (%d): %s", rc, sql);
}

/*
 * Create one partition for [lower, upper) and register it.  The name carries
 * the lower bound and a random suffix, so a restored dump never collides
 * with partitions that CREATE EXTENSION made in the target database.
 */
static char *
create_partition(TimestampTz lower, TimestampTz upper)
{
	struct pg_tm tm;
	fsec_t		fsec;
	char		relname[NAMEDATALEN];
	char	   *qualified;
	StringInfoData sql;
	Oid			types[3] = {TEXTOID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[3];
	bool		save_creating = creating_extension;
	Oid			save_extension = CurrentExtensionObject;

	if (timestamp2tm(lower, NULL, &tm, &fsec, NULL, NULL) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_DATETIME_VALUE_OUT_OF_RANGE),
				 errmsg("timestamp out of range")));
	snprintf(relname, sizeof(relname), "claims_%04d%02d%02d_%02d%02d%02d_%08x",
			 tm.tm_year, tm.tm_mon, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
			 (unsigned int) pg_prng_uint32(&pg_global_prng_state));
	qualified = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));

	/*
	 * Partitions are data, not part of the extension: pg_dump must dump them
	 * like user tables.  So even when the install script creates the first
	 * ones, they must not become extension members.
	 */
	creating_extension = false;
	CurrentExtensionObject = InvalidOid;
	PG_TRY();
	{
		initStringInfo(&sql);
		appendStringInfo(&sql, "CREATE TABLE %s () INHERITS (%s.claims)",
						 qualified, IDEM_SCHEMA);
		spi_exec(sql.data, 0, NULL, NULL, SPI_OK_UTILITY);

		resetStringInfo(&sql);
		appendStringInfo(&sql, "CREATE UNIQUE INDEX ON %s (scope, key)", qualified);
		spi_exec(sql.data, 0, NULL, NULL, SPI_OK_UTILITY);
	}
	PG_FINALLY();
	{
		creating_extension = save_creating;
		CurrentExtensionObject = save_extension;
	}
	PG_END_TRY();

	values[0] = CStringGetTextDatum(qualified);
	values[1] = TimestampTzGetDatum(lower);
	values[2] = TimestampTzGetDatum(upper);
	spi_exec("INSERT INTO idempotency.partition_registry (relid, lower, upper)"
			 " VALUES ($1::pg_catalog.regclass, $2, $3)",
			 3, types, values, SPI_OK_INSERT);
	return qualified;
}

/* Where a maintenance round reports its actions: rows, or the log. */
typedef struct MaintainReport
{
	Tuplestorestate *store;		/* NULL: log instead */
	TupleDesc	desc;
	int			elevel;
	int			nactions;
} MaintainReport;

static void
report_action(MaintainReport *rep, const char *action, const char *object)
{
	Datum		values[2];
	bool		nulls[2] = {false, false};

	if (rep == NULL)
		return;
	rep->nactions++;
	if (rep->store == NULL)
	{
		elog(rep->elevel, "idempotency maintenance: %s %s", action, object);
		return;
	}
	values[0] = CStringGetTextDatum(action);
	values[1] = CStringGetTextDatum(object);
	tuplestore_putvalues(rep->store, rep->desc, values, nulls);
}

static TimestampTz
add_seconds(TimestampTz t, int64 secs)
{
	return t + secs * USECS_PER_SEC;
}

/*
 * Make sure partitions cover [now, now + premake intervals).  If the newest
 * partition ends in the past (maintenance lagged), claims have been going
 * into it: extend its upper bound past now instead of leaving a gap, so its
 * retention counts from its last claims.
 */
static void
ensure_partitions(const IdemSettings *s, TimestampTz now, MaintainReport *rep)
{
	TimestampTz newest_upper = 0;
	bool		have_newest = false;
	Oid			newest_relid = InvalidOid;
	TimestampTz next;
	TimestampTz horizon = add_seconds(now, s->interval * s->premake);
	int64		iv_usecs = s->interval * USECS_PER_SEC;

	if (SPI_execute("SELECT relid, upper FROM idempotency.partition_registry"
					" ORDER BY upper DESC, lower DESC LIMIT 1", false, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read idempotency.partition_registry");
	if (SPI_processed == 1)
	{
		bool		isnull;

		newest_relid = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0],
													  SPI_tuptable->tupdesc, 1, &isnull));
		newest_upper = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0],
														 SPI_tuptable->tupdesc, 2, &isnull));
		have_newest = true;
	}

	/*
	 * The next interval boundary on the grid, at least a second ahead.  When
	 * extending after a lag, claimers that read the registry before our
	 * commit keep inserting into the newest partition until they see it; the
	 * second of slack keeps their claims inside its new range unless one
	 * stalls longer than that between reading its clock and inserting (its
	 * claim would then expire that much early).
	 */
	next = now - (now % iv_usecs) + iv_usecs;
	if (next - now < USECS_PER_SEC)
		next += iv_usecs;

	if (!have_newest)
	{
		/* first partition covers the current interval */
		TimestampTz lower = next - iv_usecs;

		if (lower > now)
			lower -= iv_usecs;
		report_action(rep, "create", create_partition(lower, next));
		newest_upper = next;
	}
	else if (newest_upper <= now)
	{
		Oid			types[2] = {OIDOID, TIMESTAMPTZOID};
		Datum		values[2] = {ObjectIdGetDatum(newest_relid), TimestampTzGetDatum(next)};

		spi_exec("UPDATE idempotency.partition_registry SET upper = $2 WHERE relid = $1",
				 2, types, values, SPI_OK_UPDATE);
		report_action(rep, "extend", get_rel_name(newest_relid) ?
					  psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(get_rel_name(newest_relid))) : "?");
		newest_upper = next;
	}

	while (newest_upper < horizon)
	{
		TimestampTz upper = add_seconds(newest_upper, s->interval);

		report_action(rep, "create", create_partition(newest_upper, upper));
		newest_upper = upper;
	}
}

/*
 * Registry condition: not the newest partition, which claims go into while
 * maintenance lags (so it is neither sealed nor dropped).
 */
#define NOT_NEWEST_PARTITION \
	"relid <> (SELECT relid FROM idempotency.partition_registry" \
	"          ORDER BY upper DESC, lower DESC LIMIT 1)"

/*
 * Run a query over the registry that returns partition OIDs in its first
 * column, and copy them out (the loop that follows runs more SPI).
 */
static Oid *
registry_oids(const char *sql, int nargs, Oid *types, Datum *values, uint64 *n)
{
	Oid		   *oids;

	if (SPI_execute_with_args(sql, nargs, types, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read idempotency.partition_registry");
	*n = SPI_processed;
	oids = palloc(sizeof(Oid) * (*n + 1));
	for (uint64 i = 0; i < *n; i++)
	{
		bool		isnull;

		oids[i] = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[i],
												 SPI_tuptable->tupdesc, 1, &isnull));
	}
	return oids;
}

/*
 * Drop partitions whose every claim is older than the retention window.
 * Claimers stop probing such partitions by themselves (they know the
 * retention), so normally nobody holds a lock on them; a reader of
 * idempotency.claims might, so the AccessExclusiveLock is taken
 * conditionally and a busy partition waits for a later round.
 */
static void
drop_expired(const IdemSettings *s, TimestampTz now, MaintainReport *rep)
{
	Oid			types[1] = {TIMESTAMPTZOID};
	Datum		values[1] = {TimestampTzGetDatum(add_seconds(now, -s->retention))};
	uint64		n;
	Oid		   *victims;

	/* never the newest partition: lagging claims may still go there */
	victims = registry_oids("SELECT relid FROM idempotency.partition_registry"
							" WHERE upper <= $1 AND " NOT_NEWEST_PARTITION
							" ORDER BY lower",
							1, types, values, &n);

	for (uint64 i = 0; i < n; i++)
	{
		Oid			relid = victims[i];
		char	   *relname = get_rel_name(relid);
		char	   *qualified;
		Oid			dtypes[1] = {OIDOID};
		Datum		dvalues[1] = {ObjectIdGetDatum(relid)};

		if (relname == NULL)
		{
			/* table already gone (dropped by hand): forget it */
			spi_exec("DELETE FROM idempotency.partition_registry WHERE relid = $1",
					 1, dtypes, dvalues, SPI_OK_DELETE);
			continue;
		}
		qualified = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
		if (!ConditionalLockRelationOid(relid, AccessExclusiveLock))
		{
			report_action(rep, "skip drop (in use)", qualified);
			continue;
		}
		spi_exec("DELETE FROM idempotency.partition_registry WHERE relid = $1",
				 1, dtypes, dvalues, SPI_OK_DELETE);
		spi_exec(psprintf("DROP TABLE %s", qualified), 0, NULL, NULL, SPI_OK_UTILITY);
		report_action(rep, "drop", qualified);
	}
}

/*
 * After partition_interval changed: drop the premade partitions of the old
 * width and end the current one at the next boundary of the new grid, so the
 * new width applies from then on rather than after premake old intervals.
 * Claimers never probe partitions that start in the future, so dropping
 * those does not make them wait; this runs only from idem_configure(), which
 * may wait for a reader.
 */
static void
reshape_partitions(const IdemSettings *s, TimestampTz now, MaintainReport *rep)
{
	int64		iv_usecs = s->interval * USECS_PER_SEC;
	TimestampTz next = now - (now % iv_usecs) + iv_usecs;
	Oid			types[1] = {TIMESTAMPTZOID};
	Datum		values[1];
	uint64		n;
	char	  **victims;

	if (next - now < USECS_PER_SEC)
		next += iv_usecs;
	values[0] = TimestampTzGetDatum(next);

	spi_exec("UPDATE idempotency.partition_registry SET upper = $1"
			 " WHERE lower < $1 AND upper > $1", 1, types, values, SPI_OK_UPDATE);
	if (SPI_execute_with_args("DELETE FROM idempotency.partition_registry r"
							  " USING pg_catalog.pg_class c, pg_catalog.pg_namespace n"
							  " WHERE r.lower >= $1 AND c.oid = r.relid AND n.oid = c.relnamespace"
							  " RETURNING pg_catalog.format('%I.%I', n.nspname, c.relname)",
							  1, types, values, NULL, false, 0) != SPI_OK_DELETE_RETURNING)
		elog(ERROR, "could not update idempotency.partition_registry");
	n = SPI_processed;
	victims = palloc(sizeof(char *) * (n + 1));
	for (uint64 i = 0; i < n; i++)
		victims[i] = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1);
	for (uint64 i = 0; i < n; i++)
	{
		spi_exec(psprintf("DROP TABLE %s", victims[i]), 0, NULL, NULL, SPI_OK_UTILITY);
		report_action(rep, "drop", victims[i]);
	}
}

/* Forget registry entries whose table was dropped by hand. */
static void
forget_missing(MaintainReport *rep)
{
	if (SPI_execute("DELETE FROM idempotency.partition_registry r"
					" WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = r.relid)"
					" RETURNING r.relid::pg_catalog.oid::pg_catalog.text",
					false, 0) != SPI_OK_DELETE_RETURNING)
		elog(ERROR, "could not update idempotency.partition_registry");
	for (uint64 i = 0; i < SPI_processed; i++)
		report_action(rep, "forget missing partition",
					  SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1));
}

/*
 * Bloom filter over the claims of a partition that takes no more claims, or
 * NULL if it has too many.  Needs a lock on the partition that keeps
 * inserters out.
 */
static bytea *
build_bloom(Oid relid)
{
	Relation	rel = table_open(relid, NoLock);
	Snapshot	snap = RegisterSnapshot(GetLatestSnapshot());
	TableScanDesc scan;
	HeapTuple	tup;
	uint64		nkeys = 0;
	uint32		nbits;
	bytea	   *bloom = NULL;

	/* one pass to size the filter, one to fill it */
	scan = table_beginscan(rel, snap, 0, NULL);
	while (heap_getnext(scan, ForwardScanDirection) != NULL)
		nkeys++;
	table_endscan(scan);

	if (nkeys <= IDEM_BLOOM_MAX_KEYS)
	{
		nbits = (uint32) Max(nkeys * IDEM_BLOOM_BITS_PER_KEY, IDEM_BLOOM_ROUND_BITS);
		nbits = (nbits + IDEM_BLOOM_ROUND_BITS - 1) / IDEM_BLOOM_ROUND_BITS * IDEM_BLOOM_ROUND_BITS;
		bloom = palloc0(VARHDRSZ + nbits / 8);
		SET_VARSIZE(bloom, VARHDRSZ + nbits / 8);

		scan = table_beginscan(rel, snap, 0, NULL);
		while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
		{
			bool		isnull;
			text	   *scope = DatumGetTextPP(heap_getattr(tup, 1, RelationGetDescr(rel), &isnull));
			text	   *key = DatumGetTextPP(heap_getattr(tup, 2, RelationGetDescr(rel), &isnull));

			idem_bloom_add((uint8 *) VARDATA(bloom), nbits, idem_key_hash(scope, key));
		}
		table_endscan(scan);
	}

	UnregisterSnapshot(snap);
	table_close(rel, NoLock);
	return bloom;
}

/*
 * Seal the partitions whose range has passed: no claim may go into them any
 * more, which lets claimers check them without the value lock, mostly
 * through a Bloom filter in memory.  The ShareLock, taken conditionally, proves that no claimer is
 * inserting into the partition; one that tries later waits for our commit,
 * then sees the seal and chooses another partition (see insert_claim()).
 */
static void
seal_partitions(const IdemSettings *s, TimestampTz now, MaintainReport *rep)
{
	Oid			types[2] = {TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[2];
	uint64		n;
	Oid		   *candidates;

	values[0] = TimestampTzGetDatum(add_seconds(now, -1));
	values[1] = TimestampTzGetDatum(add_seconds(now, -s->retention));
	candidates = registry_oids("SELECT relid FROM idempotency.partition_registry"
							   " WHERE NOT sealed AND upper <= $1 AND upper > $2"
							   "   AND " NOT_NEWEST_PARTITION
							   " ORDER BY lower",
							   2, types, values, &n);

	for (uint64 i = 0; i < n; i++)
	{
		Oid			utypes[2] = {OIDOID, BYTEAOID};
		Datum		uvalues[2];
		char		unulls[2] = {' ', ' '};
		bytea	   *bloom;
		char	   *relname = get_rel_name(candidates[i]);

		if (relname == NULL || !ConditionalLockRelationOid(candidates[i], ShareLock))
			continue;			/* gone, or a claimer is inserting: next round */
		bloom = build_bloom(candidates[i]);
		uvalues[0] = ObjectIdGetDatum(candidates[i]);
		uvalues[1] = PointerGetDatum(bloom);
		if (bloom == NULL)
			unulls[1] = 'n';
		if (SPI_execute_with_args("UPDATE idempotency.partition_registry"
								  " SET sealed = true, bloom = $2 WHERE relid = $1",
								  2, utypes, uvalues, unulls, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "could not update idempotency.partition_registry");
		report_action(rep, "seal", psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname)));
	}
}

/*
 * Maintenance runs SQL as the owner of idempotency.claims (often a
 * superuser): pin search_path so that no operator or function a user put on
 * it can stand in for the built-in ones.  Undo with AtEOXact_GUC().
 */
static int
pin_search_path(void)
{
	int			nestlevel = NewGUCNestLevel();

	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	return nestlevel;
}

/* One maintenance round; returns false if another session holds the lock. */
static bool
maintain(MaintainReport *rep, bool wait, bool reshape)
{
	LOCKTAG		tag;
	IdemSettings s;
	TimestampTz now;
	int			nestlevel;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 0, IDEM_LOCKTAG_MAINTAIN);
	if (LockAcquire(&tag, ExclusiveLock, false, !wait) == LOCKACQUIRE_NOT_AVAIL)
		return false;

	nestlevel = pin_search_path();
	SPI_connect();
	s = read_settings(GetLatestSnapshot());
	now = GetCurrentTimestamp();
	forget_missing(rep);
	if (reshape)
		reshape_partitions(&s, now, rep);
	ensure_partitions(&s, now, rep);
	seal_partitions(&s, now, rep);
	drop_expired(&s, now, rep);
	SPI_finish();
	AtEOXact_GUC(true, nestlevel);
	return true;
}

/*
 * One maintenance round for callers outside SQL (the background worker),
 * which must have a transaction and an active snapshot.  Each action is
 * logged at elevel.  Returns the number of actions, or -1 if another
 * session was maintaining this database.
 */
int
idem_maintain_round(int elevel)
{
	MaintainReport rep = {NULL, NULL, elevel, 0};

	if (!maintain(&rep, false, false))
		return -1;
	return rep.nactions;
}

/*
 * idem_configure(retention, partition_interval, premake): validate, store,
 * and create the partitions the new settings call for.  NULL keeps a value.
 */
Datum
idem_configure(PG_FUNCTION_ARGS)
{
	IdemSettings s;
	int64		old_interval;
	Oid			types[3] = {INTERVALOID, INTERVALOID, INT4OID};
	Datum		values[3];
	char		nulls[3];
	int			nestlevel;

	check_maintenance_privilege("configure idempotency");

	nestlevel = pin_search_path();
	SPI_connect();
	s = read_settings(GetLatestSnapshot());
	old_interval = s.interval;
	if (!PG_ARGISNULL(0))
		s.retention = interval_seconds(PG_GETARG_INTERVAL_P(0));
	if (!PG_ARGISNULL(1))
	{
		Interval   *iv = PG_GETARG_INTERVAL_P(1);

		if (iv->time % USECS_PER_SEC != 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("partition_interval must be a whole number of seconds")));
		s.interval = interval_seconds(iv);
	}
	if (!PG_ARGISNULL(2))
		s.premake = PG_GETARG_INT32(2);

	if (s.interval < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("partition_interval must be at least 1 second")));
	if (s.interval > MAX_INTERVAL_SECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("partition_interval must not exceed 10 years")));
	if (s.retention > MAX_RETENTION_SECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention must not exceed 100 years")));
	if (s.retention < s.interval)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention must not be shorter than partition_interval"),
				 errdetail("retention is %lld seconds, partition_interval %lld seconds.",
						   (long long) s.retention, (long long) s.interval)));
	if (s.premake < 1 || s.premake > MAX_PREMAKE)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("premake must be between 1 and %d", MAX_PREMAKE)));

	/* store intervals as given (NULL keeps the stored or default value) */
	for (int i = 0; i < 3; i++)
	{
		values[i] = PG_GETARG_DATUM(i);
		nulls[i] = PG_ARGISNULL(i) ? 'n' : ' ';
	}
	if (SPI_execute_with_args("INSERT INTO idempotency.settings AS s (retention, partition_interval, premake)"
							  " VALUES (coalesce($1, interval '7 days'), coalesce($2, interval '1 day'),"
							  "         coalesce($3, 4))"
							  " ON CONFLICT (singleton) DO UPDATE"
							  " SET retention = coalesce($1, s.retention),"
							  "     partition_interval = coalesce($2, s.partition_interval),"
							  "     premake = coalesce($3, s.premake)",
							  3, types, values, nulls, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not update idempotency.settings");
	SPI_finish();
	AtEOXact_GUC(true, nestlevel);

	/* new settings take effect now (after a round that is running ends) */
	maintain(NULL, true, s.interval != old_interval);
	PG_RETURN_VOID();
}

/*
 * idem_maintain(): one maintenance round, one row per action taken.  Returns
 * no rows at once if another session is maintaining this database.
 */
Datum
idem_maintain(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	MaintainReport rep;

	check_maintenance_privilege("maintain idempotency partitions");
	InitMaterializedSRF(fcinfo, 0);
	rep.store = rsinfo->setResult;
	rep.desc = rsinfo->setDesc;
	rep.nactions = 0;
	maintain(&rep, false, false);
	return (Datum) 0;
}
