/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  The transactional outbox: idem_outbox_emit() writes an event in the
 *	  caller's transaction; relays lease aggregates with idem_outbox_claim()
 *	  and settle them with ack, nack, extend, redrive and discard.
 *
 * Storage (sql/tables/40_outbox.sql): events are insert-only rows in time
 * partitions of idempotency.outbox_events (store.c), written straight
 * into the partition (rows.c); what changes lives apart, in two narrow
 * tables whose updates leave every index alone (HOT):
 *	- outbox_sequences: per aggregate, the seqs no event row carries (of
 *	  'wal' emits, and those whose rows retention dropped).  An emit takes
 *	  its aggregate's emit lock (an advisory lock on a hash of the
 *	  aggregate, to commit) and continues from the newest seq of the
 *	  aggregate's rows or counter (outbox_emit.c): emits to one aggregate
 *	  serialise, seq follows commit order, and a rollback takes its number
 *	  back with its row (no gaps).  A table-mode emit writes its row and
 *	  nothing else, however many subscriptions read the log.
 *	- outbox_deliveries: per subscription and aggregate, acked_seq
 *	  (delivered up to here), the lease, attempts of the head event,
 *	  retry_at, the dead head and a redrive waiting for the lease.  The
 *	  first relay of a subscription that meets an aggregate makes its row
 *	  (outbox_ensure_deliveries()); no row means nothing delivered.
 *
 * Subscriptions (outbox_subscriptions.c): everything below holds per
 * subscription -- its deliveries rows, its cursor, its dead letters and its
 * dead policy; statements on those rows take the subscription's id as
 * their last parameter (outbox_exec() appends it).
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
 *	  on retry_at instead, until it has nothing pending.  Unparking takes
 *	  the aggregate's emit lock only if it is free at once
 *	  (outbox_emits_idle()), and then reads the newest stored seq: with an
 *	  emit in flight it does not unpark, and leaves the aggregate due now
 *	  instead (the next claim looks again), so it never waits for an
 *	  emitter (which may be a prepared transaction) and never leaves a new
 *	  event behind the cursor; holding the lock, the next emit waits for
 *	  its commit.
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
 *	- emit: outbox_sequences in RowExclusiveLock, then the aggregate's emit
 *	  lock, to commit.  emit_many takes its aggregates' locks in one order
 *	  (by hash) before writing anything, so two batches never wait on each
 *	  other in a cycle; a batch that would take more than
 *	  OUTBOX_MAX_EMIT_LOCKS takes outbox_sequences in ExclusiveLock
 *	  instead.
 *	- claim: outbox_deliveries rows with FOR UPDATE SKIP LOCKED: a relay
 *	  never waits for another relay; an aggregate locked by one is left to
 *	  it.  A relay makes a missing row only under conditional locks (see
 *	  outbox_ensure_deliveries()), and leaves the aggregate to whoever
 *	  holds them, so it never waits on another's insert either.  ack,
 *	  nack, redrive and discard lock rows (waiting) in sorted order, and
 *	  before they make rows the subscription's rows lock (waiting).  Relays take emit locks only to unpark (only if free at
 *	  once, after their deliveries row: they never wait for an emitter),
 *	  and emitters never lock outbox_deliveries, so emitters and relays
 *	  never deadlock.  An emitter may wait for the commit of a relay that
 *	  just unparked its aggregate (the relay holds its emit lock).
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
 * its events by polling once COMMIT PREPARED has run.  Under 'coalesce' a
 * commit sends none if this backend's last NOTIFY committed less than
 * outbox_notify_window ago (NOTIFY takes a database-wide lock held through
 * the commit, so every emitting commit queues behind the one before); a
 * listener claims once more that long after each notification
 * (idem-relay's --notify-window), so such a commit's events wait for
 * neither the next NOTIFY nor the poll.
 *
 * All SQL runs through generic plans prepared once per backend with
 * search_path pinned to pg_catalog, on schema-qualified names, with the
 * caller's privileges.  The direct write of events needs no right on
 * idempotency.outbox_events: the handler capability for the aggregate type
 * (capabilities.c) is what allows it, checked before anything is written.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/outbox.h"
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
#include "storage/lock.h"
#include "storage/proc.h"
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



/*---- settings ----*/


static const struct config_enum_entry dead_policy_options[] = {
	{"block", DEAD_BLOCK, false},
	{"skip", DEAD_SKIP, false},
	{NULL, 0, false}
};

static const struct config_enum_entry notify_options[] = {
	{"commit", NOTIFY_COMMIT, false},
	{"coalesce", NOTIFY_COALESCE, false},
	{"off", NOTIFY_OFF, false},
	{NULL, 0, false}
};

static const struct config_enum_entry mode_options[] = {
	{"table", MODE_TABLE, false},
	{"wal", MODE_WAL, false},
	{"both", MODE_BOTH, false},
	{NULL, 0, false}
};

int			outbox_max_attempts = OUTBOX_MAX_ATTEMPTS_DEFAULT;
static bool outbox_keep_undelivered = OUTBOX_KEEP_UNDELIVERED_DEFAULT;
int			outbox_dead_policy = OUTBOX_DEAD_POLICY_DEFAULT;
int			outbox_notify = OUTBOX_NOTIFY_DEFAULT;
int			outbox_notify_window = OUTBOX_NOTIFY_WINDOW_DEFAULT;
int			outbox_mode = OUTBOX_MODE_DEFAULT;
static int	outbox_max_lag = OUTBOX_MAX_LAG_DEFAULT;

void
idem_outbox_init(void)
{
	RegisterXactCallback(outbox_xact_callback, NULL);
	RegisterSubXactCallback(outbox_subxact_callback, NULL);

	DefineCustomIntVariable("idempotency.outbox_max_attempts",
							"Failed attempts after which an outbox event is dead-lettered.",
							NULL,
							&outbox_max_attempts,
							OUTBOX_MAX_ATTEMPTS_DEFAULT, 1, IDEM_MAX_ATTEMPTS,
							PGC_USERSET, 0,
							NULL, NULL, NULL);
	DefineCustomBoolVariable("idempotency.outbox_keep_undelivered",
							 "Whether maintenance keeps outbox partitions that hold undelivered or dead-lettered events.",
							 "Turn off where no relay acks (change data capture reads the events from the WAL).",
							 &outbox_keep_undelivered,
							 OUTBOX_KEEP_UNDELIVERED_DEFAULT,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.outbox_max_lag",
							"How far behind a subscription may fall before maintenance detaches it.",
							"A subscription that still needs a partition which ended longer ago than this is detached at the next maintenance round; 0 keeps it for ever.",
							&outbox_max_lag,
							OUTBOX_MAX_LAG_DEFAULT, 0, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_dead_policy",
							 "What a dead-lettered event does to the rest of its aggregate: block or skip.",
							 NULL,
							 &outbox_dead_policy,
							 OUTBOX_DEAD_POLICY_DEFAULT, dead_policy_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_notify",
							 "Whether emitting transactions send NOTIFY idempotency_outbox at commit: commit, coalesce or off.",
							 "coalesce: a commit within idempotency.outbox_notify_window of this session's last NOTIFY sends none; listeners claim once more that long after each notification.",
							 &outbox_notify,
							 OUTBOX_NOTIFY_DEFAULT, notify_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
	DefineCustomIntVariable("idempotency.outbox_notify_window",
							"Under outbox_notify = coalesce, how long after a session's NOTIFY its emitting commits send none.",
							NULL,
							&outbox_notify_window,
							OUTBOX_NOTIFY_WINDOW_DEFAULT, 1, 10000,
							PGC_USERSET, GUC_UNIT_MS,
							NULL, NULL, NULL);
	DefineCustomEnumVariable("idempotency.outbox_mode",
							 "Where emitted events go: table, wal (logical decoding messages only) or both.",
							 NULL,
							 &outbox_mode,
							 OUTBOX_MODE_DEFAULT, mode_options,
							 PGC_USERSET, 0,
							 NULL, NULL, NULL);
}

/*---- statements ----*/

/*
 * Statements on a subscription's rows take its id as their last parameter
 * ($N below, "sub" in the macros); outbox_exec() appends it (SUB_ARG).
 *
 * Locked deliveries rows, as outbox_read_deliveries() expects them: FROM one of
 * the DELIVERIES_* sources below, which lock rows through LATERAL lookups
 * (an index probe per key, in key order, whatever the statistics say).  The
 * newest seq of an aggregate is not read with them: few rows need it
 * (outbox_last_seq()), and reading it probed every partition's index for
 * every locked row.  A LATERAL lookup that does
 * not lock carries a LIMIT, so that the planner cannot flatten it into a
 * hash join over the whole table.
 */
#define DELIVERY_COLUMNS \
	"SELECT d.aggregate_type, d.aggregate_id, d.acked_seq, d.leased_seq, d.lease_token," \
	" d.lease_until, d.attempts, d.retry_at, d.dead_seq, d.last_error, d.redrive_seq," \
	" d.row_ctid"
/* the rows of the aggregates named by $1 (types) and $2 (ids) that meet cond */
#define DELIVERIES_BY_KEYS(sub, cond, lock) \
	" FROM (SELECT k.t, k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)" \
	"       ORDER BY k.t COLLATE \"C\", k.i COLLATE \"C\") k" \
	" CROSS JOIN LATERAL (SELECT d.ctid AS row_ctid, d.* FROM idempotency.outbox_deliveries d" \
	"   WHERE d.subscription = " sub \
	"     AND d.aggregate_type = k.t COLLATE \"C\" AND d.aggregate_id = k.i COLLATE \"C\"" cond \
	"   " lock ") d"
/* the rows that meet cond, in retry_at order, at most $2, skipping locked ones */
#define DELIVERIES_PARKED(cond) \
	" FROM (SELECT d.ctid AS row_ctid, d.* FROM idempotency.outbox_deliveries d" \
	"   WHERE d.subscription = $4 AND " cond \
	"     AND (d.lease_until IS NULL OR d.lease_until <= $1)" \
	"     AND ($3::text[] IS NULL OR d.aggregate_type COLLATE \"C\" = ANY ($3::text[]))" \
	"   ORDER BY d.retry_at LIMIT $2 FOR UPDATE SKIP LOCKED) d"

static const IdemStatement outbox_plans[NUM_STATEMENTS] = {
	/*
	 * 'wal' emits: the counters carry their seqs ($2 ids, sorted, $3 the
	 * newest seq of each; outbox_emit.c holds their emit locks)
	 */
	[ST_WAL_SEQ] = {
		"INSERT INTO idempotency.outbox_sequences AS q"
		"  (aggregate_type, aggregate_id, last_seq, stored_seq, wal_seq)"
		" SELECT $1, u.id, u.seq, 0, u.seq"
		" FROM unnest($2::text[], $3::int8[]) WITH ORDINALITY AS u(id, seq, ord)"
		" ORDER BY u.ord"
		" ON CONFLICT (aggregate_type, aggregate_id)"
		" DO UPDATE SET last_seq = excluded.last_seq, wal_seq = excluded.wal_seq",
		3, {TEXTOID, TEXTARRAYOID, INT8ARRAYOID}
	},
	/*
	 * The newest seq of aggregate ($1, $2): of its event rows (newest first
	 * in every partition's (aggregate_type, aggregate_id, seq) index) or of
	 * its counter ('wal' seqs, and those whose rows retention dropped),
	 * whichever is greater; 0 for none.
	 */
	[ST_NEWEST_SEQ] = {
		"SELECT coalesce(greatest("
		"  (SELECT s.last_seq FROM idempotency.outbox_sequences s"
		"   WHERE s.aggregate_type = $1 COLLATE \"C\" AND s.aggregate_id = $2 COLLATE \"C\" LIMIT 1),"
		"  (SELECT e.seq FROM idempotency.outbox_events e"
		"   WHERE e.aggregate_type = $1 COLLATE \"C\" AND e.aggregate_id = $2 COLLATE \"C\""
		"   ORDER BY e.seq DESC LIMIT 1)), 0)",
		2, {TEXTOID, TEXTOID}
	},
	[ST_CURSOR_READ] = {
		"SELECT position, event_id FROM idempotency.outbox_cursor WHERE subscription = $1",
		1, {INT4OID}
	},
	/* a subscription without a cursor (after a restore) starts from the beginning */
	[ST_CURSOR_MAKE] = {
		"INSERT INTO idempotency.outbox_cursor (subscription, position, event_id)"
		" VALUES ($1, '0', '00000000-0000-0000-0000-000000000000') ON CONFLICT DO NOTHING",
		1, {INT4OID}
	},
	[ST_CURSOR_WRITE] = {
		"UPDATE idempotency.outbox_cursor SET position = $1, event_id = $2"
		" WHERE ctid IN (SELECT ctid FROM idempotency.outbox_cursor"
		"                WHERE subscription = $3 AND (position, event_id) < ($1, $2)"
		"                FOR UPDATE SKIP LOCKED)",
		3, {XID8OID, UUIDOID, INT4OID}
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
		"   WHERE d.subscription = $3"
		"     AND d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id"
		"   LIMIT 1) d ON true"
		" ORDER BY e.txid, e.id",
		3, {XID8OID, UUIDOID, INT4OID}
	},
	[ST_ENSURE_DELIVERIES] = {
		"INSERT INTO idempotency.outbox_deliveries (subscription, aggregate_type, aggregate_id)"
		" SELECT $3, k.t, k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)"
		" ORDER BY k.t COLLATE \"C\", k.i COLLATE \"C\""
		" ON CONFLICT DO NOTHING",
		3, {TEXTARRAYOID, TEXTARRAYOID, INT4OID}
	},
	[ST_LOCK_CANDIDATES] = {
		DELIVERY_COLUMNS
		DELIVERIES_BY_KEYS("$4", " AND d.retry_at IS NULL AND (d.lease_until IS NULL OR d.lease_until <= $3)",
						   "FOR UPDATE SKIP LOCKED"),
		4, {TEXTARRAYOID, TEXTARRAYOID, TIMESTAMPTZOID, INT4OID}
	},
	[ST_PARKED_DUE] = {
		DELIVERY_COLUMNS DELIVERIES_PARKED("d.retry_at <= $1"),
		4, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID, INT4OID}
	},
	[ST_PARKED_DEAD] = {
		DELIVERY_COLUMNS DELIVERIES_PARKED("d.retry_at = 'infinity' AND d.dead_seq IS NOT NULL"),
		4, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID, INT4OID}
	},
	[ST_RUN] = {
		"SELECT id, event_type, payload, headers, created_at, seq FROM idempotency.outbox_events"
		" WHERE aggregate_type = $1 COLLATE \"C\" AND aggregate_id = $2 COLLATE \"C\" AND seq > $3"
		" ORDER BY seq LIMIT $4",
		4, {TEXTOID, TEXTOID, INT8OID, INT4OID}
	},
	/*
	 * Rows this transaction holds locked: found by ctid.  The ANY makes it
	 * a TID scan of those rows; the join on ctid alone was planned as a
	 * hash join over a sequential scan of the whole table (the generic
	 * plan cannot know how few rows the arrays hold).
	 */
	[ST_SET_STATE] = {
		"UPDATE idempotency.outbox_deliveries d"
		" SET acked_seq = u.acked, leased_seq = u.leased, lease_token = u.token,"
		"     lease_until = u.until, attempts = u.attempts, retry_at = u.retry,"
		"     dead_seq = u.dead, last_error = u.err, redrive_seq = u.redrive"
		" FROM unnest($1::tid[], $2::int8[], $3::int8[], $4::uuid[], $5::timestamptz[],"
		"             $6::int4[], $7::timestamptz[], $8::int8[], $9::text[], $10::int8[])"
		"   AS u(row_ctid, acked, leased, token, until, attempts, retry, dead, err, redrive)"
		" WHERE d.ctid = ANY ($1::tid[]) AND d.ctid = u.row_ctid",
		10, {TIDARRAYOID, INT8ARRAYOID, INT8ARRAYOID, UUIDARRAYOID, TIMESTAMPTZARRAYOID,
			INT4ARRAYOID, TIMESTAMPTZARRAYOID, INT8ARRAYOID, TEXTARRAYOID, INT8ARRAYOID}
	},
	/*
	 * Unpark if nothing stored is pending, holding the emit lock ($4: it
	 * was free, see outbox_emits_idle()): this statement's snapshot, taken
	 * after it, sees every committed emit, and the next emit waits for this
	 * transaction.  An emit in flight (the lock busy) keeps the aggregate
	 * parked, due at $3 at the latest, instead of a wait.
	 */
	[ST_UNPARK] = {
		"UPDATE idempotency.outbox_deliveries d"
		" SET retry_at = CASE"
		"   WHEN $4 AND d.acked_seq >= coalesce((SELECT e.seq FROM idempotency.outbox_events e"
		"                                        WHERE e.aggregate_type = d.aggregate_type"
		"                                          AND e.aggregate_id = d.aggregate_id"
		"                                        ORDER BY e.seq DESC LIMIT 1), 0)"
		"   THEN NULL ELSE greatest(d.retry_at, $3) END"
		" WHERE d.subscription = $5"
		"   AND d.aggregate_type = $1 COLLATE \"C\" AND d.aggregate_id = $2 COLLATE \"C\""
		"   AND d.retry_at IS NOT NULL AND d.dead_seq IS NULL AND d.lease_token IS NULL",
		5, {TEXTOID, TEXTOID, TIMESTAMPTZOID, BOOLOID, INT4OID}
	},
	[ST_DEAD_LETTER] = {
		"INSERT INTO idempotency.outbox_dead_letters"
		" (subscription, id, aggregate_type, aggregate_id, seq, event_type, payload, headers,"
		"  created_at, attempts, last_error, dead_at)"
		" SELECT $7, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.event_type, e.payload,"
		"        e.headers, e.created_at, $4, $5, $6"
		" FROM idempotency.outbox_events e"
		" WHERE e.aggregate_type = $1 COLLATE \"C\" AND e.aggregate_id = $2 COLLATE \"C\" AND e.seq = $3"
		/* dead again after a rewind: the listing says so */
		" ON CONFLICT (subscription, id) DO UPDATE SET attempts = excluded.attempts,"
		"  last_error = excluded.last_error, dead_at = excluded.dead_at",
		7, {TEXTOID, TEXTOID, INT8OID, INT4OID, TEXTOID, TIMESTAMPTZOID, INT4OID}
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
		DELIVERY_COLUMNS DELIVERIES_BY_KEYS("$3", "", "FOR UPDATE"),
		3, {TEXTARRAYOID, TEXTARRAYOID, INT4OID}
	},
	/* no index on lease_token (it would make every claim a non-HOT update) */
	[ST_EXTEND] = {
		"UPDATE idempotency.outbox_deliveries SET lease_until = $2"
		" WHERE subscription = $4 AND lease_token = $1 AND lease_until > $3"
		" RETURNING leased_seq - acked_seq",
		4, {UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID, INT4OID}
	},
	[ST_LEASE_TYPES] = {
		"SELECT aggregate_type FROM idempotency.outbox_deliveries"
		" WHERE subscription = $4 AND lease_token = $1 AND lease_until > $3",
		4, {UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID, INT4OID}
	},
	[ST_FIND_DEAD] = {
		"SELECT x.id, x.aggregate_type, x.aggregate_id, x.seq"
		" FROM idempotency.outbox_dead_letters x WHERE x.subscription = $2 AND x.id = ANY ($1)"
		" ORDER BY 2, 3, 4 FOR UPDATE",
		2, {UUIDARRAYOID, INT4OID}
	},
	[ST_DELETE_DEAD] = {
		"DELETE FROM idempotency.outbox_dead_letters WHERE subscription = $2 AND id = ANY ($1)",
		2, {UUIDARRAYOID, INT4OID}
	},
};

/* the statements whose last parameter is the subscription's id */
static const bool with_subscription[NUM_STATEMENTS] = {
	[ST_CURSOR_READ] = true, [ST_CURSOR_MAKE] = true, [ST_CURSOR_WRITE] = true,
	[ST_SCAN] = true, [ST_ENSURE_DELIVERIES] = true, [ST_LOCK_CANDIDATES] = true,
	[ST_PARKED_DUE] = true, [ST_PARKED_DEAD] = true, [ST_UNPARK] = true,
	[ST_DEAD_LETTER] = true, [ST_LOCK_DELIVERIES] = true, [ST_EXTEND] = true,
	[ST_LEASE_TYPES] = true, [ST_FIND_DEAD] = true, [ST_DELETE_DEAD] = true,
};

static SPIPlanPtr prepared[NUM_STATEMENTS];

/*
 * Run a statement (see idem_statement_exec); one on a subscription's rows
 * gets the id of the subscription the call works for appended to values.
 */
uint64
outbox_exec(OutboxStatement st, Datum *values, const char *nulls, int expected)
{
	Datum		v[lengthof(outbox_plans[0].argtypes)];
	char		n[lengthof(outbox_plans[0].argtypes)];
	int			last = outbox_plans[st].nargs - 1;

	if (!with_subscription[st])
		return idem_statement_exec(&outbox_plans[st], &prepared[st], values, nulls, expected);
	for (int i = 0; i < last; i++)
	{
		v[i] = values[i];
		n[i] = nulls != NULL ? nulls[i] : ' ';
	}
	v[last] = Int32GetDatum(outbox_subscription_id());
	n[last] = ' ';
	return idem_statement_exec(&outbox_plans[st], &prepared[st], v, n, expected);
}

/*---- delivery state ----*/


/* Read the locked rows of a DELIVERY_COLUMNS statement. */
Delivery *
outbox_read_deliveries(uint64 n)
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
		d->last_seq_known = false;
		ItemPointerCopy((ItemPointer) DatumGetPointer(idem_spi_col(r, 12, &isnull)), &d->ctid);
	}
	return ds;
}

/*
 * The newest seq of d's aggregate (ST_NEWEST_SEQ), read on first use and
 * then remembered for the call.  It is read in a snapshot of its own, taken
 * now: a caller that compares it with rows it read must have read them
 * after this (see take_run() in outbox_lease.c); one that compares it with
 * acked_seq alone may read it late (a later snapshot only sees a greater
 * seq, so "nothing pending" holds in the earlier one too).
 */
int64
outbox_last_seq(Delivery *d)
{
	Datum		values[2];
	bool		isnull;

	if (d->last_seq_known)
		return d->last_seq;
	values[0] = CStringGetTextDatum(d->aggregate_type);
	values[1] = CStringGetTextDatum(d->aggregate_id);
	(void) outbox_exec(ST_NEWEST_SEQ, values, NULL, SPI_OK_SELECT);
	d->last_seq = DatumGetInt64(idem_spi_col(0, 1, &isnull));
	d->last_seq_known = true;
	return d->last_seq;
}

/*
 * The transitions of a deliveries row.  They keep the states of "Delivery
 * states" above (and the table's CHECK constraints): retry_at = infinity
 * only at a dead head, a dead head parked and not leased, a waiting redrive
 * only beside a lease.
 */

/* Park d, due at "at": found through retry_at, not the cursor. */
void
outbox_park(Delivery *d, TimestampTz at)
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
void
outbox_clear_dead(Delivery *d, TimestampTz now)
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
void
outbox_rewind_to(Delivery *d, int64 seq, TimestampTz now)
{
	if (seq <= d->acked)
		d->acked = seq - 1;
	d->redrive = false;
	d->leased = false;
	if (d->dead && d->dead_seq > d->acked + 1)
		outbox_clear_dead(d, now);
	d->attempts = 0;
	d->error = NULL;
	outbox_park(d, now);
}

/* The lease ends; a redrive that waited for that happens now. */
void
outbox_end_lease(Delivery *d, TimestampTz now)
{
	d->leased = false;
	d->changed = true;
	if (d->redrive)
		outbox_rewind_to(d, d->redrive_seq, now);
}

/* Write back every changed row, then unpark those that asked for it. */
#define SET_STATE_COLUMNS	10
void
outbox_write_deliveries(Delivery *ds, int n, TimestampTz now)
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
			Datum		keys[4];

			keys[0] = CStringGetTextDatum(ds[i].aggregate_type);
			keys[1] = CStringGetTextDatum(ds[i].aggregate_id);
			keys[2] = TimestampTzGetDatum(now);
			keys[3] = BoolGetDatum(outbox_emits_idle(ds[i].aggregate_type, ds[i].aggregate_id));
			(void) outbox_exec(ST_UNPARK, keys, NULL, SPI_OK_UPDATE);
		}
	}
}

/* Key arrays ($1, $2) of the aggregates named by parallel string arrays. */
void
outbox_key_arrays(char **types, char **ids, int n, Datum *values)
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
 * Who makes deliveries rows, and how no relay ever waits on another's
 * insert (two relays making rows in different orders could deadlock; a
 * relay waiting on an operator's open transaction would stall):
 *	- a relay holds, to its commit, a lock per row it makes (on a hash of
 *	  the subscription and the aggregate; a collision only defers), taken
 *	  only if free at once: an aggregate whose row another relay is making
 *	  is left to that relay.  At most OUTBOX_MAX_NEW_ROWS a transaction, so
 *	  that a batch of new aggregates cannot fill the lock table; the rest
 *	  wait for the next claim.  It also holds the subscription's rows lock
 *	  in share mode, again only if free at once;
 *	- an administrative call (an ack or nack without a lease token, a
 *	  redrive, a discard) takes the subscription's rows lock exclusive,
 *	  waiting for the relays in flight: one lock, however many rows it
 *	  makes, and no relay makes rows until it commits.
 * With empty names, the lock of the subscription's cursor row.
 */
static int	new_rows_made = 0;
static LocalTransactionId new_rows_lxid = InvalidLocalTransactionId;

static bool
lock_rows_of_subscription(LOCKMODE mode, bool wait)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) outbox_subscription_id(), 0,
						 IDEM_LOCKTAG_DELIVERY_ROWS);
	return LockAcquire(&tag, mode, false, !wait) != LOCKACQUIRE_NOT_AVAIL;
}

bool
outbox_lock_new_row(const char *type, const char *id, bool wait)
{
	LOCKTAG		tag;
	uint64		h = hash_bytes_extended((const unsigned char *) type, strlen(type),
										(uint64) outbox_subscription_id());

	h = hash_bytes_extended((const unsigned char *) id, strlen(id), h);
	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 IDEM_LOCKTAG_DELIVERY);
	return LockAcquire(&tag, ExclusiveLock, false, !wait) != LOCKACQUIRE_NOT_AVAIL;
}

/*
 * Make sure these aggregates have deliveries rows for the subscription:
 * a relay (admin false) for those it may make now (see above; the others
 * are left out of the arrays, and n is updated), an administrative call
 * (admin true) for all.
 */
void
outbox_ensure_deliveries(char **types, char **ids, int *n, bool admin)
{
	Datum		values[2];
	int			m = 0;

	if (admin)
		(void) lock_rows_of_subscription(ExclusiveLock, true);
	else
	{
		/* the local id: counting must not assign the transaction an xid */
		if (MyProc->lxid != new_rows_lxid)
		{
			new_rows_lxid = MyProc->lxid;
			new_rows_made = 0;
		}
		if (*n > 0 && !lock_rows_of_subscription(ShareLock, false))
			*n = 0;				/* an operator is making rows: not now */
	}
	for (int k = 0; k < *n; k++)
	{
		if (!admin && (new_rows_made >= OUTBOX_MAX_NEW_ROWS ||
					   !outbox_lock_new_row(types[k], ids[k], false)))
			continue;
		if (!admin)
			new_rows_made++;
		types[m] = types[k];
		ids[m++] = ids[k];
	}
	*n = m;
	if (m == 0)
		return;
	outbox_key_arrays(types, ids, m, values);
	(void) outbox_exec(ST_ENSURE_DELIVERIES, values, NULL, SPI_OK_INSERT);
}

/* Lock the deliveries rows of these aggregates (waiting), in key order. */
Delivery *
outbox_lock_deliveries(char **types, char **ids, int n, int *nlocked)
{
	Datum		values[2];

	*nlocked = 0;
	if (n == 0)
		return NULL;
	outbox_key_arrays(types, ids, n, values);
	*nlocked = (int) outbox_exec(ST_LOCK_DELIVERIES, values, NULL, SPI_OK_SELECT);
	return outbox_read_deliveries(*nlocked);
}

bool
outbox_lease_is(const Delivery *d, const pg_uuid_t *token)
{
	return memcmp(&d->token, token, sizeof(pg_uuid_t)) == 0;
}

bool
outbox_lease_live(const Delivery *d, TimestampTz now)
{
	return d->leased && d->until > now;
}

bool
outbox_lease_held(const Delivery *d, const pg_uuid_t *token, TimestampTz now)
{
	return outbox_lease_live(d, now) && outbox_lease_is(d, token);
}

/*
 * Copy the event at seq of d's aggregate into the dead letters; false if it
 * has no row to copy (emitted in outbox_mode 'wal', or its partition is gone).
 */
bool
outbox_dead_letter(Delivery *d, int64 seq, const char *error, TimestampTz now)
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
void
outbox_head_exhausted(Delivery *d, TimestampTz now)
{
	int64		head = d->acked + 1;

	Assert(!d->redrive);
	outbox_end_lease(d, now);
	if (outbox_dead_letter(d, head, d->error != NULL ? d->error : "lease expired", now))
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
bool
outbox_apply_dead_policy(Delivery *d, TimestampTz now)
{
	Assert(d->dead && !d->leased);
	d->changed = true;
	if (outbox_subscription_dead_policy() == DEAD_SKIP)
	{
		d->acked = d->dead_seq;
		outbox_clear_dead(d, now);
		d->attempts = 0;
		d->error = NULL;
		return true;
	}
	outbox_park(d, DT_NOEND);
	return false;
}

/*
 * The first eight columns of both an outbox_events row and an
 * idem_outbox_event: id ... created_at.
 */
void
outbox_event_stored_values(const OutboxEvent *ev, Datum *values)
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
void
outbox_event_values(const OutboxEvent *ev, int32 attempts, const pg_uuid_t *token,
			 TimestampTz until, Datum *values, bool *nulls)
{
	memset(nulls, 0, sizeof(bool) * 11);
	outbox_event_stored_values(ev, values);
	values[8] = Int32GetDatum(attempts);
	if (token != NULL)
	{
		values[9] = UUIDPGetDatum(token);
		values[10] = TimestampTzGetDatum(until);
	}
	else
		nulls[9] = nulls[10] = true;
}
