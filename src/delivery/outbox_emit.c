/*-------------------------------------------------------------------------
 *
 * outbox_emit.c
 *	  idem_outbox_emit() and idem_outbox_emit_many(): events written in the
 *	  caller's transaction, with their seq, their logical decoding message
 *	  and the NOTIFY sent at commit.
 *
 * Storage, delivery states and locking rules: see outbox.c.  Here: an
 * aggregate's counter (outbox_sequences) is found, locked and updated
 * without an executor (bump_counter()), with the row lock an UPDATE takes
 * (FOR NO KEY UPDATE, held to commit; a recheck locks the newest version); emit_many takes its aggregates'
 * counters in sorted order, the existing ones directly and, from the first
 * without one, the rest by one statement in the same order.  The counters'
 * table and index, and the events' partition, are opened with
 * RowExclusiveLock.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/outbox.h"

#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/ownership.h"
#include "common/rows.h"
#include "delivery/store.h"
#include "delivery/leases.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/relscan.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "common/hashfn.h"
#include "common/pg_prng.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "replication/message.h"
#include "storage/itemptr.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/fmgroids.h"
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
void
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

void
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


/*---- emitting ----*/


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
		outbox_event_stored_values(&evs[i], values);
		values[8] = FullTransactionIdGetDatum(txid);
		values[9] = Int32GetDatum(bucket);
		idem_insert_row(&ins, values, nulls, InvalidOid);
	}
	idem_close_insert_indexes(&ins);
	table_close(rel, NoLock);
}

/*---- counters ----*/

/* columns of idempotency.outbox_sequences, in order */
#define Natts_outbox_sequences	5
static const char *const sequence_column_names[Natts_outbox_sequences] = {
	"aggregate_type", "aggregate_id", "last_seq", "stored_seq", "wal_seq"
};

/*
 * idempotency.outbox_sequences and its one index (the primary key), opened
 * with RowExclusiveLock for counters moved on without an executor.
 */
typedef struct Counters
{
	Relation	rel;
	IdemIndexSet ins;
	TupleTableSlot *slot;
} Counters;

static void
open_counters(Counters *c)
{
	TupleDesc	desc;

	c->rel = table_open(idem_internal_relid("outbox_sequences"), RowExclusiveLock);
	desc = RelationGetDescr(c->rel);
	if (desc->natts != Natts_outbox_sequences)
		elog(ERROR, "idempotency.outbox_sequences has %d columns, not %d",
			 desc->natts, Natts_outbox_sequences);
	for (int i = 0; i < Natts_outbox_sequences; i++)
		if (TupleDescAttr(desc, i)->attisdropped ||
			strcmp(NameStr(TupleDescAttr(desc, i)->attname), sequence_column_names[i]) != 0)
			elog(ERROR, "idempotency.outbox_sequences: column %d is not %s",
				 i + 1, sequence_column_names[i]);
	idem_open_insert_indexes(c->rel, &c->ins, "outbox counters");
	if (c->ins.n != 1 || RelationGetRelid(c->ins.indexes[0]) != RelationGetPrimaryKeyIndex(c->rel))
		elog(ERROR, "idempotency.outbox_sequences must have its primary key as its only index");
	c->slot = table_slot_create(c->rel, NULL);
}

static void
close_counters(Counters *c)
{
	ExecDropSingleTupleTableSlot(c->slot);
	idem_close_insert_indexes(&c->ins);
	table_close(c->rel, NoLock);
}

/*
 * Move the counter of an aggregate that has one on by n, the new seqs stored
 * as event rows or not ('wal'), as an UPDATE of its row would, but
 * without an executor: the row is found by its primary key with a snapshot
 * taken as SPI takes one for a statement (seeing this transaction's own
 * earlier moves) and updated as UPDATE updates it: waiting for the emitter
 * or the unparking relay that holds it; if an emitter moved it meanwhile,
 * in READ COMMITTED its newest version is locked and moved (the executor's
 * recheck), under a transaction snapshot a serialization failure (as
 * UPDATE fails).  No separate row lock first (a tuple lock is a WAL record
 * of its own).  HOT: no indexed column changes; else its index entry is
 * added.  The update's row lock is held to commit: that is what orders
 * emits.  Returns the new last_seq, or 0
 * when the aggregate has no counter (the caller makes it with SQL).
 */
static int64
bump_counter(Counters *c, const char *type, const char *id, int64 n, bool stored)
{
	Relation	index = c->ins.indexes[0];
	TupleTableSlot *slot = c->slot;
	ScanKeyData key[2];
	IndexScanDesc scan;
	Snapshot	snap;
	bool		found;
	TM_Result	res;
	TM_FailureData tmfd;
	Datum		values[Natts_outbox_sequences];
	bool		nulls[Natts_outbox_sequences];
	HeapTuple	newtup;
	int64		last;

	ScanKeyInit(&key[0], 1, BTEqualStrategyNumber, F_TEXTEQ, CStringGetTextDatum(type));
	key[0].sk_collation = index->rd_indcollation[0];
	ScanKeyInit(&key[1], 2, BTEqualStrategyNumber, F_TEXTEQ, CStringGetTextDatum(id));
	key[1].sk_collation = index->rd_indcollation[1];

	CommandCounterIncrement();
	PushActiveSnapshot(GetTransactionSnapshot());
	UpdateActiveSnapshotCommandId();
	snap = GetActiveSnapshot();

	scan = index_beginscan(c->rel, index, snap, 2, 0);
	index_rescan(scan, key, 2, NULL, 0);
	found = index_getnext_slot(scan, ForwardScanDirection, slot);
	index_endscan(scan);
	if (!found)
	{
		PopActiveSnapshot();
		return 0;
	}

	for (;;)
	{
		LockTupleMode lockmode;

		slot_getallattrs(slot);
		for (int i = 0; i < Natts_outbox_sequences; i++)
		{
			values[i] = slot->tts_values[i];
			nulls[i] = slot->tts_isnull[i];
		}
		if (nulls[2] || nulls[3] || nulls[4])
			elog(ERROR, "outbox counter of \"%s\" has a NULL", id);
		last = DatumGetInt64(values[2]) + n;
		values[2] = Int64GetDatum(last);
		if (stored)
			values[3] = Int64GetDatum(last);
		else
			values[4] = Int64GetDatum(last);
		newtup = heap_form_tuple(RelationGetDescr(c->rel), values, nulls);

		/* waits for a holder (emitter, unparking relay) to end */
		res = heap_update(c->rel, &slot->tts_tid, newtup, GetCurrentCommandId(true),
						  InvalidSnapshot, true, &tmfd, &lockmode);
		if (res == TM_Ok)
			break;
		if (res != TM_Updated && res != TM_Deleted)
			elog(ERROR, "unexpected result %d updating the outbox counter of \"%s\"", (int) res, id);
		if (IsolationUsesXactSnapshot())
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to concurrent update")));
		/* counters are never deleted; one deleted meanwhile is made again */
		if (res == TM_Deleted)
		{
			PopActiveSnapshot();
			heap_freetuple(newtup);
			ExecClearTuple(slot);
			return 0;
		}
		heap_freetuple(newtup);

		/*
		 * READ COMMITTED, moved by an emitter that committed meanwhile: lock
		 * its newest version (as the executor's recheck does) and move that.
		 */
		res = table_tuple_lock(c->rel, &tmfd.ctid, snap, slot, GetCurrentCommandId(true),
							   LockTupleNoKeyExclusive, LockWaitBlock,
							   TUPLE_LOCK_FLAG_FIND_LAST_VERSION, &tmfd);
		if (res == TM_Deleted)
		{
			PopActiveSnapshot();
			ExecClearTuple(slot);
			return 0;
		}
		if (res != TM_Ok)
			elog(ERROR, "unexpected result %d locking the outbox counter of \"%s\"", (int) res, id);
	}
	PopActiveSnapshot();
	if (!HeapTupleIsHeapOnly(newtup))
		idem_insert_index_entries(&c->ins, values, nulls, &newtup->t_self, InvalidOid);
	heap_freetuple(newtup);
	ExecClearTuple(slot);
	return last;
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
	IdemAsOwner as;

	ev.aggregate_type = idem_name_arg(fcinfo, 0, "aggregate_type", OUTBOX_MAX_TYPE_BYTES);
	ev.aggregate_id = idem_name_arg(fcinfo, 1, "aggregate_id", IDEM_MAX_KEY_BYTES);
	ev.event_type = idem_name_arg(fcinfo, 2, "event_type", OUTBOX_MAX_EVENT_TYPE_BYTES);
	if (PG_ARGISNULL(3))
		idem_null_argument("payload");
	ev.payload = PG_GETARG_JSONB_P(3);
	ev.headers = PG_ARGISNULL(4) ? idem_empty_object() : idem_check_object(PG_GETARG_JSONB_P(4), "outbox event headers");
	idem_capability_require("idem_outbox_emit", IDEM_CAP_HANDLER, IDEM_AXIS_TYPE, ev.aggregate_type);
	/* the counter and the event are written without an executor, which would check this */
	PreventCommandIfReadOnly("idem_outbox_emit()");
	txid = emitting_transaction();
	ev.created_at = idem_row_time(txid);

	idem_spi_connect_as_owner(&as);
	if (outbox_mode != MODE_WAL)
		rel = open_target(ev.created_at, &bucket);
	else
		bucket = idem_store_target(IDEM_STORE_OUTBOX, ev.created_at, NULL, NULL);
	idem_row_id(ev.created_at, bucket, txid, &ev.id);
	values[0] = CStringGetTextDatum(ev.aggregate_type);
	values[1] = CStringGetTextDatum(ev.aggregate_id);
	values[2] = BoolGetDatum(outbox_mode != MODE_WAL);
	{
		Counters	c;

		open_counters(&c);
		ev.seq = bump_counter(&c, ev.aggregate_type, ev.aggregate_id, 1, outbox_mode != MODE_WAL);
		close_counters(&c);
	}
	if (ev.seq == 0)
	{
		bool		isnull;

		/* its first event, or a racer made the counter: SQL makes or takes it */
		n = outbox_exec(ST_EMIT_SEQ, values, NULL, SPI_OK_INSERT_RETURNING);
		if (n != 1)
			elog(ERROR, "outbox emit took " UINT64_FORMAT " seqs", n);
		ev.seq = DatumGetInt64(idem_spi_col(0, 1, &isnull));
	}
	idem_spi_finish_as_owner(&as);
	if (outbox_mode != MODE_WAL)
		insert_events(rel, bucket, txid, &ev, 1);

	announce_event(&ev);
	{
		Datum		out[11];
		bool		nulls[11];

		outbox_event_values(&ev, 0, NULL, 0, out, nulls);
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
	int			first_new;
	char	  **names;			/* distinct aggregate ids, sorted */
	Datum	   *counts;			/* events per aggregate */
	int64	   *next_seq;
	OutboxEvent *evs;
	Jsonb	   *none = idem_empty_object();
	FullTransactionId txid = emitting_transaction();
	TimestampTz now = idem_row_time(txid);
	int32		bucket;
	Relation	rel = NULL;
	IdemAsOwner as;

	InitMaterializedSRF(fcinfo, 0);
	n = idem_array_arg(fcinfo, 1, "aggregate_ids", TEXTOID, &ids);
	if (idem_array_arg(fcinfo, 2, "event_types", TEXTOID, &types) != n ||
		idem_array_arg(fcinfo, 3, "payloads", JSONBOID, &payloads) != n ||
		(!PG_ARGISNULL(4) && idem_array_arg(fcinfo, 4, "headers", JSONBOID, &headers) != n))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("aggregate_ids, event_types, payloads and headers must have the same length")));
	idem_capability_require("idem_outbox_emit_many", IDEM_CAP_HANDLER, IDEM_AXIS_TYPE, aggregate_type);
	PreventCommandIfReadOnly("idem_outbox_emit_many()");
	if (n == 0)
		return (Datum) 0;

	/* the events outlive SPI_finish(): made here, not in SPI's memory */
	idem_spi_connect_as_owner(&as);
	if (outbox_mode != MODE_WAL)
		rel = open_target(now, &bucket);
	else
		bucket = idem_store_target(IDEM_STORE_OUTBOX, now, NULL, NULL);
	idem_spi_finish_as_owner(&as);
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

	/*
	 * The counters in sorted order (lock order): moved on directly while
	 * they exist; from the first aggregate without one on, the rest (still
	 * in sorted order) by one statement that makes or takes them.
	 */
	next_seq = palloc(sizeof(int64) * nagg);
	{
		Counters	c;

		open_counters(&c);
		for (first_new = 0; first_new < nagg; first_new++)
		{
			int64		count = DatumGetInt64(counts[first_new]);
			int64		last = bump_counter(&c, aggregate_type, names[first_new], count,
											outbox_mode != MODE_WAL);

			if (last == 0)
				break;
			next_seq[first_new] = last - count + 1;
		}
		close_counters(&c);
	}
	if (first_new < nagg)
	{
		int			rest = nagg - first_new;
		Datum		values[4];
		Datum	   *name_datums = palloc(sizeof(Datum) * rest);
		uint64		got;

		for (int a = 0; a < rest; a++)
			name_datums[a] = CStringGetTextDatum(names[first_new + a]);
		values[0] = CStringGetTextDatum(aggregate_type);
		values[1] = idem_build_array(name_datums, NULL, rest, TEXTOID);
		values[2] = BoolGetDatum(outbox_mode != MODE_WAL);
		values[3] = idem_build_array(counts + first_new, NULL, rest, INT8OID);
		idem_spi_connect_as_owner(&as);
		got = outbox_exec(ST_RESERVE, values, NULL, SPI_OK_INSERT_RETURNING);
		if (got != (uint64) rest)
			elog(ERROR, "outbox emit reserved " UINT64_FORMAT " counters, not %d", got, rest);
		for (uint64 r = 0; r < got; r++)
		{
			bool		isnull;
			int			a = sorted_index(names, nagg,
										 TextDatumGetCString(idem_spi_col(r, 1, &isnull)));

			next_seq[a] = DatumGetInt64(idem_spi_col(r, 2, &isnull)) - DatumGetInt64(counts[a]) + 1;
		}
		idem_spi_finish_as_owner(&as);
	}
	/* seqs in array order */
	for (int i = 0; i < n; i++)
		evs[i].seq = next_seq[sorted_index(names, nagg, evs[i].aggregate_id)]++;

	if (outbox_mode != MODE_WAL)
		insert_events(rel, bucket, txid, evs, n);

	for (int i = 0; i < n; i++)
	{
		Datum		values[11];
		bool		nulls[11];

		announce_event(&evs[i]);
		outbox_event_values(&evs[i], 0, NULL, 0, values, nulls);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

