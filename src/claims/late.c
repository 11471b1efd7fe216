/*-------------------------------------------------------------------------
 *
 * late.c
 *	  Late duplicates: when maintenance drops an expired claims partition,
 *	  the hashes of its keys go into a summary, a Bloom filter kept for
 *	  idempotency.late_duplicate_window; a new claim whose key is probably
 *	  in a summary is counted, warned about or refused
 *	  (idempotency.late_duplicate_policy).
 *
 * Summaries are rows of idempotency.late_summaries (so they survive
 * restarts and dumps).  The window is cut into IDEM_LATE_BUCKETS buckets;
 * a drop adds its keys to the newest summary if that one was last added to
 * in the same bucket and has room, else to a new summary sized for the keys
 * the previous bucket received (at least twice the drop, doubling within a
 * bucket).  A summary is kept until its last drop is older than the window,
 * at most IDEM_LATE_MAX_SUMMARIES of them (the oldest go first).  Sizes and
 * the false-positive rate: doc/claims.md, "Late duplicates".
 *
 * Only a key that a claim found nowhere within the retention pays for the
 * check (claims.c calls idem_late_lookup() under the value lock, after its
 * probe found no row): one filter test per summary in the window, most
 * recent first.  Their filters are held like those of sealed partitions,
 * in the shared area when preloaded, else in the backend (filters.c).
 *
 * Locking rules: the per-backend list of summaries is dropped by a relcache
 * invalidation of idempotency.late_summaries (the statement trigger
 * partition_cache_invalidate() sends it at the writer's commit), noted
 * before the build reads the table under AccessShareLock; an invalidation
 * during the build restarts it.  Only maintenance writes the table, under
 * its round's lock, in the transaction that drops the partitions.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/late.h"
#include "common/catalog.h"
#include "common/clock.h"
#include "common/keys.h"
#include "common/spi.h"
#include "stats/stats.h"
#include "claims/filters.h"
#include "claims/partitions.h"

#include <limits.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/*---- GUC variables ----*/
#define LATE_WINDOW_SECS_DEFAULT	(30 * SECS_PER_DAY)

static int	idem_late_window_secs = LATE_WINDOW_SECS_DEFAULT;
static int	idem_late_policy = IDEM_LATE_COUNT;

static const struct config_enum_entry late_policy_options[] = {
	{"count", IDEM_LATE_COUNT, false},
	{"warn", IDEM_LATE_WARN, false},
	{"error", IDEM_LATE_ERROR, false},
	{NULL, 0, false}
};

/* When a summary's claims expired, and when a partition was last added. */
typedef struct LateTimes
{
	TimestampTz expired_from;
	TimestampTz expired_to;
	TimestampTz last_drop;
} LateTimes;

/*---- the per-backend list of summaries ----*/
static MemoryContext late_cxt = NULL;
static bool late_valid = false;
static Oid	late_relid = InvalidOid;
static uint64 late_invals = 0;
static int	late_n = 0;
static IdemPartition *late_parts = NULL;	/* their filters, newest first */
static LateTimes *late_times = NULL;

static void
late_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == late_relid)
	{
		late_valid = false;
		late_invals++;
	}
}

static int64
window_usecs(void)
{
	return (int64) idem_late_window_secs * USECS_PER_SEC;
}

/* The table, or InvalidOid (a database still at version 1.0). */
static Oid
summaries_relid(void)
{
	return get_relname_relid("late_summaries", idem_schema_oid());
}

/*
 * Read the summaries (not their bits) in snap, newest first, into cxt;
 * each filter is named by (table, id, row xmin).
 */
static int
read_summaries(Relation rel, Snapshot snap, MemoryContext cxt, IdemPartition **parts,
			   LateTimes **times)
{
	TupleDesc	desc = RelationGetDescr(rel);
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	HeapTuple	tup;
	int			n = 0;
	int			cap = IDEM_LATE_MAX_SUMMARIES;

	*parts = MemoryContextAllocZero(cxt, cap * sizeof(IdemPartition));
	*times = MemoryContextAlloc(cxt, cap * sizeof(LateTimes));
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Oid			id = (Oid) DatumGetInt32(heap_getattr(tup, Anum_late_id, desc, &isnull));
		IdemPartition *p;
		LateTimes  *t;
		int			at;

		if (n == cap)
		{
			cap *= 2;
			*parts = repalloc(*parts, cap * sizeof(IdemPartition));
			*times = repalloc(*times, cap * sizeof(LateTimes));
		}
		/* insertion sort by id, newest (highest) first */
		for (at = n; at > 0 && (*parts)[at - 1].relid < id; at--)
		{
			(*parts)[at] = (*parts)[at - 1];
			(*times)[at] = (*times)[at - 1];
		}
		p = &(*parts)[at];
		t = &(*times)[at];
		memset(p, 0, sizeof(IdemPartition));
		p->relid = id;
		p->filter_xmin = HeapTupleHeaderGetRawXmin(tup->t_data);
		p->filter_source = RelationGetRelid(rel);
		p->has_filter = true;
		p->sealed = true;
		/* its size, so that a look at one block need not read the header */
		p->filter_nbits = idem_filter_stored_nbits(heap_getattr(tup, Anum_late_bloom, desc, &isnull));
		t->expired_from = DatumGetTimestampTz(heap_getattr(tup, Anum_late_expired_from, desc, &isnull));
		t->expired_to = DatumGetTimestampTz(heap_getattr(tup, Anum_late_expired_to, desc, &isnull));
		t->last_drop = DatumGetTimestampTz(heap_getattr(tup, Anum_late_last_drop, desc, &isnull));
		n++;
	}
	table_endscan(scan);
	return n;
}

static void
late_read(Relation rel, Snapshot snap, MemoryContext cxt)
{
	late_n = read_summaries(rel, snap, cxt, &late_parts, &late_times);
}

/* (Re)build this backend's list of summaries. */
static void
late_build(void)
{
	bool		read;

	late_relid = summaries_relid();
	if (late_cxt == NULL)
		late_cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency late summaries",
										 ALLOCSET_SMALL_SIZES);
	read = idem_summaries_read(late_relid, late_cxt, &late_invals, late_read);
	late_valid = true;
	if (!read)
	{
		late_n = 0;				/* no table: nothing to look at */
		late_parts = NULL;
		late_times = NULL;
		return;
	}
	/* this backend's copies of summaries gone or rewritten are freed */
	idem_filters_forget_unlisted(late_relid, late_parts, late_n, false);
}

/*
 * Is the key with this hash probably in a summary within the window at
 * "now"?  Then *m says when its earlier claim expired (the most recent
 * summary that holds it).  The caller has accepted invalidations
 * (idem_partition_set()).
 */
bool
idem_late_lookup(uint64 hash, TimestampTz now, IdemLateMatch *m)
{
	TimestampTz since;

	if (idem_late_window_secs == 0)
		return false;
	if (!late_valid)
		late_build();
	if (late_n == 0)
		return false;
	since = now - window_usecs();
	/* the blocks of all summaries load at once, not one after the other */
	for (int i = 0; i < late_n; i++)
		idem_filter_prefetch(&late_parts[i], hash);
	for (int i = 0; i < late_n; i++)
	{
		if (late_times[i].last_drop <= since)
			continue;			/* past the window; maintenance deletes it */
		if (idem_filter_summary_maybe(&late_parts[i], hash))
		{
			m->expired_from = late_times[i].expired_from;
			m->expired_to = late_times[i].expired_to;
			return true;
		}
	}
	return false;
}

static int
late_detail(text *scope, text *key, const IdemLateMatch *m)
{
	/* timestamptz_to_str() returns a static buffer: copy the first */
	char	   *from = pstrdup(timestamptz_to_str(m->expired_from));

	return errdetail("Scope \"%s\", key \"%s\" was probably claimed before; that claim expired between %s and %s.",
					 text_to_cstring(scope), idem_key_for_message(key),
					 from, timestamptz_to_str(m->expired_to));
}

/* Does a new claim of such a key fail (policy 'error')? */
bool
idem_late_refuses(void)
{
	return idem_late_policy == IDEM_LATE_ERROR;
}

/*
 * Refuse a new claim of a key probably claimed before (IK008, counted at
 * once: the transaction fails).
 */
void
idem_late_refuse(text *scope, text *key, const IdemLateMatch *m)
{
	idem_stats_count_scope_now(scope, IDEM_STAT_LATE_DUPLICATES, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_LATE_DUPLICATE),
			 errmsg("late duplicate of an expired claim"),
			 late_detail(scope, key, m),
			 errhint("The key is in a summary of dropped claims partitions (idempotency.late_duplicate_window); "
					 "set idempotency.late_duplicate_policy to 'count' or 'warn' to claim it anyway.")));
}

/* The claim of such a key was made: count it (at commit), warn if asked. */
void
idem_late_claimed(text *scope, text *key, const IdemLateMatch *m)
{
	idem_stats_count_scope(scope, IDEM_STAT_LATE_DUPLICATES, 1);
	if (idem_late_policy == IDEM_LATE_WARN)
		ereport(WARNING,
				(errcode(ERRCODE_IDEM_LATE_DUPLICATE),
				 errmsg("late duplicate of an expired claim"),
				 late_detail(scope, key, m)));
}

/*---- maintenance ----*/

/* A bucket of the window: drops in one bucket share summaries. */
static int64
bucket_width(void)
{
	return Max(window_usecs() / IDEM_LATE_BUCKETS, USECS_PER_SEC);
}

static int64
bucket_of(TimestampTz t)
{
	int64		width = bucket_width();

	return t >= 0 ? t / width : (t - width + 1) / width;
}

/* The key hashes of a partition's claims; *n of them. */
static uint64 *
partition_hashes(Relation part, int64 *n)
{
	TupleDesc	desc = RelationGetDescr(part);
	Snapshot	snap = RegisterSnapshot(GetLatestSnapshot());
	TableScanDesc scan = table_beginscan(part, snap, 0, NULL);
	HeapTuple	tup;
	int64		cap = 1024;
	uint64	   *hashes = palloc(cap * sizeof(uint64));

	*n = 0;
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		text	   *scope = DatumGetTextPP(heap_getattr(tup, Anum_claims_scope, desc, &isnull));
		text	   *key = DatumGetTextPP(heap_getattr(tup, Anum_claims_key, desc, &isnull));

		if (*n == cap)
		{
			cap *= 2;
			hashes = repalloc_huge(hashes, cap * sizeof(uint64));
		}
		hashes[(*n)++] = idem_key_hash(scope, key);
	}
	table_endscan(scan);
	UnregisterSnapshot(snap);
	return hashes;
}

/*
 * The partition "part" is about to be dropped (the caller holds
 * AccessExclusiveLock on it, and it is sealed: no claim can be added): add
 * its keys to the summary of the current bucket.  Its claims expired
 * between expired_from and expired_to.
 */
void
idem_late_fold(Relation part, TimestampTz expired_from, TimestampTz expired_to, TimestampTz now)
{
	uint64	   *hashes;
	int64		n;
	bool		found;
	int32		newest_id = 0;
	TimestampTz newest_drop = 0;
	int64		newest_nkeys = 0;
	int64		newest_capacity = 0;
	int32		id;
	int64		capacity;
	bytea	   *bloom;
	Oid			types[7] = {INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID, TIMESTAMPTZOID, INT8OID, INT8OID, BYTEAOID};
	Datum		values[7];

	if (idem_late_window_secs == 0 || !OidIsValid(summaries_relid()))
		return;
	expired_from = Min(expired_from, expired_to);	/* whatever the settings did */
	hashes = partition_hashes(part, &n);
	if (n == 0)
		return;

	idem_spi_exec("SELECT id, last_drop, nkeys, capacity, bloom FROM idempotency.late_summaries"
				  " ORDER BY id DESC LIMIT 1", 0, NULL, NULL, SPI_OK_SELECT);
	found = SPI_processed > 0;
	if (found)
	{
		bool		isnull;

		newest_id = DatumGetInt32(idem_spi_col(0, 1, &isnull));
		newest_drop = DatumGetTimestampTz(idem_spi_col(0, 2, &isnull));
		newest_nkeys = DatumGetInt64(idem_spi_col(0, 3, &isnull));
		newest_capacity = DatumGetInt64(idem_spi_col(0, 4, &isnull));
	}

	if (found && bucket_of(newest_drop) == bucket_of(now) && newest_nkeys + n <= newest_capacity)
	{
		/* room in the current bucket's summary */
		bool		isnull;

		id = newest_id;
		capacity = newest_capacity;
		bloom = DatumGetByteaPCopy(idem_spi_col(0, 5, &isnull));
	}
	else
	{
		/*
		 * A new summary, sized for what the previous bucket received (the
		 * steady state), for twice this drop, and within a bucket that
		 * outgrew its summary for twice that one.
		 */
		int64		width = bucket_width();

		id = newest_id + 1;
		capacity = Max(IDEM_LATE_MIN_CAPACITY, 2 * n);
		if (found && bucket_of(newest_drop) == bucket_of(now))
			capacity = Max(capacity, 2 * newest_capacity);
		else
		{
			Oid			btypes[2] = {TIMESTAMPTZOID, TIMESTAMPTZOID};
			Datum		bvalues[2];
			bool		isnull;
			int64		prev;

			bvalues[0] = TimestampTzGetDatum((bucket_of(now) - 1) * width);
			bvalues[1] = TimestampTzGetDatum(bucket_of(now) * width);
			idem_spi_exec("SELECT pg_catalog.sum(nkeys)::bigint FROM idempotency.late_summaries"
						  " WHERE last_drop >= $1 AND last_drop < $2", 2, btypes, bvalues, SPI_OK_SELECT);
			prev = DatumGetInt64(idem_spi_col(0, 1, &isnull));
			if (!isnull)
				capacity = Max(capacity, prev + prev / 4);
		}
		bloom = idem_filter_new(&capacity, n, IDEM_LATE_BITS_PER_KEY);
	}
	if (!idem_filter_add_hashes(bloom, hashes, n))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("late-duplicate summary %d is damaged", id),
				 errhint("Delete its row from idempotency.late_summaries.")));

	/* the new summary, or the one added to; and at most as many as allowed */
	values[0] = Int32GetDatum(id);
	values[1] = TimestampTzGetDatum(expired_from);
	values[2] = TimestampTzGetDatum(expired_to);
	values[3] = TimestampTzGetDatum(now);
	values[4] = Int64GetDatum(n);
	values[5] = Int64GetDatum(capacity);
	values[6] = PointerGetDatum(bloom);
	idem_spi_exec("INSERT INTO idempotency.late_summaries AS s"
				  " (id, expired_from, expired_to, last_drop, nkeys, capacity, bloom)"
				  " VALUES ($1, $2, $3, $4, $5, $6, $7)"
				  " ON CONFLICT (id) DO UPDATE SET bloom = excluded.bloom, nkeys = s.nkeys + excluded.nkeys,"
				  " expired_from = LEAST(s.expired_from, excluded.expired_from),"
				  " expired_to = GREATEST(s.expired_to, excluded.expired_to),"
				  " last_drop = GREATEST(s.last_drop, excluded.last_drop)",
				  7, types, values, SPI_OK_INSERT);
	values[0] = Int32GetDatum(id - IDEM_LATE_MAX_SUMMARIES);
	idem_spi_exec("DELETE FROM idempotency.late_summaries WHERE id <= $1",
				  1, types, values, SPI_OK_DELETE);
	pfree(hashes);
}

/*
 * Delete the summaries whose window has passed (all of them with the
 * window off), and forget the filters of those gone or rewritten in the
 * shared area.  Returns how many were deleted.
 */
int
idem_late_expire(TimestampTz now)
{
	Oid			relid = summaries_relid();
	int			deleted;
	Relation	rel;
	Snapshot	snap;
	IdemPartition *parts;
	LateTimes  *times;
	int			n;

	if (!OidIsValid(relid))
		return 0;
	if (idem_late_window_secs == 0)
		idem_spi_exec("DELETE FROM idempotency.late_summaries", 0, NULL, NULL, SPI_OK_DELETE);
	else
	{
		Oid			types[1] = {TIMESTAMPTZOID};
		Datum		values[1] = {TimestampTzGetDatum(now - window_usecs())};

		idem_spi_exec("DELETE FROM idempotency.late_summaries WHERE last_drop <= $1",
					  1, types, values, SPI_OK_DELETE);
	}
	deleted = (int) SPI_processed;

	rel = table_open(relid, AccessShareLock);
	snap = RegisterSnapshot(GetLatestSnapshot());
	n = read_summaries(rel, snap, CurrentMemoryContext, &parts, &times);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	idem_filters_forget_unlisted(relid, parts, n, true);
	return deleted;
}

void
idem_late_init(void)
{
	CacheRegisterRelcacheCallback(late_cache_callback, (Datum) 0);
	DefineCustomIntVariable("idempotency.late_duplicate_window",
							"How long the summaries of dropped claims partitions are kept, for late-duplicate detection.",
							"0 keeps none and checks nothing.",
							&idem_late_window_secs,
							LATE_WINDOW_SECS_DEFAULT, 0, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.late_duplicate_policy",
							 "What a new claim of a key probably claimed before (and expired) does: count, warn or error.",
							 NULL,
							 &idem_late_policy,
							 IDEM_LATE_COUNT,
							 late_policy_options,
							 PGC_USERSET,
							 0,
							 NULL, NULL, NULL);
}
