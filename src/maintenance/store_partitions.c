/*-------------------------------------------------------------------------
 *
 * store_partitions.c
 *	  The stores' step of a maintenance round: create the partitions of the
 *	  outbox's events, the inbox's messages and the requests ahead, give
 *	  them the new width after partition_interval changed, and drop them
 *	  past their retention, never while one holds a row its store pins (an
 *	  undelivered event, say).  Each store has its own retention
 *	  (idem_configure_store(), store_settings.c), else idem_configure's,
 *	  read once per round under the maintenance lock: a partition goes only
 *	  once its upper bound and its newest row are both older than the
 *	  retention in force at the round.  The stores are described in
 *	  delivery/store.c.
 *
 * Locking rules:
 *	- A partition is made as a table of its own and then attached:
 *	  ATTACH PARTITION takes ShareUpdateExclusiveLock on the parent, which
 *	  neither writers (RowExclusiveLock) nor readers (AccessShareLock)
 *	  conflict with.  A writer with a stale cache just uses an older
 *	  partition.
 *	- Dropping a partition takes AccessExclusiveLock on it and on the
 *	  parent.  Both are only tried, a few times over half a second, never
 *	  queued for, and a busy one leaves the drop to a later round.  The
 *	  partitions past their retention are checked first without them; then
 *	  all droppable ones of a store are locked, then its parent, and all are
 *	  dropped at once: writers and readers wait only for the DROPs
 *	  themselves and the commit that follows (the stores' steps come last in
 *	  a round; call idem_maintain() on its own, not inside a longer
 *	  transaction).  A store with a step before its drops (the outbox:
 *	  its aggregates' counters carry the seqs of the newest events that
 *	  go) also has that step's table locked RowExclusiveLock, only if
 *	  free, before any drop.
 *	- Whether a partition holds young rows or is pinned is read before
 *	  those locks, under the latest snapshot, and again once the partition
 *	  is locked: then no writer is in progress there (a prepared one keeps
 *	  its lock until COMMIT PREPARED), so the latest snapshot sees every
 *	  row it will hold.  A writer whose cache knows no newer partition
 *	  (after a long lag, those the round makes are not committed yet) still
 *	  writes into the newest that has begun, even past its retention, and a
 *	  transaction the first check could not see may have committed an
 *	  undelivered row meanwhile: the second check catches both (see
 *	  recheck_locked()).
 *	- Maintenance acts only on partitions that are ours (ownership.c), as
 *	  the extension's owner; its DDL waits at most lock_timeout
 *	  (IDEM_MAINTENANCE_LOCK_TIMEOUT_MS) for the parent, so a role that
 *	  may LOCK a store's table cannot stall the round.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/settings.h"
#include "maintenance/actions.h"
#include "maintenance/store_settings.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "common/catalog.h"
#include "common/clock.h"
#include "common/ownership.h"
#include "common/pg_prng.h"
#include "common/spi.h"
#include "delivery/store.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/* attempts to lock a partition and the parent for a drop, and the pause */
#define DROP_LOCK_TRIES			50
#define DROP_LOCK_PAUSE_USECS	10000L

typedef struct StoreRound
{
	MaintainReport *rep;
	const IdemSettings *s;
	TimestampTz now;
	const StoreDesc *d;
	int64		retention;		/* this store's, in seconds */
	char	   *parent_name;	/* qualified, for reports and DDL */
	Oid			parent;
} StoreRound;

static bool
create_one(void *arg)
{
	IdemCreateCall *c = arg;
	StoreRound *r = c->step;
	Oid			types[4] = {TEXTOID, INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[4];
	int32		bucket;

	const StoreDesc *d = r->d;

	/* a bucket no partition of this store has (the registry says which) */
	for (;;)
	{
		Datum		b;

		bucket = (int32) (pg_prng_uint32(&pg_global_prng_state) % IDEM_STORE_BUCKETS) + 1;
		b = Int32GetDatum(bucket);
		types[0] = INT4OID;
		if (SPI_execute_with_args(psprintf("SELECT FROM %s.%s WHERE bucket = $1",
										   IDEM_SCHEMA, d->registry),
								  1, types, &b, NULL, true, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not read %s.%s", IDEM_SCHEMA, d->registry);
		if (SPI_processed == 0)
			break;
	}
	types[0] = TEXTOID;

	idem_exec_ddl_as_data(psprintf("CREATE TABLE %s (LIKE %s INCLUDING ALL)",
								   c->name, r->parent_name));
	for (int i = 0; i < (int) lengthof(d->indexes) && d->indexes[i] != NULL; i++)
		idem_exec_ddl_as_data(psprintf(d->indexes[i], c->name));
	idem_exec_ddl_as_data(psprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES IN (%d)",
								   r->parent_name, c->name, bucket));
	values[0] = CStringGetTextDatum(c->name);
	values[1] = Int32GetDatum(bucket);
	values[2] = TimestampTzGetDatum(c->lower);
	values[3] = TimestampTzGetDatum(c->upper);
	idem_spi_exec(psprintf("INSERT INTO %s.%s (relid, bucket, lower, upper)"
						   " VALUES ($1::pg_catalog.regclass, $2, $3, $4)",
						   IDEM_SCHEMA, d->registry),
				  4, types, values, SPI_OK_INSERT);
	idem_report_action(r->rep, "create", c->name);
	return true;
}

typedef struct ReshapeCall
{
	StoreRound *r;
	StorePartition *parts;
	int			n;
} ReshapeCall;

static void
set_range(StoreRound *r, StorePartition *p, TimestampTz lower, TimestampTz upper)
{
	Oid			types[3] = {OIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[3];

	values[0] = ObjectIdGetDatum(p->relid);
	values[1] = TimestampTzGetDatum(lower);
	values[2] = TimestampTzGetDatum(upper);
	idem_spi_exec(psprintf("UPDATE %s.%s SET lower = $2, upper = $3 WHERE relid = $1",
						   IDEM_SCHEMA, r->d->registry),
				  3, types, values, SPI_OK_UPDATE);
	p->lower = lower;
	p->upper = upper;
}

/*
 * After partition_interval changed: end the current partition at the next
 * boundary of the new grid and give the premade ones ranges of the new
 * width from there.  A range is only the registry's word on which events a
 * partition takes (emitters follow it through their cache), so this is no
 * DDL; events already in a partition keep it for the retention after the
 * newest of them.
 */
static StorePartition *
current_partition(StoreRound *r, StorePartition *parts, int n)
{
	StorePartition *cur = NULL;

	for (int i = 0; i < n; i++)
		if (parts[i].lower <= r->now && r->now < parts[i].upper &&
			(cur == NULL || parts[i].lower > cur->lower))
			cur = &parts[i];
	return cur;
}

/* The current partition is wider than the setting and reaches past the grid. */
static bool
current_too_long(StoreRound *r, StorePartition *cur)
{
	int64		iv = r->s->interval * USECS_PER_SEC;

	return cur != NULL && cur->upper - cur->lower != iv &&
		cur->upper > idem_next_boundary(r->now, r->s->interval);
}

/* A premade partition has another width than the setting. */
static bool
premade_misshapen(StoreRound *r, StorePartition *parts, int n)
{
	int64		iv = r->s->interval * USECS_PER_SEC;

	for (int i = 0; i < n; i++)
		if (parts[i].lower > r->now && parts[i].upper - parts[i].lower != iv)
			return true;
	return false;
}

static bool
reshape_one(void *arg)
{
	ReshapeCall *c = arg;
	StoreRound *r = c->r;
	int64		iv = r->s->interval * USECS_PER_SEC;
	StorePartition *cur = current_partition(r, c->parts, c->n);
	TimestampTz cursor;

	if (current_too_long(r, cur))
		set_range(r, cur, cur->lower, idem_next_boundary(r->now, r->s->interval));
	cursor = cur != NULL ? cur->upper : idem_next_boundary(r->now, r->s->interval);
	if (premade_misshapen(r, c->parts, c->n))
	{
		/* parts are sorted by lower: the premade ones follow in order */
		for (int i = 0; i < c->n; i++)
		{
			StorePartition *p = &c->parts[i];

			if (p->lower <= r->now)
				continue;
			set_range(r, p, cursor, cursor + iv);
			cursor += iv;
		}
	}
	idem_report_action(r->rep, "reshape", r->parent_name);
	return true;
}

/* Does the current or a premade partition have another width than the setting? */
static bool
needs_reshape(StoreRound *r, StorePartition *parts, int n)
{
	return current_too_long(r, current_partition(r, parts, n)) ||
		premade_misshapen(r, parts, n);
}

/*
 * Make sure partitions cover [start of the current interval, now + premake
 * intervals), following the newest one without a gap (after a lag the new
 * ones start at the current interval: the newest took the events between).
 */
static void
ensure_partitions(StoreRound *r, StorePartition *parts, int n)
{
	int64		iv = r->s->interval;
	TimestampTz next = idem_next_boundary(r->now, iv);
	TimestampTz cursor = next - iv * USECS_PER_SEC;
	TimestampTz horizon = r->now + iv * r->s->premake * USECS_PER_SEC;

	if (cursor > r->now)
		cursor -= iv * USECS_PER_SEC;
	for (int i = 0; i < n; i++)
		if (parts[i].upper > cursor)
			cursor = parts[i].upper;

	while (cursor < horizon)
	{
		IdemCreateCall call = {r, cursor, cursor + iv * USECS_PER_SEC, NULL};

		call.name = idem_partition_name(r->d->name, cursor);
		if (!idem_run_guarded(r->rep, "create", call.name, create_one, &call))
			break;
		cursor = call.upper;
	}
}

/*
 * The newest event of a partition (DT_NOBEGIN if empty).  Events that went
 * in after its upper bound (while maintenance lagged) come from the newest
 * transactions in it, so the last ones by (txid, id) are enough to look at.
 */
static TimestampTz
partition_newest(const StoreDesc *d, const char *name)
{
	bool		isnull;
	Datum		v;

	if (SPI_execute(psprintf(d->newest, name), true, 0) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read %s", name);
	v = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return isnull ? DT_NOBEGIN : DatumGetTimestampTz(v);
}

static bool
partition_pinned(const StoreDesc *d, Oid relid)
{
	Oid			types[1] = {REGCLASSOID};
	Datum		values[1] = {ObjectIdGetDatum(relid)};
	bool		isnull;

	if (SPI_execute_with_args(psprintf("SELECT %s.%s($1)", IDEM_SCHEMA, d->pinned),
							  1, types, values, NULL, true, 0) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not check %s partition %u", d->name, relid);
	/* NULL: the function does not know it as a partition; keep it, to be safe */
	return DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull)) ||
		isnull;
}

/* Lock a relation in mode if it is free now or within half a second. */
static bool
try_lock_mode(Oid relid, LOCKMODE mode)
{
	for (int i = 0; i < DROP_LOCK_TRIES; i++)
	{
		if (ConditionalLockRelationOid(relid, mode))
			return true;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(DROP_LOCK_PAUSE_USECS);
	}
	return false;
}

static bool
try_lock_exclusive(Oid relid)
{
	return try_lock_mode(relid, AccessExclusiveLock);
}

typedef struct DropCall
{
	StoreRound *r;
	StorePartition *p;
	const char *name;
	bool		droppable;
	Datum		seen_xmin;		/* xid8: the first check's snapshot's xmin */
} DropCall;

/* Is the boolean setting name on (for this session)? */
static bool
setting_on(const char *name)
{
	bool		on = true;

	(void) parse_bool(GetConfigOption(name, false, false), &on);
	return on;
}

/* Do pins keep this store's partitions? */
static bool
pins_count(const StoreDesc *d)
{
	/* a setting that lets rows be dropped counts only from a trusted caller */
	return d->pinned != NULL &&
		(d->keep_pinned == NULL || setting_on(d->keep_pinned) || !idem_round_caller_trusted());
}

/* Has the partition a row younger than the retention (under the active snapshot)? */
static bool
has_young_rows(DropCall *c)
{
	return partition_newest(c->r->d, c->name) >
		c->r->now - c->r->retention * USECS_PER_SEC;
}

/* xmin of the active snapshot, as xid8: every xid it cannot see is at least that */
static Datum
active_snapshot_xmin(void)
{
	bool		isnull;

	if (SPI_execute("SELECT pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())",
					true, 0) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the snapshot's xmin");
	return SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
}

/* Has the partition a row of a transaction the first check could not see? */
static bool
written_since(DropCall *c)
{
	Oid			types[1] = {XID8OID};
	bool		isnull;

	if (SPI_execute_with_args(psprintf(c->r->d->written_since, c->name), 1, types,
							  &c->seen_xmin, NULL, true, 0) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not read %s", c->name);
	return DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
}

/*
 * A pinned partition that ended longer ago than the store's detach_after
 * setting allows: detach whoever pins it (only a trusted caller's setting
 * counts, as for keep_pinned), one action each.  True if any was.
 */
static bool
detach_lagging(DropCall *c)
{
	const StoreDesc *d = c->r->d;
	Oid			types[3] = {REGCLASSOID, TEXTOID, TIMESTAMPTZOID};
	Datum		values[3];
	bool		any = false;

	if (d->detach == NULL || !idem_round_caller_trusted())
		return false;
	values[0] = ObjectIdGetDatum(c->p->relid);
	values[1] = CStringGetTextDatum(GetConfigOption(d->detach_after, false, false));
	values[2] = TimestampTzGetDatum(c->r->now);
	if (SPI_execute_with_args(psprintf("SELECT %s.%s($1, $2::pg_catalog.interval, $3)",
									   IDEM_SCHEMA, d->detach),
							  3, types, values, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not detach what pins %s", c->name);
	for (uint64 r = 0; r < SPI_processed; r++)
	{
		bool		isnull;
		Datum		v = SPI_getbinval(SPI_tuptable->vals[r], SPI_tuptable->tupdesc, 1, &isnull);

		if (isnull)
			continue;
		idem_report_action(c->r->rep, "detach subscription", TextDatumGetCString(v));
		any = true;
	}
	/* the pins are read again: under the active snapshot, which must see this */
	if (any)
	{
		CommandCounterIncrement();
		UpdateActiveSnapshotCommandId();
	}
	return any;
}

/*
 * The first check, with no lock beyond AccessShareLock: no row younger than
 * the retention, nothing pinned.  Under the latest snapshot (a caller in
 * REPEATABLE READ must not decide from an old one), whose xmin is kept for
 * the second check.
 */
static bool
check_one(void *arg)
{
	DropCall   *c = arg;

	PushActiveSnapshot(GetLatestSnapshot());
	c->seen_xmin = active_snapshot_xmin();
	c->droppable = !has_young_rows(c);
	if (c->droppable && pins_count(c->r->d) && partition_pinned(c->r->d, c->p->relid) &&
		!(detach_lagging(c) && !partition_pinned(c->r->d, c->p->relid)))
	{
		idem_report_action(c->r->rep, "keep (pinned)", c->name);
		c->droppable = false;
	}
	PopActiveSnapshot();
	return c->droppable;
}

/*
 * The second check, holding the partition's AccessExclusiveLock: no writer
 * is in progress there now (a prepared one keeps its lock until COMMIT
 * PREPARED), so the latest snapshot sees every row it will ever hold.  Rows
 * may have come since the first check: from a writer whose cache knows no
 * newer partition (those this round made are not committed yet), or from
 * a transaction the first check's snapshot could not see, committed (or
 * prepared, then committed) while the round waited.  So: its newest row
 * again, and the pins again -- for the outbox only over the rows of those
 * transactions (an index probe on txid: readers wait on this lock), for
 * the inbox whole (its pin is an index probe).
 */
static bool
recheck_locked(DropCall *c)
{
	const StoreDesc *d = c->r->d;
	bool		ok = true;

	PushActiveSnapshot(GetLatestSnapshot());
	if (has_young_rows(c))
		ok = false;
	else if (pins_count(d) &&
			 (d->written_since != NULL ? written_since(c) : partition_pinned(d, c->p->relid)))
	{
		idem_report_action(c->r->rep, "keep (written since checked)", c->name);
		ok = false;
	}
	PopActiveSnapshot();
	return ok;
}

typedef struct DropBatch
{
	StoreRound *r;
	DropCall   *calls;
	int			n;
} DropBatch;

/*
 * Drop the partitions found droppable, together: each is locked first (a
 * busy one waits for a later round), then the parent, held only from here
 * to the end of the round's transaction, which this step ends.
 */
static bool
drop_batch(void *arg)
{
	DropBatch  *b = arg;
	Oid			types[1] = {OIDOID};
	int			locked = 0;

	for (int i = 0; i < b->n; i++)
	{
		DropCall   *c = &b->calls[i];

		if (!c->droppable)
			continue;
		if (!try_lock_exclusive(c->p->relid))
		{
			idem_report_action(b->r->rep, "skip drop (in use)", c->name);
			c->droppable = false;
			continue;
		}

		if (!recheck_locked(c))
		{
			c->droppable = false;
			continue;
		}
		locked++;
	}
	if (locked == 0)
		return false;
	/*
	 * The store's step before a drop writes a table of its own (the
	 * outbox's counters): taken only if free, like the others, so that a
	 * writer holding it (a bulk emit) never waits for the drop's locks
	 * while the drop waits for it.
	 */
	if (!try_lock_exclusive(b->r->parent) ||
		(b->r->d->before_drop_table != NULL &&
		 !try_lock_mode(idem_internal_relid(b->r->d->before_drop_table), RowExclusiveLock)))
	{
		for (int i = 0; i < b->n; i++)
			if (b->calls[i].droppable)
				idem_report_action(b->r->rep, "skip drop (in use)", b->calls[i].name);
		return false;
	}
	for (int i = 0; i < b->n; i++)
	{
		DropCall   *c = &b->calls[i];
		Datum		values[1] = {ObjectIdGetDatum(c->p->relid)};

		if (!c->droppable)
			continue;
		if (b->r->d->before_drop != NULL)
			idem_spi_exec(psprintf(b->r->d->before_drop, c->name), 0, NULL, NULL, SPI_OK_INSERT);
		idem_spi_exec(psprintf("DELETE FROM %s.%s WHERE relid = $1",
							   IDEM_SCHEMA, b->r->d->registry),
					  1, types, values, SPI_OK_DELETE);
		idem_exec_ddl_as_data(psprintf("DROP TABLE %s", c->name));
		idem_report_action(b->r->rep, "drop", c->name);
	}
	return true;
}

/* Drop the partitions past their retention that nothing pins. */
static void
drop_expired(StoreRound *r, StorePartition *parts, int n)
{
	DropBatch	b = {r, palloc0(sizeof(DropCall) * Max(n, 1)), 0};

	for (int i = 0; i < n; i++)
	{
		StorePartition *p = &parts[i];
		char	   *relname = get_rel_name(p->relid);
		DropCall   *c = &b.calls[b.n];

		if (relname == NULL || p->upper + r->retention * USECS_PER_SEC > r->now)
			continue;
		c->r = r;
		c->p = p;
		c->name = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
		if (idem_partition_trusted(r->rep, "drop", p->relid, r->parent, c->name))
			(void) idem_run_guarded(r->rep, "drop", c->name, check_one, c);
		b.n++;
	}
	if (b.n > 0)
	{
		idem_debug_wait(psprintf("%s_drop_checked", r->d->name));
		(void) idem_run_guarded(r->rep, "drop", r->parent_name, drop_batch, &b);
	}
}

/* One store's part of a maintenance round. */
static void
maintain_store(MaintainReport *rep, const IdemSettings *s, TimestampTz now,
			   const StoreDesc *d, int64 retention)
{
	StoreRound	r = {rep, s, now, d, retention, NULL, InvalidOid};
	StorePartition *parts;
	int			n;

	/* a database still on an older version may not have this store */
	r.parent = get_relname_relid(d->parent, idem_schema_oid());
	if (!OidIsValid(r.parent))
		return;
	r.parent_name = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(d->parent));
	parts = idem_store_read_partitions(d, &n);
	/* inside CREATE or ALTER EXTENSION: only the first partitions */
	if (creating_extension && n > 0)
		return;

	idem_forget_missing(rep, d->registry);
	parts = idem_store_read_partitions(d, &n);
	if (needs_reshape(&r, parts, n))
	{
		ReshapeCall call = {&r, parts, n};

		(void) idem_run_guarded(rep, "reshape", r.parent_name, reshape_one, &call);
		parts = idem_store_read_partitions(d, &n);
	}
	ensure_partitions(&r, parts, n);
	drop_expired(&r, parts, n);
}

/*
 * The stores' part of a maintenance round, its last step; the caller holds
 * the maintenance lock, is connected to SPI and has pinned search_path.
 */
void
idem_stores_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now)
{
	int64		retention[IDEM_NSTORES];

	/* under the lock idem_configure_store() writes under: what is in force */
	idem_store_retentions(s, GetLatestSnapshot(), retention);
	for (int i = 0; i < IDEM_NSTORES; i++)
		if (idem_stores[i].name != NULL)
			maintain_store(rep, s, now, &idem_stores[i], retention[i]);
}

