/*-------------------------------------------------------------------------
 *
 * requests.c
 *	  Request idempotency: stored responses for HTTP-style Idempotency-Key
 *	  requests whose work spans several transactions (SPEC section 5).
 *
 * A request is a claim in scope 'request:<scope>' (claims.c: the same
 * uniqueness across partitions, concurrency and retention as any claim)
 * plus one row of idempotency.requests that holds its state.  begin()
 * claims the key and then acts on the key's row: none yet, it inserts it
 * ('started', attempt 1, under a lease); otherwise it returns the stored
 * response ('completed'), raises IK002 while another attempt's lease is
 * live (after waiting up to "wait" for it to finish), or takes over an
 * expired lease as the next attempt, resuming from the last recovery point.
 * The attempt number is the only holder identity and the fencing token:
 * every call that acts for an attempt checks it is still current (IK003 if
 * not), and it never repeats for a key, not even after abandon().
 *
 * Responses.  complete() stores the body once, as jsonb ("response") or as
 * text ("response_body"), with the status and the headers (checked, names
 * lower-cased), and returns what it stored as begin() replays it: the body
 * text is the text stored or the jsonb's canonical text, so the first
 * answer and every replay are the same bytes.  With on_conflict 'return',
 * begin() gives a live holder back as the row 'in_progress' instead of
 * IK002: it then runs in a subtransaction that it rolls back, so that it
 * leaves nothing behind, not even the claim it may have made.
 *
 * A request and its claim live and leave together: a key has at most one
 * row, and a claim that is new (the key's earlier claim expired or was
 * released while its row stayed, their partitions being dropped apart) makes
 * the key new, so begin() starts afresh in that row as the next attempt,
 * its created_at renewed with the claim's (a row that outlived its claim is
 * never a second request of the key).  A row that went before its claim is
 * made again as attempt 1.
 *
 * Snapshots.  begin() decides from the row as it is now (read with a fresh
 * snapshot under REPEATABLE READ and SERIALIZABLE, as the claim's probe
 * reads claims): the stored response, IK002 or a wait hold under any
 * snapshot.  Its writes, and the holder's calls, run under the
 * transaction's snapshot; one that finds the row changed since, or finds no
 * row where the fresh look finds one it would have acted on, raises 40001
 * (a retry in a new transaction decides again).  So no snapshot ever makes
 * a second attempt 1 or runs an effect twice.
 *
 * Locking rules:
 *	- begin() of a new key holds the claim's value lock (claims.c) and then
 *	  the claim itself to commit: concurrent begins of the key wait for that
 *	  transaction and then find its row.
 *	- A row is only ever inserted under a transaction-level advisory lock on
 *	  the key, after a fresh look that finds none: of two begins that would
 *	  make the row, the second sees the first's.
 *	- A takeover and every call of a holder lock the request's row:
 *	  fence() with FOR SHARE, the others by updating it.  begin()'s update
 *	  names the row as it saw it (bucket, attempt, status, lease expired), so
 *	  a takeover waits for a fenced transaction of the old holder to end,
 *	  and then finds, or the holder finds, that the attempt moved on.
 *	- begin() with "wait" polls the row (a live lease is not a lock; the
 *	  holder may be between transactions), sleeping on its latch.
 *	- begin() with on_conflict 'return' takes these locks in its
 *	  subtransaction: rolled back (in_progress), it releases them at once;
 *	  otherwise they pass to the caller's transaction, as without it.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/ownership.h"
#include "common/keys.h"
#include "common/rows.h"
#include "stats/stats.h"
#include "claims/claims.h"
#include "delivery/store.h"

#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "utils/lsyscache.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_request_begin);
PG_FUNCTION_INFO_V1(idem_request_checkpoint);
PG_FUNCTION_INFO_V1(idem_request_fence);
PG_FUNCTION_INFO_V1(idem_request_extend);
PG_FUNCTION_INFO_V1(idem_request_complete);
PG_FUNCTION_INFO_V1(idem_request_abandon);

/* claims of requests go into scope REQUEST_SCOPE_PREFIX || scope */
#define REQUEST_SCOPE_PREFIX	"request:"
#define MAX_REQUEST_SCOPE_BYTES	(IDEM_MAX_SCOPE_BYTES - (int) strlen(REQUEST_SCOPE_PREFIX))

/* how long begin() with wait sleeps between looks, at first and at most */
#define WAIT_FIRST_MS	10
#define WAIT_MAX_MS		100

/* columns of idempotency.requests and its partitions, in order */
#define Natts_requests	15
static const char *const request_columns[Natts_requests] = {
	"scope", "key", "digest", "status", "attempt", "lease_until", "recovery_point",
	"state", "response", "response_status", "response_body", "response_headers",
	"created_at", "updated_at", "bucket"
};

typedef enum RequestStatement
{
	ST_FIND,
	ST_FIND_FOR_SHARE,
	ST_TAKE_OVER,
	ST_RESTART,
	ST_CHECKPOINT,
	ST_EXTEND,
	ST_COMPLETE,
	ST_ABANDON,
	NUM_STATEMENTS
} RequestStatement;

#define ROW_COLUMNS \
	"status, attempt, lease_until, digest, recovery_point, state, response, response_status," \
	" bucket, response_body, response_headers"
#define FIND_ROW \
	"SELECT " ROW_COLUMNS " FROM idempotency.requests WHERE scope = $1 AND key = $2"
#define WHERE_HELD \
	" WHERE scope = $1 AND key = $2 AND status = 'started' AND attempt = $3"
/* the row as begin() saw it ($3 bucket, $4 attempt, $5 status), not live at $6 */
#define WHERE_AS_SEEN \
	" WHERE scope = $1 AND key = $2 AND bucket = $3 AND attempt = $4 AND status = $5" \
	"   AND (status <> 'started' OR lease_until <= $6)"
#define RETURN_ROW " RETURNING " ROW_COLUMNS
#define AS_SEEN_TYPES	TEXTOID, TEXTOID, INT4OID, INT4OID, TEXTOID, TIMESTAMPTZOID

static const IdemStatement request_plans[NUM_STATEMENTS] = {
	[ST_FIND] = {FIND_ROW, 2, {TEXTOID, TEXTOID}},
	[ST_FIND_FOR_SHARE] = {FIND_ROW " FOR SHARE", 2, {TEXTOID, TEXTOID}},
	/* the next attempt resumes from the last recovery point */
	[ST_TAKE_OVER] = {
		"UPDATE idempotency.requests SET attempt = attempt + 1, lease_until = $7, updated_at = $6"
		WHERE_AS_SEEN RETURN_ROW,
		7, {AS_SEEN_TYPES, TIMESTAMPTZOID}},
	/*
	 * after abandon(), or for a new claim: afresh, but the attempt number
	 * still goes up; a new claim's time is the row's ($9), else it is kept
	 */
	[ST_RESTART] = {
		"UPDATE idempotency.requests SET status = 'started', attempt = attempt + 1,"
		"       lease_until = $7, updated_at = $6, digest = $8, created_at = coalesce($9, created_at),"
		"       recovery_point = NULL, state = NULL, response = NULL, response_status = NULL,"
		"       response_body = NULL, response_headers = NULL"
		WHERE_AS_SEEN RETURN_ROW,
		9, {AS_SEEN_TYPES, TIMESTAMPTZOID, BYTEAOID, TIMESTAMPTZOID}},
	[ST_CHECKPOINT] = {
		"UPDATE idempotency.requests SET recovery_point = $4,"
		"       state = coalesce($5, state), updated_at = $6" WHERE_HELD,
		6, {TEXTOID, TEXTOID, INT4OID, TEXTOID, JSONBOID, TIMESTAMPTZOID}},
	[ST_EXTEND] = {
		"UPDATE idempotency.requests SET lease_until = $4, updated_at = $5" WHERE_HELD,
		5, {TEXTOID, TEXTOID, INT4OID, TIMESTAMPTZOID, TIMESTAMPTZOID}},
	[ST_COMPLETE] = {
		"UPDATE idempotency.requests SET status = 'completed', lease_until = NULL,"
		"       response = $4, response_status = $5, updated_at = $6,"
		"       response_body = $7, response_headers = $8"
		" WHERE scope = $1 AND key = $2 AND status = 'started'"
		"   AND ($3 IS NULL OR attempt = $3)",
		8, {TEXTOID, TEXTOID, INT4OID, JSONBOID, INT4OID, TIMESTAMPTZOID, TEXTOID, JSONBOID}},
	[ST_ABANDON] = {
		"UPDATE idempotency.requests SET status = 'abandoned', lease_until = NULL,"
		"       recovery_point = NULL, state = NULL, response = NULL, response_status = NULL,"
		"       response_body = NULL, response_headers = NULL, updated_at = $4"
		" WHERE scope = $1 AND key = $2 AND ($3 IS NULL OR attempt = $3)",
		4, {TEXTOID, TEXTOID, INT4OID, TIMESTAMPTZOID}},
};

static SPIPlanPtr prepared[NUM_STATEMENTS];

/* Run a statement (see idem_statement_exec). */
static uint64
request_exec(RequestStatement st, Datum *values, const char *nulls, int expected)
{
	return idem_statement_exec(&request_plans[st], &prepared[st], values, nulls, expected);
}

/*
 * Run a statement that reads the row as it is now: under a snapshot taken
 * now, which at READ COMMITTED is what every statement gets anyway.
 */
static uint64
request_exec_fresh(RequestStatement st, Datum *values, const char *nulls, int expected)
{
	MemoryContext cxt = CurrentMemoryContext;
	volatile int rc = 0;

	if (!IsolationUsesXactSnapshot())
		return request_exec(st, values, nulls, expected);
	PG_TRY();
	{
		rc = SPI_execute_snapshot(idem_statement_plan(&request_plans[st], &prepared[st]),
								  values, nulls, GetLatestSnapshot(), InvalidSnapshot,
								  false, false, 0);
	}
	PG_CATCH();
	{
		idem_rethrow_without_sql(cxt, request_plans[st].sql);	/* no SQL text shown */
	}
	PG_END_TRY();
	if (rc != expected)
		elog(ERROR, "SPI_execute_snapshot failed (%s): %s",
			 SPI_result_code_string(rc), request_plans[st].sql);
	return SPI_processed;
}

/*---- arguments ----*/

/* A request's key and scope, checked, and its claim's scope. */
typedef struct RequestKey
{
	text	   *key;
	text	   *scope;
	char	   *key_str;
	char	   *scope_str;
	text	   *claim_scope;
} RequestKey;

static void
request_key_args(FunctionCallInfo fcinfo, RequestKey *rk)
{
	if (PG_ARGISNULL(0))
		idem_null_argument("key");
	if (PG_ARGISNULL(1))
		idem_null_argument("scope");
	rk->key = PG_GETARG_TEXT_PP(0);
	rk->scope = PG_GETARG_TEXT_PP(1);
	idem_check_key(rk->key);
	idem_check_scope(rk->scope, MAX_REQUEST_SCOPE_BYTES);
	rk->key_str = text_to_cstring(rk->key);
	rk->scope_str = text_to_cstring(rk->scope);
	rk->claim_scope = cstring_to_text(psprintf("%s%s", REQUEST_SCOPE_PREFIX, rk->scope_str));
	idem_capability_require(get_func_name(fcinfo->flinfo->fn_oid), IDEM_CAP_HANDLER,
							IDEM_AXIS_SCOPE, rk->scope_str);
}

/* A required attempt argument: NULL is 22004, below 1 is 22023. */
static int32
attempt_arg(FunctionCallInfo fcinfo, int argno)
{
	int32		attempt;

	if (PG_ARGISNULL(argno))
		idem_null_argument("attempt");
	attempt = PG_GETARG_INT32(argno);
	if (attempt < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("attempt must be positive"),
				 errdetail("Attempts count from 1; %d was given.", attempt)));
	return attempt;
}

/* An optional attempt argument: 0 for NULL (whichever is current). */
static int32
optional_attempt_arg(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? 0 : attempt_arg(fcinfo, argno);
}

/* An argument that may be NULL, as an SPI value and null flag. */
static void
nullable_arg(FunctionCallInfo fcinfo, int argno, Datum *value, char *null)
{
	*value = PG_ARGISNULL(argno) ? (Datum) 0 : PG_GETARG_DATUM(argno);
	*null = PG_ARGISNULL(argno) ? 'n' : ' ';
}

/*---- the stored row ----*/

typedef enum RequestStatus
{
	REQ_NONE,					/* no row */
	REQ_STARTED,
	REQ_COMPLETED,
	REQ_ABANDONED
} RequestStatus;

static const char *const status_names[] = {
	[REQ_NONE] = "none", [REQ_STARTED] = "started",
	[REQ_COMPLETED] = "completed", [REQ_ABANDONED] = "abandoned"
};

typedef struct RequestRow
{
	RequestStatus status;
	int32		attempt;
	TimestampTz lease_until;	/* DT_NOBEGIN if none */
	bytea	   *digest;			/* NULL if none */
	Datum		recovery_point;
	bool		recovery_point_null;
	Datum		state;
	bool		state_null;
	Datum		response;
	bool		response_null;
	Datum		response_status;
	bool		response_status_null;
	int32		bucket;			/* the partition it is in */
	Datum		response_body;	/* stored only when given as text */
	bool		response_body_null;
	Datum		response_headers;
	bool		response_headers_null;
} RequestRow;

/*
 * A column's value out of SPI's memory, detoasted (a stored response may be
 * large: what begin() returns must not point into the table).
 */
static Datum
transfer(Datum d)
{
	return SPI_datumTransfer(PointerGetDatum(PG_DETOAST_DATUM_PACKED(d)), false, -1);
}

/* Read the first row of SPI's result (in ROW_COLUMNS' order) into row. */
static void
read_row(RequestRow *row)
{
	HeapTuple	tup;
	TupleDesc	desc = SPI_tuptable->tupdesc;
	bool		isnull;
	char	   *status;

	if (SPI_processed == 0)
	{
		row->status = REQ_NONE;
		return;
	}
	tup = SPI_tuptable->vals[0];
	status = TextDatumGetCString(SPI_getbinval(tup, desc, 1, &isnull));
	row->status = strcmp(status, "started") == 0 ? REQ_STARTED :
		strcmp(status, "completed") == 0 ? REQ_COMPLETED : REQ_ABANDONED;
	row->attempt = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));
	row->lease_until = DatumGetTimestampTz(SPI_getbinval(tup, desc, 3, &isnull));
	if (isnull)
		row->lease_until = DT_NOBEGIN;
	row->digest = NULL;
	{
		Datum		d = SPI_getbinval(tup, desc, 4, &isnull);

		if (!isnull)
			row->digest = DatumGetByteaPCopy(d);
	}
	/* SPI_getbinval's datums live in SPI's memory: copy what is returned */
	row->recovery_point = SPI_getbinval(tup, desc, 5, &row->recovery_point_null);
	if (!row->recovery_point_null)
		row->recovery_point = transfer(row->recovery_point);
	row->state = SPI_getbinval(tup, desc, 6, &row->state_null);
	if (!row->state_null)
		row->state = transfer(row->state);
	row->response = SPI_getbinval(tup, desc, 7, &row->response_null);
	if (!row->response_null)
		row->response = transfer(row->response);
	row->response_status = SPI_getbinval(tup, desc, 8, &row->response_status_null);
	row->bucket = DatumGetInt32(SPI_getbinval(tup, desc, 9, &isnull));
	row->response_body = SPI_getbinval(tup, desc, 10, &row->response_body_null);
	if (!row->response_body_null)
		row->response_body = transfer(row->response_body);
	row->response_headers = SPI_getbinval(tup, desc, 11, &row->response_headers_null);
	if (!row->response_headers_null)
		row->response_headers = transfer(row->response_headers);
}

/* A row as begin() returns it when it holds the key: no response. */
static void
no_response(RequestRow *row)
{
	row->response_null = row->response_status_null = true;
	row->response_body_null = row->response_headers_null = true;
}

/* The key's row as it is now (see request_exec_fresh). */
static void
find_row(RequestKey *rk, RequestRow *row)
{
	Datum		values[2] = {PointerGetDatum(rk->scope), PointerGetDatum(rk->key)};

	(void) request_exec_fresh(ST_FIND, values, NULL, SPI_OK_SELECT);
	read_row(row);
}

/* The key's row, locked FOR SHARE to the end of the transaction. */
static void
share_row(RequestKey *rk, RequestRow *row)
{
	Datum		values[2] = {PointerGetDatum(rk->scope), PointerGetDatum(rk->key)};

	(void) request_exec(ST_FIND_FOR_SHARE, values, NULL, SPI_OK_SELECT);
	read_row(row);
}

/*
 * 40001: a statement of this transaction found the row otherwise than it is
 * now (changed since its snapshot, or not there for it).
 */
static void
request_changed(RequestKey *rk)
{
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not serialize access to request \"%s\" in scope \"%s\"",
					rk->key_str, rk->scope_str),
			 errdetail("Another transaction changed the request, and this transaction's snapshot does not show the change."),
			 errhint("Retry the transaction.")));
}

/*
 * A holder's statement (st, for attempt, or for whichever is current if
 * attempt_null) found nothing to act on: 40001 if the row as it is now is
 * one it acts on (its snapshot could not see it so), else IK003 -- or
 * nothing, for abandon() without an attempt of a key that has no row.
 */
static void
holder_missed(RequestStatement st, RequestKey *rk, int32 attempt, bool attempt_null)
{
	RequestRow	row;
	const char *state;

	find_row(rk, &row);
	if (row.status != REQ_NONE && (attempt_null || row.attempt == attempt) &&
		(st == ST_ABANDON || row.status == REQ_STARTED))
		request_changed(rk);
	if (st == ST_ABANDON && attempt_null)
		return;					/* nothing to forget */
	state = row.status == REQ_NONE ? "was never begun (or has expired)" :
		row.status == REQ_COMPLETED ? "is completed" :
		row.status == REQ_ABANDONED ? "was abandoned" : NULL;
	if (state != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_LEASE_LOST),
				 errmsg("request \"%s\" in scope \"%s\" is not started", rk->key_str, rk->scope_str),
				 errdetail("The request %s.", state)));
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_LEASE_LOST),
			 errmsg("attempt %d of request \"%s\" in scope \"%s\" is no longer current",
					attempt_null ? 0 : attempt, rk->key_str, rk->scope_str),
			 errdetail("Attempt %d holds the request now.", row.attempt),
			 errhint("Stop this attempt's work: its effects must not commit.")));
}

/*---- begin ----*/

/* Insert the row of a request begun now, as attempt 1. */
static void
insert_row(RequestKey *rk, bytea *digest, TimestampTz now, TimestampTz lease_until)
{
	int32		bucket;
	Relation	rel = idem_store_open_target(IDEM_STORE_REQUESTS, now, &bucket,
											 request_columns, Natts_requests);
	IdemIndexSet ins;
	Datum		values[Natts_requests];
	bool		nulls[Natts_requests] = {false};

	values[0] = PointerGetDatum(rk->scope);
	values[1] = PointerGetDatum(rk->key);
	values[2] = PointerGetDatum(digest);
	nulls[2] = digest == NULL;
	values[3] = CStringGetTextDatum("started");
	values[4] = Int32GetDatum(1);
	values[5] = TimestampTzGetDatum(lease_until);
	for (int i = 6; i <= 11; i++)
		nulls[i] = true;		/* recovery point to response_headers */
	values[12] = TimestampTzGetDatum(now);
	values[13] = TimestampTzGetDatum(now);
	values[14] = Int32GetDatum(bucket);
	idem_open_insert_indexes(rel, &ins, "requests partition");
	idem_insert_row(&ins, values, nulls, InvalidOid);
	idem_close_insert_indexes(&ins);
	table_close(rel, NoLock);
}

/* Same payload?  No payload on either side counts as the same. */
static bool
same_payload(bytea *stored, bytea *given)
{
	if (stored == NULL || given == NULL)
		return true;
	return VARSIZE_ANY_EXHDR(stored) == VARSIZE_ANY_EXHDR(given) &&
		memcmp(VARDATA_ANY(stored), VARDATA_ANY(given), VARSIZE_ANY_EXHDR(given)) == 0;
}

static void
key_reused(RequestKey *rk)
{
	idem_stats_count_scope(rk->claim_scope, IDEM_STAT_PAYLOAD_MISMATCHES, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_KEY_REUSED),
			 errmsg("idempotency key \"%s\" in scope \"%s\" was used with another payload",
					rk->key_str, rk->scope_str),
			 errdetail("A request with this key and a different payload was begun before."),
			 errhint("Use a new key for a new request.")));
}

/*
 * IK002: another attempt's lease is live for "left" microseconds.  The hint
 * has the whole seconds a client waits (Retry-After), rounded up.
 */
static void
in_progress(RequestKey *rk, int32 attempt, int64 left)
{
	int64		secs = (left + USECS_PER_SEC - 1) / USECS_PER_SEC;

	idem_stats_count_scope(rk->claim_scope, IDEM_STAT_REQUESTS_CONFLICTED, 1);
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_REQUEST_IN_PROGRESS),
			 errmsg("request \"%s\" in scope \"%s\" is in progress", rk->key_str, rk->scope_str),
			 errdetail("The lease of attempt %d ends in %.3f seconds.",
					   attempt, (double) left / USECS_PER_SEC),
			 errhint_plural("Retry after %lld second, or begin with a wait.",
							"Retry after %lld seconds, or begin with a wait.",
							(unsigned long) secs, (long long) secs)));
}

/* Sleep ms milliseconds on the latch (interruptible). */
static void
nap(long ms)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH, ms,
					 PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/* Take the lock under which a key's row is made. */
static void
lock_key(RequestKey *rk)
{
	LOCKTAG		tag;
	uint64		hash = idem_key_hash(rk->claim_scope, rk->key);

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (hash >> 32), (uint32) hash,
						 IDEM_LOCKTAG_REQUEST);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

/*
 * Make the request's row, attempt 1, and fill out as begin() returns it.
 * The lease runs from now: after any wait for the claim or the key lock.
 */
static void
begin_fresh(RequestKey *rk, bytea *digest, int64 lease, RequestRow *out)
{
	TimestampTz now = idem_now();

	insert_row(rk, digest, now, now + lease);
	out->status = REQ_STARTED;
	out->attempt = 1;
	out->recovery_point_null = out->state_null = true;
	no_response(out);
}

/*
 * Make the row as seen ("seen", not live at "now") the next attempt: st is
 * ST_TAKE_OVER (resume) or ST_RESTART (afresh, with this digest, and if
 * anew the claim's time as created_at).  False if the row is not as seen
 * any more (decide again); 40001 if this transaction's snapshot cannot
 * see it as seen.
 */
static bool
next_attempt(RequestKey *rk, RequestRow *seen, RequestStatement st, bytea *digest, bool anew,
			 TimestampTz now, int64 lease, RequestRow *out)
{
	Datum		values[9];
	char		nulls[10] = "         ";

	values[0] = PointerGetDatum(rk->scope);
	values[1] = PointerGetDatum(rk->key);
	values[2] = Int32GetDatum(seen->bucket);
	values[3] = Int32GetDatum(seen->attempt);
	values[4] = CStringGetTextDatum(status_names[seen->status]);
	values[5] = TimestampTzGetDatum(now);
	values[6] = TimestampTzGetDatum(now + lease);
	values[7] = PointerGetDatum(digest);
	nulls[7] = digest == NULL ? 'n' : ' ';
	values[8] = TimestampTzGetDatum(now);
	nulls[8] = anew ? ' ' : 'n';
	if (request_exec(st, values, nulls, SPI_OK_UPDATE_RETURNING) == 0)
	{
		/* at READ COMMITTED the update saw the row as it is now */
		if (IsolationUsesXactSnapshot())
			request_changed(rk);
		return false;
	}
	read_row(out);
	no_response(out);
	return true;
}

/*
 * The outcome of begin(): fills row with what it returns, and returns true.
 * A live lease after the wait is IK002, or with on_conflict 'return'
 * (give_back) false, with the lease the holder has left in *left.  The
 * caller is connected to SPI.
 */
static bool
begin_request(RequestKey *rk, Jsonb *payload, int64 lease, int64 wait, bool give_back,
			  RequestRow *out, int64 *left)
{
	bytea	   *digest = NULL;
	TimestampTz deadline = GetCurrentTimestamp() + wait;
	long		pause = WAIT_FIRST_MS;
	bool		claimed;
	bool		locked = false;

	if (payload != NULL)
	{
		digest = palloc(VARHDRSZ + PG_SHA256_DIGEST_LENGTH);
		SET_VARSIZE(digest, VARHDRSZ + PG_SHA256_DIGEST_LENGTH);
		idem_payload_digest(payload, (uint8 *) VARDATA(digest));
	}

	/* a new claim: the key is new, whatever is left of an earlier request */
	claimed = idem_claim_key(rk->claim_scope, rk->key, NULL, "idem_request_begin()");

	for (;;)
	{
		TimestampTz now = idem_now();
		RequestRow	row;
		bool		live;

		find_row(rk, &row);
		if (row.status == REQ_NONE)
		{
			/* a new key, or its row expired first: make it, once */
			if (!locked)
			{
				lock_key(rk);
				locked = true;
				continue;		/* and look again */
			}
			begin_fresh(rk, digest, lease, out);
			return true;
		}
		live = row.status == REQ_STARTED && row.lease_until > now;
		if (claimed && !live)
		{
			/* what is left of an expired request: start afresh in its row */
			if (next_attempt(rk, &row, ST_RESTART, digest, true, now, lease, out))
				return true;
			continue;
		}
		if (row.status != REQ_ABANDONED && !same_payload(row.digest, digest))
			key_reused(rk);
		if (row.status == REQ_COMPLETED)
		{
			*out = row;
			return true;
		}
		if (live)
		{
			TimestampTz clock = GetCurrentTimestamp();

			if (clock >= deadline)
			{
				if (!give_back)
					in_progress(rk, row.attempt, row.lease_until - now);
				*left = row.lease_until - now;
				return false;
			}
			nap(Min(pause, (deadline - clock + 999) / 1000));
			pause = Min(pause * 2, WAIT_MAX_MS);
			continue;
		}

		/*
		 * An expired lease, or an abandoned request.  The update waits for
		 * a fenced transaction of the old holder, and then finds whether
		 * the row is still as seen.
		 */
		if (next_attempt(rk, &row, row.status == REQ_ABANDONED ? ST_RESTART : ST_TAKE_OVER,
						 digest, false, now, lease, out))
			return true;
	}
}

/*---- what begin() and complete() return ----*/

/* the columns both return, in the order of complete()'s */
typedef struct ResponseColumns
{
	Datum		values[6];		/* status, response, response_status, response_body, */
	bool		nulls[6];		/* response_headers, replayed */
} ResponseColumns;

/*
 * The columns of a stored response (row) as they are returned: the body is
 * the text stored, or the canonical text of the jsonb stored, so that a
 * handler that sends response_body sends the same bytes every time.
 */
static void
response_columns(const char *status, RequestRow *row, bool replayed, ResponseColumns *rc)
{
	rc->values[0] = CStringGetTextDatum(status);
	rc->nulls[0] = false;
	rc->values[1] = row->response;
	rc->nulls[1] = row->response_null;
	rc->values[2] = row->response_status;
	rc->nulls[2] = row->response_status_null;
	rc->values[3] = row->response_body;
	rc->nulls[3] = row->response_body_null;
	if (rc->nulls[3] && !row->response_null)
	{
		Jsonb	   *j = DatumGetJsonbP(row->response);

		rc->values[3] = CStringGetTextDatum(JsonbToCString(NULL, &j->root, VARSIZE(j)));
		rc->nulls[3] = false;
	}
	rc->values[4] = row->response_headers;
	rc->nulls[4] = row->response_headers_null;
	rc->values[5] = BoolGetDatum(replayed);
	rc->nulls[5] = false;
}

/* on_conflict of begin(): true for 'return', false for 'error' */
static bool
on_conflict_arg(FunctionCallInfo fcinfo, int argno)
{
	char	   *v;

	if (PG_ARGISNULL(argno))
		idem_null_argument("on_conflict");
	v = text_to_cstring(PG_GETARG_TEXT_PP(argno));
	if (strcmp(v, "return") == 0)
		return true;
	if (strcmp(v, "error") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid value for on_conflict: \"%s\"", v),
				 errhint("Use 'error' or 'return'.")));
	return false;
}

/*
 * idem_request_begin(key, scope, payload, lease, wait, on_conflict)
 *	  RETURNS TABLE(status, response, response_status, attempt, recovery_point,
 *					state, retry_after, replayed, response_body, response_headers)
 *
 * With on_conflict 'return', a live lease after the wait is the row
 * 'in_progress' with retry_after, instead of IK002; the begin runs in a
 * subtransaction that is then rolled back, so that it leaves nothing (not
 * the claim it may have made: IK002 would have rolled that back too).
 */
Datum
idem_request_begin(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	RequestKey	rk;
	Jsonb	   *payload = PG_ARGISNULL(2) ? NULL : PG_GETARG_JSONB_P(2);
	int64		lease;
	int64		wait;
	bool		give_back;
	bool		held_by_other = false;
	int64		left = 0;
	RequestRow	row;
	ResponseColumns rc;
	Datum		values[10];
	bool		nulls[10] = {false};
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	IdemAsOwner as;

	request_key_args(fcinfo, &rk);
	lease = idem_positive_interval_arg(fcinfo, 3, "lease");
	if (PG_ARGISNULL(4))
		idem_null_argument("wait");
	wait = idem_retry_after_arg(fcinfo, 4, "wait");
	give_back = on_conflict_arg(fcinfo, 5);
	PreventCommandIfReadOnly("idem_request_begin()");
	InitMaterializedSRF(fcinfo, 0);

	if (give_back)
	{
		BeginInternalSubTransaction(NULL);
		MemoryContextSwitchTo(cxt);
	}
	PG_TRY();
	{
		idem_spi_connect_as_owner(&as);
		held_by_other = !begin_request(&rk, payload, lease, wait, give_back, &row, &left);
		idem_spi_finish_as_owner(&as);
	}
	PG_CATCH();
	{
		if (give_back)
		{
			/* end the subtransaction as the error would have, and rethrow */
			ErrorData  *edata;

			MemoryContextSwitchTo(cxt);
			edata = CopyErrorData();
			FlushErrorState();
			RollbackAndReleaseCurrentSubTransaction();
			MemoryContextSwitchTo(cxt);
			CurrentResourceOwner = owner;
			ReThrowError(edata);
		}
		PG_RE_THROW();
	}
	PG_END_TRY();
	if (give_back)
	{
		if (held_by_other)
			RollbackAndReleaseCurrentSubTransaction();
		else
			ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
	}

	if (held_by_other)
	{
		Interval   *iv = palloc0(sizeof(Interval));

		/* counted here, in the caller's (sub)transaction */
		idem_stats_count_scope(rk.claim_scope, IDEM_STAT_REQUESTS_CONFLICTED, 1);
		iv->time = left;
		values[0] = CStringGetTextDatum("in_progress");
		for (int i = 1; i < 10; i++)
			nulls[i] = true;
		values[6] = IntervalPGetDatum(iv);
		nulls[6] = false;
		values[7] = BoolGetDatum(false);
		nulls[7] = false;
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
		return (Datum) 0;
	}
	if (row.status != REQ_COMPLETED)
		idem_stats_count_scope(rk.claim_scope, IDEM_STAT_REQUESTS_STARTED, 1);

	response_columns(row.status == REQ_COMPLETED ? "completed" : "started", &row,
					 row.status == REQ_COMPLETED, &rc);
	values[0] = rc.values[0];
	values[1] = rc.values[1];
	nulls[1] = rc.nulls[1];
	values[2] = rc.values[2];
	nulls[2] = rc.nulls[2];
	values[3] = Int32GetDatum(row.attempt);
	values[4] = row.recovery_point;
	nulls[4] = row.recovery_point_null;
	values[5] = row.state;
	nulls[5] = row.state_null;
	nulls[6] = true;			/* retry_after */
	values[7] = rc.values[5];	/* replayed */
	values[8] = rc.values[3];	/* response_body */
	nulls[8] = rc.nulls[3];
	values[9] = rc.values[4];	/* response_headers */
	nulls[9] = rc.nulls[4];
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	return (Datum) 0;
}

/*---- the holder's calls ----*/

/*
 * Run an UPDATE that acts for an attempt (or, attempt_null, for whichever
 * is current); see holder_missed() if it matched no row.
 */
static void
holder_update(RequestStatement st, RequestKey *rk, int32 attempt, bool attempt_null,
			  Datum *values, char *nulls)
{
	IdemAsOwner as;

	idem_spi_connect_as_owner(&as);
	values[0] = PointerGetDatum(rk->scope);
	values[1] = PointerGetDatum(rk->key);
	values[2] = Int32GetDatum(attempt);
	nulls[2] = attempt_null ? 'n' : ' ';
	if (request_exec(st, values, nulls, SPI_OK_UPDATE) == 0)
		holder_missed(st, rk, attempt, attempt_null);
	idem_spi_finish_as_owner(&as);
}

/* idem_request_checkpoint(key, scope, attempt, recovery_point, state) */
Datum
idem_request_checkpoint(PG_FUNCTION_ARGS)
{
	RequestKey	rk;
	int32		attempt;
	Datum		values[6];
	char		nulls[7] = "      ";

	request_key_args(fcinfo, &rk);
	attempt = attempt_arg(fcinfo, 2);
	if (PG_ARGISNULL(3))
		idem_null_argument("recovery_point");
	if (VARSIZE_ANY_EXHDR(PG_GETARG_TEXT_PP(3)) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("recovery_point must not be empty")));
	values[3] = PG_GETARG_DATUM(3);
	nullable_arg(fcinfo, 4, &values[4], &nulls[4]);
	values[5] = TimestampTzGetDatum(idem_now());
	holder_update(ST_CHECKPOINT, &rk, attempt, false, values, nulls);
	PG_RETURN_VOID();
}

/*
 * idem_request_fence(key, scope, attempt): in the transaction that makes an
 * effect, check the attempt is current and hold the row FOR SHARE to the
 * end of the transaction, so no takeover completes meanwhile.
 */
Datum
idem_request_fence(PG_FUNCTION_ARGS)
{
	RequestKey	rk;
	int32		attempt;
	RequestRow	row;
	IdemAsOwner as;

	request_key_args(fcinfo, &rk);
	attempt = attempt_arg(fcinfo, 2);
	PreventCommandIfReadOnly("idem_request_fence()");
	idem_spi_connect_as_owner(&as);
	share_row(&rk, &row);
	if (row.status != REQ_STARTED || row.attempt != attempt)
		holder_missed(ST_FIND_FOR_SHARE, &rk, attempt, false);
	idem_spi_finish_as_owner(&as);
	PG_RETURN_VOID();
}

/* idem_request_extend(key, scope, attempt, lease) */
Datum
idem_request_extend(PG_FUNCTION_ARGS)
{
	RequestKey	rk;
	int32		attempt;
	int64		lease;
	TimestampTz now = idem_now();
	Datum		values[5];
	char		nulls[6] = "     ";

	request_key_args(fcinfo, &rk);
	attempt = attempt_arg(fcinfo, 2);
	lease = idem_positive_interval_arg(fcinfo, 3, "lease");
	values[3] = TimestampTzGetDatum(now + lease);
	values[4] = TimestampTzGetDatum(now);
	holder_update(ST_EXTEND, &rk, attempt, false, values, nulls);
	PG_RETURN_VOID();
}

/*---- stored response headers ----*/

/* A header name is an HTTP token (RFC 9110, section 5.6.2). */
static bool
is_token_char(unsigned char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static void
bad_headers(const char *detail)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("invalid response_headers"),
			 errdetail("%s", detail),
			 errhint("Give an object whose keys are header names and whose values are strings or arrays of strings, such as {\"content-type\": \"application/json\"}.")));
}

/* A header value (one field line's): no control characters but tab. */
static void
check_header_value(const char *name, JsonbValue *v)
{
	if (v->type != jbvString)
		bad_headers(psprintf("The value of header \"%s\" is not a string or an array of strings.", name));
	for (int i = 0; i < v->val.string.len; i++)
	{
		unsigned char c = (unsigned char) v->val.string.val[i];

		if ((c < 0x20 && c != '\t') || c == 0x7f)
			bad_headers(psprintf("The value of header \"%s\" contains a control character (such as a line break).",
								 name));
	}
}

static int
compare_names(const void *a, const void *b)
{
	return strcmp(*(char *const *) a, *(char *const *) b);
}

/*
 * response_headers, checked, with the names in lower case: HTTP field names
 * are case-insensitive (and HTTP/2 and 3 send them in lower case), so
 * "Content-Type" and "content-type" are one header and are stored once.
 */
static Jsonb *
request_headers(Jsonb *headers)
{
	JsonbIterator *it;
	JsonbParseState *st = NULL;
	JsonbValue	v;
	JsonbValue *res = NULL;
	JsonbIteratorToken tok;
	int			nnames = 0;
	char	  **names;
	char	   *name = NULL;

	idem_check_object(headers, "response_headers");
	names = palloc(Max(JsonContainerSize(&headers->root), 1) * sizeof(char *));
	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		if (tok == WJB_KEY)
		{
			name = pnstrdup(v.val.string.val, v.val.string.len);
			if (v.val.string.len == 0)
				bad_headers("A header name is empty.");
			for (int i = 0; i < v.val.string.len; i++)
			{
				if (!is_token_char((unsigned char) name[i]))
					bad_headers(psprintf("Header name \"%s\" is not an HTTP token.", name));
				name[i] = pg_ascii_tolower((unsigned char) name[i]);
			}
			names[nnames++] = name;
			v.val.string.val = name;
		}
		else if (tok == WJB_VALUE && v.type == jbvBinary)
		{
			/* an array of strings: one field line each */
			JsonbIterator *ait;
			JsonbValue	e;
			int			n = 0;

			if (!JsonContainerIsArray(v.val.binary.data))
				check_header_value(name, &v);	/* an object: refused */
			ait = JsonbIteratorInit(v.val.binary.data);
			while ((tok = JsonbIteratorNext(&ait, &e, true)) != WJB_DONE)
				if (tok == WJB_ELEM)
				{
					check_header_value(name, &e);
					n++;
				}
			if (n == 0)
				bad_headers(psprintf("Header \"%s\" has an empty array of values.", name));
			tok = WJB_VALUE;
		}
		else if (tok == WJB_VALUE)
			check_header_value(name, &v);
		res = pushJsonbValue(&st, tok, tok == WJB_BEGIN_OBJECT || tok == WJB_END_OBJECT ? NULL : &v);
	}
	/* names that differ only in case became one: refuse rather than pick */
	if (res->val.object.nPairs < nnames)
	{
		qsort(names, nnames, sizeof(char *), compare_names);
		for (int i = 1; i < nnames; i++)
			if (strcmp(names[i - 1], names[i]) == 0)
				bad_headers(psprintf("Header \"%s\" is named more than once (names are case-insensitive); give its values as an array.",
									 names[i]));
	}
	return JsonbValueToJsonb(res);
}

/*
 * idem_request_complete(key, scope, response, attempt, response_status,
 *						 response_body, response_headers)
 *	  RETURNS TABLE(status, response, response_status, response_body,
 *					response_headers, replayed)
 *
 * Stores the response, given as jsonb (response) or as text (response_body),
 * and returns it as a replay will: response_body is the text stored, or the
 * jsonb's canonical text.
 */
Datum
idem_request_complete(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	RequestKey	rk;
	int32		attempt;
	Datum		values[8];
	char		nulls[9] = "        ";
	RequestRow	row;
	ResponseColumns rc;

	request_key_args(fcinfo, &rk);
	attempt = optional_attempt_arg(fcinfo, 3);
	if (!PG_ARGISNULL(4) && (PG_GETARG_INT32(4) < 100 || PG_GETARG_INT32(4) > 599))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("response_status must be an HTTP status code (100 to 599)"),
				 errdetail("%d was given.", PG_GETARG_INT32(4))));
	if (!PG_ARGISNULL(2) && !PG_ARGISNULL(5))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("response and response_body cannot both be given"),
				 errdetail("The body is stored once: as jsonb (response) or as text (response_body).")));
	/* detoasted: they are returned as well as stored */
	values[3] = PG_ARGISNULL(2) ? (Datum) 0 : JsonbPGetDatum(PG_GETARG_JSONB_P(2));
	nulls[3] = PG_ARGISNULL(2) ? 'n' : ' ';
	nullable_arg(fcinfo, 4, &values[4], &nulls[4]);
	values[5] = TimestampTzGetDatum(idem_now());
	values[6] = PG_ARGISNULL(5) ? (Datum) 0 : PointerGetDatum(PG_GETARG_TEXT_PP(5));
	nulls[6] = PG_ARGISNULL(5) ? 'n' : ' ';
	values[7] = PG_ARGISNULL(6) ? (Datum) 0 :
		JsonbPGetDatum(request_headers(PG_GETARG_JSONB_P(6)));
	nulls[7] = PG_ARGISNULL(6) ? 'n' : ' ';
	InitMaterializedSRF(fcinfo, 0);
	holder_update(ST_COMPLETE, &rk, attempt, PG_ARGISNULL(3), values, nulls);
	idem_stats_count_scope(rk.claim_scope, IDEM_STAT_REQUESTS_COMPLETED, 1);

	/* what was stored, as begin() will return it */
	row.response = values[3];
	row.response_null = nulls[3] == 'n';
	row.response_status = values[4];
	row.response_status_null = nulls[4] == 'n';
	row.response_body = values[6];
	row.response_body_null = nulls[6] == 'n';
	row.response_headers = values[7];
	row.response_headers_null = nulls[7] == 'n';
	response_columns("completed", &row, false, &rc);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, rc.values, rc.nulls);
	return (Datum) 0;
}

/*
 * idem_request_abandon(key, scope, attempt): forget the request whatever its
 * state (with an attempt: only while that attempt is the latest), so the
 * next begin() starts afresh.
 */
Datum
idem_request_abandon(PG_FUNCTION_ARGS)
{
	RequestKey	rk;
	int32		attempt;
	Datum		values[4];
	char		nulls[5] = "    ";

	request_key_args(fcinfo, &rk);
	attempt = optional_attempt_arg(fcinfo, 2);
	values[3] = TimestampTzGetDatum(idem_now());
	/* nothing to forget is fine, but not an attempt that is not the latest */
	holder_update(ST_ABANDON, &rk, attempt, PG_ARGISNULL(2), values, nulls);
	PG_RETURN_VOID();
}
