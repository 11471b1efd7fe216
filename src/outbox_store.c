/*-------------------------------------------------------------------------
 *
 * outbox_store.c
 *	  The time partitions of idempotency.outbox_events: created ahead and
 *	  dropped past their retention by the maintenance round (retention.c
 *	  calls idem_outbox_maintain()), never while they hold an undelivered or
 *	  dead-lettered event.
 *
 * idempotency.outbox_events is a declarative LIST-partitioned table on
 * "bucket": each partition takes one random bucket, and idempotency.
 * outbox_partitions gives it the time range of the events it takes.  So
 * emitters insert through the parent (a publication with
 * publish_via_partition_root covers partitions made later), and partitions
 * restored from a dump never clash with those CREATE EXTENSION made in the
 * target.  Emitters choose the partition from a per-backend cache of the
 * registry, dropped by the registry's invalidation trigger: the one whose
 * range covers the time, else (maintenance lagging) the newest that has
 * begun, so an event always has a partition.  Each partition carries its
 * own indexes (the parent has none, so that pg_restore can attach dumped
 * partitions to the parent the extension made).
 *
 * The partitions follow the settings of the claims store (retention,
 * partition_interval, premake); an outbox partition is kept for the
 * retention after its upper bound or its newest event, whichever is later,
 * and longer while pinned (unless idempotency.outbox_keep_undelivered is
 * off, for change data capture without a relay).
 *
 * Locking rules:
 *	- A partition is made as a table of its own and then attached:
 *	  ATTACH PARTITION takes ShareUpdateExclusiveLock on the parent, which
 *	  neither emitters (RowExclusiveLock) nor relays (AccessShareLock)
 *	  conflict with.  An emitter with a stale cache just uses an older
 *	  partition.
 *	- Dropping a partition takes AccessExclusiveLock on it and on the
 *	  parent.  Both are only tried, a few times over half a second, never
 *	  queued for, and a busy one leaves the drop to a later round.  The
 *	  partitions past their retention are checked first without them; then
 *	  all droppable ones are locked, then the parent, and all are dropped at
 *	  once as the round's last step: emitters and relays wait only for the
 *	  DROPs themselves and the commit that follows (the outbox's step comes
 *	  last in a round; call idem_maintain() on its own, not inside a longer
 *	  transaction).
 *	- Whether a partition is pinned is read before those locks: only a
 *	  redrive moves an aggregate back, and a partition past its retention
 *	  gets no new events (emitters choose a newer one).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "common/pg_prng.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#define OUTBOX_PARTITION_PREFIX	"outbox"

/* attempts to lock a partition and the parent for a drop, and the pause */
#define DROP_LOCK_TRIES			50
#define DROP_LOCK_PAUSE_USECS	10000L

typedef struct OutboxPartition
{
	Oid			relid;
	int32		bucket;
	TimestampTz lower;
	TimestampTz upper;
} OutboxPartition;

/* the emitters' cache of the registry, newest first */
static OutboxPartition *cached_parts = NULL;
static int	cached_nparts = -1;		/* -1: not read */
static Oid	cached_registry = InvalidOid;
static Oid	cached_parent = InvalidOid;	/* idempotency.outbox_events */

static void
outbox_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == cached_registry)
		cached_nparts = -1;
}

/* Read the registry again at the next emit. */
void
idem_outbox_forget_partitions(void)
{
	cached_nparts = -1;
}

void
idem_outbox_store_init(void)
{
	CacheRegisterRelcacheCallback(outbox_cache_callback, (Datum) 0);
}

typedef struct OutboxRound
{
	MaintainReport *rep;
	const IdemSettings *s;
	TimestampTz now;
	Oid			parent;
} OutboxRound;

static OutboxPartition *
read_partitions(int *n)
{
	OutboxPartition *parts;

	if (SPI_execute("SELECT relid::pg_catalog.oid, bucket, lower, upper"
					" FROM idempotency.outbox_partitions ORDER BY lower, relid::pg_catalog.oid",
					true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read idempotency.outbox_partitions");
	*n = (int) SPI_processed;
	parts = palloc(sizeof(OutboxPartition) * Max(*n, 1));
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
	Oid			types[4] = {TEXTOID, INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[4];
	int32		bucket;

	/* a bucket no partition of this database has (the registry says which) */
	for (;;)
	{
		Datum		b;

		bucket = (int32) (pg_prng_uint32(&pg_global_prng_state) % IDEM_OUTBOX_BUCKETS) + 1;
		b = Int32GetDatum(bucket);
		types[0] = INT4OID;
		if (SPI_execute_with_args("SELECT FROM idempotency.outbox_partitions WHERE bucket = $1",
								  1, types, &b, NULL, true, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not read idempotency.outbox_partitions");
		if (SPI_processed == 0)
			break;
	}
	types[0] = TEXTOID;

	idem_exec_ddl_as_data(psprintf("CREATE TABLE %s (LIKE %s.outbox_events INCLUDING ALL)",
								   c->name, IDEM_SCHEMA));
	idem_exec_ddl_as_data(psprintf("CREATE INDEX ON %s (txid, id)", c->name));
	idem_exec_ddl_as_data(psprintf("CREATE INDEX ON %s (aggregate_type, aggregate_id, seq)", c->name));
	idem_exec_ddl_as_data(psprintf("ALTER TABLE %s.outbox_events ATTACH PARTITION %s"
								   " FOR VALUES IN (%d)", IDEM_SCHEMA, c->name, bucket));
	values[0] = CStringGetTextDatum(c->name);
	values[1] = Int32GetDatum(bucket);
	values[2] = TimestampTzGetDatum(c->lower);
	values[3] = TimestampTzGetDatum(c->upper);
	idem_spi_exec("INSERT INTO idempotency.outbox_partitions (relid, bucket, lower, upper)"
				  " VALUES ($1::pg_catalog.regclass, $2, $3, $4)",
				  4, types, values, SPI_OK_INSERT);
	idem_report_action(c->r->rep, "create", c->name);
	return true;
}

typedef struct ReshapeCall
{
	OutboxRound *r;
	OutboxPartition *parts;
	int			n;
} ReshapeCall;

static void
set_range(OutboxPartition *p, TimestampTz lower, TimestampTz upper)
{
	Oid			types[3] = {OIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[3];

	values[0] = ObjectIdGetDatum(p->relid);
	values[1] = TimestampTzGetDatum(lower);
	values[2] = TimestampTzGetDatum(upper);
	idem_spi_exec("UPDATE idempotency.outbox_partitions SET lower = $2, upper = $3 WHERE relid = $1",
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
static OutboxPartition *
current_partition(OutboxRound *r, OutboxPartition *parts, int n)
{
	OutboxPartition *cur = NULL;

	for (int i = 0; i < n; i++)
		if (parts[i].lower <= r->now && r->now < parts[i].upper &&
			(cur == NULL || parts[i].lower > cur->lower))
			cur = &parts[i];
	return cur;
}

/* The current partition is wider than the setting and reaches past the grid. */
static bool
current_too_long(OutboxRound *r, OutboxPartition *cur)
{
	int64		iv = r->s->interval * USECS_PER_SEC;

	return cur != NULL && cur->upper - cur->lower != iv &&
		cur->upper > idem_next_boundary(r->now, r->s->interval);
}

/* A premade partition has another width than the setting. */
static bool
premade_misshapen(OutboxRound *r, OutboxPartition *parts, int n)
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
	OutboxRound *r = c->r;
	int64		iv = r->s->interval * USECS_PER_SEC;
	OutboxPartition *cur = current_partition(r, c->parts, c->n);
	TimestampTz cursor;

	if (current_too_long(r, cur))
		set_range(cur, cur->lower, idem_next_boundary(r->now, r->s->interval));
	cursor = cur != NULL ? cur->upper : idem_next_boundary(r->now, r->s->interval);
	if (premade_misshapen(r, c->parts, c->n))
	{
		/* parts are sorted by lower: the premade ones follow in order */
		for (int i = 0; i < c->n; i++)
		{
			OutboxPartition *p = &c->parts[i];

			if (p->lower <= r->now)
				continue;
			set_range(p, cursor, cursor + iv);
			cursor += iv;
		}
	}
	idem_report_action(r->rep, "reshape", IDEM_SCHEMA ".outbox_events");
	return true;
}

/* Does the current or a premade partition have another width than the setting? */
static bool
needs_reshape(OutboxRound *r, OutboxPartition *parts, int n)
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
ensure_partitions(OutboxRound *r, OutboxPartition *parts, int n)
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
		CreateCall	call = {r, cursor, cursor + iv * USECS_PER_SEC, NULL};

		call.name = idem_partition_name(OUTBOX_PARTITION_PREFIX, cursor);
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
partition_newest(const char *name)
{
	bool		isnull;
	Datum		v;

	if (SPI_execute(psprintf("SELECT max(created_at) FROM (SELECT created_at FROM %s"
							 " ORDER BY txid DESC, id DESC LIMIT 1000) e", name),
					true, 0) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read %s", name);
	v = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return isnull ? DT_NOBEGIN : DatumGetTimestampTz(v);
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
	bool		droppable;
} DropCall;

/* May the partition go?  Reads it, without locks beyond AccessShareLock. */
static bool
check_one(void *arg)
{
	DropCall   *c = arg;

	if (partition_newest(c->name) > c->r->now - c->r->s->retention * USECS_PER_SEC)
		return false;			/* took events while maintenance lagged */
	if (idem_outbox_keep_undelivered && partition_pinned(c->p->relid))
	{
		idem_report_action(c->r->rep, "keep (pinned)", c->name);
		return false;
	}
	c->droppable = true;
	return true;
}

typedef struct DropBatch
{
	OutboxRound *r;
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
		locked++;
	}
	if (locked == 0)
		return false;
	if (!try_lock_exclusive(b->r->parent))
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
		idem_spi_exec("DELETE FROM idempotency.outbox_partitions WHERE relid = $1",
					  1, types, values, SPI_OK_DELETE);
		idem_exec_ddl_as_data(psprintf("DROP TABLE %s", c->name));
		idem_report_action(b->r->rep, "drop", c->name);
	}
	return true;
}

/* Drop the partitions past their retention that nothing pins. */
static void
drop_expired(OutboxRound *r, OutboxPartition *parts, int n)
{
	DropBatch	b = {r, palloc0(sizeof(DropCall) * Max(n, 1)), 0};

	for (int i = 0; i < n; i++)
	{
		OutboxPartition *p = &parts[i];
		char	   *relname = get_rel_name(p->relid);
		DropCall   *c = &b.calls[b.n];

		if (relname == NULL || p->upper + r->s->retention * USECS_PER_SEC > r->now)
			continue;
		c->r = r;
		c->p = p;
		c->name = psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
		(void) idem_run_guarded(r->rep, "drop", c->name, check_one, c);
		b.n++;
	}
	if (b.n > 0)
		(void) idem_run_guarded(r->rep, "drop", IDEM_SCHEMA ".outbox_events", drop_batch, &b);
}

/*
 * The outbox's part of a maintenance round, its last step; the caller holds
 * the maintenance lock, is connected to SPI and has pinned search_path.
 */
void
idem_outbox_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now)
{
	OutboxRound r = {rep, s, now, InvalidOid};
	OutboxPartition *parts;
	int			n;

	/* a database still on 1.0 (before ALTER EXTENSION UPDATE) has no outbox */
	r.parent = get_relname_relid("outbox_events", idem_schema_oid());
	if (!OidIsValid(r.parent))
		return;
	parts = read_partitions(&n);
	/* inside CREATE or ALTER EXTENSION: only the first partitions */
	if (creating_extension && n > 0)
		return;

	idem_forget_missing(rep, "outbox_partitions");
	parts = read_partitions(&n);
	if (needs_reshape(&r, parts, n))
	{
		ReshapeCall call = {&r, parts, n};

		(void) idem_run_guarded(rep, "reshape", IDEM_SCHEMA ".outbox_events", reshape_one, &call);
		parts = read_partitions(&n);
	}
	ensure_partitions(&r, parts, n);
	drop_expired(&r, parts, n);
}

/*---- the emitters' side ----*/

static int
newest_first(const void *a, const void *b)
{
	const OutboxPartition *pa = a;
	const OutboxPartition *pb = b;

	if (pa->lower != pb->lower)
		return pa->lower > pb->lower ? -1 : 1;
	return pa->relid > pb->relid ? -1 : (pa->relid < pb->relid ? 1 : 0);
}

/* Read the registry into the cache (the caller is connected to SPI). */
static void
load_cache(void)
{
	OutboxPartition *parts;
	int			n;
	MemoryContext old;

	cached_registry = idem_internal_relid("outbox_partitions");
	cached_parent = idem_internal_relid("outbox_events");
	parts = read_partitions(&n);
	qsort(parts, n, sizeof(OutboxPartition), newest_first);
	old = MemoryContextSwitchTo(CacheMemoryContext);
	if (cached_parts != NULL)
		pfree(cached_parts);
	cached_parts = palloc(sizeof(OutboxPartition) * Max(n, 1));
	MemoryContextSwitchTo(old);
	memcpy(cached_parts, parts, sizeof(OutboxPartition) * n);
	cached_nparts = n;
}

/*
 * The partition an event created at "now" goes into: the one whose range
 * covers it (the newest such), else the newest that has begun, else the
 * oldest.  Sets its bucket, its table and the parent (cached with the
 * registry: no catalog look-up per emit).  The caller is connected to SPI.
 */
int32
idem_outbox_target_bucket(TimestampTz now, Oid *relid, Oid *parent)
{
	OutboxPartition *target = NULL;
	OutboxPartition *begun = NULL;

	AcceptInvalidationMessages();
	if (cached_nparts < 0)
		load_cache();
	if (cached_nparts == 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency.outbox_events has no partition"),
				 errhint("Run SELECT idem_maintain() as the owner of the extension.")));
	for (int i = 0; i < cached_nparts && target == NULL; i++)
	{
		OutboxPartition *p = &cached_parts[i];

		if (p->lower <= now && now < p->upper)
			target = p;
		else if (begun == NULL && p->lower <= now)
			begun = p;
	}
	if (target == NULL)
		target = begun != NULL ? begun : &cached_parts[cached_nparts - 1];
	if (relid != NULL)
		*relid = target->relid;
	if (parent != NULL)
		*parent = cached_parent;
	return target->bucket;
}
