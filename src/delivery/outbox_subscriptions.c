/*-------------------------------------------------------------------------
 *
 * outbox_subscriptions.c
 *	  Named subscriptions to the outbox: idem_outbox_subscribe(),
 *	  idem_outbox_unsubscribe(), and the subscription each relay or
 *	  operator call works for.
 *
 * Any number of subscriptions read the one event log; none copies an
 * event.  Each has, in rows of its own id, a deliveries row per aggregate
 * (progress, lease, attempts, parking), a cursor and dead letters
 * (sql/tables/40_outbox.sql), so everything outbox.c says of "the"
 * delivery state holds per subscription.  The relay functions name theirs
 * (argument subscription, 'default' when left out); outbox_exec() appends
 * its id to every statement on those rows.
 *
 * Start.  'earliest' reads every event still stored: its relays make each
 * aggregate's row when they first meet it, from nothing delivered.  'now'
 * reads what commits from its subscription on (and possibly a little that
 * committed just before): it makes a row for every aggregate there is,
 * delivered up to the newest seq it sees, and starts its cursor at the
 * xmin of a snapshot taken before that -- every event of a transaction
 * below that xmin is visible to the copy, hence covered, and every event
 * that commits later comes from a transaction at or above it.
 *
 * Ids.  'default' is always id 0 (CREATE EXTENSION makes it, and a dump
 * leaves it out, so a restore does not make it twice); every other
 * subscription gets a new id that is never reused.
 *
 * Detaching.  Maintenance detaches a subscription that keeps a partition
 * past idempotency.outbox_max_lag (idempotency.outbox_detach_lagging()):
 * it pins nothing from then on and its calls fail (55000) until it is
 * unsubscribed.
 *
 * Locking rules:
 *	- subscribe and unsubscribe take SHARE ROW EXCLUSIVE on
 *	  outbox_subscriptions, so they run one at a time.
 *	- every call that works for a subscription holds a ShareLock on its
 *	  name (an advisory locktag, IDEM_LOCKTAG_SUBSCRIPTION, which no SQL
 *	  advisory lock can take) to the end of its transaction, taken before
 *	  it reads the subscription; subscribe and unsubscribe take it
 *	  Exclusive.  So unsubscribe waits for the transactions of the relays
 *	  in flight (under lock_timeout) and then deletes every row they made,
 *	  and a call after it waits for its commit and finds no subscription.
 *	  A lock, not a row lock on the subscription: that would make every
 *	  claim write the row.  A relay in REPEATABLE READ reads the
 *	  subscription from its snapshot: rows it makes after an unsubscribe
 *	  belong to no subscription (ids are never reused) and count for
 *	  nothing.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/outbox.h"

#include "common/args.h"
#include "common/capabilities.h"
#include "common/clock.h"
#include "common/ownership.h"
#include "common/spi.h"

#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_outbox_subscribe);
PG_FUNCTION_INFO_V1(idem_outbox_unsubscribe);

typedef enum
{
	SS_FIND,
	SS_LOCK,
	SS_INSERT,
	SS_CURSOR,
	SS_FROM_NOW,
	SS_DROP,
	NUM_SUB_STATEMENTS
} SubscriptionStatement;

static const IdemStatement subscription_plans[NUM_SUB_STATEMENTS] = {
	[SS_FIND] = {
		"SELECT id, aggregate_types, dead_policy, detached_at, detach_reason, start"
		" FROM idempotency.outbox_subscriptions WHERE name = $1 COLLATE \"C\"",
		1, {TEXTOID}
	},
	[SS_LOCK] = {
		"LOCK TABLE idempotency.outbox_subscriptions IN SHARE ROW EXCLUSIVE MODE", 0, {0}
	},
	[SS_INSERT] = {
		"INSERT INTO idempotency.outbox_subscriptions"
		" (id, name, aggregate_types, dead_policy, start, created_at)"
		" VALUES (CASE WHEN $1 = 'default' THEN 0"
		"              ELSE pg_catalog.nextval('idempotency.outbox_subscription_ids') END,"
		"         $1, $2, $3, $4, $5)"
		" RETURNING id",
		5, {TEXTOID, TEXTARRAYOID, TEXTOID, TEXTOID, TIMESTAMPTZOID}
	},
	/* 'now': from the xmin of this statement's snapshot; 'earliest': from 0 */
	[SS_CURSOR] = {
		"INSERT INTO idempotency.outbox_cursor (subscription, position, event_id)"
		" SELECT $1, CASE WHEN $2 THEN pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())"
		"                 ELSE '0' END,"
		"        '00000000-0000-0000-0000-000000000000'",
		2, {INT4OID, BOOLOID}
	},
	/* 'now', after the cursor: every aggregate there is, delivered up to its newest seq (its rows' or its counter's) */
	[SS_FROM_NOW] = {
		"INSERT INTO idempotency.outbox_deliveries (subscription, aggregate_type, aggregate_id, acked_seq)"
		" SELECT $1, a.t, a.i, max(a.s)"
		" FROM (SELECT s.aggregate_type, s.aggregate_id, s.last_seq FROM idempotency.outbox_sequences s"
		"       UNION ALL"
		"       SELECT e.aggregate_type, e.aggregate_id, max(e.seq) FROM idempotency.outbox_events e"
		"       GROUP BY e.aggregate_type, e.aggregate_id) a(t, i, s)"
		" WHERE $2::text[] IS NULL OR a.t = ANY ($2::text[])"
		" GROUP BY a.t, a.i",
		2, {INT4OID, TEXTARRAYOID}
	},
	[SS_DROP] = {
		"WITH b AS (DELETE FROM idempotency.outbox_subscriptions WHERE id = $1),"
		" d AS (DELETE FROM idempotency.outbox_deliveries WHERE subscription = $1),"
		" x AS (DELETE FROM idempotency.outbox_dead_letters WHERE subscription = $1)"
		" DELETE FROM idempotency.outbox_cursor WHERE subscription = $1",
		1, {INT4OID}
	},
};

static SPIPlanPtr prepared[NUM_SUB_STATEMENTS];

static uint64
sub_exec(SubscriptionStatement st, Datum *values, const char *nulls, int expected)
{
	return idem_statement_exec(&subscription_plans[st], &prepared[st], values, nulls, expected);
}

/* the subscription of the call in progress */
static OutboxSubscription current = {-1, NULL, -1, NULL, 0, -1};

int32
outbox_subscription_id(void)
{
	Assert(current.id >= 0);
	return current.id;
}

int
outbox_subscription_dead_policy(void)
{
	return current.dead_policy >= 0 ? current.dead_policy : outbox_dead_policy;
}

bool
outbox_subscription_covers(const OutboxSubscription *sub, const char *type)
{
	if (sub->ntypes < 0)
		return true;
	for (int i = 0; i < sub->ntypes; i++)
		if (strcmp(sub->types[i], type) == 0)
			return true;
	return false;
}

static int
policy_value(const char *policy)
{
	if (strcmp(policy, "block") == 0)
		return DEAD_BLOCK;
	if (strcmp(policy, "skip") == 0)
		return DEAD_SKIP;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("dead_policy must be \"block\" or \"skip\"")));
	return -1;					/* keep the compiler quiet */
}

/* A text[] as C strings, in memory of the caller's context. */
static int
text_array_names(Datum arr, char ***names)
{
	Datum	   *elems;
	bool	   *nulls;
	int			n;

	deconstruct_array(DatumGetArrayTypeP(arr), TEXTOID, -1, false, TYPALIGN_INT,
					  &elems, &nulls, &n);
	*names = palloc(sizeof(char *) * Max(n, 1));
	for (int i = 0; i < n; i++)
		(*names)[i] = TextDatumGetCString(elems[i]);
	return n;
}

/* Lock a subscription's name, to the end of the transaction (see the banner). */
static void
lock_name(const char *name, LOCKMODE mode)
{
	LOCKTAG		tag;
	uint64		h = hash_bytes_extended((const unsigned char *) name, strlen(name), 0);

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 IDEM_LOCKTAG_SUBSCRIPTION);
	(void) LockAcquire(&tag, mode, false, false);
}

/*
 * Read the subscription named "name" into *sub (memory of the caller's
 * context); false if there is none.
 */
static bool
find_subscription(const char *name, OutboxSubscription *sub, char **detach_reason,
				  char **start)
{
	Datum		v = CStringGetTextDatum(name);
	bool		isnull;
	Datum		col;

	if (sub_exec(SS_FIND, &v, NULL, SPI_OK_SELECT) != 1)
		return false;
	sub->id = DatumGetInt32(idem_spi_col(0, 1, &isnull));
	sub->name = name;
	col = idem_spi_col(0, 2, &isnull);
	sub->ntypes = -1;
	if (!isnull)
	{
		sub->types_array = SPI_datumTransfer(col, false, -1);
		sub->ntypes = text_array_names(sub->types_array, &sub->types);
	}
	col = idem_spi_col(0, 3, &isnull);
	sub->dead_policy = isnull ? -1 : policy_value(TextDatumGetCString(col));
	col = idem_spi_col(0, 5, &isnull);
	*detach_reason = isnull ? NULL : TextDatumGetCString(col);
	*start = TextDatumGetCString(idem_spi_col(0, 6, &isnull));
	return true;
}

/*
 * The subscription a relay or operator call names in argument argno, made
 * the one that outbox_exec() works for.  Called connected to SPI, as the
 * extension's owner, with the caller's grants g of capability cap (from
 * idem_capability_require_any()): a grant limited to some subscriptions
 * works for those only (42501).  None of that name: 42704; detached: 55000.
 */
const OutboxSubscription *
outbox_subscription_open(FunctionCallInfo fcinfo, int argno, const char *fname, int cap,
						 const IdemCapGrants *g)
{
	char	   *name = idem_name_arg(fcinfo, argno, "subscription", NAMEDATALEN - 1);
	OutboxSubscription *sub = palloc0(sizeof(OutboxSubscription));
	char	   *reason;
	char	   *start;

	idem_capability_check_value(fname, (IdemCapability) cap, g, IDEM_AXIS_SUBSCRIPTION, name);
	lock_name(name, ShareLock);
	if (!find_subscription(name, sub, &reason, &start))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("outbox subscription \"%s\" does not exist", name),
				 errhint("Create it with idem_outbox_subscribe().")));
	if (reason != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox subscription \"%s\" was detached", name),
				 errdetail("It %s.", reason),
				 errhint("Unsubscribe it with idem_outbox_unsubscribe() and subscribe again.")));
	current = *sub;
	return sub;
}

/*
 * The operator's limits on aggregate types cover the subscription's: a
 * limited operator manages only subscriptions to its own types.
 */
static void
check_types_allowed(const char *fname, const IdemCapGrants *g, char **types, int ntypes)
{
	if (!idem_capability_limited(g, IDEM_AXIS_TYPE))
		return;
	if (ntypes < 0)
		idem_capability_check_unlimited(fname, IDEM_CAP_OPERATOR, g);
	for (int i = 0; i < ntypes; i++)
		idem_capability_check_value(fname, IDEM_CAP_OPERATOR, g, IDEM_AXIS_TYPE, types[i]);
}

static bool
same_types(const OutboxSubscription *a, char **types, int ntypes)
{
	if (a->ntypes != ntypes)
		return false;
	for (int i = 0; i < ntypes; i++)
		if (!outbox_subscription_covers(a, types[i]))
			return false;
	return true;
}

/*
 * idem_outbox_subscribe(name, aggregate_types, start, dead_policy): true if
 * it made the subscription; false if one of that name exists just as asked
 * (start aside: it has started).  Another of that name: 42710.
 */
Datum
idem_outbox_subscribe(PG_FUNCTION_ARGS)
{
	char	   *name = idem_name_arg(fcinfo, 0, "name", NAMEDATALEN - 1);
	char	   *start = idem_name_arg(fcinfo, 2, "start", NAMEDATALEN - 1);
	int			dead_policy = PG_ARGISNULL(3) ? -1 :
		policy_value(text_to_cstring(PG_GETARG_TEXT_PP(3)));
	char	  **types = NULL;
	int			ntypes = -1;
	Datum		types_array = (Datum) 0;
	const IdemCapGrants *g;
	OutboxSubscription old;
	char	   *reason;
	char	   *old_start;
	IdemAsOwner as;
	bool		from_now;

	if (strcmp(start, "now") != 0 && strcmp(start, "earliest") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("start must be \"now\" or \"earliest\"")));
	from_now = strcmp(start, "now") == 0;
	if (!PG_ARGISNULL(1))
	{
		Datum	   *elems;

		ntypes = idem_array_arg(fcinfo, 1, "aggregate_types", TEXTOID, &elems);
		if (ntypes == 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("aggregate_types must not be empty"),
					 errhint("Pass NULL for every aggregate type.")));
		types = palloc(sizeof(char *) * ntypes);
		for (int i = 0; i < ntypes; i++)
			types[i] = idem_check_name(DatumGetTextPP(elems[i]), "aggregate type",
									   OUTBOX_MAX_TYPE_BYTES);
		types_array = idem_text_array(types, ntypes);
	}
	g = idem_capability_require_any("idem_outbox_subscribe", IDEM_CAP_OPERATOR);
	check_types_allowed("idem_outbox_subscribe", g, types, ntypes);
	idem_capability_check_value("idem_outbox_subscribe", IDEM_CAP_OPERATOR, g,
								IDEM_AXIS_SUBSCRIPTION, name);

	idem_spi_connect_as_owner(&as);
	(void) sub_exec(SS_LOCK, NULL, NULL, SPI_OK_UTILITY);
	lock_name(name, ExclusiveLock);
	if (find_subscription(name, &old, &reason, &old_start))
	{
		if (reason != NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("outbox subscription \"%s\" was detached", name),
					 errdetail("It %s.", reason),
					 errhint("Unsubscribe it with idem_outbox_unsubscribe() first.")));
		if (!same_types(&old, types, ntypes) || old.dead_policy != dead_policy)
			ereport(ERROR,
					(errcode(ERRCODE_DUPLICATE_OBJECT),
					 errmsg("outbox subscription \"%s\" already exists with other aggregate types or dead policy",
							name)));
		idem_spi_finish_as_owner(&as);
		PG_RETURN_BOOL(false);
	}
	{
		Datum		values[5];
		char		nulls[5] = {' ', ' ', ' ', ' ', ' '};
		bool		isnull;
		int32		id;

		values[0] = CStringGetTextDatum(name);
		values[1] = types_array;
		if (ntypes < 0)
			nulls[1] = 'n';
		values[2] = dead_policy >= 0 ? PG_GETARG_DATUM(3) : (Datum) 0;
		if (dead_policy < 0)
			nulls[2] = 'n';
		values[3] = CStringGetTextDatum(start);
		values[4] = TimestampTzGetDatum(idem_now());
		(void) sub_exec(SS_INSERT, values, nulls, SPI_OK_INSERT_RETURNING);
		id = DatumGetInt32(idem_spi_col(0, 1, &isnull));

		values[0] = Int32GetDatum(id);
		values[1] = BoolGetDatum(from_now);
		(void) sub_exec(SS_CURSOR, values, NULL, SPI_OK_INSERT);
		if (from_now)
		{
			/* a later snapshot than the cursor's: see the banner */
			CommandCounterIncrement();
			values[1] = types_array;
			(void) sub_exec(SS_FROM_NOW, values, nulls, SPI_OK_INSERT);
		}
	}
	idem_spi_finish_as_owner(&as);
	PG_RETURN_BOOL(true);
}

/*
 * idem_outbox_unsubscribe(name): drops the subscription, its progress,
 * cursor and dead letters; false if there was none of that name.  A
 * detached one may be unsubscribed.
 */
Datum
idem_outbox_unsubscribe(PG_FUNCTION_ARGS)
{
	char	   *name = idem_name_arg(fcinfo, 0, "name", NAMEDATALEN - 1);
	const IdemCapGrants *g = idem_capability_require_any("idem_outbox_unsubscribe",
														 IDEM_CAP_OPERATOR);
	OutboxSubscription old;
	char	   *reason;
	char	   *start;
	IdemAsOwner as;
	Datum		id;

	idem_capability_check_value("idem_outbox_unsubscribe", IDEM_CAP_OPERATOR, g,
								IDEM_AXIS_SUBSCRIPTION, name);
	idem_spi_connect_as_owner(&as);
	(void) sub_exec(SS_LOCK, NULL, NULL, SPI_OK_UTILITY);
	lock_name(name, ExclusiveLock);
	if (!find_subscription(name, &old, &reason, &start))
	{
		idem_spi_finish_as_owner(&as);
		PG_RETURN_BOOL(false);
	}
	check_types_allowed("idem_outbox_unsubscribe", g, old.types, old.ntypes);
	id = Int32GetDatum(old.id);
	(void) sub_exec(SS_DROP, &id, NULL, SPI_OK_DELETE);
	idem_spi_finish_as_owner(&as);
	PG_RETURN_BOOL(true);
}
