/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  The transactional outbox: idem_outbox_emit() writes an event in the
 *	  caller's transaction; relays lease aggregates with idem_outbox_claim()
 *	  and settle them with ack, nack, extend, redrive and discard.
 *
 * Storage (sql/ext/40_outbox.sql): events are insert-only rows in time
 * partitions of idempotency.outbox_events (store.c), written straight
 * into the partition (rows.c); what changes lives apart, in two narrow
 * tables whose updates leave every index alone (HOT):
 *	- outbox_sequences: per aggregate, the seq of its newest event (and of
 *	  its newest stored and unstored one, for the backlog).  An emit
 *	  increments it (an UPDATE; INSERT ... ON CONFLICT DO UPDATE for the
 *	  aggregate's first event, which also makes its deliveries row) and so
 *	  holds its row lock to commit: emits to one aggregate serialise, seq
 *	  follows commit order, and a rollback takes its number back (no gaps).
 *	- outbox_deliveries: per aggregate, acked_seq (delivered up to here),
 *	  the lease, attempts of the head event, retry_at, the dead head and a
 *	  redrive waiting for the lease.
 *
 * An event id (a UUIDv7) carries created_at, the partition's bucket and the
 * emitting transaction, so acks find an event with one index probe.
 *
 * Finding work.  Relays find pending aggregates in two ways:
 *	- the cursor: events are scanned in order of their emitting transaction
 *	  (txid) from idempotency.outbox_cursor.  The cursor may only pass an
 *	  event that is delivered or belongs to a parked aggregate, and never
 *	  passes the xmin of a snapshot taken before the scan: every transaction
 *	  below that has ended, so no event can appear behind the cursor later.
 *	  A cursor value stays valid forever (acked_seq only grows, but for a
 *	  rewind, which parks; a parked aggregate stays parked until it has
 *	  nothing pending), so each relay keeps one in memory and writes it back
 *	  about once a second.  A scan page's rows, candidates and locked rows
 *	  live in a memory context of their own (an SPI level per page), so a
 *	  claim's memory is bounded by its batch and a page, whatever backlog it
 *	  scans.
 *	- parking: an aggregate whose head failed (nack), is dead-lettered, or
 *	  was redriven has retry_at set and is found through the partial index
 *	  on retry_at instead, until it has nothing pending.  Unparking reads
 *	  the newest stored seq under FOR SHARE SKIP LOCKED: with an emit in
 *	  flight (the row is locked) it does not unpark, and leaves the
 *	  aggregate due now instead (the next claim looks again), so it never
 *	  waits for an emitter (which may be a prepared transaction) and never
 *	  leaves a new event behind the cursor.
 *
 * Delivery states.  Every state of a deliveries row has a way out, and the
 * CHECK constraints on the table keep out those that would not:
 *	- idle (no lease, not parked): the cursor finds its pending events;
 *	- leased: the holder's ack of its run, its nack, or expiry (then the
 *	  cursor, or retry_at if parked, finds it: an expired lease counts as
 *	  no lease to every claim);
 *	- parked, due at retry_at (finite): a claim once it is due;
 *	- parked for good (retry_at = infinity): only at a dead head (CHECK),
 *	  which a claim under 'skip', a redrive or a discard ends.  Whatever
 *	  clears a dead head (skip, ack, rewind, discard) makes the aggregate
 *	  due now, so it never stays parked for good without one;
 *	- a dead head is parked and leased to nobody (CHECK);
 *	- a redrive waiting for a live lease (redrive_seq): applied when the
 *	  lease ends, however it ends (CHECK: only beside a lease).
 *
 * Locking rules:
 *	- emit: the aggregate's outbox_sequences row, to commit.  emit_many
 *	  takes those rows in sorted order before writing anything, so two
 *	  batches never wait on each other in a cycle.
 *	- claim: outbox_deliveries rows with FOR UPDATE SKIP LOCKED: a relay
 *	  never waits for another relay; an aggregate locked by one is left to
 *	  it.  ack, nack, redrive and discard lock them (waiting) in sorted
 *	  order.  Relays never lock outbox_sequences except to unpark (FOR
 *	  SHARE SKIP LOCKED, after their deliveries row: they never wait for an
 *	  emitter), and emitters never lock outbox_deliveries, so emitters and
 *	  relays never deadlock.  An emitter may wait for the commit of a relay
 *	  that just unparked its aggregate (the relay's share lock).
 *	- the cursor row is written with SKIP LOCKED: a busy row means another
 *	  relay is moving it.
 *
 * Claims should run in READ COMMITTED: FOR UPDATE of a row that another
 * relay changed after a REPEATABLE READ snapshot is a serialization
 * failure.
 *
 * Wake-ups: an emit under outbox_notify = 'commit' only notes that its
 * transaction (or subtransaction) emitted; the NOTIFY is sent just before
 * the commit (XACT_EVENT_PRE_COMMIT), so a transaction whose emits rolled
 * back sends none, and a transaction that is prepared (PREPARE TRANSACTION,
 * which refuses one with a pending NOTIFY) sends none either: relays find
 * its events by polling once COMMIT PREPARED has run.
 *
 * All SQL runs through generic plans prepared once per backend with
 * search_path pinned to pg_catalog, on schema-qualified names, with the
 * caller's privileges; the direct write of events checks INSERT on
 * idempotency.outbox_events as a routed insert would.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/delivery.h"
#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/rows.h"
#include "delivery/store.h"
#include "delivery/leases.h"

#include "access/table.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "common/hashfn.h"
#include "common/pg_prng.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "replication/message.h"
#include "storage/itemptr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/guc.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"
#include "utils/xid8.h"

PG_FUNCTION_INFO_V1(idem_outbox_emit);
PG_FUNCTION_INFO_V1(idem_outbox_emit_many);
PG_FUNCTION_INFO_V1(idem_outbox_claim);
PG_FUNCTION_INFO_V1(idem_outbox_ack);
PG_FUNCTION_INFO_V1(idem_outbox_nack);
PG_FUNCTION_INFO_V1(idem_outbox_extend);
PG_FUNCTION_INFO_V1(idem_outbox_redrive);
PG_FUNCTION_INFO_V1(idem_outbox_discard);

/* prefix of the logical decoding messages of outbox_mode 'wal' and 'both' */
#define OUTBOX_MESSAGE_PREFIX	"idempotency.outbox"
#define OUTBOX_NOTIFY_CHANNEL	"idempotency_outbox"

/* longest names stored as they are */
#define OUTBOX_MAX_TYPE_BYTES	IDEM_MAX_SCOPE_BYTES
#define OUTBOX_MAX_EVENT_TYPE_BYTES	255

/* most events one claim hands out */
#define OUTBOX_MAX_BATCH		10000

/* rows a claim reads from its cursor at a time */
#define OUTBOX_SCAN_CHUNK		256

/* aggregates a claim locks at first, before it knows how long runs are */
#define OUTBOX_LEASE_GROUP		8

/* how often a relay writes its cursor back */
#define OUTBOX_CURSOR_WRITE_USECS	USECS_PER_SEC

/*---- settings ----*/

typedef enum
{
	DEAD_BLOCK,
	DEAD_SKIP
} OutboxDeadPolicy;

typedef enum
{
	NOTIFY_COMMIT,
	NOTIFY_OFF
} OutboxNotify;

typedef enum
{
	MODE_TABLE,
	MODE_WAL,
	MODE_BOTH
} OutboxMode;

static const struct config_enum_entry dead_policy_options[] = {
	{"block", DEAD_BLOCK, false},
	{"skip", DEAD_SKIP, false},
	{NULL, 0, false}
};

static const struct config_enum_entry notify_options[] = {
	{"commit", NOTIFY_COMMIT, false},
	{"off", NOTIFY_OFF, false},
	{NULL, 0, false}
};

static const struct config_enum_entry mode_options[] = {
	{"table", MODE_TABLE, false},
	{"wal", MODE_WAL, false},
	{"both", MODE_BOTH, false},
	{NULL, 0, false}
};

static int	outbox_max_attempts = 10;
static bool outbox_keep_undelivered = true;
static int	outbox_dead_policy = DEAD_BLOCK;
static int	outbox_notify = NOTIFY_COMMIT;
static int	outbox_mode = MODE_TABLE;

/*---- wake-ups ----*/

/*
 * The outermost transaction nesting level at which an emit that asked for a
 * NOTIFY still stands (0: none).  Emits deeper down count for their level
 * until their subtransaction commits (then for its parent) or aborts (then
 * not at all: every emit that stood was at that level or deeper).
 */
static int	notify_level = 0;

static void
want_notify(void)
{
	int			level = GetCurrentTransactionNestLevel();

	if (notify_level == 0 || level < notify_level)
		notify_level = level;
}

/*
 * Send the NOTIFY of an emitting transaction just before it commits
 * (PreCommit_Notify, later in the commit, queues it); a transaction that is
 * prepared, or aborts, sends none.
 */
static void
outbox_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
			if (notify_level > 0)
			{
				notify_level = 0;
				Async_Notify(OUTBOX_NOTIFY_CHANNEL, "");
			}
			break;
		case XACT_EVENT_PRE_PREPARE:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			notify_level = 0;
			break;
		default:
			break;
	}
}

static void
outbox_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();

	if (notify_level < level)
		return;					/* nothing emitted at this level */
	if (event == SUBXACT_EVENT_COMMIT_SUB)
		notify_level = level - 1;
	else if (event == SUBXACT_EVENT_ABORT_SUB)
		notify_level = 0;
}

void
idem_outbox_init(void)
{
	RegisterXactCallback(outbox_xact_callback, NULL);
	RegisterSubXactCallback(outbox_subxact_callback, NULL);

	DefineCustomIntVariable("idempotency.outbox_max_attempts",
							"Failed attempts after which an outbox event is dead-lettered.",
							NULL,
							&outbox_max_attempts,
							10, 1, 1000,
							PGC_USERSET, 0,
							NULL, NULL, NULL);
	DefineCustomBoolVariable("idempotency.outbox_keep_undelivered",
							 "Whether maintenance keeps outbox partitions that hold undelivered or dead-lettered events.",
							 "Turn off where no relay acks (change data capture reads the events from the WAL).",
							 &outbox_keep_undelivered,
							 true,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_dead_policy",
							 "What a dead-lettered event does to the rest of its aggregate: block or skip.",
							 NULL,
							 &outbox_dead_policy,
							 DEAD_BLOCK, dead_policy_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_notify",
							 "Whether emitting transactions send NOTIFY idempotency_outbox at commit: commit or off.",
							 NULL,
							 &outbox_notify,
							 NOTIFY_COMMIT, notify_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_mode",
							 "Where emitted events go: table, wal (logical decoding messages only) or both.",
							 NULL,
							 &outbox_mode,
							 MODE_TABLE, mode_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
}

/*---- statements ----*/

/*
 * Locked deliveries rows, as read_deliveries() expects them: FROM one of
 * the DELIVERIES_* sources below, which lock rows through LATERAL lookups
 * (an index probe per key, in key order, whatever the statistics say), and
 * bring the newest seq of each aggregate along.  A LATERAL lookup that does
 * not lock carries a LIMIT, so that the planner cannot flatten it into a
 * hash join over the whole table.
 */
#define DELIVERY_COLUMNS \
	"SELECT d.aggregate_type, d.aggregate_id, d.acked_seq, d.leased_seq, d.lease_token," \
	" d.lease_until, d.attempts, d.retry_at, d.dead_seq, d.last_error, d.redrive_seq," \
	" coalesce(s.last_seq, 0), d.row_ctid"
#define DELIVERY_JOIN_SEQUENCES \
	" LEFT JOIN LATERAL (SELECT s.last_seq FROM idempotency.outbox_sequences s" \
	"   WHERE s.aggregate_type = d.aggregate_type AND s.aggregate_id = d.aggregate_id" \
	"   LIMIT 1) s ON true"
/* the rows of the aggregates named by $1 (types) and $2 (ids) that meet cond */
#define DELIVERIES_BY_KEYS(cond, lock) \
	" FROM (SELECT k.t, k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)" \
	"       ORDER BY k.t COLLATE \"C\", k.i COLLATE \"C\") k" \
	" CROSS JOIN LATERAL (SELECT d.ctid AS row_ctid, d.* FROM idempotency.outbox_deliveries d" \
	"   WHERE d.aggregate_type = k.t COLLATE \"C\" AND d.aggregate_id = k.i COLLATE \"C\"" cond \
	"   " lock ") d" DELIVERY_JOIN_SEQUENCES
/* the rows that meet cond, in retry_at order, at most $2, skipping locked ones */
#define DELIVERIES_PARKED(cond) \
	" FROM (SELECT d.ctid AS row_ctid, d.* FROM idempotency.outbox_deliveries d" \
	"   WHERE " cond \
	"     AND (d.lease_until IS NULL OR d.lease_until <= $1)" \
	"     AND ($3::text[] IS NULL OR d.aggregate_type COLLATE \"C\" = ANY ($3::text[]))" \
	"   ORDER BY d.retry_at LIMIT $2 FOR UPDATE SKIP LOCKED) d" DELIVERY_JOIN_SEQUENCES
/*
 * An aggregate's deliveries row is made by the emit that starts it (seq 1),
 * in the emitter's transaction: relays never insert rows that another relay
 * could be inserting too (they would wait on each other's transactions).
 */
#define NEW_DELIVERY_ROW(select) \
	"INSERT INTO idempotency.outbox_deliveries (aggregate_type, aggregate_id)" select \
	" ON CONFLICT DO NOTHING"

/* the new seq is stored ($3) or not ('wal') */
#define NEXT_SEQ \
	"UPDATE idempotency.outbox_sequences SET last_seq = last_seq + 1," \
	" stored_seq = CASE WHEN $3 THEN last_seq + 1 ELSE stored_seq END," \
	" wal_seq = CASE WHEN $3 THEN wal_seq ELSE last_seq + 1 END" \
	" WHERE aggregate_type = $1 COLLATE \"C\" AND aggregate_id = $2 COLLATE \"C\"" \
	" RETURNING last_seq"

typedef enum
{
	ST_EMIT_NEXT_SEQ,
	ST_EMIT_SEQ,
	ST_RESERVE,
	ST_CURSOR_READ,
	ST_CURSOR_WRITE,
	ST_SCAN,
	ST_ENSURE_DELIVERIES,
	ST_LOCK_CANDIDATES,
	ST_PARKED_DUE,
	ST_PARKED_DEAD,
	ST_RUN,
	ST_SET_STATE,
	ST_UNPARK,
	ST_DEAD_LETTER,
	ST_FIND_EVENTS,
	ST_LOCK_DELIVERIES,
	ST_EXTEND,
	ST_FIND_DEAD,
	ST_DELETE_DEAD,
	NUM_STATEMENTS
} OutboxStatement;

static const IdemStatement outbox_plans[NUM_STATEMENTS] = {
	/* an aggregate that has emitted before: a plain (HOT) update of its counter */
	[ST_EMIT_NEXT_SEQ] = {
		NEXT_SEQ, 3, {TEXTOID, TEXTOID, BOOLOID}
	},
	/* otherwise (none updated): make the counter, or take it over from a racer */
	[ST_EMIT_SEQ] = {
		"WITH s AS ("
		" INSERT INTO idempotency.outbox_sequences AS q"
		"  (aggregate_type, aggregate_id, last_seq, stored_seq, wal_seq)"
		" VALUES ($1, $2, 1, CASE WHEN $3 THEN 1 ELSE 0 END, CASE WHEN $3 THEN 0 ELSE 1 END)"
		" ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = q.last_seq + 1,"
		"  stored_seq = CASE WHEN $3 THEN q.last_seq + 1 ELSE q.stored_seq END,"
		"  wal_seq = CASE WHEN $3 THEN q.wal_seq ELSE q.last_seq + 1 END"
		" RETURNING q.last_seq), "
		" d AS (" NEW_DELIVERY_ROW(" SELECT $1, $2 FROM s WHERE s.last_seq = 1") ")"
		" SELECT last_seq FROM s",
		3, {TEXTOID, TEXTOID, BOOLOID}
	},
	/* counts per aggregate, in the (sorted) order given: that is lock order */
	[ST_RESERVE] = {
		"WITH s AS ("
		" INSERT INTO idempotency.outbox_sequences AS q"
		"  (aggregate_type, aggregate_id, last_seq, stored_seq, wal_seq)"
		" SELECT $1, u.id, u.n, CASE WHEN $4 THEN u.n ELSE 0 END, CASE WHEN $4 THEN 0 ELSE u.n END"
		" FROM unnest($2::text[], $3::int8[]) WITH ORDINALITY AS u(id, n, ord)"
		" ORDER BY u.ord"
		" ON CONFLICT (aggregate_type, aggregate_id)"
		" DO UPDATE SET last_seq = q.last_seq + excluded.last_seq,"
		"  stored_seq = CASE WHEN $4 THEN q.last_seq + excluded.last_seq ELSE q.stored_seq END,"
		"  wal_seq = CASE WHEN $4 THEN q.wal_seq ELSE q.last_seq + excluded.last_seq END"
		" RETURNING q.aggregate_id, q.last_seq), "
		" n AS (SELECT u.id, u.n FROM unnest($2::text[], $3::int8[]) AS u(id, n)), "
		" d AS (" NEW_DELIVERY_ROW(" SELECT $1, s.aggregate_id FROM s JOIN n"
								   " ON n.id = s.aggregate_id COLLATE \"C\" WHERE s.last_seq = n.n"
								   " ORDER BY 2") ")"
		" SELECT aggregate_id, last_seq FROM s",
		4, {TEXTOID, TEXTARRAYOID, INT8ARRAYOID, BOOLOID}
	},
	[ST_CURSOR_READ] = {
		"SELECT position, event_id FROM idempotency.outbox_cursor", 0, {0}
	},
	[ST_CURSOR_WRITE] = {
		"UPDATE idempotency.outbox_cursor SET position = $1, event_id = $2"
		" WHERE ctid IN (SELECT ctid FROM idempotency.outbox_cursor"
		"                WHERE (position, event_id) < ($1, $2) FOR UPDATE SKIP LOCKED)",
		2, {XID8OID, UUIDOID}
	},
	/*
	 * A page of events from ($1, $2) on, in scan order.  The constant
	 * LIMIT keeps the plan an ordered merge of the partitions' (txid, id)
	 * indexes, whatever the statistics say about how many rows follow.
	 */
	[ST_SCAN] = {
		"SELECT e.txid, e.aggregate_type, e.aggregate_id, e.seq, e.id, e.event_type,"
		"       e.payload, e.headers, e.created_at, d.acked_seq, d.lease_until, d.retry_at"
		" FROM (SELECT * FROM idempotency.outbox_events e"
		"       WHERE (e.txid, e.id) >= ($1, $2)"
		"       ORDER BY e.txid, e.id LIMIT " CppAsString2(OUTBOX_SCAN_CHUNK) ") e"
		" LEFT JOIN LATERAL (SELECT d.acked_seq, d.lease_until, d.retry_at"
		"   FROM idempotency.outbox_deliveries d"
		"   WHERE d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id"
		"   LIMIT 1) d ON true"
		" ORDER BY e.txid, e.id",
		2, {XID8OID, UUIDOID}
	},
	[ST_ENSURE_DELIVERIES] = {
		"INSERT INTO idempotency.outbox_deliveries (aggregate_type, aggregate_id)"
		" SELECT k.t, k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)"
		" ORDER BY k.t COLLATE \"C\", k.i COLLATE \"C\""
		" ON CONFLICT DO NOTHING",
		2, {TEXTARRAYOID, TEXTARRAYOID}
	},
	[ST_LOCK_CANDIDATES] = {
		DELIVERY_COLUMNS
		DELIVERIES_BY_KEYS(" AND d.retry_at IS NULL AND (d.lease_until IS NULL OR d.lease_until <= $3)",
						   "FOR UPDATE SKIP LOCKED"),
		3, {TEXTARRAYOID, TEXTARRAYOID, TIMESTAMPTZOID}
	},
	[ST_PARKED_DUE] = {
		DELIVERY_COLUMNS DELIVERIES_PARKED("d.retry_at <= $1"),
		3, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID}
	},
	[ST_PARKED_DEAD] = {
		DELIVERY_COLUMNS DELIVERIES_PARKED("d.retry_at = 'infinity' AND d.dead_seq IS NOT NULL"),
		3, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID}
	},
	[ST_RUN] = {
		"SELECT id, event_type, payload, headers, created_at, seq FROM idempotency.outbox_events"
		" WHERE aggregate_type = $1 COLLATE \"C\" AND aggregate_id = $2 COLLATE \"C\" AND seq > $3"
		" ORDER BY seq LIMIT $4",
		4, {TEXTOID, TEXTOID, INT8OID, INT4OID}
	},
	/* rows this transaction holds locked: found by ctid */
	[ST_SET_STATE] = {
		"UPDATE idempotency.outbox_deliveries d"
		" SET acked_seq = u.acked, leased_seq = u.leased, lease_token = u.token,"
		"     lease_until = u.until, attempts = u.attempts, retry_at = u.retry,"
		"     dead_seq = u.dead, last_error = u.err, redrive_seq = u.redrive"
		" FROM unnest($1::tid[], $2::int8[], $3::int8[], $4::uuid[], $5::timestamptz[],"
		"             $6::int4[], $7::timestamptz[], $8::int8[], $9::text[], $10::int8[])"
		"   AS u(row_ctid, acked, leased, token, until, attempts, retry, dead, err, redrive)"
		" WHERE d.ctid = u.row_ctid",
		10, {TIDARRAYOID, INT8ARRAYOID, INT8ARRAYOID, UUIDARRAYOID, TIMESTAMPTZARRAYOID,
			INT4ARRAYOID, TIMESTAMPTZARRAYOID, INT8ARRAYOID, TEXTARRAYOID, INT8ARRAYOID}
	},
	/*
	 * Unpark if nothing stored is pending: the counter's row under FOR SHARE
	 * SKIP LOCKED, so that a committed emit's seq is seen and the next emit
	 * waits for this transaction; an emit in flight (a locked row: NULL)
	 * keeps the aggregate parked, due at $3 at the latest, instead of a
	 * wait.  No counter at all: nothing was ever emitted.
	 */
	[ST_UNPARK] = {
		"UPDATE idempotency.outbox_deliveries d"
		" SET retry_at = CASE"
		"   WHEN d.acked_seq >= (SELECT s.stored_seq FROM idempotency.outbox_sequences s"
		"                        WHERE s.aggregate_type = d.aggregate_type"
		"                          AND s.aggregate_id = d.aggregate_id FOR SHARE SKIP LOCKED)"
		"     OR NOT EXISTS (SELECT FROM idempotency.outbox_sequences s"
		"                    WHERE s.aggregate_type = d.aggregate_type AND s.aggregate_id = d.aggregate_id)"
		"   THEN NULL ELSE greatest(d.retry_at, $3) END"
		" WHERE d.aggregate_type = $1 COLLATE \"C\" AND d.aggregate_id = $2 COLLATE \"C\""
		"   AND d.retry_at IS NOT NULL AND d.dead_seq IS NULL AND d.lease_token IS NULL",
		3, {TEXTOID, TEXTOID, TIMESTAMPTZOID}
	},
	[ST_DEAD_LETTER] = {
		"INSERT INTO idempotency.outbox_dead_letters"
		" (id, aggregate_type, aggregate_id, seq, event_type, payload, headers, created_at,"
		"  attempts, last_error, dead_at)"
		" SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq, e.event_type, e.payload,"
		"        e.headers, e.created_at, $4, $5, $6"
		" FROM idempotency.outbox_events e"
		" WHERE e.aggregate_type = $1 COLLATE \"C\" AND e.aggregate_id = $2 COLLATE \"C\" AND e.seq = $3"
		/* dead again after a rewind: the listing says so */
		" ON CONFLICT (id) DO UPDATE SET attempts = excluded.attempts,"
		"  last_error = excluded.last_error, dead_at = excluded.dead_at",
		6, {TEXTOID, TEXTOID, INT8OID, INT4OID, TEXTOID, TIMESTAMPTZOID}
	},
	/* the ids say their partition and transaction: one (txid, id) probe each */
	[ST_FIND_EVENTS] = {
		"SELECT e.aggregate_type, e.aggregate_id, e.seq"
		" FROM unnest($1::xid8[], $2::uuid[]) AS k(t, i)"
		" CROSS JOIN LATERAL (SELECT e.aggregate_type, e.aggregate_id, e.seq"
		"   FROM idempotency.outbox_events e"
		"   WHERE e.bucket = $3 AND e.txid = k.t AND e.id = k.i LIMIT 1) e",
		3, {XID8ARRAYOID, UUIDARRAYOID, INT4OID}
	},
	[ST_LOCK_DELIVERIES] = {
		DELIVERY_COLUMNS DELIVERIES_BY_KEYS("", "FOR UPDATE"),
		2, {TEXTARRAYOID, TEXTARRAYOID}
	},
	/* no index on lease_token (it would make every claim a non-HOT update) */
	[ST_EXTEND] = {
		"UPDATE idempotency.outbox_deliveries SET lease_until = $2"
		" WHERE lease_token = $1 AND lease_until > $3"
		" RETURNING leased_seq - acked_seq",
		3, {UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
	},
	[ST_FIND_DEAD] = {
		"SELECT x.id, x.aggregate_type, x.aggregate_id, x.seq"
		" FROM idempotency.outbox_dead_letters x WHERE x.id = ANY ($1)"
		" ORDER BY 2, 3, 4 FOR UPDATE",
		1, {UUIDARRAYOID}
	},
	[ST_DELETE_DEAD] = {
		"DELETE FROM idempotency.outbox_dead_letters WHERE id = ANY ($1)",
		1, {UUIDARRAYOID}
	},
};

static SPIPlanPtr prepared[NUM_STATEMENTS];

/* Run a statement (see idem_statement_exec). */
static uint64
outbox_exec(OutboxStatement st, Datum *values, const char *nulls, int expected)
{
	return idem_statement_exec(&outbox_plans[st], &prepared[st], values, nulls, expected);
}

/*---- emitting ----*/

/* what an emit hands the caller and logical decoding */
typedef struct OutboxEvent
{
	pg_uuid_t	id;
	const char *aggregate_type;
	const char *aggregate_id;
	int64		seq;
	const char *event_type;
	Jsonb	   *payload;
	Jsonb	   *headers;
	TimestampTz created_at;
} OutboxEvent;

static void
append_json_string(StringInfo buf, const char *key, const char *value, bool comma)
{
	if (comma)
		appendStringInfoChar(buf, ',');
	escape_json(buf, key);
	appendStringInfoChar(buf, ':');
	escape_json(buf, value);
}

/* The event as a JSON object: the content of its logical decoding message. */
static char *
event_json(const OutboxEvent *ev)
{
	StringInfoData buf;

	initStringInfo(&buf);
	appendStringInfoChar(&buf, '{');
	append_json_string(&buf, "id",
					   DatumGetCString(DirectFunctionCall1(uuid_out, UUIDPGetDatum(&ev->id))),
					   false);
	append_json_string(&buf, "aggregate_type", ev->aggregate_type, true);
	append_json_string(&buf, "aggregate_id", ev->aggregate_id, true);
	appendStringInfo(&buf, ",\"seq\":" INT64_FORMAT, ev->seq);
	append_json_string(&buf, "event_type", ev->event_type, true);
	appendStringInfoString(&buf, ",\"payload\":");
	appendStringInfoString(&buf, JsonbToCString(NULL, &ev->payload->root, VARSIZE(ev->payload)));
	appendStringInfoString(&buf, ",\"headers\":");
	appendStringInfoString(&buf, JsonbToCString(NULL, &ev->headers->root, VARSIZE(ev->headers)));
	/* ISO 8601 in UTC, as to_json() writes it, whatever DateStyle says */
	{
		char		iso[MAXDATELEN + 1];
		int			utc = 0;

		appendStringInfoString(&buf, ",\"created_at\":");
		escape_json(&buf, JsonEncodeDateTime(iso, TimestampTzGetDatum(ev->created_at),
											 TIMESTAMPTZOID, &utc));
	}
	appendStringInfoChar(&buf, '}');
	return buf.data;
}

/* What every emitted event sends besides its row: a message, a wake-up. */
static void
announce_event(const OutboxEvent *ev)
{
	if (outbox_mode != MODE_TABLE)
	{
		char	   *json = event_json(ev);

		(void) LogLogicalMessage(OUTBOX_MESSAGE_PREFIX, json, strlen(json), true);
		pfree(json);
	}
	/* one NOTIFY per emitting transaction, sent at its commit */
	if (outbox_notify == NOTIFY_COMMIT)
		want_notify();
}

/*
 * The first eight columns of both an outbox_events row and an
 * idem_outbox_event: id ... created_at.
 */
static void
event_stored_values(const OutboxEvent *ev, Datum *values)
{
	values[0] = UUIDPGetDatum(&ev->id);
	values[1] = CStringGetTextDatum(ev->aggregate_type);
	values[2] = CStringGetTextDatum(ev->aggregate_id);
	values[3] = Int64GetDatum(ev->seq);
	values[4] = CStringGetTextDatum(ev->event_type);
	values[5] = JsonbPGetDatum(ev->payload);
	values[6] = JsonbPGetDatum(ev->headers);
	values[7] = TimestampTzGetDatum(ev->created_at);
}

/* The columns of idem_outbox_event for one event. */
static void
event_values(const OutboxEvent *ev, int32 attempts, const pg_uuid_t *token,
			 TimestampTz until, Datum *values, bool *nulls)
{
	memset(nulls, 0, sizeof(bool) * 11);
	event_stored_values(ev, values);
	values[8] = Int32GetDatum(attempts);
	if (token != NULL)
	{
		values[9] = UUIDPGetDatum(token);
		values[10] = TimestampTzGetDatum(until);
	}
	else
		nulls[9] = nulls[10] = true;
}

/* The emitting transaction, as stored with each event. */
static FullTransactionId
emitting_transaction(void)
{
	return GetTopFullTransactionId();
}

/* columns of idempotency.outbox_events and its partitions, in order */
#define Natts_outbox_events	10
static const char *const event_column_names[Natts_outbox_events] = {
	"id", "aggregate_type", "aggregate_id", "seq", "event_type", "payload", "headers",
	"created_at", "txid", "bucket"
};

/*
 * Emits write events straight into their partition (rows.c), without an
 * executor: partition routing and executor start-up were most of an emit.
 * Nothing reads the row back, so emitting needs only INSERT on the events.
 */
static Relation
open_target(TimestampTz ts, int32 *bucket)
{
	return idem_store_open_target(IDEM_STORE_OUTBOX, ts, bucket,
								  event_column_names, Natts_outbox_events);
}

/* Write events into rel (from open_target()) and close it. */
static void
insert_events(Relation rel, int32 bucket, FullTransactionId txid, const OutboxEvent *evs, int n)
{
	IdemIndexSet ins;
	Datum		values[Natts_outbox_events];
	bool		nulls[Natts_outbox_events] = {false};

	idem_open_insert_indexes(rel, &ins, "outbox partition");
	for (int i = 0; i < n; i++)
	{
		event_stored_values(&evs[i], values);
		values[8] = FullTransactionIdGetDatum(txid);
		values[9] = Int32GetDatum(bucket);
		idem_insert_row(&ins, values, nulls, InvalidOid);
	}
	idem_close_insert_indexes(&ins);
	table_close(rel, NoLock);
}

Datum
idem_outbox_emit(PG_FUNCTION_ARGS)
{
	OutboxEvent ev;
	TupleDesc	desc = idem_result_tupdesc(fcinfo);
	Datum		values[3];
	uint64		n;
	int32		bucket;
	Relation	rel = NULL;
	FullTransactionId txid;

	ev.aggregate_type = idem_name_arg(fcinfo, 0, "aggregate_type", OUTBOX_MAX_TYPE_BYTES);
	ev.aggregate_id = idem_name_arg(fcinfo, 1, "aggregate_id", IDEM_MAX_KEY_BYTES);
	ev.event_type = idem_name_arg(fcinfo, 2, "event_type", OUTBOX_MAX_EVENT_TYPE_BYTES);
	if (PG_ARGISNULL(3))
		idem_null_argument("payload");
	ev.payload = PG_GETARG_JSONB_P(3);
	ev.headers = PG_ARGISNULL(4) ? idem_empty_object() : idem_check_object(PG_GETARG_JSONB_P(4), "outbox event headers");
	txid = emitting_transaction();
	ev.created_at = idem_row_time(txid);

	SPI_connect();
	if (outbox_mode != MODE_WAL)
		rel = open_target(ev.created_at, &bucket);
	else
		bucket = idem_store_target(IDEM_STORE_OUTBOX, ev.created_at, NULL, NULL);
	idem_row_id(ev.created_at, bucket, txid, &ev.id);
	values[0] = CStringGetTextDatum(ev.aggregate_type);
	values[1] = CStringGetTextDatum(ev.aggregate_id);
	values[2] = BoolGetDatum(outbox_mode != MODE_WAL);
	n = outbox_exec(ST_EMIT_NEXT_SEQ, values, NULL, SPI_OK_UPDATE_RETURNING);
	if (n == 0)
		n = outbox_exec(ST_EMIT_SEQ, values, NULL, SPI_OK_SELECT);
	if (n != 1)
		elog(ERROR, "outbox emit took " UINT64_FORMAT " seqs", n);
	{
		bool		isnull;

		ev.seq = DatumGetInt64(idem_spi_col(0, 1, &isnull));
	}
	SPI_finish();
	if (outbox_mode != MODE_WAL)
		insert_events(rel, bucket, txid, &ev, 1);

	announce_event(&ev);
	{
		Datum		out[11];
		bool		nulls[11];

		event_values(&ev, 0, NULL, 0, out, nulls);
		PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, out, nulls)));
	}
}


/* for sorting a batch's aggregate ids into lock order */
static int
cstring_cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *) a, *(char *const *) b);
}

/* index of name in a sorted array of distinct names (which holds it) */
static int
sorted_index(char **names, int n, const char *name)
{
	char	  **hit = bsearch(&name, names, n, sizeof(char *), cstring_cmp);

	if (hit == NULL)
		elog(ERROR, "outbox: aggregate \"%s\" missing from its batch", name);
	return hit - names;
}

Datum
idem_outbox_emit_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	char	   *aggregate_type = idem_name_arg(fcinfo, 0, "aggregate_type", OUTBOX_MAX_TYPE_BYTES);
	Datum	   *ids;
	Datum	   *types;
	Datum	   *payloads;
	Datum	   *headers = NULL;
	int			n;
	int			nagg = 0;
	char	  **names;			/* distinct aggregate ids, sorted */
	Datum	   *counts;			/* events per aggregate */
	int64	   *next_seq;
	OutboxEvent *evs;
	Jsonb	   *none = idem_empty_object();
	FullTransactionId txid = emitting_transaction();
	TimestampTz now = idem_row_time(txid);
	int32		bucket;
	Relation	rel = NULL;

	InitMaterializedSRF(fcinfo, 0);
	n = idem_array_arg(fcinfo, 1, "aggregate_ids", TEXTOID, &ids);
	if (idem_array_arg(fcinfo, 2, "event_types", TEXTOID, &types) != n ||
		idem_array_arg(fcinfo, 3, "payloads", JSONBOID, &payloads) != n ||
		(!PG_ARGISNULL(4) && idem_array_arg(fcinfo, 4, "headers", JSONBOID, &headers) != n))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("aggregate_ids, event_types, payloads and headers must have the same length")));
	if (n == 0)
		return (Datum) 0;

	/* the events outlive SPI_finish(): made here, not in SPI's memory */
	SPI_connect();
	if (outbox_mode != MODE_WAL)
		rel = open_target(now, &bucket);
	else
		bucket = idem_store_target(IDEM_STORE_OUTBOX, now, NULL, NULL);
	SPI_finish();
	evs = palloc(sizeof(OutboxEvent) * n);
	names = palloc(sizeof(char *) * n);
	for (int i = 0; i < n; i++)
	{
		evs[i].aggregate_type = aggregate_type;
		evs[i].aggregate_id = idem_check_name(DatumGetTextPP(ids[i]), "aggregate_id", IDEM_MAX_KEY_BYTES);
		evs[i].event_type = idem_check_name(DatumGetTextPP(types[i]), "event_type",
									   OUTBOX_MAX_EVENT_TYPE_BYTES);
		evs[i].payload = DatumGetJsonbP(payloads[i]);
		evs[i].headers = headers != NULL ? idem_check_object(DatumGetJsonbP(headers[i]), "outbox event headers") : none;
		evs[i].created_at = i == 0 ? now : idem_row_time(txid);
		idem_row_id(evs[i].created_at, bucket, txid, &evs[i].id);
		names[i] = (char *) evs[i].aggregate_id;
	}

	/* distinct aggregates, sorted: the order their counters are locked in */
	qsort(names, n, sizeof(char *), cstring_cmp);
	counts = palloc(sizeof(Datum) * n);
	for (int i = 0; i < n; i++)
	{
		if (nagg > 0 && strcmp(names[i], names[nagg - 1]) == 0)
		{
			counts[nagg - 1] = Int64GetDatum(DatumGetInt64(counts[nagg - 1]) + 1);
			continue;
		}
		names[nagg] = names[i];
		counts[nagg++] = Int64GetDatum(1);
	}

	next_seq = palloc(sizeof(int64) * nagg);
	SPI_connect();
	{
		Datum		values[4];
		Datum	   *name_datums = palloc(sizeof(Datum) * nagg);
		uint64		got;

		for (int a = 0; a < nagg; a++)
			name_datums[a] = CStringGetTextDatum(names[a]);
		values[0] = CStringGetTextDatum(aggregate_type);
		values[1] = idem_build_array(name_datums, NULL, nagg, TEXTOID);
		values[2] = idem_build_array(counts, NULL, nagg, INT8OID);
		values[3] = BoolGetDatum(outbox_mode != MODE_WAL);
		got = outbox_exec(ST_RESERVE, values, NULL, SPI_OK_SELECT);
		if (got != (uint64) nagg)
			elog(ERROR, "outbox emit reserved " UINT64_FORMAT " counters, not %d", got, nagg);
		for (uint64 r = 0; r < got; r++)
		{
			bool		isnull;
			int			a = sorted_index(names, nagg,
										 TextDatumGetCString(idem_spi_col(r, 1, &isnull)));

			next_seq[a] = DatumGetInt64(idem_spi_col(r, 2, &isnull)) - DatumGetInt64(counts[a]) + 1;
		}
	}
	/* seqs in array order */
	for (int i = 0; i < n; i++)
		evs[i].seq = next_seq[sorted_index(names, nagg, evs[i].aggregate_id)]++;

	SPI_finish();
	if (outbox_mode != MODE_WAL)
		insert_events(rel, bucket, txid, evs, n);

	for (int i = 0; i < n; i++)
	{
		Datum		values[11];
		bool		nulls[11];

		announce_event(&evs[i]);
		event_values(&evs[i], 0, NULL, 0, values, nulls);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/*---- delivery state ----*/

/* One outbox_deliveries row, as locked and as it will be written back. */
typedef struct Delivery
{
	char	   *aggregate_type;
	char	   *aggregate_id;
	int64		acked;
	bool		leased;			/* leased_seq, lease_token, lease_until set */
	int64		leased_seq;
	pg_uuid_t	token;
	TimestampTz until;
	int32		attempts;
	bool		parked;			/* retry_at set */
	TimestampTz retry_at;
	bool		dead;			/* dead_seq set: the head (acked + 1) is dead */
	int64		dead_seq;
	char	   *error;			/* last_error, or NULL */
	bool		redrive;		/* redrive_seq set: waiting for the lease to end */
	int64		redrive_seq;
	int64		last_seq;		/* newest seq, as the locking statement saw it */
	ItemPointerData ctid;		/* of the locked row version */
	bool		changed;
	bool		unpark;			/* try to unpark after writing */
} Delivery;

/* Read the locked rows of a DELIVERY_COLUMNS statement. */
static Delivery *
read_deliveries(uint64 n)
{
	Delivery   *ds = palloc0(sizeof(Delivery) * Max(n, 1));

	for (uint64 r = 0; r < n; r++)
	{
		Delivery   *d = &ds[r];
		bool		isnull;
		Datum		v;

		d->aggregate_type = TextDatumGetCString(idem_spi_col(r, 1, &isnull));
		d->aggregate_id = TextDatumGetCString(idem_spi_col(r, 2, &isnull));
		d->acked = DatumGetInt64(idem_spi_col(r, 3, &isnull));
		v = idem_spi_col(r, 4, &isnull);
		d->leased = !isnull;
		if (d->leased)
		{
			d->leased_seq = DatumGetInt64(v);
			v = idem_spi_col(r, 5, &isnull);
			d->leased = !isnull;
			if (!isnull)
				memcpy(&d->token, DatumGetUUIDP(v), sizeof(pg_uuid_t));
			v = idem_spi_col(r, 6, &isnull);
			d->leased = d->leased && !isnull;
			if (!isnull)
				d->until = DatumGetTimestampTz(v);
		}
		d->attempts = DatumGetInt32(idem_spi_col(r, 7, &isnull));
		v = idem_spi_col(r, 8, &isnull);
		d->parked = !isnull;
		if (!isnull)
			d->retry_at = DatumGetTimestampTz(v);
		v = idem_spi_col(r, 9, &isnull);
		d->dead = !isnull;
		if (!isnull)
			d->dead_seq = DatumGetInt64(v);
		v = idem_spi_col(r, 10, &isnull);
		d->error = isnull ? NULL : TextDatumGetCString(v);
		v = idem_spi_col(r, 11, &isnull);
		d->redrive = !isnull;
		if (!isnull)
			d->redrive_seq = DatumGetInt64(v);
		d->last_seq = DatumGetInt64(idem_spi_col(r, 12, &isnull));
		ItemPointerCopy((ItemPointer) DatumGetPointer(idem_spi_col(r, 13, &isnull)), &d->ctid);
	}
	return ds;
}

/*
 * The transitions of a deliveries row.  They keep the states of "Delivery
 * states" above (and the table's CHECK constraints): retry_at = infinity
 * only at a dead head, a dead head parked and not leased, a waiting redrive
 * only beside a lease.
 */

/* Park d, due at "at": found through retry_at, not the cursor. */
static void
park(Delivery *d, TimestampTz at)
{
	d->parked = true;
	d->retry_at = at;
	d->changed = true;
}

/*
 * The head is no longer dead (passed over, acked by hand, rewound past,
 * discarded): an aggregate parked for good becomes due now.  It stays
 * parked, as the cursor may have passed what follows.
 */
static void
clear_dead(Delivery *d, TimestampTz now)
{
	d->dead = false;
	if (d->parked && TIMESTAMP_IS_NOEND(d->retry_at))
		d->retry_at = now;
	d->changed = true;
}

/*
 * Go back to seq (at most acked + 1): what follows is delivered again, in
 * order, including later events that died (they are retried in turn; their
 * dead letters stay listed until redriven or discarded).  What it goes back
 * to is behind the cursor: the aggregate is parked, due now.  Ends any
 * lease: the caller has made sure that none is live, or that it ended.
 */
static void
rewind_to(Delivery *d, int64 seq, TimestampTz now)
{
	if (seq <= d->acked)
		d->acked = seq - 1;
	d->redrive = false;
	d->leased = false;
	if (d->dead && d->dead_seq > d->acked + 1)
		clear_dead(d, now);
	d->attempts = 0;
	d->error = NULL;
	park(d, now);
}

/* The lease ends; a redrive that waited for that happens now. */
static void
end_lease(Delivery *d, TimestampTz now)
{
	d->leased = false;
	d->changed = true;
	if (d->redrive)
		rewind_to(d, d->redrive_seq, now);
}

/* Write back every changed row, then unpark those that asked for it. */
#define SET_STATE_COLUMNS	10
static void
write_deliveries(Delivery *ds, int n, TimestampTz now)
{
	static const Oid elemtypes[SET_STATE_COLUMNS] = {TIDOID, INT8OID, INT8OID, UUIDOID,
		TIMESTAMPTZOID, INT4OID, TIMESTAMPTZOID, INT8OID, TEXTOID, INT8OID};
	Datum	   *v[SET_STATE_COLUMNS];
	bool	   *isnull[SET_STATE_COLUMNS];
	Datum		values[SET_STATE_COLUMNS];
	int			m = 0;

	for (int c = 0; c < SET_STATE_COLUMNS; c++)
	{
		v[c] = palloc(sizeof(Datum) * Max(n, 1));
		isnull[c] = palloc0(sizeof(bool) * Max(n, 1));
	}
	for (int i = 0; i < n; i++)
	{
		Delivery   *d = &ds[i];

		if (!d->changed)
			continue;
		Assert(!d->parked || !TIMESTAMP_IS_NOEND(d->retry_at) || d->dead);
		Assert(!d->dead || (d->parked && !d->leased && d->dead_seq == d->acked + 1));
		Assert(!d->redrive || d->leased);
		v[0][m] = PointerGetDatum(&d->ctid);
		v[1][m] = Int64GetDatum(d->acked);
		v[2][m] = Int64GetDatum(d->leased_seq);
		v[3][m] = UUIDPGetDatum(&d->token);
		v[4][m] = TimestampTzGetDatum(d->until);
		isnull[2][m] = isnull[3][m] = isnull[4][m] = !d->leased;
		v[5][m] = Int32GetDatum(d->attempts);
		v[6][m] = TimestampTzGetDatum(d->retry_at);
		isnull[6][m] = !d->parked;
		v[7][m] = Int64GetDatum(d->dead_seq);
		isnull[7][m] = !d->dead;
		v[8][m] = d->error ? CStringGetTextDatum(d->error) : (Datum) 0;
		isnull[8][m] = d->error == NULL;
		v[9][m] = Int64GetDatum(d->redrive_seq);
		isnull[9][m] = !d->redrive;
		m++;
	}
	if (m > 0)
	{
		for (int c = 0; c < SET_STATE_COLUMNS; c++)
			values[c] = idem_build_array(v[c], isnull[c], m, elemtypes[c]);
		(void) outbox_exec(ST_SET_STATE, values, NULL, SPI_OK_UPDATE);
	}
	for (int i = 0; i < n; i++)
	{
		if (ds[i].unpark)
		{
			Datum		keys[3];

			keys[0] = CStringGetTextDatum(ds[i].aggregate_type);
			keys[1] = CStringGetTextDatum(ds[i].aggregate_id);
			keys[2] = TimestampTzGetDatum(now);
			(void) outbox_exec(ST_UNPARK, keys, NULL, SPI_OK_UPDATE);
		}
	}
}

/* Key arrays ($1, $2) of the aggregates named by parallel string arrays. */
static void
key_arrays(char **types, char **ids, int n, Datum *values)
{
	Datum	   *t = palloc(sizeof(Datum) * n);
	Datum	   *i = palloc(sizeof(Datum) * n);

	for (int k = 0; k < n; k++)
	{
		t[k] = CStringGetTextDatum(types[k]);
		i[k] = CStringGetTextDatum(ids[k]);
	}
	values[0] = idem_build_array(t, NULL, n, TEXTOID);
	values[1] = idem_build_array(i, NULL, n, TEXTOID);
}

/*
 * Make sure these aggregates have deliveries rows.  Emits make them; this
 * covers rows deleted by hand, and administrative acks and nacks.
 */
static void
ensure_deliveries(char **types, char **ids, int n)
{
	Datum		values[2];

	if (n == 0)
		return;
	key_arrays(types, ids, n, values);
	(void) outbox_exec(ST_ENSURE_DELIVERIES, values, NULL, SPI_OK_INSERT);
}

/* Lock the deliveries rows of these aggregates (waiting), in key order. */
static Delivery *
lock_deliveries(char **types, char **ids, int n, int *nlocked)
{
	Datum		values[2];

	*nlocked = 0;
	if (n == 0)
		return NULL;
	key_arrays(types, ids, n, values);
	*nlocked = (int) outbox_exec(ST_LOCK_DELIVERIES, values, NULL, SPI_OK_SELECT);
	return read_deliveries(*nlocked);
}

static bool
lease_is(const Delivery *d, const pg_uuid_t *token)
{
	return memcmp(&d->token, token, sizeof(pg_uuid_t)) == 0;
}

static bool
lease_live(const Delivery *d, TimestampTz now)
{
	return d->leased && d->until > now;
}

static bool
lease_held(const Delivery *d, const pg_uuid_t *token, TimestampTz now)
{
	return lease_live(d, now) && lease_is(d, token);
}

/*
 * Copy the event at seq of d's aggregate into the dead letters; false if it
 * has no row to copy (emitted in outbox_mode 'wal', or its partition is gone).
 */
static bool
dead_letter(Delivery *d, int64 seq, const char *error, TimestampTz now)
{
	Datum		values[6];
	char		nulls[6] = {' ', ' ', ' ', ' ', ' ', ' '};

	values[0] = CStringGetTextDatum(d->aggregate_type);
	values[1] = CStringGetTextDatum(d->aggregate_id);
	values[2] = Int64GetDatum(seq);
	values[3] = Int32GetDatum(d->attempts);
	if (error != NULL)
		values[4] = CStringGetTextDatum(error);
	else
		nulls[4] = 'n';
	values[5] = TimestampTzGetDatum(now);
	return outbox_exec(ST_DEAD_LETTER, values, nulls, SPI_OK_INSERT) > 0;
}

/*
 * The head of d has been handed out outbox_max_attempts times and every
 * attempt failed: dead-letter it (the caller applies the dead policy).  A
 * head with no row to dead-letter is passed over: nothing could redrive or
 * discard it.  The caller has applied any waiting redrive.
 */
static void
head_exhausted(Delivery *d, TimestampTz now)
{
	int64		head = d->acked + 1;

	Assert(!d->redrive);
	end_lease(d, now);
	if (dead_letter(d, head, d->error != NULL ? d->error : "lease expired", now))
	{
		d->dead = true;
		d->dead_seq = head;
		return;
	}
	d->acked = head;
	d->attempts = 0;
	d->error = NULL;
}

/*
 * A dead head under the policy in force: 'skip' passes it (its dead letter
 * stays) and returns true; 'block' parks the aggregate for good (until a
 * redrive, a discard or a claim under 'skip') and returns false.
 */
static bool
apply_dead_policy(Delivery *d, TimestampTz now)
{
	Assert(d->dead && !d->leased);
	d->changed = true;
	if (outbox_dead_policy == DEAD_SKIP)
	{
		d->acked = d->dead_seq;
		clear_dead(d, now);
		d->attempts = 0;
		d->error = NULL;
		return true;
	}
	park(d, DT_NOEND);
	return false;
}

/*---- claiming ----*/

/* An event read by a claim, kept until the claim returns it. */
typedef struct ClaimEvent
{
	int64		seq;
	HeapTuple	tup;			/* id, event_type, payload, headers, created_at */
	TupleDesc	desc;			/* ... from attribute number "col" on */
	int			col;
} ClaimEvent;

/* Everything one idem_outbox_claim() call works with. */
typedef struct Claim
{
	int			batch;
	int			taken;			/* events handed out so far */
	TimestampTz now;
	TimestampTz until;
	pg_uuid_t	token;
	Datum		types;			/* aggregate_types filter, or 0 */
	bool		has_types;
	char	  **type_names;
	int			ntype_names;
	ReturnSetInfo *rsinfo;
} Claim;

static bool
type_wanted(Claim *c, const char *type)
{
	if (!c->has_types)
		return true;
	for (int i = 0; i < c->ntype_names; i++)
		if (strcmp(c->type_names[i], type) == 0)
			return true;
	return false;
}

static void
emit_claimed(Claim *c, Delivery *d, ClaimEvent *ev)
{
	OutboxEvent out;
	Datum		values[11];
	bool		nulls[11];
	bool		isnull;
	int			k = ev->col;

	memcpy(&out.id, DatumGetUUIDP(heap_getattr(ev->tup, k, ev->desc, &isnull)), sizeof(pg_uuid_t));
	out.aggregate_type = d->aggregate_type;
	out.aggregate_id = d->aggregate_id;
	out.seq = ev->seq;
	out.event_type = TextDatumGetCString(heap_getattr(ev->tup, k + 1, ev->desc, &isnull));
	out.payload = DatumGetJsonbP(heap_getattr(ev->tup, k + 2, ev->desc, &isnull));
	out.headers = DatumGetJsonbP(heap_getattr(ev->tup, k + 3, ev->desc, &isnull));
	out.created_at = DatumGetTimestampTz(heap_getattr(ev->tup, k + 4, ev->desc, &isnull));
	event_values(&out, d->attempts, &c->token, c->until, values, nulls);
	tuplestore_putvalues(c->rsinfo->setResult, c->rsinfo->setDesc, values, nulls);
}

static int
claim_event_cmp(const void *a, const void *b)
{
	int64		x = ((const ClaimEvent *) a)->seq;
	int64		y = ((const ClaimEvent *) b)->seq;

	return x < y ? -1 : (x > y ? 1 : 0);
}

/* The aggregate's undelivered events from the index, in seq order. */
static ClaimEvent *
fetch_run(Claim *c, Delivery *d, int *n)
{
	Datum		values[4];
	ClaimEvent *evs;
	uint64		got;

	values[0] = CStringGetTextDatum(d->aggregate_type);
	values[1] = CStringGetTextDatum(d->aggregate_id);
	values[2] = Int64GetDatum(d->acked);
	values[3] = Int32GetDatum(c->batch - c->taken);
	got = outbox_exec(ST_RUN, values, NULL, SPI_OK_SELECT);
	evs = palloc(sizeof(ClaimEvent) * Max(got, 1));
	for (uint64 r = 0; r < got; r++)
	{
		bool		isnull;

		evs[r].tup = SPI_tuptable->vals[r];
		evs[r].desc = SPI_tuptable->tupdesc;
		evs[r].col = 1;
		evs[r].seq = DatumGetInt64(heap_getattr(evs[r].tup, 6, evs[r].desc, &isnull));
	}
	*n = (int) got;
	return evs;
}

/*
 * Lease d's run of events, from its head, in seq order.  evs are the
 * events the cursor scan found for it (NULL: read them from the index).
 * A seq at or below the newest that has no row was emitted in outbox_mode
 * 'wal' (or its partition is gone after a rewind): it is passed over at the
 * head; inside a run, the run stops before it.
 */
static void
take_run(Claim *c, Delivery *d, ClaimEvent *evs, int nevs)
{
	int			first = -1;
	int			count = 0;
	int64		expect;

	/*
	 * No live lease here: an expired one ends now (and a redrive that waited
	 * for it goes back; then the scan's events may not reach the new head,
	 * which is seen below).
	 */
	Assert(!lease_live(d, c->now));
	if (d->leased)
		end_lease(d, c->now);
	if (d->dead && !apply_dead_policy(d, c->now))
		return;
	if (d->attempts >= outbox_max_attempts && d->acked < d->last_seq)
	{
		head_exhausted(d, c->now);
		if (d->dead && !apply_dead_policy(d, c->now))
			return;
	}

	if (evs != NULL)
	{
		qsort(evs, nevs, sizeof(ClaimEvent), claim_event_cmp);
		for (first = 0; first < nevs && evs[first].seq <= d->acked; first++)
			;
		/* the scan has not reached the head: ask the index */
		if (first == nevs || evs[first].seq != d->acked + 1)
			evs = NULL;
		else
		{
			int64		next = d->acked + 1;

			for (int i = first; i < nevs && evs[i].seq <= next; i++)
				if (evs[i].seq == next)
					next++;
			/* it saw part of the run: read the rest from the index, if it fits */
			if (next <= d->last_seq && c->taken + (next - d->acked - 1) < c->batch)
				evs = NULL;
		}
	}
	if (evs == NULL)
	{
		evs = fetch_run(c, d, &nevs);
		first = 0;
		if (nevs == 0 && d->acked < d->last_seq)
		{
			d->acked = d->last_seq;		/* nothing but rows never stored */
			d->changed = true;
		}
		else if (nevs > 0 && evs[0].seq > d->acked + 1 && evs[0].seq <= d->last_seq)
		{
			d->acked = evs[0].seq - 1;
			d->changed = true;
		}
	}

	expect = d->acked + 1;
	for (int i = first; i < nevs && c->taken < c->batch; i++)
	{
		if (evs[i].seq < expect)
			continue;			/* a duplicate row from the scan */
		if (evs[i].seq != expect)
			break;
		expect++;
		count++;
		c->taken++;
	}
	if (count == 0)
		return;

	d->attempts++;
	d->leased = true;
	d->leased_seq = expect - 1;
	d->token = c->token;
	d->until = c->until;
	d->changed = true;
	expect = d->acked + 1;
	for (int i = first; i < nevs && expect <= d->leased_seq; i++)
	{
		if (evs[i].seq != expect)
			continue;
		emit_claimed(c, d, &evs[i]);
		expect++;
	}
}

/* Parked aggregates whose time has come (and, under 'skip', dead ones). */
static void
claim_parked(Claim *c, OutboxStatement st)
{
	Datum		values[3];
	char		nulls[3] = {' ', ' ', ' '};
	Delivery   *ds;
	int			n;

	values[0] = TimestampTzGetDatum(c->now);
	values[1] = Int32GetDatum(c->batch - c->taken);
	values[2] = c->types;
	if (!c->has_types)
		nulls[2] = 'n';
	n = (int) outbox_exec(st, values, nulls, SPI_OK_SELECT);
	ds = read_deliveries(n);
	for (int i = 0; i < n && c->taken < c->batch; i++)
	{
		take_run(c, &ds[i], NULL, 0);
		if (!ds[i].leased && !ds[i].dead && ds[i].acked >= ds[i].last_seq)
			ds[i].unpark = true;
	}
	write_deliveries(ds, n, c->now);
}

/*---- the cursor ----*/

/*
 * A position in the scan order of events: the emitting transaction, then
 * the event id (a transaction's events are final together, so a cursor may
 * stop inside one).
 */
typedef struct OutboxPos
{
	FullTransactionId txid;
	pg_uuid_t	id;
} OutboxPos;

static int
pos_cmp(const OutboxPos *a, const OutboxPos *b)
{
	if (FullTransactionIdPrecedes(a->txid, b->txid))
		return -1;
	if (FullTransactionIdFollows(a->txid, b->txid))
		return 1;
	return memcmp(a->id.data, b->id.data, UUID_LEN);
}

static OutboxPos
pos_at(FullTransactionId txid)
{
	OutboxPos	p;

	p.txid = txid;
	memset(p.id.data, 0, UUID_LEN);
	return p;
}

/* this backend's cursor, and when it last wrote it back */
static OutboxPos local_cursor = {{0}, {{0}}};
static TimestampTz cursor_written = 0;

/*
 * The oldest transaction that may still commit an event, as the scan will
 * see it: the xmin of a snapshot taken now (the scan's, taken later, has a
 * later one), or under REPEATABLE READ of the transaction's snapshot, which
 * the scan uses.  Every event from below it is final and visible to the
 * scan.
 */
static OutboxPos
event_horizon(void)
{
	Snapshot	snap = IsolationUsesXactSnapshot() ? GetTransactionSnapshot()
		: GetLatestSnapshot();
	FullTransactionId next = ReadNextFullTransactionId();
	TransactionId xmin = snap->xmin;
	uint32		epoch = EpochFromFullTransactionId(next);

	if (xmin > XidFromFullTransactionId(next))
		epoch--;
	return pos_at(FullTransactionIdFromEpochAndXid(epoch, xmin));
}

static OutboxPos
read_cursor(void)
{
	OutboxPos	stored = pos_at(FullTransactionIdFromU64(0));
	OutboxPos	next = pos_at(ReadNextFullTransactionId());
	bool		isnull;

	if (outbox_exec(ST_CURSOR_READ, NULL, NULL, SPI_OK_SELECT) == 1)
	{
		Datum		v = idem_spi_col(0, 1, &isnull);

		if (!isnull)
		{
			stored.txid = DatumGetFullTransactionId(v);
			v = idem_spi_col(0, 2, &isnull);
			if (!isnull)
				memcpy(&stored.id, DatumGetUUIDP(v), sizeof(pg_uuid_t));
		}
	}
	/* from another cluster (a restore): worthless, scan everything */
	if (pos_cmp(&stored, &next) > 0)
		stored = pos_at(FullTransactionIdFromU64(0));
	if (pos_cmp(&local_cursor, &next) > 0)
		local_cursor = pos_at(FullTransactionIdFromU64(0));
	return pos_cmp(&local_cursor, &stored) > 0 ? local_cursor : stored;
}

static void
write_cursor(OutboxPos pos, TimestampTz now)
{
	Datum		values[2];

	if (pos_cmp(&pos, &local_cursor) > 0)
		local_cursor = pos;
	if (now - cursor_written < OUTBOX_CURSOR_WRITE_USECS && now >= cursor_written)
		return;
	values[0] = FullTransactionIdGetDatum(local_cursor.txid);
	values[1] = UUIDPGetDatum(&local_cursor.id);
	(void) outbox_exec(ST_CURSOR_WRITE, values, NULL, SPI_OK_UPDATE);
	cursor_written = now;
}

/* Candidate aggregates met by the scan, with their events. */
typedef struct Candidate
{
	uint32		hash;
	char	   *aggregate_type;
	char	   *aggregate_id;
	bool		has_row;		/* has a deliveries row */
	bool		tried;			/* a lease was attempted */
	int			nevents;
	int			cap;
	ClaimEvent *events;
} Candidate;

typedef struct CandidateSet
{
	int			n;
	int			cap;
	Candidate **slots;			/* open addressing, cap a power of 2 */
	Candidate **list;			/* in order met */
	int			nlist;
} CandidateSet;

static uint32
candidate_hash(const char *type, const char *id)
{
	return hash_combine(hash_bytes((const unsigned char *) type, strlen(type)),
						hash_bytes((const unsigned char *) id, strlen(id)));
}

static void
candidates_grow(CandidateSet *cs)
{
	int			cap = cs->cap == 0 ? 64 : cs->cap * 2;
	Candidate **slots = palloc0(sizeof(Candidate *) * cap);

	for (int i = 0; i < cs->nlist; i++)
	{
		Candidate  *cand = cs->list[i];
		uint32		pos = cand->hash & (cap - 1);

		while (slots[pos] != NULL)
			pos = (pos + 1) & (cap - 1);
		slots[pos] = cand;
	}
	cs->slots = slots;
	cs->cap = cap;
	cs->list = cs->list == NULL ? palloc(sizeof(Candidate *) * cap)
		: repalloc(cs->list, sizeof(Candidate *) * cap);
}

static Candidate *
candidate_get(CandidateSet *cs, const char *type, const char *id, bool create)
{
	uint32		h = candidate_hash(type, id);
	uint32		pos;
	Candidate  *cand;

	if (cs->cap == 0)
	{
		if (!create)
			return NULL;
		candidates_grow(cs);
	}
	for (pos = h & (cs->cap - 1); cs->slots[pos] != NULL; pos = (pos + 1) & (cs->cap - 1))
	{
		cand = cs->slots[pos];
		if (cand->hash == h && strcmp(cand->aggregate_type, type) == 0 &&
			strcmp(cand->aggregate_id, id) == 0)
			return cand;
	}
	if (!create)
		return NULL;
	if ((cs->nlist + 1) * 2 > cs->cap)
	{
		candidates_grow(cs);
		return candidate_get(cs, type, id, create);
	}
	cand = palloc0(sizeof(Candidate));
	cand->hash = h;
	cand->aggregate_type = pstrdup(type);
	cand->aggregate_id = pstrdup(id);
	cs->slots[pos] = cand;
	cs->list[cs->nlist++] = cand;
	return cand;
}

static void
candidate_add_event(Candidate *cand, HeapTuple tup, TupleDesc desc, int64 seq)
{
	if (cand->nevents == cand->cap)
	{
		cand->cap = cand->cap == 0 ? 4 : cand->cap * 2;
		cand->events = cand->events == NULL ? palloc(sizeof(ClaimEvent) * cand->cap)
			: repalloc(cand->events, sizeof(ClaimEvent) * cand->cap);
	}
	cand->events[cand->nevents].seq = seq;
	cand->events[cand->nevents].tup = tup;
	cand->events[cand->nevents].desc = desc;
	cand->events[cand->nevents].col = 5;
	cand->nevents++;
}

/*
 * Lease candidates not tried yet, in the order the scan met them, a group
 * at a time, until the batch is full.  A group is sized by the runs taken
 * so far, so that few rows are locked beyond those that get leased (a
 * locked row stays locked to the other relays until we commit).
 */
static void
lease_candidates(Claim *c, CandidateSet *cs)
{
	char	  **types = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **ids = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **new_types = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **new_ids = palloc(sizeof(char *) * Max(cs->nlist, 1));
	int			next = 0;
	int			leased = 0;
	int			taken_before = c->taken;

	while (c->taken < c->batch && next < cs->nlist)
	{
		int			group = OUTBOX_LEASE_GROUP;
		int			n = 0;
		int			nnew = 0;
		Datum		values[3];
		Delivery   *ds;
		int			nlocked;

		/* runs so far average (taken / leased) events: size the group by that */
		if (leased > 0 && c->taken > taken_before)
			group = Max(1, Min(OUTBOX_SCAN_CHUNK,
							   (int) ((int64) (c->batch - c->taken) * leased /
									  (c->taken - taken_before)) + 1));
		for (; next < cs->nlist && n < group; next++)
		{
			Candidate  *cand = cs->list[next];

			if (cand->tried || cand->nevents == 0)
				continue;
			cand->tried = true;
			types[n] = cand->aggregate_type;
			ids[n++] = cand->aggregate_id;
			if (!cand->has_row)
			{
				new_types[nnew] = cand->aggregate_type;
				new_ids[nnew++] = cand->aggregate_id;
			}
		}
		if (n == 0)
			break;
		ensure_deliveries(new_types, new_ids, nnew);

		key_arrays(types, ids, n, values);
		values[2] = TimestampTzGetDatum(c->now);
		nlocked = (int) outbox_exec(ST_LOCK_CANDIDATES, values, NULL, SPI_OK_SELECT);
		ds = read_deliveries(nlocked);
		for (int i = 0; i < nlocked && c->taken < c->batch; i++)
		{
			Candidate  *cand = candidate_get(cs, ds[i].aggregate_type, ds[i].aggregate_id, false);

			take_run(c, &ds[i], cand ? cand->events : NULL, cand ? cand->nevents : 0);
			if (ds[i].leased && lease_is(&ds[i], &c->token))
				leased++;
		}
		write_deliveries(ds, nlocked, c->now);
	}
}

/* Where a claim's scan of events stands between pages. */
typedef struct EventScan
{
	OutboxPos	last_seen;		/* the last event scanned */
	OutboxPos	first_pending;	/* the first event scanned that is still pending */
	bool		pending_seen;
	bool		first_page;
} EventScan;

/*
 * Scan a page of events from st->last_seen and lease the aggregates met
 * that can be leased.  The page runs at an SPI level of its own: its rows,
 * its candidates and the rows locked for them are freed when it ends (what
 * the claim hands out is in its tuplestore by then), so a claim's memory
 * does not grow with the pages it scans.  An aggregate tried on an earlier
 * page and met again is tried again: the locking statement passes over it
 * if it is leased (by this claim too) or locked.  Returns the page's rows.
 */
static uint64
scan_page(Claim *c, EventScan *st)
{
	CandidateSet cs = {0};
	SPITupleTable *tt;
	uint64		got;
	Datum		args[2];

	SPI_connect();
	/* pages follow each other by key: each starts at the last row seen */
	args[0] = FullTransactionIdGetDatum(st->last_seen.txid);
	args[1] = UUIDPGetDatum(&st->last_seen.id);
	got = outbox_exec(ST_SCAN, args, NULL, SPI_OK_SELECT);
	tt = SPI_tuptable;
	for (uint64 r = 0; r < got; r++)
	{
		HeapTuple	tup = tt->vals[r];
		TupleDesc	desc = tt->tupdesc;
		bool		isnull;
		int64		seq = DatumGetInt64(heap_getattr(tup, 4, desc, &isnull));
		Datum		acked = heap_getattr(tup, 10, desc, &isnull);
		bool		has_row = !isnull;
		OutboxPos	pos;
		Datum		until;
		char	   *type;
		char	   *id;
		Candidate  *cand;

		pos.txid = DatumGetFullTransactionId(heap_getattr(tup, 1, desc, &isnull));
		memcpy(&pos.id, DatumGetUUIDP(heap_getattr(tup, 5, desc, &isnull)), UUID_LEN);
		if (!st->first_page && pos_cmp(&pos, &st->last_seen) == 0)
			continue;			/* the last row of the previous page */
		st->last_seen = pos;
		if (has_row && seq <= DatumGetInt64(acked))
			continue;			/* delivered */
		(void) heap_getattr(tup, 12, desc, &isnull);
		if (!isnull)
			continue;			/* parked: found through retry_at */
		if (!st->pending_seen)
		{
			st->first_pending = pos;
			st->pending_seen = true;
		}
		until = heap_getattr(tup, 11, desc, &isnull);
		if (!isnull && DatumGetTimestampTz(until) > c->now)
			continue;			/* leased by another relay */
		type = TextDatumGetCString(heap_getattr(tup, 2, desc, &isnull));
		if (!type_wanted(c, type))
			continue;
		id = TextDatumGetCString(heap_getattr(tup, 3, desc, &isnull));
		cand = candidate_get(&cs, type, id, true);
		if (cand->tried)
			continue;
		cand->has_row = has_row;
		candidate_add_event(cand, tup, desc, seq);
	}
	st->first_page = false;
	lease_candidates(c, &cs);
	SPI_finish();
	return got;
}

/*
 * Scan events from the cursor, a page at a time, lease the aggregates met
 * that can be leased, and move the cursor up to the first event still
 * pending.
 */
static void
claim_by_cursor(Claim *c)
{
	OutboxPos	horizon = event_horizon();
	OutboxPos	from = read_cursor();
	EventScan	st = {0};
	bool		exhausted = false;

	st.last_seen = from;
	st.first_page = true;
	while (c->taken < c->batch)
	{
		if (scan_page(c, &st) < OUTBOX_SCAN_CHUNK)
		{
			exhausted = true;
			break;
		}
	}

	/* the cursor moves up to the first pending event, never past horizon */
	if (st.pending_seen && pos_cmp(&st.first_pending, &horizon) < 0)
		horizon = st.first_pending;
	else if (!st.pending_seen && !exhausted && pos_cmp(&st.last_seen, &horizon) < 0)
		horizon = st.last_seen;
	if (pos_cmp(&horizon, &from) > 0)
		write_cursor(horizon, c->now);
}

Datum
idem_outbox_claim(PG_FUNCTION_ARGS)
{
	Claim		c = {0};
	int64		lease;

	c.batch = idem_batch_arg(fcinfo, 0, "batch", OUTBOX_MAX_BATCH);
	lease = idem_positive_interval_arg(fcinfo, 1, "lease");
	if (!PG_ARGISNULL(2))
	{
		Datum	   *elems;

		c.ntype_names = idem_array_arg(fcinfo, 2, "aggregate_types", TEXTOID, &elems);
		c.type_names = palloc(sizeof(char *) * Max(c.ntype_names, 1));
		for (int i = 0; i < c.ntype_names; i++)
			c.type_names[i] = TextDatumGetCString(elems[i]);
		c.types = PG_GETARG_DATUM(2);
		c.has_types = true;
	}
	InitMaterializedSRF(fcinfo, 0);
	c.rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	c.now = idem_now();
	c.until = c.now + lease;
	idem_lease_token(&c.token);

	SPI_connect();
	claim_parked(&c, ST_PARKED_DUE);
	if (outbox_dead_policy == DEAD_SKIP && c.taken < c.batch)
		claim_parked(&c, ST_PARKED_DEAD);
	if (c.taken < c.batch)
		claim_by_cursor(&c);
	SPI_finish();
	return (Datum) 0;
}

/*---- settling: ack, nack, extend ----*/

/* (aggregate, seq) of an event */
typedef struct FoundEvent
{
	char	   *aggregate_type;
	char	   *aggregate_id;
	int64		seq;
} FoundEvent;

static int
found_event_cmp(const void *a, const void *b)
{
	const FoundEvent *x = a;
	const FoundEvent *y = b;
	int			c = strcmp(x->aggregate_type, y->aggregate_type);

	if (c == 0)
		c = strcmp(x->aggregate_id, y->aggregate_id);
	if (c == 0)
		c = x->seq < y->seq ? -1 : (x->seq > y->seq ? 1 : 0);
	return c;
}

/* The events with these ids, sorted by aggregate and seq; unknown ids are left out. */
static FoundEvent *
find_events(Datum *ids, int n, int *nfound)
{
	int32	   *buckets = palloc(sizeof(int32) * n);
	FullTransactionId *txids = palloc(sizeof(FullTransactionId) * n);
	Datum	   *k_txids = palloc(sizeof(Datum) * n);
	Datum	   *k_ids = palloc(sizeof(Datum) * n);
	FoundEvent *found = NULL;
	int			cap = 0;

	*nfound = 0;
	for (int i = 0; i < n; i++)
		if (!idem_row_id_parts(DatumGetUUIDP(ids[i]), NULL, &buckets[i], &txids[i]))
			buckets[i] = 0;		/* not an event id */

	/* one statement per partition the ids name (usually one) */
	for (int i = 0; i < n; i++)
	{
		bool		seen = buckets[i] == 0;
		int			m = 0;
		Datum		values[3];
		uint64		got;

		for (int j = 0; j < i && !seen; j++)
			seen = buckets[j] == buckets[i];
		if (seen)
			continue;
		for (int j = i; j < n; j++)
		{
			if (buckets[j] != buckets[i])
				continue;
			k_txids[m] = FullTransactionIdGetDatum(txids[j]);
			k_ids[m++] = ids[j];
		}
		values[0] = idem_build_array(k_txids, NULL, m, XID8OID);
		values[1] = idem_build_array(k_ids, NULL, m, UUIDOID);
		values[2] = Int32GetDatum(buckets[i]);
		got = outbox_exec(ST_FIND_EVENTS, values, NULL, SPI_OK_SELECT);
		if (*nfound + (int) got > cap)
		{
			cap = *nfound + (int) got + 16;
			found = found == NULL ? palloc(sizeof(FoundEvent) * cap)
				: repalloc(found, sizeof(FoundEvent) * cap);
		}
		for (uint64 r = 0; r < got; r++)
		{
			FoundEvent *f = &found[(*nfound)++];
			bool		isnull;

			f->aggregate_type = TextDatumGetCString(idem_spi_col(r, 1, &isnull));
			f->aggregate_id = TextDatumGetCString(idem_spi_col(r, 2, &isnull));
			f->seq = DatumGetInt64(idem_spi_col(r, 3, &isnull));
		}
	}
	if (*nfound > 1)
		qsort(found, *nfound, sizeof(FoundEvent), found_event_cmp);
	return found;
}

static bool
same_aggregate(const char *t1, const char *i1, const char *t2, const char *i2)
{
	return strcmp(t1, t2) == 0 && strcmp(i1, i2) == 0;
}

/* The distinct aggregates of sorted found events, as key arrays. */
static int
distinct_aggregates(FoundEvent *f, int n, char ***types, char ***ids)
{
	int			m = 0;

	*types = palloc(sizeof(char *) * Max(n, 1));
	*ids = palloc(sizeof(char *) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		if (m > 0 && same_aggregate((*types)[m - 1], (*ids)[m - 1],
									f[i].aggregate_type, f[i].aggregate_id))
			continue;
		(*types)[m] = f[i].aggregate_type;
		(*ids)[m++] = f[i].aggregate_id;
	}
	return m;
}

/*
 * Mark d delivered up to a seq; the lease ends once its run is delivered
 * (and a redrive that waited for that goes back).  attempts counts the
 * hand-outs of the head: a new head that was handed out in the run (a
 * partial ack) keeps the count, a new one starts at 0.  A dead head acked
 * by hand (no lease token) is passed like 'skip' would.  A parked aggregate
 * with nothing known to be pending tries to unpark.
 */
static void
advance(Delivery *d, int64 to, TimestampTz now)
{
	d->acked = to;
	d->error = NULL;
	d->changed = true;
	if (d->dead && d->dead_seq <= to)
		clear_dead(d, now);
	if (d->leased && d->acked >= d->leased_seq)
		end_lease(d, now);
	if (!d->leased)
		d->attempts = 0;
	if (d->parked && !d->dead && !d->leased && d->acked >= d->last_seq)
		d->unpark = true;
}

Datum
idem_outbox_ack(PG_FUNCTION_ARGS)
{
	Datum	   *ids;
	int			n = idem_array_arg(fcinfo, 0, "ids", UUIDOID, &ids);
	bool		fenced = !PG_ARGISNULL(1);
	pg_uuid_t  *token = fenced ? PG_GETARG_UUID_P(1) : NULL;
	TimestampTz now = idem_now();
	FoundEvent *found;
	int			nfound;
	char	  **types;
	char	  **aggs;
	int			nagg;
	Delivery   *ds;
	int			nlocked;
	int			marked = 0;

	if (n == 0)
		PG_RETURN_INT32(0);
	SPI_connect();
	found = find_events(ids, n, &nfound);
	nagg = distinct_aggregates(found, nfound, &types, &aggs);
	if (!fenced)
		ensure_deliveries(types, aggs, nagg);
	ds = lock_deliveries(types, aggs, nagg, &nlocked);
	for (int i = 0, f = 0; i < nlocked; i++)
	{
		Delivery   *d = &ds[i];
		int64		expect = d->acked + 1;

		/* found events and locked rows are both in key order */
		while (f < nfound && !same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											 d->aggregate_type, d->aggregate_id))
			f++;
		if (fenced && !lease_held(d, token, now))
			continue;
		for (; f < nfound && same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											d->aggregate_type, d->aggregate_id); f++)
		{
			if (found[f].seq < expect)
				continue;
			if (found[f].seq != expect || (fenced && found[f].seq > d->leased_seq))
				break;
			expect++;
		}
		if (expect > d->acked + 1)
		{
			marked += (int) (expect - 1 - d->acked);
			advance(d, expect - 1, now);
		}
	}
	write_deliveries(ds, nlocked, now);
	SPI_finish();
	PG_RETURN_INT32(marked);
}

Datum
idem_outbox_nack(PG_FUNCTION_ARGS)
{
	pg_uuid_t  *id;
	char	   *error;
	bool		fenced = !PG_ARGISNULL(3);
	int64		retry_after;
	TimestampTz now = idem_now();
	Datum		idd;
	FoundEvent *found;
	int			nfound;
	Delivery   *d;
	int			nlocked;

	if (PG_ARGISNULL(0))
		idem_null_argument("id");
	if (PG_ARGISNULL(1))
		idem_null_argument("error");
	id = PG_GETARG_UUID_P(0);
	error = text_to_cstring(PG_GETARG_TEXT_PP(1));
	retry_after = idem_retry_after_arg(fcinfo, 2, "retry_after");

	SPI_connect();
	idd = UUIDPGetDatum(id);
	found = find_events(&idd, 1, &nfound);
	if (nfound == 0)
	{
		SPI_finish();
		PG_RETURN_VOID();		/* not an event (any more): nothing to retry */
	}
	if (!fenced)
		ensure_deliveries(&found[0].aggregate_type, &found[0].aggregate_id, 1);
	d = lock_deliveries(&found[0].aggregate_type, &found[0].aggregate_id, 1, &nlocked);
	if (nlocked == 1 && found[0].seq > d->acked && !d->dead &&
		(!fenced || lease_held(d, PG_GETARG_UUID_P(3), now)))
	{
		if (d->redrive)
		{
			/* a redrive waited for this lease: back to it, no failure counted */
			end_lease(d, now);
		}
		else
		{
			TimestampTz retry_at;

			d->error = error;
			end_lease(d, now);
			if (idem_attempt_failed(d->attempts, outbox_max_attempts, retry_after, now, &retry_at))
			{
				/* dead now; the next claim applies the dead policy */
				head_exhausted(d, now);
				retry_at = now;
			}
			park(d, retry_at);
		}
		write_deliveries(d, 1, now);
	}
	SPI_finish();
	PG_RETURN_VOID();
}

Datum
idem_outbox_extend(PG_FUNCTION_ARGS)
{
	int64		lease;
	TimestampTz now = idem_now();
	Datum		values[3];
	uint64		n;
	int64		covered = 0;

	if (PG_ARGISNULL(0))
		idem_null_argument("lease_token");
	lease = idem_positive_interval_arg(fcinfo, 1, "lease");
	SPI_connect();
	values[0] = PG_GETARG_DATUM(0);
	values[1] = TimestampTzGetDatum(now + lease);
	values[2] = TimestampTzGetDatum(now);
	n = outbox_exec(ST_EXTEND, values, NULL, SPI_OK_UPDATE_RETURNING);
	for (uint64 r = 0; r < n; r++)
	{
		bool		isnull;
		Datum		v = idem_spi_col(r, 1, &isnull);

		if (!isnull)
			covered += DatumGetInt64(v);
	}
	SPI_finish();
	PG_RETURN_INT32((int32) Min(covered, PG_INT32_MAX));
}

/*---- dead letters: redrive, discard ----*/

/*
 * Lock the dead letters with these ids and their aggregates' deliveries
 * rows; apply fn to each aggregate with the seqs of its dead letters; delete
 * the dead letters.  Returns how many there were.
 */
typedef void (*DeadLetterAction) (Delivery *d, int64 *seqs, int nseqs, TimestampTz now);

static int
settle_dead_letters(FunctionCallInfo fcinfo, DeadLetterAction fn)
{
	Datum	   *ids;
	int			n = idem_array_arg(fcinfo, 0, "ids", UUIDOID, &ids);
	Datum		arr;
	FoundEvent *found;
	int64	   *seqs;
	uint64		got;
	char	  **types;
	char	  **aggs;
	int			nagg;
	Delivery   *ds;
	int			nlocked;
	TimestampTz now = idem_now();

	if (n == 0)
		return 0;
	SPI_connect();
	arr = idem_build_array(ids, NULL, n, UUIDOID);
	got = outbox_exec(ST_FIND_DEAD, &arr, NULL, SPI_OK_SELECT);
	found = palloc(sizeof(FoundEvent) * Max(got, 1));
	seqs = palloc(sizeof(int64) * Max(got, 1));
	for (uint64 r = 0; r < got; r++)
	{
		bool		isnull;

		found[r].aggregate_type = TextDatumGetCString(idem_spi_col(r, 2, &isnull));
		found[r].aggregate_id = TextDatumGetCString(idem_spi_col(r, 3, &isnull));
		found[r].seq = DatumGetInt64(idem_spi_col(r, 4, &isnull));
	}
	nagg = distinct_aggregates(found, (int) got, &types, &aggs);
	ensure_deliveries(types, aggs, nagg);
	ds = lock_deliveries(types, aggs, nagg, &nlocked);
	for (int i = 0, f = 0; i < nlocked; i++)
	{
		int			k = 0;

		while (f < (int) got && !same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
												ds[i].aggregate_type, ds[i].aggregate_id))
			f++;
		for (; f < (int) got && same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											   ds[i].aggregate_type, ds[i].aggregate_id); f++)
			seqs[k++] = found[f].seq;
		if (k > 0)
			fn(&ds[i], seqs, k, now);
	}
	write_deliveries(ds, nlocked, now);
	(void) outbox_exec(ST_DELETE_DEAD, &arr, NULL, SPI_OK_DELETE);
	SPI_finish();
	return (int) got;
}

/* Park an aggregate, due now: the next claim takes it from its head. */
static void
park_now(Delivery *d, TimestampTz now)
{
	d->attempts = 0;
	d->error = NULL;
	end_lease(d, now);
	park(d, now);
}

/*
 * Redrive: a blocked head is unblocked; an aggregate that went on past a
 * dead event (policy 'skip') goes back to it, so what followed it is
 * delivered again, in order (consumers dedupe on seq).  While a relay holds
 * a live lease on the aggregate, going back waits for that lease to end
 * (end_lease): the holder is never revoked without knowing, and no other
 * relay is handed the aggregate meanwhile.  A dead letter of an event still
 * ahead of the head (it died, and a rewind came back before it) needs
 * nothing: it is delivered in turn.  seqs are sorted.
 */
static void
redrive_aggregate(Delivery *d, int64 *seqs, int nseqs, TimestampTz now)
{
	if (seqs[0] <= d->acked)
	{
		if (lease_live(d, now))
		{
			if (!d->redrive || seqs[0] < d->redrive_seq)
			{
				d->redrive = true;
				d->redrive_seq = seqs[0];
				d->changed = true;
			}
			return;
		}
		rewind_to(d, seqs[0], now);
		return;
	}
	for (int i = 0; i < nseqs; i++)
	{
		if (d->dead && seqs[i] == d->dead_seq)
		{
			clear_dead(d, now);
			park_now(d, now);
		}
	}
}

/* Discard: a blocked head is passed over for good. */
static void
discard_aggregate(Delivery *d, int64 *seqs, int nseqs, TimestampTz now)
{
	for (int i = 0; i < nseqs; i++)
	{
		if (d->dead && seqs[i] == d->dead_seq)
		{
			d->acked = d->dead_seq;
			clear_dead(d, now);
			park_now(d, now);
		}
	}
}

Datum
idem_outbox_redrive(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(settle_dead_letters(fcinfo, redrive_aggregate));
}

Datum
idem_outbox_discard(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(settle_dead_letters(fcinfo, discard_aggregate));
}
