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
 *	- The row is read, locked and updated without the executor (as the
 *	  outbox moves its counters): idempotency.requests is locked as a
 *	  statement on it would lock it (AccessShareLock to look, RowShareLock
 *	  to fence, RowExclusiveLock to change), which holds off a partition's
 *	  drop, and its attached partitions are probed one by one through their
 *	  (scope, key) index, each locked the same way, the one a row begun now
 *	  goes into first (or the one the row was seen in), so a call nearly
 *	  always touches one partition.  Looks and locks follow SELECT and
 *	  SELECT FOR SHARE, updates UPDATE: a row changed since the snapshot is
 *	  followed to its newest version and its condition checked again at
 *	  READ COMMITTED, and is 40001 under a transaction snapshot.  Triggers,
 *	  rules and row-level security on the partitions are not applied (as
 *	  for the rows inserted, rows.c).
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

#include "access/genam.h"
#include "access/heapam.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "partitioning/partdesc.h"
#include "pgstat.h"
#include "utils/lsyscache.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/jsonb.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_request_begin);
PG_FUNCTION_INFO_V1(idem_request_checkpoint);
PG_FUNCTION_INFO_V1(idem_request_fence);
PG_FUNCTION_INFO_V1(idem_request_extend);
PG_FUNCTION_INFO_V1(idem_request_complete);
PG_FUNCTION_INFO_V1(idem_request_abandon);

/* claims of requests go into scope IDEM_REQUEST_SCOPE_PREFIX || scope */
#define MAX_REQUEST_SCOPE_BYTES	(IDEM_MAX_SCOPE_BYTES - (int) strlen(IDEM_REQUEST_SCOPE_PREFIX))

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

/* what acts on a request's row */
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
	rk->claim_scope = cstring_to_text(psprintf("%s%s", IDEM_REQUEST_SCOPE_PREFIX, rk->scope_str));
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
	Oid			relid;			/* and that partition */
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

/* A row as begin() returns it when it holds the key: no response. */
static void
no_response(RequestRow *row)
{
	row->response_null = row->response_status_null = true;
	row->response_body_null = row->response_headers_null = true;
}

/*---- the row, partition by partition ----*/

/*
 * Found, locked and changed without the executor (see the last locking rule
 * of the banner): a statement on the parent locks and probes every
 * partition, its generic plan unable to prune them (the row's bucket is not
 * known to the caller).
 */

/* columns of idempotency.requests (request_columns), from 0 */
enum
{
	C_SCOPE, C_KEY, C_DIGEST, C_STATUS, C_ATTEMPT, C_LEASE_UNTIL, C_RECOVERY_POINT,
	C_STATE, C_RESPONSE, C_RESPONSE_STATUS, C_RESPONSE_BODY, C_RESPONSE_HEADERS,
	C_CREATED_AT, C_UPDATED_AT, C_BUCKET
};

typedef struct RequestPart
{
	Relation	parent;
	Relation	rel;			/* the partition the row is in */
	Relation	index;			/* its (scope, key) index */
	TupleTableSlot *slot;		/* the row version found */
} RequestPart;

/*
 * Open partition relid and its (scope, key) index with mode; false if it
 * is gone.
 */
static bool
open_part(Oid relid, LOCKMODE mode, RequestPart *p)
{
	TupleDesc	desc;
	List	   *oids;
	ListCell   *lc;

	p->rel = try_table_open(relid, mode);
	if (p->rel == NULL)
		return false;
	/* rows are read and written as heap tuples */
	if (p->rel->rd_rel->relkind != RELKIND_RELATION || p->rel->rd_rel->relam != HEAP_TABLE_AM_OID)
		elog(ERROR, "requests partition \"%s\" is not a heap table",
			 RelationGetRelationName(p->rel));
	desc = RelationGetDescr(p->rel);
	for (int i = 0; i < Natts_requests; i++)
		if (desc->natts != Natts_requests || TupleDescAttr(desc, i)->attisdropped ||
			strcmp(NameStr(TupleDescAttr(desc, i)->attname), request_columns[i]) != 0)
			elog(ERROR, "requests partition \"%s\" does not have the columns of %s.requests",
				 RelationGetRelationName(p->rel), IDEM_SCHEMA);
	p->index = NULL;
	oids = RelationGetIndexList(p->rel);
	foreach(lc, oids)
	{
		Relation	index = index_open(lfirst_oid(lc), mode);
		Form_pg_index ix = index->rd_index;

		if (ix->indisunique && ix->indisvalid && ix->indnkeyatts == 2 &&
			ix->indkey.values[0] == C_SCOPE + 1 && ix->indkey.values[1] == C_KEY + 1 &&
			index->rd_rel->relam == BTREE_AM_OID &&
			heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL))
		{
			p->index = index;
			break;
		}
		index_close(index, NoLock);
	}
	list_free(oids);
	if (p->index == NULL)
		elog(ERROR, "requests partition \"%s\" has no unique index on (scope, key)",
			 RelationGetRelationName(p->rel));
	p->slot = table_slot_create(p->rel, NULL);
	return true;
}

static void
close_part(RequestPart *p)
{
	ExecDropSingleTupleTableSlot(p->slot);
	index_close(p->index, NoLock);
	table_close(p->rel, NoLock);
}

/* Is the text datum d the text t? */
static bool
same_text(Datum d, text *t)
{
	text	   *dt = DatumGetTextPP(d);

	return VARSIZE_ANY_EXHDR(dt) == VARSIZE_ANY_EXHDR(t) &&
		memcmp(VARDATA_ANY(dt), VARDATA_ANY(t), VARSIZE_ANY_EXHDR(t)) == 0;
}

/* Does p's index have the key's row, visible to snap?  Into p->slot. */
static bool
probe_part(RequestPart *p, RequestKey *rk, Snapshot snap)
{
	ScanKeyData key[2];
	IndexScanDesc scan;
	bool		found;

	ScanKeyInit(&key[0], 1, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(rk->scope));
	key[0].sk_collation = p->index->rd_indcollation[0];
	ScanKeyInit(&key[1], 2, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(rk->key));
	key[1].sk_collation = p->index->rd_indcollation[1];
	scan = index_beginscan(p->rel, p->index, snap, 2, 0);
	index_rescan(scan, key, 2, NULL, 0);
	found = index_getnext_slot(scan, ForwardScanDirection, p->slot);
	index_endscan(scan);
	return found;
}

/*
 * Find the key's row version visible to the active snapshot: the parent is
 * opened with mode into p->parent (the caller closes it, end_find()), and,
 * if found, the partition too with the row in p->slot.  The partition
 * probed first is "first" if valid, else the one a row begun now goes into.
 * The caller is connected to SPI.
 */
static bool
find_part(RequestKey *rk, LOCKMODE mode, Oid first, RequestPart *p)
{
	Snapshot	snap = GetActiveSnapshot();
	PartitionDesc pd;
	bool		first_is_part = false;

	/* the partitions attached now: those a statement on the parent would see */
	p->parent = table_open(idem_internal_relid("requests"), mode);
	pd = RelationGetPartitionDesc(p->parent, true);
	if (pd->nparts == 0)
		return false;
	if (!OidIsValid(first))
		(void) idem_store_target(IDEM_STORE_REQUESTS, idem_now(), &first, NULL);
	for (int i = 0; i < pd->nparts; i++)
		if (pd->oids[i] == first)
			first_is_part = true;
	for (int i = -1; i < pd->nparts; i++)
	{
		Oid			relid = i < 0 ? first : pd->oids[i];

		if (i < 0 ? !first_is_part : relid == first)
			continue;
		if (!open_part(relid, mode, p))
			continue;
		if (probe_part(p, rk, snap))
			return true;
		close_part(p);
	}
	return false;
}

static void
end_find(RequestPart *p, bool found)
{
	if (found)
		close_part(p);
	table_close(p->parent, NoLock);
}

/* Column col of a row as read, copied out of the table; (Datum) 0 if null. */
static Datum
copied(Datum *v, bool *n, int col, bool *isnull)
{
	*isnull = n[col];
	return *isnull ? (Datum) 0 : transfer(v[col]);
}

/* The row as read (values in request_columns' order), copied out of the table. */
static void
read_values(Datum *v, bool *n, RequestRow *row)
{
	char	   *status = TextDatumGetCString(v[C_STATUS]);

	row->status = strcmp(status, "started") == 0 ? REQ_STARTED :
		strcmp(status, "completed") == 0 ? REQ_COMPLETED : REQ_ABANDONED;
	row->attempt = DatumGetInt32(v[C_ATTEMPT]);
	row->lease_until = n[C_LEASE_UNTIL] ? DT_NOBEGIN : DatumGetTimestampTz(v[C_LEASE_UNTIL]);
	row->digest = n[C_DIGEST] ? NULL : DatumGetByteaPCopy(v[C_DIGEST]);
	/* a stored response may be large: what begin() returns must not point into the table */
	row->recovery_point = copied(v, n, C_RECOVERY_POINT, &row->recovery_point_null);
	row->state = copied(v, n, C_STATE, &row->state_null);
	row->response = copied(v, n, C_RESPONSE, &row->response_null);
	row->response_status_null = n[C_RESPONSE_STATUS];
	row->response_status = v[C_RESPONSE_STATUS];
	row->bucket = DatumGetInt32(v[C_BUCKET]);
	row->response_body = copied(v, n, C_RESPONSE_BODY, &row->response_body_null);
	row->response_headers = copied(v, n, C_RESPONSE_HEADERS, &row->response_headers_null);
}

/* The row in p->slot, if it is still the key's (a hand-made update may move a row). */
static bool
read_slot(RequestPart *p, RequestKey *rk, RequestRow *row)
{
	slot_getallattrs(p->slot);
	if (!same_text(p->slot->tts_values[C_SCOPE], rk->scope) ||
		!same_text(p->slot->tts_values[C_KEY], rk->key))
		return false;
	read_values(p->slot->tts_values, p->slot->tts_isnull, row);
	row->relid = RelationGetRelid(p->rel);
	return true;
}

/*
 * The key's row as it is now: under a snapshot taken now, which at READ
 * COMMITTED is the one a statement gets anyway (with this transaction's
 * own changes so far).
 */
static void
find_row(RequestKey *rk, RequestRow *row)
{
	RequestPart p;
	bool		found;

	CommandCounterIncrement();
	PushActiveSnapshot(IsolationUsesXactSnapshot() ?
					   GetLatestSnapshot() : GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();
	found = find_part(rk, AccessShareLock, InvalidOid, &p);
	if (!found || !read_slot(&p, rk, row))
		row->status = REQ_NONE;
	end_find(&p, found);
	PopActiveSnapshot();
}

/* 40001, as the executor raises it for a row changed since the snapshot */
static void
concurrent_update(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not serialize access due to concurrent update")));
}

/*
 * The key's row, locked FOR SHARE to the end of the transaction, as SELECT
 * ... FOR SHARE locks it: at READ COMMITTED its newest version, under a
 * transaction snapshot 40001 if it changed since.
 */
static void
share_row(RequestKey *rk, RequestRow *row)
{
	RequestPart p;
	bool		found;
	TM_Result	res;
	TM_FailureData tmfd;

	CommandCounterIncrement();
	PushActiveSnapshot(GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();
	found = find_part(rk, RowShareLock, InvalidOid, &p);
	row->status = REQ_NONE;
	if (found)
	{
		res = table_tuple_lock(p.rel, &p.slot->tts_tid, GetActiveSnapshot(), p.slot,
							   GetCurrentCommandId(true), LockTupleShare, LockWaitBlock,
							   TUPLE_LOCK_FLAG_LOCK_UPDATE_IN_PROGRESS |
							   (IsolationUsesXactSnapshot() ? 0 : TUPLE_LOCK_FLAG_FIND_LAST_VERSION),
							   &tmfd);
		if ((res == TM_Updated || res == TM_Deleted) && IsolationUsesXactSnapshot())
			concurrent_update();
		if (res == TM_Ok)
			(void) read_slot(&p, rk, row);
		else if (res != TM_Deleted)
			elog(ERROR, "unexpected result %d locking request \"%s\"", (int) res, rk->key_str);
	}
	end_find(&p, found);
	PopActiveSnapshot();
}

/* Which row a change acts on (the WHERE of its UPDATE), besides the key. */
typedef enum RowCondition
{
	COND_HELD,					/* status 'started', this attempt */
	COND_STARTED,				/* status 'started', this attempt or any */
	COND_ANY,					/* this attempt or any */
	COND_AS_SEEN				/* as seen (seen_*), and not live at "now" */
} RowCondition;

typedef struct RowChange
{
	RowCondition cond;
	int32		attempt;
	bool		any_attempt;
	RequestRow *seen;			/* COND_AS_SEEN */
	TimestampTz now;			/* COND_AS_SEEN */
	/* the change: the columns set, and whether the attempt moves on */
	bool		set[Natts_requests];
	Datum		values[Natts_requests];
	bool		nulls[Natts_requests];
	bool		next_attempt;
} RowChange;

static void
set_column(RowChange *ch, int col, Datum value, bool isnull)
{
	ch->set[col] = true;
	ch->values[col] = value;
	ch->nulls[col] = isnull;
}

/* Does the row version (v, n) meet the change's condition? */
static bool
row_matches(RowChange *ch, RequestKey *rk, Datum *v, bool *n)
{
	const char *status = TextDatumGetCString(v[C_STATUS]);
	int32		attempt = DatumGetInt32(v[C_ATTEMPT]);
	bool		started = strcmp(status, "started") == 0;

	if (!same_text(v[C_SCOPE], rk->scope) || !same_text(v[C_KEY], rk->key))
		return false;
	switch (ch->cond)
	{
		case COND_HELD:
			return started && attempt == ch->attempt;
		case COND_STARTED:
			return started && (ch->any_attempt || attempt == ch->attempt);
		case COND_ANY:
			return ch->any_attempt || attempt == ch->attempt;
		case COND_AS_SEEN:
			return DatumGetInt32(v[C_BUCKET]) == ch->seen->bucket &&
				attempt == ch->seen->attempt &&
				strcmp(status, status_names[ch->seen->status]) == 0 &&
				(!started ||
				 (!n[C_LEASE_UNTIL] && DatumGetTimestampTz(v[C_LEASE_UNTIL]) <= ch->now));
	}
	return false;
}

/*
 * Change the key's row as an UPDATE ... WHERE <the change's condition>
 * would: found with the statement's snapshot, then updated, waiting for a
 * transaction that holds it (a fenced holder, a racing takeover); if one
 * changed it meanwhile, at READ COMMITTED its newest version is locked and
 * the condition checked on it (the executor's recheck), under a transaction
 * snapshot it is 40001.  HOT, unless the page is full: then its index
 * entries are added.  True if it changed the row (then the new row is in
 * *out if out is given); false if no row met the condition.  The caller is
 * connected to SPI.
 */
static bool
change_row(RequestKey *rk, RowChange *ch, RequestRow *out)
{
	RequestPart p;
	Snapshot	snap;
	bool		found;
	bool		changed = false;
	Datum		values[Natts_requests];
	bool		nulls[Natts_requests];
	HeapTuple	newtup = NULL;

	CommandCounterIncrement();
	PushActiveSnapshot(GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();
	snap = GetActiveSnapshot();
	found = find_part(rk, RowExclusiveLock, ch->seen != NULL ? ch->seen->relid : InvalidOid, &p);
	while (found)
	{
		TM_Result	res;
		TM_FailureData tmfd;
		LockTupleMode lockmode;

		slot_getallattrs(p.slot);
		memcpy(values, p.slot->tts_values, sizeof(values));
		memcpy(nulls, p.slot->tts_isnull, sizeof(nulls));
		if (!row_matches(ch, rk, values, nulls))
			break;
		for (int i = 0; i < Natts_requests; i++)
			if (ch->set[i])
			{
				values[i] = ch->values[i];
				nulls[i] = ch->nulls[i];
			}
		if (ch->next_attempt)
			values[C_ATTEMPT] = Int32GetDatum(DatumGetInt32(values[C_ATTEMPT]) + 1);
		newtup = heap_form_tuple(RelationGetDescr(p.rel), values, nulls);

		res = heap_update(p.rel, &p.slot->tts_tid, newtup, GetCurrentCommandId(true),
						  InvalidSnapshot, true, &tmfd, &lockmode);
		if (res == TM_Ok)
		{
			changed = true;
			break;
		}
		heap_freetuple(newtup);
		newtup = NULL;
		if (res != TM_Updated && res != TM_Deleted)
			elog(ERROR, "unexpected result %d updating request \"%s\"", (int) res, rk->key_str);
		if (IsolationUsesXactSnapshot())
			concurrent_update();
		if (res == TM_Deleted)
			break;
		res = table_tuple_lock(p.rel, &tmfd.ctid, snap, p.slot, GetCurrentCommandId(true),
							   LockTupleNoKeyExclusive, LockWaitBlock,
							   TUPLE_LOCK_FLAG_FIND_LAST_VERSION, &tmfd);
		if (res == TM_Deleted)
			break;
		if (res != TM_Ok)
			elog(ERROR, "unexpected result %d locking request \"%s\"", (int) res, rk->key_str);
	}
	PopActiveSnapshot();
	if (changed)
	{
		if (!HeapTupleIsHeapOnly(newtup))
		{
			IdemIndexSet ins;

			idem_open_insert_indexes(p.rel, &ins, "requests partition");
			idem_insert_index_entries(&ins, values, nulls, &newtup->t_self, InvalidOid);
			idem_close_insert_indexes(&ins);
		}
		if (out != NULL)
		{
			read_values(values, nulls, out);
			out->relid = RelationGetRelid(p.rel);
		}
		heap_freetuple(newtup);
	}
	end_find(&p, found);
	return changed;
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
	RowChange	ch = {0};

	ch.cond = COND_AS_SEEN;
	ch.seen = seen;
	ch.now = now;
	ch.next_attempt = true;
	set_column(&ch, C_LEASE_UNTIL, TimestampTzGetDatum(now + lease), false);
	set_column(&ch, C_UPDATED_AT, TimestampTzGetDatum(now), false);
	if (st == ST_RESTART)
	{
		set_column(&ch, C_STATUS, CStringGetTextDatum("started"), false);
		set_column(&ch, C_DIGEST, PointerGetDatum(digest), digest == NULL);
		if (anew)
			set_column(&ch, C_CREATED_AT, TimestampTzGetDatum(now), false);
		for (int i = C_RECOVERY_POINT; i <= C_RESPONSE_HEADERS; i++)
			set_column(&ch, i, (Datum) 0, true);
	}
	if (!change_row(rk, &ch, out))
	{
		/* at READ COMMITTED the update saw the row as it is now */
		if (IsolationUsesXactSnapshot())
			request_changed(rk);
		return false;
	}
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

	/*
	 * With a new claim the key has no row but one that outlived an earlier
	 * claim: the key lock first, so that one look decides whether to make
	 * the row (the look is what a new key costs: every partition's index).
	 */
	if (claimed)
	{
		lock_key(rk);
		locked = true;
	}

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
 * Make a holder's change (ch) to the row of the key, for an attempt (or,
 * attempt_null, for whichever is current); see holder_missed() if no row
 * met its condition.
 */
static void
holder_update(RequestStatement st, RequestKey *rk, int32 attempt, bool attempt_null,
			  RowChange *ch, const char *fname)
{
	IdemAsOwner as;

	/* written without the executor, which would check this */
	PreventCommandIfReadOnly(fname);
	ch->attempt = attempt;
	ch->any_attempt = attempt_null;
	idem_spi_connect_as_owner(&as);
	if (!change_row(rk, ch, NULL))
		holder_missed(st, rk, attempt, attempt_null);
	idem_spi_finish_as_owner(&as);
}

/* idem_request_checkpoint(key, scope, attempt, recovery_point, state) */
Datum
idem_request_checkpoint(PG_FUNCTION_ARGS)
{
	RequestKey	rk;
	int32		attempt;
	RowChange	ch = {0};

	request_key_args(fcinfo, &rk);
	attempt = attempt_arg(fcinfo, 2);
	if (PG_ARGISNULL(3))
		idem_null_argument("recovery_point");
	if (VARSIZE_ANY_EXHDR(PG_GETARG_TEXT_PP(3)) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("recovery_point must not be empty")));
	ch.cond = COND_HELD;
	/* detoasted: the row must not point at another table's toast */
	set_column(&ch, C_RECOVERY_POINT, PointerGetDatum(PG_GETARG_TEXT_PP(3)), false);
	if (!PG_ARGISNULL(4))		/* no state: the last one stays */
		set_column(&ch, C_STATE, JsonbPGetDatum(PG_GETARG_JSONB_P(4)), false);
	set_column(&ch, C_UPDATED_AT, TimestampTzGetDatum(idem_now()), false);
	holder_update(ST_CHECKPOINT, &rk, attempt, false, &ch, "idem_request_checkpoint()");
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
	RowChange	ch = {0};

	request_key_args(fcinfo, &rk);
	attempt = attempt_arg(fcinfo, 2);
	lease = idem_positive_interval_arg(fcinfo, 3, "lease");
	ch.cond = COND_HELD;
	set_column(&ch, C_LEASE_UNTIL, TimestampTzGetDatum(now + lease), false);
	set_column(&ch, C_UPDATED_AT, TimestampTzGetDatum(now), false);
	holder_update(ST_EXTEND, &rk, attempt, false, &ch, "idem_request_extend()");
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
	RowChange	ch = {0};
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
	ch.cond = COND_STARTED;
	set_column(&ch, C_STATUS, CStringGetTextDatum("completed"), false);
	set_column(&ch, C_LEASE_UNTIL, (Datum) 0, true);
	/* detoasted: they are returned as well as stored */
	set_column(&ch, C_RESPONSE, PG_ARGISNULL(2) ? (Datum) 0 : JsonbPGetDatum(PG_GETARG_JSONB_P(2)),
			   PG_ARGISNULL(2));
	set_column(&ch, C_RESPONSE_STATUS, PG_ARGISNULL(4) ? (Datum) 0 : PG_GETARG_DATUM(4),
			   PG_ARGISNULL(4));
	set_column(&ch, C_UPDATED_AT, TimestampTzGetDatum(idem_now()), false);
	set_column(&ch, C_RESPONSE_BODY,
			   PG_ARGISNULL(5) ? (Datum) 0 : PointerGetDatum(PG_GETARG_TEXT_PP(5)),
			   PG_ARGISNULL(5));
	set_column(&ch, C_RESPONSE_HEADERS, PG_ARGISNULL(6) ? (Datum) 0 :
			   JsonbPGetDatum(request_headers(PG_GETARG_JSONB_P(6))), PG_ARGISNULL(6));
	InitMaterializedSRF(fcinfo, 0);
	holder_update(ST_COMPLETE, &rk, attempt, PG_ARGISNULL(3), &ch, "idem_request_complete()");
	idem_stats_count_scope(rk.claim_scope, IDEM_STAT_REQUESTS_COMPLETED, 1);

	/* what was stored, as begin() will return it */
	row.response = ch.values[C_RESPONSE];
	row.response_null = ch.nulls[C_RESPONSE];
	row.response_status = ch.values[C_RESPONSE_STATUS];
	row.response_status_null = ch.nulls[C_RESPONSE_STATUS];
	row.response_body = ch.values[C_RESPONSE_BODY];
	row.response_body_null = ch.nulls[C_RESPONSE_BODY];
	row.response_headers = ch.values[C_RESPONSE_HEADERS];
	row.response_headers_null = ch.nulls[C_RESPONSE_HEADERS];
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
	RowChange	ch = {0};

	request_key_args(fcinfo, &rk);
	attempt = optional_attempt_arg(fcinfo, 2);
	ch.cond = COND_ANY;
	set_column(&ch, C_STATUS, CStringGetTextDatum("abandoned"), false);
	for (int i = C_LEASE_UNTIL; i <= C_RESPONSE_HEADERS; i++)
		if (i != C_ATTEMPT)
			set_column(&ch, i, (Datum) 0, true);
	set_column(&ch, C_UPDATED_AT, TimestampTzGetDatum(idem_now()), false);
	/* nothing to forget is fine, but not an attempt that is not the latest */
	holder_update(ST_ABANDON, &rk, attempt, PG_ARGISNULL(2), &ch, "idem_request_abandon()");
	PG_RETURN_VOID();
}
