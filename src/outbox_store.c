/*-------------------------------------------------------------------------
 *
 * outbox_store.c
 *	  The time partitions of idempotency.outbox_events: created ahead and
 *	  dropped past their retention by the maintenance round (retention.c
 *	  calls idem_outbox_maintain()), never while they hold an undelivered or
 *	  dead-lettered event.
 *
 * idempotency.outbox_events is a declarative range-partitioned table on
 * created_at, so emitters insert through the parent and a publication with
 * publish_via_partition_root covers partitions made later.  Its default
 * partition (made by the install script) takes events while no range
 * covers their time; retention leaves it alone (it is an extension member:
 * its rows are dumped as configuration data).
 *
 * The partitions follow the settings of the claims store (retention,
 * partition_interval, premake); an outbox partition is kept for the
 * retention after its upper bound, and longer while pinned.
 *
 * Locking rules:
 *	- A partition is made as a table of its own and then attached:
 *	  ATTACH PARTITION takes ShareUpdateExclusiveLock on the parent, which
 *	  neither emitters (RowExclusiveLock) nor relays (AccessShareLock)
 *	  conflict with; it scans the default partition under lock, which is
 *	  empty unless maintenance lagged.
 *	- Dropping a partition takes AccessExclusiveLock on it and on the
 *	  parent.  Both are only tried, a few times over half a second, never
 *	  queued for: emitters and relays never wait behind a drop, and a busy
 *	  parent leaves the drop to a later round.
 *	- Whether a partition is pinned is read before those locks: only a
 *	  redrive moves an aggregate back, and a partition past its retention
 *	  gets no new events.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

#define OUTBOX_PARTITION_PREFIX	"outbox"

/* attempts to lock a partition and the parent for a drop, and the pause */
#define DROP_LOCK_TRIES			50
#define DROP_LOCK_PAUSE_USECS	10000L

typedef struct OutboxPartition
{
	Oid			relid;
	TimestampTz lower;
	TimestampTz upper;
} OutboxPartition;

typedef struct OutboxRound
{
	MaintainReport *rep;
	const IdemSettings *s;
	TimestampTz now;
	Oid			parent;
} OutboxRound;

static char *
timestamp_literal(TimestampTz t)
{
	return quote_literal_cstr(DatumGetCString(DirectFunctionCall1(timestamptz_out,
																  TimestampTzGetDatum(t))));
}

/* Forget registry rows whose table was dropped by hand. */
static void
forget_missing(OutboxRound *r)
{
	if (SPI_execute("DELETE FROM idempotency.outbox_partitions o"
					" WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = o.relid)"
					" RETURNING o.relid::pg_catalog.oid::pg_catalog.text",
					false, 0) != SPI_OK_DELETE_RETURNING)
		elog(ERROR, "could not update idempotency.outbox_partitions");
	for (uint64 i = 0; i < SPI_processed; i++)
		idem_report_action(r->rep, "forget missing partition",
						   SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1));
}

static OutboxPartition *
read_partitions(int *n)
{
	OutboxPartition *parts;

	if (SPI_execute("SELECT relid::pg_catalog.oid, lower, upper FROM idempotency.outbox_partitions"
					" ORDER BY lower", true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read idempotency.outbox_partitions");
	*n = (int) SPI_processed;
	parts = palloc(sizeof(OutboxPartition) * Max(*n, 1));
	for (int i = 0; i < *n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		isnull;

		parts[i].relid = DatumGetObjectId(SPI_getbinval(tup, desc, 1, &isnull));
		parts[i].lower = DatumGetTimestampTz(SPI_getbinval(tup, desc, 2, &isnull));
		parts[i].upper = DatumGetTimestampTz(SPI_getbinval(tup, desc, 3, &isnull));
	}
	return parts;
}

/* The newest created_at in the default partition, or DT_NOBEGIN. */
static TimestampTz
default_newest(void)
{
	bool		isnull;
	Datum		v;

	if (SPI_execute("SELECT max(created_at) FROM idempotency.outbox_events_default",
					true, 0) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read idempotency.outbox_events_default");
	v = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return isnull ? DT_NOBEGIN : DatumGetTimestampTz(v);
}

typedef struct CreateCall
{
	OutboxRound *r;
	TimestampTz lower;
	TimestampTz upper;
	const char *name;
} CreateCall;

static bool
create_one(void *arg)
{
	CreateCall *c = arg;
	Oid			types[3] = {TEXTOID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[3];

	idem_exec_ddl_as_data(psprintf("CREATE TABLE %s (LIKE %s.outbox_events INCLUDING ALL)",
								   c->name, IDEM_SCHEMA));
	idem_exec_ddl_as_data(psprintf("ALTER TABLE %s.outbox_events ATTACH PARTITION %s"
								   " FOR VALUES FROM (%s) TO (%s)",
								   IDEM_SCHEMA, c->name,
								   timestamp_literal(c->lower), timestamp_literal(c->upper)));
	values[0] = CStringGetTextDatum(c->name);
	values[1] = TimestampTzGetDatum(c->lower);
	values[2] = TimestampTzGetDatum(c->upper);
	idem_spi_exec("INSERT INTO idempotency.outbox_partitions (relid, lower, upper)"
				  " VALUES ($1::pg_catalog.regclass, $2, $3)",
				  3, types, values, SPI_OK_INSERT);
	idem_report_action(c->r->rep, "create", c->name);
	return true;
}

/*
 * Make sure partitions cover [start of the current interval, now + premake
 * intervals), following the newest one without a gap.  Never a range that
 * overlaps events the default partition took while maintenance lagged.
 * Not while CREATE EXTENSION runs: a restore brings its own partitions,
 * and until the first round the default partition takes every event.
 */
static void
ensure_partitions(OutboxRound *r, OutboxPartition *parts, int n)
{
	int64		iv = r->s->interval;
	TimestampTz next = idem_next_boundary(r->now, iv);
	TimestampTz cursor = next - iv * USECS_PER_SEC;
	TimestampTz horizon = r->now + iv * r->s->premake * USECS_PER_SEC;
	TimestampTz lagged;

	if (creating_extension)
		return;
	if (cursor > r->now)
		cursor -= iv * USECS_PER_SEC;
	if (n > 0 && parts[n - 1].upper > cursor)
		cursor = parts[n - 1].upper;
	lagged = default_newest();
	if (lagged != DT_NOBEGIN && lagged >= cursor)
		cursor = idem_next_boundary(lagged, iv);

	while (cursor < horizon)
	{
		CreateCall	call = {r, cursor, cursor + iv * USECS_PER_SEC, NULL};

		call.name = idem_partition_name(OUTBOX_PARTITION_PREFIX, cursor);
		if (!idem_run_guarded(r->rep, "create", call.name, create_one, &call))
			break;
		cursor = call.upper;
	}
}

static bool
partition_pinned(Oid relid)
{
	Oid			types[1] = {REGCLASSOID};
	Datum		values[1] = {ObjectIdGetDatum(relid)};
	bool		isnull;

	if (SPI_execute_with_args("SELECT idempotency.outbox_partition_pinned($1)",
							  1, types, values, NULL, true, 0) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not check outbox partition %u", relid);
	return DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
}

/* Lock a relation AccessExclusive if it is free now or within half a second. */
static bool
try_lock_exclusive(Oid relid)
{
	for (int i = 0; i < DROP_LOCK_TRIES; i++)
	{
		if (ConditionalLockRelationOid(relid, AccessExclusiveLock))
			return true;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(DROP_LOCK_PAUSE_USECS);
	}
	return false;
}

typedef struct DropCall
{
	OutboxRound *r;
	OutboxPartition *p;
	const char *name;
} DropCall;

static bool
drop_one(void *arg)
{
	DropCall   *c = arg;
	Oid			types[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(c->p->relid)};

	if (partition_pinned(c->p->relid))
	{
		idem_report_action(c->r->rep, "keep (pinned)", c->name);
		return false;
	}
	/* the partition first, as DROP TABLE would, then the parent */
	if (!try_lock_exclusive(c->p->relid) || !try_lock_exclusive(c->r->parent))
	{
		idem_report_action(c->r->rep, "skip drop (in use)", c->name);
		return false;
	}
	idem_spi_exec("DELETE FROM idempotency.outbox_partitions WHERE relid = $1",
				  1, types, values, SPI_OK_DELETE);
	idem_exec_ddl_as_data(psprintf("DROP TABLE %s", c->name));
	idem_report_action(c->r->rep, "drop", c->name);
	return true;
}

/* Drop the partitions past their retention that nothing pins. */
static void
drop_expired(OutboxRound *r, OutboxPartition *parts, int n)
{
	for (int i = 0; i < n; i++)
	{
		OutboxPartition *p = &parts[i];
		char	   *relname = get_rel_name(p->relid);
		DropCall	call = {r, p, NULL};

		if (relname == NULL || p->upper + r->s->retention * USECS_PER_SEC > r->now)
			continue;
		call.name = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
		(void) idem_run_guarded(r->rep, "drop", call.name, drop_one, &call);
	}
}

/*
 * The outbox's part of a maintenance round; the caller holds the
 * maintenance lock, is connected to SPI and has pinned search_path.
 */
void
idem_outbox_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now)
{
	OutboxRound r = {rep, s, now, idem_internal_relid("outbox_events")};
	OutboxPartition *parts;
	int			n;

	forget_missing(&r);
	parts = read_partitions(&n);
	ensure_partitions(&r, parts, n);
	drop_expired(&r, parts, n);
}
