/*-------------------------------------------------------------------------
 *
 * inbox.c
 *	  The inbox: idem_inbox_receive() stores a message once per (source,
 *	  message_id) in the caller's transaction; workers lease messages with
 *	  idem_inbox_claim() and settle them with done and fail;
 *	  idem_inbox_replay() makes processed messages leasable again.
 *
 * Dedup is a claim (claims.c, idem_claim_key) of message_id in scope
 * 'inbox:<source>': the same uniqueness, retention, payload check (IK001)
 * and waiting on a receiver in flight as idem_claim().  Only a new claim
 * stores the message, straight into its time partition of
 * idempotency.inbox_messages (store.c, rows.c).  A message with an
 * ordering_key header gets seq = the next number of its (source,
 * ordering_key) from idempotency.inbox_sequences, whose row the receiver
 * holds locked to commit (so seq follows commit order, without gaps).
 *
 * The processing state (attempts, lease, retry_at, done_at, dead_at,
 * last_error) lives in the message row itself: unlike the outbox, whose
 * events are insert-only, every claim, done and fail updates the message
 * (done is not a HOT update: done_at is indexed).  Rows are never
 * deleted; partitions go whole once nothing in them is left undone.
 *
 * Claiming.  Candidates are messages that are not done, not dead, not
 * leased live and not waiting for retry_at; of an ordering key, only its
 * head (no earlier message of the key is left undone) is a candidate.  A
 * head is handed out with the run of the key's messages after it, in seq
 * order, up to the first that is not leasable; a key with a live lease on
 * any of its messages (possible after a replay) is left alone.  The
 * lease-time rules are the outbox's (leases.c): an expired lease ends the
 * attempt as failed, and a message handed out inbox_max_attempts times
 * without success is dead, which blocks its ordering key until replayed.
 *
 * Locking rules:
 *	- receive: the claim's value lock (claims.c), then the key's
 *	  inbox_sequences row to commit.  Receivers never lock messages.
 *	- claim: candidates are locked FOR UPDATE SKIP LOCKED, so a claimer
 *	  never waits for another and never takes a head another claimer holds;
 *	  the run after a head is locked FOR UPDATE in seq order (only done,
 *	  fail and replay, all short, can hold those rows).  Because a later
 *	  message of a key is a candidate only once every earlier one is done,
 *	  two claimers never split a key.
 *	- done and fail lock the messages they name (one statement); extend
 *	  locks the undone messages its token holds the live lease of (one
 *	  statement: it waits for a claim that is taking them over, and then
 *	  finds the token gone); replay locks the messages of its range.
 *
 * Everything runs with the caller's privileges (README "Inbox"), through
 * generic plans prepared with search_path pinned (idempotency.c).  The
 * direct write of a message needs no right on idempotency.inbox_messages:
 * the handler capability for the source (capabilities.c) allows it.
 * Claims should run in READ COMMITTED, like the outbox's.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/delivery.h"
#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/ownership.h"
#include "common/rows.h"
#include "claims/claims.h"
#include "delivery/store.h"
#include "delivery/leases.h"

#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"
#include "utils/xid8.h"

PG_FUNCTION_INFO_V1(idem_inbox_receive);
PG_FUNCTION_INFO_V1(idem_inbox_claim);
PG_FUNCTION_INFO_V1(idem_inbox_done);
PG_FUNCTION_INFO_V1(idem_inbox_fail);
PG_FUNCTION_INFO_V1(idem_inbox_extend);
PG_FUNCTION_INFO_V1(idem_inbox_replay);

/* the claims scope of a source is this prefix and the source */
#define INBOX_MAX_SOURCE_BYTES	(IDEM_MAX_SCOPE_BYTES - (int) strlen(IDEM_INBOX_SCOPE_PREFIX))

/* candidate queries one claim runs at most while its batch is not full */
#define INBOX_CLAIM_ROUNDS		8

/*---- settings ----*/

#define INBOX_MAX_ATTEMPTS_DEFAULT	10

static int	inbox_max_attempts = INBOX_MAX_ATTEMPTS_DEFAULT;

void
idem_inbox_init(void)
{
	DefineCustomIntVariable("idempotency.inbox_max_attempts",
							"Failed attempts after which an inbox message is dead-lettered.",
							NULL,
							&inbox_max_attempts,
							INBOX_MAX_ATTEMPTS_DEFAULT, 1, IDEM_MAX_ATTEMPTS,
							PGC_USERSET, 0,
							NULL, NULL, NULL);
}

/*---- statements ----*/

/* the state of a message as claims read it; columns 1-10 */
#define STATE_COLUMNS \
	"SELECT m.id, m.bucket, m.source, m.ordering_key, m.seq, m.attempts," \
	" m.lease_until, m.retry_at, m.dead_at IS NOT NULL, m.last_error"

/* a message leasable now ($1) */
#define CLAIMABLE \
	" m.done_at IS NULL AND m.dead_at IS NULL" \
	" AND (m.lease_until IS NULL OR m.lease_until <= $1)" \
	" AND (m.retry_at IS NULL OR m.retry_at <= $1)"

typedef enum
{
	ST_NEXT_SEQ,
	ST_FIRST_SEQ,
	ST_CANDIDATES,
	ST_KEY_LEASED,
	ST_RUN,
	ST_LEASE,
	ST_DEAD,
	ST_DONE,
	ST_LOCK_ONE,
	ST_FAIL,
	ST_EXTEND,
	ST_REPLAY,
	ST_SOURCES_OF,
	ST_TOKEN_SOURCES,
	NUM_STATEMENTS
} InboxStatement;

static const IdemStatement inbox_plans[NUM_STATEMENTS] = {
	/* for a relay limited to some sources: the sources of messages */
	[ST_SOURCES_OF] = {
		"SELECT m.id, m.source FROM idempotency.inbox_messages m"
		" WHERE m.bucket = $1 AND m.id = ANY ($2)",
		2, {INT4OID, UUIDARRAYOID}
	},
	/* ... and of a live lease */
	[ST_TOKEN_SOURCES] = {
		"SELECT m.source FROM idempotency.inbox_messages m"
		" WHERE m.done_at IS NULL AND m.dead_at IS NULL"
		"   AND m.lease_token = $1 AND m.lease_until > $3",
		3, {UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
	},
	/* a key that has received before: a plain (HOT) update of its counter */
	[ST_NEXT_SEQ] = {
		"UPDATE idempotency.inbox_sequences SET last_seq = last_seq + 1"
		" WHERE source = $1 COLLATE \"C\" AND ordering_key = $2 COLLATE \"C\""
		" RETURNING last_seq",
		2, {TEXTOID, TEXTOID}
	},
	/* otherwise (none updated): make the counter, or take it over from a racer */
	[ST_FIRST_SEQ] = {
		"INSERT INTO idempotency.inbox_sequences AS q (source, ordering_key, last_seq)"
		" VALUES ($1, $2, 1)"
		" ON CONFLICT (source, ordering_key) DO UPDATE SET last_seq = q.last_seq + 1"
		" RETURNING q.last_seq",
		2, {TEXTOID, TEXTOID}
	},

	/*
	 * Claimable messages without an ordering key, and heads of keys whose
	 * earlier messages are all done; at most $2, skipping locked ones.  The
	 * (done_at, dead_at) indexes find the undone messages without reading
	 * the done ones; ordering by their columns (all NULL here: no order
	 * among messages is promised) makes them index scans that stop at the
	 * LIMIT, where a bitmap scan would read every undone entry first.
	 */
	[ST_CANDIDATES] = {
		STATE_COLUMNS
		" FROM idempotency.inbox_messages m"
		" WHERE" CLAIMABLE
		"   AND ($3::text[] IS NULL OR m.source = ANY ($3::text[]))"
		"   AND (m.ordering_key IS NULL OR NOT EXISTS ("
		"        SELECT FROM idempotency.inbox_messages p"
		"        WHERE p.source = m.source AND p.ordering_key = m.ordering_key"
		"          AND p.seq < m.seq AND p.done_at IS NULL))"
		" ORDER BY m.done_at, m.dead_at LIMIT $2 FOR UPDATE OF m SKIP LOCKED",
		3, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID}
	},
	/* one run at a time per key: is any message of it leased live? */
	[ST_KEY_LEASED] = {
		"SELECT FROM idempotency.inbox_messages m"
		" WHERE m.source = $1 AND m.ordering_key = $2 AND m.done_at IS NULL"
		"   AND m.lease_until > $3 LIMIT 1",
		3, {TEXTOID, TEXTOID, TIMESTAMPTZOID}
	},
	/* the undone messages of a key after its head, in seq order, locked */
	[ST_RUN] = {
		STATE_COLUMNS
		" FROM idempotency.inbox_messages m"
		" WHERE m.source = $1 AND m.ordering_key = $2 AND m.seq > $3 AND m.done_at IS NULL"
		" ORDER BY m.seq LIMIT $4 FOR UPDATE OF m",
		4, {TEXTOID, TEXTOID, INT8OID, INT4OID}
	},
	/* lease messages this transaction holds locked; the rows handed out, in order */
	[ST_LEASE] = {
		"WITH k AS (SELECT k.id, k.bucket, k.ord"
		"           FROM unnest($1::uuid[], $2::int4[]) WITH ORDINALITY AS k(id, bucket, ord)),"
		" u AS (UPDATE idempotency.inbox_messages m"
		"       SET attempts = m.attempts + 1, lease_token = $3, lease_until = $4, retry_at = NULL"
		"       FROM k WHERE m.bucket = k.bucket AND m.id = k.id"
		"       RETURNING k.ord, m.id, m.source, m.message_id, m.payload, m.headers,"
		"                 m.received_at, m.attempts, m.lease_token, m.lease_until)"
		" SELECT id, source, message_id, payload, headers, received_at, attempts,"
		"        lease_token, lease_until FROM u ORDER BY ord",
		4, {UUIDARRAYOID, INT4ARRAYOID, UUIDOID, TIMESTAMPTZOID}
	},
	/* a message whose last allowed attempt expired (locked by this transaction) */
	[ST_DEAD] = {
		"UPDATE idempotency.inbox_messages m"
		" SET dead_at = $3, lease_token = NULL, lease_until = NULL,"
		"     last_error = coalesce(m.last_error, 'lease expired')"
		" WHERE m.bucket = $1 AND m.id = $2",
		3, {INT4OID, UUIDOID, TIMESTAMPTZOID}
	},
	/* the ids say their partition: one statement per bucket */
	[ST_DONE] = {
		"UPDATE idempotency.inbox_messages m"
		" SET done_at = $3, lease_token = NULL, lease_until = NULL, retry_at = NULL"
		" WHERE m.bucket = $1 AND m.id = ANY ($2) AND m.done_at IS NULL"
		"   AND ($4::uuid IS NULL OR (m.lease_token = $4 AND m.lease_until > $3"
		"                             AND m.dead_at IS NULL))",
		4, {INT4OID, UUIDARRAYOID, TIMESTAMPTZOID, UUIDOID}
	},
	[ST_LOCK_ONE] = {
		"SELECT m.attempts, m.lease_token, m.lease_until,"
		"       m.done_at IS NOT NULL OR m.dead_at IS NOT NULL"
		" FROM idempotency.inbox_messages m WHERE m.bucket = $1 AND m.id = $2 FOR UPDATE",
		2, {INT4OID, UUIDOID}
	},
	[ST_FAIL] = {
		"UPDATE idempotency.inbox_messages m"
		" SET last_error = $3, lease_token = NULL, lease_until = NULL, retry_at = $4, dead_at = $5"
		" WHERE m.bucket = $1 AND m.id = $2",
		5, {INT4OID, UUIDOID, TEXTOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
	},

	/*
	 * The messages a token holds the live lease of, among the undone ones:
	 * the (done_at, dead_at) index finds those without reading the done
	 * ones, so the cost grows with the backlog, not with the history (an
	 * index on lease_token would cost every claim its HOT update).
	 */
	[ST_EXTEND] = {
		"UPDATE idempotency.inbox_messages m SET lease_until = $2"
		" WHERE m.done_at IS NULL AND m.dead_at IS NULL"
		"   AND m.lease_token = $1 AND m.lease_until > $3",
		3, {UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
	},

	/*
	 * Ids sort by received_at: [$2, $3) is the time range as ids, a range
	 * scan of each partition's id index.
	 */
	[ST_REPLAY] = {
		"UPDATE idempotency.inbox_messages m"
		" SET attempts = 0, done_at = NULL, dead_at = NULL, lease_token = NULL,"
		"     lease_until = NULL, retry_at = NULL, last_error = NULL"
		" WHERE m.id >= $2 AND m.id < $3 AND m.source = $1"
		"   AND m.received_at >= $4 AND m.received_at < $5"
		"   AND (m.done_at IS NOT NULL OR m.dead_at IS NOT NULL)",
		5, {TEXTOID, UUIDOID, UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
	},
};

static SPIPlanPtr prepared[NUM_STATEMENTS];

/* Run a statement (see idem_statement_exec). */
static uint64
inbox_exec(InboxStatement st, Datum *values, const char *nulls, int expected)
{
	return idem_statement_exec(&inbox_plans[st], &prepared[st], values, nulls, expected);
}

/*---- receiving ----*/

/* columns of idempotency.inbox_messages and its partitions, in order */
#define Natts_inbox_messages	17
static const char *const message_column_names[Natts_inbox_messages] = {
	"id", "source", "message_id", "ordering_key", "seq", "payload", "headers",
	"received_at", "txid", "bucket", "attempts", "lease_token", "lease_until",
	"retry_at", "done_at", "dead_at", "last_error"
};

/*
 * The ordering key a message's headers carry, as headers->>'ordering_key'
 * gives it, or NULL (no key, or JSON null); a string or a number.
 */
static char *
ordering_key(Jsonb *headers)
{
	JsonbValue	k;
	JsonbValue *v;
	char	   *s;

	k.type = jbvString;
	k.val.string.val = "ordering_key";
	k.val.string.len = strlen("ordering_key");
	v = findJsonbValueFromContainer(&headers->root, JB_FOBJECT, &k);
	if (v == NULL || v->type == jbvNull)
		return NULL;
	switch (v->type)
	{
		case jbvString:
			s = pnstrdup(v->val.string.val, v->val.string.len);
			break;
		case jbvNumeric:
			s = DatumGetCString(DirectFunctionCall1(numeric_out,
													NumericGetDatum(v->val.numeric)));
			break;
		default:
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("ordering_key in the headers must be a JSON string or number")));
	}
	return idem_check_name(cstring_to_text(s), "ordering_key", IDEM_MAX_KEY_BYTES);
}

/* The next seq of (source, key); the counter's row stays locked to commit. */
static int64
next_seq(const char *source, const char *key)
{
	Datum		values[2];
	uint64		n;
	bool		isnull;

	values[0] = CStringGetTextDatum(source);
	values[1] = CStringGetTextDatum(key);
	n = inbox_exec(ST_NEXT_SEQ, values, NULL, SPI_OK_UPDATE_RETURNING);
	if (n == 0)
		n = inbox_exec(ST_FIRST_SEQ, values, NULL, SPI_OK_INSERT_RETURNING);
	if (n != 1)
		elog(ERROR, "inbox receive took " UINT64_FORMAT " seqs", n);
	return DatumGetInt64(idem_spi_col(0, 1, &isnull));
}

/*
 * idem_inbox_receive(source, message_id, payload, headers = '{}'): true if
 * the message is new and now stored in the caller's transaction.
 */
Datum
idem_inbox_receive(PG_FUNCTION_ARGS)
{
	char	   *source = idem_name_arg(fcinfo, 0, "source", INBOX_MAX_SOURCE_BYTES);
	text	   *message_id;
	Jsonb	   *payload;
	Jsonb	   *headers;
	char	   *key;
	FullTransactionId txid;
	TimestampTz ts;
	int32		bucket;
	int64		seq = 0;
	Relation	rel;
	IdemIndexSet ins;
	pg_uuid_t	id;
	Datum		values[Natts_inbox_messages];
	bool		nulls[Natts_inbox_messages] = {false};
	IdemAsOwner as;

	if (PG_ARGISNULL(1))
		idem_null_argument("message_id");
	message_id = PG_GETARG_TEXT_PP(1);
	(void) idem_check_name(message_id, "message_id", IDEM_MAX_KEY_BYTES);
	if (PG_ARGISNULL(2))
		idem_null_argument("payload");
	payload = PG_GETARG_JSONB_P(2);
	headers = PG_ARGISNULL(3) ? idem_empty_object()
		: idem_check_object(PG_GETARG_JSONB_P(3), "inbox message headers");
	key = ordering_key(headers);
	idem_capability_require("idem_inbox_receive", IDEM_CAP_HANDLER, IDEM_AXIS_SOURCE, source);

	if (!idem_claim_key(cstring_to_text(psprintf(IDEM_INBOX_SCOPE_PREFIX "%s", source)),
						message_id, payload, "idem_inbox_receive()"))
		PG_RETURN_BOOL(false);

	txid = GetTopFullTransactionId();
	ts = idem_row_time(txid);
	idem_spi_connect_as_owner(&as);
	rel = idem_store_open_target(IDEM_STORE_INBOX, ts, &bucket,
								 message_column_names, Natts_inbox_messages);
	if (key != NULL)
		seq = next_seq(source, key);
	idem_spi_finish_as_owner(&as);

	idem_row_id(ts, bucket, txid, &id);
	values[0] = UUIDPGetDatum(&id);
	values[1] = CStringGetTextDatum(source);
	values[2] = PointerGetDatum(message_id);
	values[3] = key != NULL ? CStringGetTextDatum(key) : (Datum) 0;
	nulls[3] = key == NULL;
	values[4] = Int64GetDatum(seq);
	nulls[4] = key == NULL;
	values[5] = JsonbPGetDatum(payload);
	values[6] = JsonbPGetDatum(headers);
	values[7] = TimestampTzGetDatum(ts);
	values[8] = FullTransactionIdGetDatum(txid);
	values[9] = Int32GetDatum(bucket);
	values[10] = Int32GetDatum(0);
	for (int i = 11; i < Natts_inbox_messages; i++)
	{
		values[i] = (Datum) 0;
		nulls[i] = true;
	}
	idem_open_insert_indexes(rel, &ins, "inbox partition");
	idem_insert_row(&ins, values, nulls, InvalidOid);
	idem_close_insert_indexes(&ins);
	table_close(rel, NoLock);
	PG_RETURN_BOOL(true);
}

/*---- claiming ----*/

/* A message's state as a claim reads it (STATE_COLUMNS). */
typedef struct MessageState
{
	pg_uuid_t	id;
	int32		bucket;
	char	   *source;
	char	   *key;			/* ordering key, or NULL */
	int64		seq;
	int32		attempts;
	bool		leased;			/* lease_until set */
	TimestampTz lease_until;
	bool		waiting;		/* retry_at set */
	TimestampTz retry_at;
	bool		dead;
} MessageState;

static void
read_state(uint64 row, MessageState *m)
{
	bool		isnull;
	Datum		v;

	memcpy(&m->id, DatumGetUUIDP(idem_spi_col(row, 1, &isnull)), sizeof(pg_uuid_t));
	m->bucket = DatumGetInt32(idem_spi_col(row, 2, &isnull));
	m->source = TextDatumGetCString(idem_spi_col(row, 3, &isnull));
	v = idem_spi_col(row, 4, &isnull);
	m->key = isnull ? NULL : TextDatumGetCString(v);
	v = idem_spi_col(row, 5, &isnull);
	m->seq = isnull ? 0 : DatumGetInt64(v);
	m->attempts = DatumGetInt32(idem_spi_col(row, 6, &isnull));
	v = idem_spi_col(row, 7, &isnull);
	m->leased = !isnull;
	m->lease_until = isnull ? 0 : DatumGetTimestampTz(v);
	v = idem_spi_col(row, 8, &isnull);
	m->waiting = !isnull;
	m->retry_at = isnull ? 0 : DatumGetTimestampTz(v);
	m->dead = DatumGetBool(idem_spi_col(row, 9, &isnull));
}

typedef struct LeaseCall
{
	int32		batch;
	TimestampTz now;
	TimestampTz until;
	pg_uuid_t	token;
	Datum		sources;		/* text[], or 0 */
	bool		has_sources;
	const IdemCapGrants *grants;	/* the relay's limits, or NULL */
	ReturnSetInfo *rsinfo;
	int			taken;			/* handed out so far */
	/* what this round hands out */
	Datum	   *ids;
	Datum	   *buckets;
	int			n;
} LeaseCall;

static void
take(LeaseCall *c, MessageState *m)
{
	c->ids[c->n] = UUIDPGetDatum(&m->id);
	c->buckets[c->n] = Int32GetDatum(m->bucket);
	c->n++;
}

/*
 * An expired lease ended the message's last attempt as failed; if that was
 * the last one allowed, the message is dead now (and blocks its key).
 * Returns true if it died.
 */
static bool
died_of_expiry(LeaseCall *c, MessageState *m)
{
	Datum		values[3];

	if (!m->leased || m->attempts < inbox_max_attempts)
		return false;
	values[0] = Int32GetDatum(m->bucket);
	values[1] = UUIDPGetDatum(&m->id);
	values[2] = TimestampTzGetDatum(c->now);
	(void) inbox_exec(ST_DEAD, values, NULL, SPI_OK_UPDATE);
	m->dead = true;
	return true;
}

/* Is the message leasable now (of a run: the head was, the rest may not be)? */
static bool
leasable(LeaseCall *c, MessageState *m)
{
	if (m->dead || (m->leased && m->lease_until > c->now) ||
		(m->waiting && m->retry_at > c->now))
		return false;
	return !died_of_expiry(c, m);
}

/*
 * Hand out a key's head and the run after it: its undone messages in seq
 * order, up to the first that is not leasable or the end of the batch.
 * The rows of the run read here stay locked to the end of the transaction.
 */
static void
take_run(LeaseCall *c, MessageState *head)
{
	Datum		values[4];
	uint64		got;
	MessageState *run;

	values[0] = CStringGetTextDatum(head->source);
	values[1] = CStringGetTextDatum(head->key);
	values[2] = TimestampTzGetDatum(c->now);
	if (inbox_exec(ST_KEY_LEASED, values, NULL, SPI_OK_SELECT) > 0)
		return;
	if (!leasable(c, head))
		return;
	take(c, head);
	if (c->taken + c->n >= c->batch)
		return;
	values[2] = Int64GetDatum(head->seq);
	values[3] = Int32GetDatum(c->batch - c->taken - c->n);
	got = inbox_exec(ST_RUN, values, NULL, SPI_OK_SELECT);
	run = palloc(sizeof(MessageState) * Max(got, 1));
	for (uint64 r = 0; r < got; r++)
		read_state(r, &run[r]);
	for (uint64 r = 0; r < got; r++)
	{
		if (!leasable(c, &run[r]))
			break;
		take(c, &run[r]);
	}
}

/* Lease what this round took and return it; the rows are locked by us. */
static void
lease_taken(LeaseCall *c)
{
	Datum		values[4];
	uint64		got;

	if (c->n == 0)
		return;
	values[0] = idem_build_array(c->ids, NULL, c->n, UUIDOID);
	values[1] = idem_build_array(c->buckets, NULL, c->n, INT4OID);
	values[2] = UUIDPGetDatum(&c->token);
	values[3] = TimestampTzGetDatum(c->until);
	got = inbox_exec(ST_LEASE, values, NULL, SPI_OK_SELECT);
	if (got != (uint64) c->n)
		elog(ERROR, "inbox claim leased " UINT64_FORMAT " messages, not %d", got, c->n);
	for (uint64 r = 0; r < got; r++)
	{
		Datum		out[9];
		bool		nulls[9];

		heap_deform_tuple(SPI_tuptable->vals[r], SPI_tuptable->tupdesc, out, nulls);
		tuplestore_putvalues(c->rsinfo->setResult, c->rsinfo->setDesc, out, nulls);
	}
	c->taken += c->n;
	c->n = 0;
}

/* One candidate query and what follows; false if there is nothing more. */
static bool
lease_round(LeaseCall *c)
{
	Datum		values[3];
	char		nulls[3] = {' ', ' ', ' '};
	int32		want = c->batch - c->taken;
	uint64		got;
	MessageState *cands;

	values[0] = TimestampTzGetDatum(c->now);
	values[1] = Int32GetDatum(want);
	values[2] = c->sources;
	if (!c->has_sources)
		nulls[2] = 'n';
	got = inbox_exec(ST_CANDIDATES, values, nulls, SPI_OK_SELECT);
	cands = palloc(sizeof(MessageState) * Max(got, 1));
	for (uint64 r = 0; r < got; r++)
		read_state(r, &cands[r]);
	c->ids = palloc(sizeof(Datum) * want);
	c->buckets = palloc(sizeof(Datum) * want);
	c->n = 0;
	for (uint64 r = 0; r < got && c->taken + c->n < c->batch; r++)
	{
		if (!idem_capability_allows(c->grants, IDEM_AXIS_SOURCE, cands[r].source))
			continue;			/* a relay limited by prefix: not its source */
		if (cands[r].key != NULL)
			take_run(c, &cands[r]);
		else if (leasable(c, &cands[r]))
			take(c, &cands[r]);
	}
	lease_taken(c);
	/* a full page of candidates may have left more behind */
	return got == (uint64) want;
}

/*
 * idem_inbox_claim(batch = 100, lease = '30 seconds', sources = NULL)
 * returns setof idem_inbox_message, all under one lease token.
 */
Datum
idem_inbox_claim(PG_FUNCTION_ARGS)
{
	LeaseCall		c = {0};
	int64		lease;
	IdemAsOwner as;
	Datum	   *elems;
	int			nsources = idem_lease_batch_args(fcinfo, &c.batch, &lease, "sources", &elems);
	char	  **names;

	if (nsources >= 0)
	{
		c.sources = PG_GETARG_DATUM(2);
		c.has_sources = true;
	}

	/*
	 * A relay limited to some sources: asking for another is refused;
	 * asking for none leases only its own (named in the statement when the
	 * limits are exact names, else filtered here).
	 */
	c.grants = idem_capability_require_any("idem_inbox_claim", IDEM_CAP_RELAY);
	for (int i = 0; i < nsources; i++)
		idem_capability_check_value("idem_inbox_claim", IDEM_CAP_RELAY, c.grants,
									IDEM_AXIS_SOURCE, TextDatumGetCString(elems[i]));
	if (!c.has_sources &&
		(nsources = idem_capability_exact_names(c.grants, IDEM_AXIS_SOURCE, &names)) >= 0)
	{
		c.sources = idem_text_array(names, nsources);
		c.has_sources = true;
	}
	InitMaterializedSRF(fcinfo, 0);
	c.rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	c.now = idem_now();
	c.until = c.now + lease;
	idem_lease_token(&c.token);

	idem_spi_connect_as_owner(&as);
	for (int round = 0; round < INBOX_CLAIM_ROUNDS && c.taken < c.batch; round++)
	{
		int			before = c.taken;

		if (!lease_round(&c) || c.taken == before)
			break;
	}
	idem_spi_finish_as_owner(&as);
	return (Datum) 0;
}

/*---- settling: done, fail ----*/

/*
 * idem_inbox_done(ids, lease_token = NULL): mark messages processed and
 * return how many.  With a token, only messages whose live lease it is;
 * without, any message not done yet (dead ones included: the way to give
 * up on one).
 */
Datum
idem_inbox_done(PG_FUNCTION_ARGS)
{
	Datum	   *ids;
	int			n = idem_array_arg(fcinfo, 0, "ids", UUIDOID, &ids);
	int32	   *buckets;
	Datum	   *group;
	TimestampTz now = idem_now();
	uint64		marked = 0;
	const IdemCapGrants *g = idem_capability_require_any("idem_inbox_done", IDEM_CAP_RELAY);
	IdemAsOwner as;

	if (n == 0)
		PG_RETURN_INT32(0);
	buckets = palloc(sizeof(int32) * n);
	group = palloc(sizeof(Datum) * n);
	for (int i = 0; i < n; i++)
		if (!idem_row_id_parts(DatumGetUUIDP(ids[i]), NULL, &buckets[i], NULL))
			buckets[i] = 0;		/* not a message id */

	idem_spi_connect_as_owner(&as);
	/* one statement per partition the ids name (usually one) */
	for (int i = 0; i < n; i++)
	{
		bool		seen = buckets[i] == 0;
		int			m = 0;
		Datum		values[4];
		char		nulls[4] = {' ', ' ', ' ', ' '};

		for (int j = 0; j < i && !seen; j++)
			seen = buckets[j] == buckets[i];
		if (seen)
			continue;
		for (int j = i; j < n; j++)
			if (buckets[j] == buckets[i])
				group[m++] = ids[j];
		values[0] = Int32GetDatum(buckets[i]);
		values[1] = idem_build_array(group, NULL, m, UUIDOID);
		if (idem_capability_limited(g, IDEM_AXIS_SOURCE))
		{
			/* a limited relay: another source's message is as good as unknown */
			uint64		got = inbox_exec(ST_SOURCES_OF, values, NULL, SPI_OK_SELECT);
			bool		isnull;

			m = 0;
			for (uint64 r = 0; r < got; r++)
				if (idem_capability_allows(g, IDEM_AXIS_SOURCE,
										   TextDatumGetCString(idem_spi_col(r, 2, &isnull))))
					group[m++] = idem_spi_col(r, 1, &isnull);
			values[1] = idem_build_array(group, NULL, m, UUIDOID);
		}
		values[2] = TimestampTzGetDatum(now);
		if (PG_ARGISNULL(1))
		{
			values[3] = (Datum) 0;
			nulls[3] = 'n';
		}
		else
			values[3] = PG_GETARG_DATUM(1);
		marked += inbox_exec(ST_DONE, values, nulls, SPI_OK_UPDATE);
	}
	idem_spi_finish_as_owner(&as);
	PG_RETURN_INT32((int32) Min(marked, PG_INT32_MAX));
}

/*
 * idem_inbox_fail(id, error, retry_after = NULL, lease_token = NULL):
 * record a failed attempt and end the lease.  The message is leasable
 * again after retry_after (default: the backoff), or dead if that was its
 * last attempt.  Nothing happens to a message that is done or dead, or
 * whose live lease the token is not.
 */
Datum
idem_inbox_fail(PG_FUNCTION_ARGS)
{
	pg_uuid_t  *id;
	char	   *error;
	int64		retry_after;
	TimestampTz now = idem_now();
	int32		bucket;
	Datum		values[5];
	char		nulls[5] = {' ', ' ', ' ', ' ', ' '};
	bool		isnull;
	int32		attempts;
	bool		settled;
	TimestampTz retry_at = 0;
	const IdemCapGrants *g;
	IdemAsOwner as;

	idem_lease_fail_args(fcinfo, &id, &error, &retry_after);
	g = idem_capability_require_any("idem_inbox_fail", IDEM_CAP_RELAY);
	if (!idem_row_id_parts(id, NULL, &bucket, NULL))
		PG_RETURN_VOID();		/* not a message id */

	idem_spi_connect_as_owner(&as);
	values[0] = Int32GetDatum(bucket);
	if (idem_capability_limited(g, IDEM_AXIS_SOURCE))
	{
		/* a limited relay: another source's message is as good as unknown */
		Datum		one = UUIDPGetDatum(id);

		values[1] = idem_build_array(&one, NULL, 1, UUIDOID);
		if (inbox_exec(ST_SOURCES_OF, values, NULL, SPI_OK_SELECT) != 1 ||
			!idem_capability_allows(g, IDEM_AXIS_SOURCE,
									TextDatumGetCString(idem_spi_col(0, 2, &isnull))))
		{
			idem_spi_finish_as_owner(&as);
			PG_RETURN_VOID();
		}
	}
	values[1] = UUIDPGetDatum(id);
	if (inbox_exec(ST_LOCK_ONE, values, NULL, SPI_OK_SELECT) != 1)
	{
		idem_spi_finish_as_owner(&as);
		PG_RETURN_VOID();		/* no such message (any more) */
	}
	attempts = DatumGetInt32(idem_spi_col(0, 1, &isnull));
	settled = DatumGetBool(idem_spi_col(0, 4, &isnull));
	if (!PG_ARGISNULL(3))
	{
		Datum		token = idem_spi_col(0, 2, &isnull);
		Datum		until;
		bool		until_null;

		until = idem_spi_col(0, 3, &until_null);
		if (isnull || until_null || DatumGetTimestampTz(until) <= now ||
			memcmp(DatumGetUUIDP(token), PG_GETARG_UUID_P(3), sizeof(pg_uuid_t)) != 0)
			settled = true;		/* not this holder's attempt */
	}
	if (!settled)
	{
		values[2] = CStringGetTextDatum(error);
		if (idem_attempt_failed(attempts, inbox_max_attempts, retry_after, now, &retry_at))
		{
			nulls[3] = 'n';
			values[4] = TimestampTzGetDatum(now);
		}
		else
		{
			values[3] = TimestampTzGetDatum(retry_at);
			nulls[4] = 'n';
		}
		(void) inbox_exec(ST_FAIL, values, nulls, SPI_OK_UPDATE);
	}
	idem_spi_finish_as_owner(&as);
	PG_RETURN_VOID();
}

/*
 * idem_inbox_extend(lease_token, lease): prolong the live lease of a token
 * to lease from now, on its messages not settled yet, and return how many
 * those are.  A token whose lease expired (its messages may have gone to
 * another worker) prolongs nothing: 0.
 */
Datum
idem_inbox_extend(PG_FUNCTION_ARGS)
{
	Datum		values[3];
	uint64		n;
	const IdemCapGrants *g;
	IdemAsOwner as;

	idem_lease_extend_args(fcinfo, values);
	g = idem_capability_require_any("idem_inbox_extend", IDEM_CAP_RELAY);
	idem_spi_connect_as_owner(&as);
	/* a limited relay extends nothing if the lease holds another source */
	if (idem_capability_limited(g, IDEM_AXIS_SOURCE))
	{
		n = inbox_exec(ST_TOKEN_SOURCES, values, NULL, SPI_OK_SELECT);
		for (uint64 r = 0; r < n; r++)
		{
			bool		isnull;

			if (!idem_capability_allows(g, IDEM_AXIS_SOURCE,
										TextDatumGetCString(idem_spi_col(r, 1, &isnull))))
			{
				idem_spi_finish_as_owner(&as);
				PG_RETURN_INT32(0);
			}
		}
	}
	n = inbox_exec(ST_EXTEND, values, NULL, SPI_OK_UPDATE);
	idem_spi_finish_as_owner(&as);
	PG_RETURN_INT32((int32) Min(n, PG_INT32_MAX));
}

/*---- replay ----*/

/*
 * idem_inbox_replay(source, since, until = now()): make the done and dead
 * messages of source received in [since, until) leasable again, attempts
 * reset; returns how many.  Their claims stay: receiving them again is
 * still a duplicate.
 */
Datum
idem_inbox_replay(PG_FUNCTION_ARGS)
{
	char	   *source = idem_name_arg(fcinfo, 0, "source", INBOX_MAX_SOURCE_BYTES);
	TimestampTz since;
	TimestampTz until;
	pg_uuid_t	lo;
	pg_uuid_t	hi;
	Datum		values[5];
	uint64		n;
	IdemAsOwner as;

	if (PG_ARGISNULL(1))
		idem_null_argument("since");
	if (PG_ARGISNULL(2))
		idem_null_argument("until");
	since = PG_GETARG_TIMESTAMPTZ(1);
	until = PG_GETARG_TIMESTAMPTZ(2);
	if (since > until)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("since must not be later than until")));
	idem_row_id_bound(since, &lo);
	idem_row_id_bound(until, &hi);
	idem_capability_require("idem_inbox_replay", IDEM_CAP_OPERATOR, IDEM_AXIS_SOURCE, source);

	idem_spi_connect_as_owner(&as);
	values[0] = CStringGetTextDatum(source);
	values[1] = UUIDPGetDatum(&lo);
	values[2] = UUIDPGetDatum(&hi);
	values[3] = TimestampTzGetDatum(since);
	values[4] = TimestampTzGetDatum(until);
	n = inbox_exec(ST_REPLAY, values, NULL, SPI_OK_UPDATE);
	idem_spi_finish_as_owner(&as);
	PG_RETURN_INT32((int32) Min(n, PG_INT32_MAX));
}
