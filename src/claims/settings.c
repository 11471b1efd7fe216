/*-------------------------------------------------------------------------
 *
 * settings.c
 *	  The claims store's settings (retention, partition_interval, premake):
 *	  read from idempotency.settings, the defaults where it has no row, and
 *	  the rule of which shapes the claim path can serve, over every retention
 *	  class (classes.c).  The outbox, inbox and request stores share the
 *	  partition interval and premake; their retention is their own if
 *	  idem_configure_store() gave one (common/store_retention.c).
 *
 * Locking rules: reads idempotency.settings with AccessShareLock under the
 * caller's snapshot; writing it is idem_configure()'s (maintenance.c).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/settings.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "common/args.h"
#include "common/catalog.h"
#include "funcapi.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_current_settings);

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

IdemSettings
idem_settings_from_scan(Relation rel, Snapshot snap)
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
	Relation	rel = idem_open_internal(idem_internal_relid("settings"));
	IdemSettings s;

	snap = RegisterSnapshot(snap);
	s = idem_settings_from_scan(rel, snap);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	return s;
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

/*
 * Error out unless a configuration is one the claim path can serve: the
 * default retention class and the nclasses others (retentions in seconds,
 * from idempotency.scope_retention) share the partition interval and the
 * bound on live partitions.
 */
void
idem_validate_settings(const IdemSettings *s, const int64 *classes, int nclasses)
{
	int64		live;
	int64		windows;

	if (s->interval < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("partition_interval must be at least 1 second")));
	if (s->interval > IDEM_MAX_INTERVAL_SECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("partition_interval must not exceed %d years", IDEM_MAX_INTERVAL_YEARS)));
	if (s->retention > IDEM_MAX_RETENTION_SECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention must not exceed %d years", IDEM_MAX_RETENTION_YEARS)));
	if (s->retention < s->interval)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention must not be shorter than partition_interval"),
				 errdetail("retention is %lld seconds, partition_interval %lld seconds.",
						   (long long) s->retention, (long long) s->interval)));
	for (int i = 0; i < nclasses; i++)
		if (classes[i] < s->interval)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("a scope's retention must not be shorter than partition_interval"),
					 errdetail("A scope's retention is %lld seconds, partition_interval %lld seconds.",
							   (long long) classes[i], (long long) s->interval)));
	if (s->premake < 1 || s->premake > IDEM_MAX_PREMAKE)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("premake must be between 1 and %d", IDEM_MAX_PREMAKE)));

	/* live partitions, per class: its retention window, the current one, premade ones */
	windows = s->retention;
	live = (s->retention + s->interval - 1) / s->interval + 1 + s->premake;
	for (int i = 0; i < nclasses; i++)
	{
		windows += classes[i];
		live += (classes[i] + s->interval - 1) / s->interval + 1 + s->premake;
	}
	if (live > IDEM_MAX_LIVE_PARTITIONS)
	{
		int			room = IDEM_MAX_LIVE_PARTITIONS - (nclasses + 1) * (1 + s->premake);

		if (room < nclasses + 1)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("too many live partitions: premake %d leaves no room for the retention window",
							s->premake),
					 errdetail("At most %d partitions may be live at once, over %d retention classes.",
							   IDEM_MAX_LIVE_PARTITIONS, nclasses + 1)));
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("too many live partitions: %lld, at most %d",
						(long long) live, IDEM_MAX_LIVE_PARTITIONS),
				 nclasses == 0 ?
				 errdetail("Every claim consults each live partition; retention %lld s over partition_interval %lld s, plus premake %d, is too many.",
						   (long long) s->retention, (long long) s->interval, s->premake) :
				 errdetail("Every claim consults each live partition; the retentions of %d classes, %lld s in all, over partition_interval %lld s, plus premake %d each, are too many.",
						   nclasses + 1, (long long) windows, (long long) s->interval, s->premake),
				 errhint("Use a partition_interval of at least %lld seconds.",
						 (long long) ((windows + room - nclasses - 1) / (room - nclasses)))));
	}
}
