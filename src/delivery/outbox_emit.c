/*-------------------------------------------------------------------------
 *
 * outbox_emit.c
 *	  idem_outbox_emit() and idem_outbox_emit_many(): events written in the
 *	  caller's transaction, with their seq, their logical decoding message
 *	  and the NOTIFY sent at commit.
 *
 * Storage, delivery states and locking rules: see outbox.c.  Here: an
 * emit takes its aggregate's emit lock (an advisory lock on a hash of the
 * aggregate, to commit) and continues from the aggregate's newest seq,
 * read from the events' (aggregate_type, aggregate_id, seq) indexes and
 * the counter (outbox_sequences, written only for 'wal' emits and by
 * retention) -- see "How emits of one aggregate serialise" below.
 * emit_many takes its aggregates' locks in hash order, or one lock on
 * outbox_sequences for a batch too large for the lock table.  The
 * counters' table is opened with RowExclusiveLock (held to commit), the
 * events' partitions with AccessShareLock while probed, the one written
 * into with RowExclusiveLock.
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
#include "access/htup_details.h"
#include "access/nbtree.h"
#include "access/relation.h"
#include "access/heapam.h"
#include "access/relscan.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
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
#include "storage/bufmgr.h"
#include "storage/itemptr.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
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
#include "utils/rel.h"
#include "utils/relcache.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
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

/* the NOTIFY this transaction queued, and when this backend's last committed */
static bool notify_queued = false;
static TimestampTz last_notify_at = 0;

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
				if (outbox_notify != NOTIFY_COALESCE || last_notify_at == 0 ||
					GetCurrentTimestamp() - last_notify_at >=
					(TimestampTz) outbox_notify_window * 1000)
				{
					Async_Notify(OUTBOX_NOTIFY_CHANNEL, "");
					notify_queued = true;
				}
			}
			break;
		case XACT_EVENT_COMMIT:
			/*
			 * the window runs from a NOTIFY that was sent, not one whose
			 * commit failed after PRE_COMMIT (SERIALIZABLE's check at
			 * commit): that goes to ABORT below
			 */
			if (notify_queued)
				last_notify_at = GetCurrentTimestamp();
			notify_level = 0;
			notify_queued = false;
			break;
		case XACT_EVENT_PRE_PREPARE:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			notify_level = 0;
			notify_queued = false;
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
	/* one NOTIFY per emitting transaction, sent at its commit (or coalesced) */
	if (outbox_notify != NOTIFY_OFF)
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
/* Write events into rel (from open_events_target()) and close it. */
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

/*---- seq: the emit lock and the newest seq ----*/

/*
 * How emits of one aggregate serialise, and where seq comes from.
 *
 * An emitter holds, to the end of its transaction, outbox_sequences in
 * RowExclusiveLock and then the aggregate's emit lock: an advisory lock on
 * a 64-bit hash of (aggregate_type, aggregate_id) in ExclusiveLock (a
 * collision only makes two aggregates wait for each other).  A prepared
 * transaction keeps it until COMMIT or ROLLBACK PREPARED; a subtransaction
 * that rolls back releases it with its rows.  Holding it, the emitter reads
 * the aggregate's newest seq: the greater of its newest event row and its
 * counter (outbox_sequences, which only 'wal' emits, storing no row, and
 * retention, before it drops the partition of an aggregate's newest event,
 * write).  Both are read with a dirty snapshot: every earlier emitter of
 * the aggregate has ended (a lock is released after the proc array entry,
 * so its rows are committed or aborted for good), and the emitter's own
 * rows count whatever command wrote them.  seq = that + 1: gap-free (a
 * rollback takes the row and the lock away together) and in commit order
 * (the next emitter waits for this one's commit).
 *
 * Where the newest event is.  Partitions are probed newest first (the
 * store cache's order) and the first that holds an event of the aggregate
 * holds its newest: an emit writes into the newer of its time's partition
 * and the one that holds the aggregate's newest event, so an aggregate's
 * events never go back to an older partition, whatever the clock or a
 * stale cache says.  The list is read after the lock, so it has every
 * partition an earlier emitter wrote into; one dropped since (by
 * retention, which carried its newest seqs into the counters first) is
 * passed over.  The probe reads the aggregate's last index entry straight
 * off the leaf page (newest_entry(): an index scan would read all of the
 * aggregate's entries on it).  Partitions older than the one the emit's
 * time falls into are locked only while a call probes them: one that
 * holds nothing of the aggregate may go, and one that held its newest
 * event leaves the seq in the counter when it goes; the others stay locked
 * to commit (retention drops none of them soon).  The counter is not
 * probed while its table never had a row.
 *
 * REPEATABLE READ and SERIALIZABLE: an emitter whose snapshot does not see
 * the newest seq (committed by another emitter after the snapshot) gets a
 * serialization failure, as the UPDATE of a counter row would.
 *
 * Lock-table pressure: a transaction takes at most OUTBOX_MAX_EMIT_LOCKS
 * emit locks; a batch that would take more takes outbox_sequences in
 * ExclusiveLock instead (bulk): that excludes every other emitter until it
 * ends, and needs no emit lock of its own (lock_emits() says when it
 * waits for it).
 *
 * Relays take the emit lock only if it is free at once
 * (outbox_emits_idle(), to unpark an aggregate): they never wait for an
 * emitter, which may be a prepared transaction.
 */

/* columns of idempotency.outbox_sequences, in order */
#define Natts_outbox_sequences	5
static const char *const sequence_column_names[Natts_outbox_sequences] = {
	"aggregate_type", "aggregate_id", "last_seq", "stored_seq", "wal_seq"
};

static LocalTransactionId emit_locks_lxid = InvalidLocalTransactionId;
static int	emit_locks_taken = 0;

static uint64
aggregate_hash(const char *type, const char *id)
{
	uint64		h = hash_bytes_extended((const unsigned char *) type, strlen(type), 0);

	return hash_bytes_extended((const unsigned char *) id, strlen(id), h);
}

static void
emit_locktag(LOCKTAG *tag, uint64 h)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 IDEM_LOCKTAG_EMIT);
}

static int
hash_cmp(const void *a, const void *b)
{
	uint64		x = *(const uint64 *) a;
	uint64		y = *(const uint64 *) b;

	return x < y ? -1 : (x > y ? 1 : 0);
}

/*
 * Take outbox_sequences in RowExclusiveLock and the emit locks of the
 * aggregates of hashes hs, to commit, in hash order (every batch takes
 * them in that one order: no deadlock between batches), or the bulk lock
 * (see above).  The bulk lock is waited for only by a transaction that
 * holds no emit lock yet (so it holds nothing an emitter waits for, and
 * does not trade RowExclusiveLock up to ExclusiveLock, which two such
 * transactions would deadlock on); one that emitted already takes it only
 * if free at once, else takes the emit locks all the same (the lock table
 * may then run out: max_locks_per_transaction).
 */
static void
lock_emits(uint64 *hs, int n)
{
	Oid			relid = idem_internal_relid("outbox_sequences");
	LOCKTAG		rel;

	if (MyProc->lxid != emit_locks_lxid)
	{
		emit_locks_lxid = MyProc->lxid;
		emit_locks_taken = 0;
	}
	SET_LOCKTAG_RELATION(rel, MyDatabaseId, relid);
	if (LockHeldByMe(&rel, ExclusiveLock) || LockHeldByMe(&rel, AccessExclusiveLock))
		return;					/* bulk already */
	if (emit_locks_taken + n > OUTBOX_MAX_EMIT_LOCKS)
	{
		if (!LockHeldByMe(&rel, RowExclusiveLock))
		{
			LockRelationOid(relid, ExclusiveLock);
			return;
		}
		if (ConditionalLockRelationOid(relid, ExclusiveLock))
			return;
	}
	LockRelationOid(relid, RowExclusiveLock);
	qsort(hs, n, sizeof(uint64), hash_cmp);
	for (int i = 0; i < n; i++)
	{
		LOCKTAG		tag;

		if (i > 0 && hs[i] == hs[i - 1])
			continue;
		emit_locktag(&tag, hs[i]);
		if (LockAcquire(&tag, ExclusiveLock, false, false) == LOCKACQUIRE_OK)
			emit_locks_taken++;
	}
}

/*
 * Whether no emit of the aggregate is in flight, and none can start before
 * this transaction ends: its emit lock (and outbox_sequences in
 * RowExclusiveLock, which a bulk emitter's lock excludes), taken only if
 * free at once, and then held to commit.  Never waits.
 */
bool
outbox_emits_idle(const char *type, const char *id)
{
	LOCKTAG		tag;

	if (!ConditionalLockRelationOid(idem_internal_relid("outbox_sequences"), RowExclusiveLock))
		return false;
	emit_locktag(&tag, aggregate_hash(type, id));
	return LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
}

/* A partition of the events as a call probes it. */
typedef struct ProbedPartition
{
	Relation	heap;			/* NULL: not opened yet, or gone */
	Relation	index;			/* its (aggregate_type, aggregate_id, seq) index */
	TupleTableSlot *slot;
	IndexFetchTableData *fetch;
	BTScanInsert key;			/* (aggregate_type, aggregate_id), for newest_entry() */
	bool		opened;
	bool		gone;			/* dropped since the registry was read */
} ProbedPartition;

/* What an emit call reads seqs with. */
typedef struct SeqReader
{
	Relation	counters;		/* outbox_sequences, RowExclusiveLock */
	Relation	counters_pk;
	TupleTableSlot *counter_slot;
	StorePartition *parts;		/* the events' partitions, newest first */
	int			nparts;
	ProbedPartition *probed;
	Oid			home;			/* the newest partition with a probed aggregate's newest event */
	int			home_at;
	int			keep_upto;		/* partitions 0 .. this stay locked to commit */
	bool		no_counters;	/* outbox_sequences has never had a row */
	bool		counters_checked;
	SnapshotData dirty;
} SeqReader;

static void
open_seq_reader(SeqReader *r)
{
	TupleDesc	desc;

	memset(r, 0, sizeof(SeqReader));
	r->counters = table_open(idem_internal_relid("outbox_sequences"), RowExclusiveLock);
	desc = RelationGetDescr(r->counters);
	if (desc->natts != Natts_outbox_sequences)
		elog(ERROR, "idempotency.outbox_sequences has %d columns, not %d",
			 desc->natts, Natts_outbox_sequences);
	for (int i = 0; i < Natts_outbox_sequences; i++)
		if (TupleDescAttr(desc, i)->attisdropped ||
			strcmp(NameStr(TupleDescAttr(desc, i)->attname), sequence_column_names[i]) != 0)
			elog(ERROR, "idempotency.outbox_sequences: column %d is not %s",
				 i + 1, sequence_column_names[i]);
	if (!OidIsValid(RelationGetPrimaryKeyIndex(r->counters)))
		elog(ERROR, "idempotency.outbox_sequences has no primary key");
	r->counters_pk = index_open(RelationGetPrimaryKeyIndex(r->counters), AccessShareLock);
	r->counter_slot = table_slot_create(r->counters, NULL);
	r->counters_checked = false;
	r->home = InvalidOid;
	r->home_at = -1;
	InitDirtySnapshot(r->dirty);
}

/*
 * Whether B-tree index has never had an entry (no root page yet): its
 * metapage says so, unless this backend has seen its root already.
 */
static bool
btree_never_filled(Relation index)
{
	Buffer		buf;
	bool		empty;

	if (index->rd_amcache != NULL)
		return false;
	buf = ReadBuffer(index, BTREE_METAPAGE);
	LockBuffer(buf, BUFFER_LOCK_SHARE);
	empty = BTPageGetMeta(BufferGetPage(buf))->btm_root == P_NONE;
	UnlockReleaseBuffer(buf);
	return empty;
}

/*
 * The partitions as the registry lists them now: called after the emit
 * locks.  Those from the one that takes rows made at ts on to the newest
 * are kept locked to commit (retention drops none of them soon, and the
 * next emit of the transaction finds them locked); older ones only while
 * probed, so that retention can drop them.
 */
static void
load_partitions(SeqReader *r, TimestampTz ts)
{
	r->parts = idem_store_partitions(IDEM_STORE_OUTBOX, &r->nparts);
	r->keep_upto = idem_store_pick(r->parts, r->nparts, ts);
	r->probed = palloc0(sizeof(ProbedPartition) * r->nparts);
	r->home_at = -1;
	for (int i = 0; i < r->nparts; i++)
		if (r->parts[i].relid == r->home)
			r->home_at = i;
}

static void
close_partitions(SeqReader *r)
{
	for (int i = 0; i < r->nparts; i++)
	{
		ProbedPartition *p = &r->probed[i];

		if (p->fetch != NULL)
			table_index_fetch_end(p->fetch);
		if (p->slot != NULL)
			ExecDropSingleTupleTableSlot(p->slot);
		if (p->index != NULL)
			index_close(p->index, i <= r->keep_upto ? NoLock : AccessShareLock);
		if (p->heap != NULL)
			table_close(p->heap, i <= r->keep_upto ? NoLock : AccessShareLock);
	}
	pfree(r->probed);
	pfree(r->parts);
	r->probed = NULL;
	r->parts = NULL;
	r->nparts = 0;
}

static void
close_seq_reader(SeqReader *r)
{
	if (r->parts != NULL)
		close_partitions(r);
	ExecDropSingleTupleTableSlot(r->counter_slot);
	index_close(r->counters_pk, AccessShareLock);
	table_close(r->counters, NoLock);	/* RowExclusiveLock held to commit */
}

/* which index of an events partition is on (aggregate_type, aggregate_id, seq) */
#define SEQ_INDEX_CACHE	32
static struct
{
	Oid			heap;
	Oid			index;
}			seq_index_cache[SEQ_INDEX_CACHE];
static int	seq_index_next = 0;

static Oid
events_seq_index(Relation heap)
{
	Oid			relid = RelationGetRelid(heap);
	Oid			found = InvalidOid;
	List	   *list;
	ListCell   *lc;

	for (int i = 0; i < SEQ_INDEX_CACHE; i++)
		if (seq_index_cache[i].heap == relid)
			return seq_index_cache[i].index;
	list = RelationGetIndexList(heap);
	foreach(lc, list)
	{
		Oid			ix = lfirst_oid(lc);
		HeapTuple	tup = SearchSysCache1(INDEXRELID, ObjectIdGetDatum(ix));
		Form_pg_index f;

		if (!HeapTupleIsValid(tup))
			continue;
		f = (Form_pg_index) GETSTRUCT(tup);
		if (f->indnatts == 3 && f->indkey.values[0] == 2 && f->indkey.values[1] == 3 &&
			f->indkey.values[2] == 4 && f->indisvalid &&
			heap_attisnull(tup, Anum_pg_index_indpred, NULL) &&
			heap_attisnull(tup, Anum_pg_index_indexprs, NULL))
			found = ix;
		ReleaseSysCache(tup);
	}
	list_free(list);
	if (!OidIsValid(found))
		elog(ERROR, "outbox partition \"%s\" has no index on (aggregate_type, aggregate_id, seq)",
			 RelationGetRelationName(heap));
	seq_index_cache[seq_index_next].heap = relid;
	seq_index_cache[seq_index_next].index = found;
	seq_index_next = (seq_index_next + 1) % SEQ_INDEX_CACHE;
	return found;
}

/*
 * The seq index of an events partition, opened with AccessShareLock; one
 * remembered that is gone or changed (REINDEX CONCURRENTLY) is looked up
 * again.
 */
static Relation
open_seq_index(Relation heap)
{
	for (int attempt = 0;; attempt++)
	{
		Oid			ix = events_seq_index(heap);
		Relation	index = try_relation_open(ix, AccessShareLock);

		if (index != NULL && index->rd_rel->relkind == RELKIND_INDEX &&
			index->rd_index->indrelid == RelationGetRelid(heap) && index->rd_index->indisvalid)
			return index;
		if (index != NULL)
			relation_close(index, AccessShareLock);
		if (attempt > 0)
			elog(ERROR, "outbox partition \"%s\": its (aggregate_type, aggregate_id, seq) index changed",
				 RelationGetRelationName(heap));
		for (int i = 0; i < SEQ_INDEX_CACHE; i++)
			if (seq_index_cache[i].heap == RelationGetRelid(heap))
				seq_index_cache[i].heap = InvalidOid;
	}
}

/* Open partition i for probes (AccessShareLock, released when the call ends). */
static ProbedPartition *
probed_partition(SeqReader *r, int i)
{
	ProbedPartition *p = &r->probed[i];

	if (p->opened)
		return p;
	p->opened = true;
	p->heap = try_table_open(r->parts[i].relid, AccessShareLock);
	if (p->heap == NULL)
	{
		p->gone = true;			/* dropped since the registry was read */
		return p;
	}
	p->index = open_seq_index(p->heap);
	if (p->index->rd_rel->relam != BTREE_AM_OID ||
		IndexRelationGetNumberOfKeyAttributes(p->index) != 3)
		elog(ERROR, "outbox partition \"%s\": its seq index is not a B-tree on three columns",
			 RelationGetRelationName(p->heap));
	p->slot = table_slot_create(p->heap, NULL);
	p->fetch = table_index_fetch_begin(p->heap);
	/* a search key on the first two columns, its arguments set per probe */
	p->key = _bt_mkscankey(p->index, NULL);
	p->key->heapkeyspace = true;
	p->key->nextkey = true;
	p->key->keysz = 2;
	for (int k = 0; k < 2; k++)
		p->key->scankeys[k].sk_flags &= ~SK_ISNULL;
	return p;
}

/*
 * A transaction snapshot (REPEATABLE READ, SERIALIZABLE) must see the
 * newest seq it continues from: else, as an UPDATE of that row would,
 * a serialization failure.
 */
static void
check_seen(Relation rel, TupleTableSlot *slot)
{
	HeapTuple	tup;
	bool		should_free;

	if (!IsolationUsesXactSnapshot())
		return;
	tup = ExecFetchSlotHeapTuple(slot, false, &should_free);
	if (TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(tup->t_data)))
		return;
	if (!table_tuple_satisfies_snapshot(rel, slot, GetTransactionSnapshot()))
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent update"),
				 errdetail("An outbox event of this aggregate was emitted after this transaction's snapshot.")));
}

/* seek the rows of (type, id) in index, the first two columns */
static IndexScanDesc
seek_aggregate(Relation heap, Relation index, Snapshot snap, Datum type, Datum id)
{
	ScanKeyData key[2];
	IndexScanDesc scan;

	ScanKeyInit(&key[0], 1, BTEqualStrategyNumber, F_TEXTEQ, type);
	key[0].sk_collation = index->rd_indcollation[0];
	ScanKeyInit(&key[1], 2, BTEqualStrategyNumber, F_TEXTEQ, id);
	key[1].sk_collation = index->rd_indcollation[1];
	scan = index_beginscan(heap, index, snap, 2, 0);
	index_rescan(scan, key, 2, NULL, 0);
	return scan;
}

/*
 * The newest event of (type, id) in partition p, read straight off its
 * index: one descent to the first entry past the aggregate (nextkey), the
 * entry before it, and its heap tuple under the dirty snapshot, into
 * p->slot.  An index scan would read every entry of the aggregate on that
 * leaf page.  Returns 1 if found, 0 if the partition holds no event of the
 * aggregate, -1 if this cannot tell (the entry before is on the page to
 * the left, or its tuple is not visible: a rolled-back emit): the caller
 * scans the index instead.
 */
static int
newest_entry(SeqReader *r, ProbedPartition *p, Datum type, Datum id)
{
	Buffer		buf;
	BTStack		stack;
	Page		page;
	BTPageOpaque opaque;
	OffsetNumber low;
	OffsetNumber high;
	OffsetNumber first;
	IndexTuple	itup;
	ItemPointerData tids[MaxIndexTuplesPerPage];
	int			ntids;
	int			found = -1;

	p->key->scankeys[0].sk_argument = type;
	p->key->scankeys[1].sk_argument = id;
	stack = _bt_search(p->index, p->key, &buf, BT_READ, NULL);
	_bt_freestack(stack);
	if (!BufferIsValid(buf))
		return 0;				/* an empty index */
	page = BufferGetPage(buf);
	opaque = BTPageGetOpaque(page);
	first = P_FIRSTDATAKEY(opaque);
	low = first;
	high = PageGetMaxOffsetNumber(page) + 1;
	/* the first entry past the aggregate */
	while (low < high)
	{
		OffsetNumber mid = low + (high - low) / 2;

		if (_bt_compare(p->index, p->key, page, mid) >= 0)
			low = mid + 1;
		else
			high = mid;
	}
	if (low <= first)
	{
		_bt_relbuf(p->index, buf);
		return -1;				/* what comes before is on the left page */
	}
	if (_bt_compare(p->index, p->key, page, low - 1) != 0)
	{
		_bt_relbuf(p->index, buf);
		return 0;				/* before it, another aggregate */
	}
	itup = (IndexTuple) PageGetItem(page, PageGetItemId(page, low - 1));
	if (BTreeTupleIsPosting(itup))
	{
		ntids = BTreeTupleGetNPosting(itup);
		for (int k = 0; k < ntids; k++)
			tids[k] = *BTreeTupleGetPostingN(itup, k);
	}
	else
	{
		ntids = 1;
		tids[0] = itup->t_tid;
	}
	/* the pin stays while the heap is read: VACUUM cannot recycle the tids */
	LockBuffer(buf, BUFFER_LOCK_UNLOCK);
	for (int k = 0; k < ntids && found < 0; k++)
	{
		bool		call_again = false;
		bool		all_dead = false;

		if (table_index_fetch_tuple(p->fetch, &tids[k], &r->dirty, p->slot, &call_again, &all_dead))
			found = 1;
	}
	ReleaseBuffer(buf);
	return found;
}

/*
 * The newest seq of (type, id), 0 for none (see "How emits of one aggregate
 * serialise" above); the caller holds its emit lock.  Moves r->home to the
 * partition of its newest event if that is newer.
 */
static int64
newest_seq(SeqReader *r, const char *type, const char *id)
{
	Datum		t = CStringGetTextDatum(type);
	Datum		i = CStringGetTextDatum(id);
	int64		stored = 0;
	int64		counted = 0;
	IndexScanDesc scan;
	bool		isnull;

	for (int k = 0; k < r->nparts && stored == 0; k++)
	{
		ProbedPartition *p = probed_partition(r, k);
		int			got;

		if (p->gone)
			continue;
		got = newest_entry(r, p, t, i);
		if (got < 0)
		{
			scan = seek_aggregate(p->heap, p->index, &r->dirty, t, i);
			got = index_getnext_slot(scan, BackwardScanDirection, p->slot) ? 1 : 0;
			index_endscan(scan);
		}
		if (got > 0)
		{
			stored = DatumGetInt64(slot_getattr(p->slot, 4, &isnull));
			check_seen(p->heap, p->slot);
			if (r->home_at < 0 || k < r->home_at)
			{
				r->home_at = k;
				r->home = r->parts[k].relid;
			}
		}
		ExecClearTuple(p->slot);
	}

	/*
	 * Read after the partitions: a drop that passed them has written it.
	 * A counter table that never had a row (no 'wal' emit, no retention
	 * yet) is not probed; whether it had one is asked once per call.
	 */
	if (!r->counters_checked)
	{
		r->no_counters = btree_never_filled(r->counters_pk);
		r->counters_checked = true;
	}
	if (r->no_counters)
		return stored;
	scan = seek_aggregate(r->counters, r->counters_pk, &r->dirty, t, i);
	if (index_getnext_slot(scan, ForwardScanDirection, r->counter_slot))
	{
		counted = DatumGetInt64(slot_getattr(r->counter_slot, 3, &isnull));
		if (counted > stored)
			check_seen(r->counters, r->counter_slot);
	}
	index_endscan(scan);
	ExecClearTuple(r->counter_slot);
	return Max(stored, counted);
}

/*
 * The partition events made at ts go into, opened with RowExclusiveLock:
 * the one ts falls into, or r->home if that is newer (see above).  Sets
 * its bucket.
 */
static Relation
open_events_target(SeqReader *r, TimestampTz ts, int32 *bucket)
{
	for (int attempt = 0;; attempt++)
	{
		int			t = idem_store_pick(r->parts, r->nparts, ts);
		Relation	rel;

		if (r->home_at >= 0 && r->home_at < t)
			t = r->home_at;
		rel = idem_store_open_partition(IDEM_STORE_OUTBOX, r->parts[t].relid,
										event_column_names, Natts_outbox_events);
		if (rel != NULL)
		{
			*bucket = r->parts[t].bucket;
			return rel;
		}
		/* dropped since this backend read the registry: read it again */
		if (attempt > 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the outbox partition for bucket %d is gone", r->parts[t].bucket),
					 errhint("Run SELECT idem_maintain(); if it was dropped by hand, the next round forgets it.")));
		idem_store_forget(IDEM_STORE_OUTBOX);
		close_partitions(r);
		load_partitions(r, ts);
	}
}

/*
 * 'wal' emits store no row: their aggregates' counters carry the seqs
 * (ids: the aggregates, sorted; seqs: the newest of each).
 */
static void
write_wal_counters(const char *type, char **ids, const int64 *seqs, int n)
{
	Datum		values[3];
	Datum	   *id_datums = palloc(sizeof(Datum) * n);
	Datum	   *seq_datums = palloc(sizeof(Datum) * n);

	for (int a = 0; a < n; a++)
	{
		id_datums[a] = CStringGetTextDatum(ids[a]);
		seq_datums[a] = Int64GetDatum(seqs[a]);
	}
	values[0] = CStringGetTextDatum(type);
	values[1] = idem_build_array(id_datums, NULL, n, TEXTOID);
	values[2] = idem_build_array(seq_datums, NULL, n, INT8OID);
	(void) outbox_exec(ST_WAL_SEQ, values, NULL, SPI_OK_INSERT);
}

Datum
idem_outbox_emit(PG_FUNCTION_ARGS)
{
	OutboxEvent ev;
	TupleDesc	desc = idem_result_tupdesc(fcinfo);
	int32		bucket;
	Relation	rel = NULL;
	FullTransactionId txid;
	IdemAsOwner as;
	SeqReader	r;
	uint64		h;

	ev.aggregate_type = idem_name_arg(fcinfo, 0, "aggregate_type", OUTBOX_MAX_TYPE_BYTES);
	ev.aggregate_id = idem_name_arg(fcinfo, 1, "aggregate_id", IDEM_MAX_KEY_BYTES);
	ev.event_type = idem_name_arg(fcinfo, 2, "event_type", OUTBOX_MAX_EVENT_TYPE_BYTES);
	if (PG_ARGISNULL(3))
		idem_null_argument("payload");
	ev.payload = PG_GETARG_JSONB_P(3);
	ev.headers = PG_ARGISNULL(4) ? idem_empty_object() : idem_check_object(PG_GETARG_JSONB_P(4), "outbox event headers");
	idem_capability_require("idem_outbox_emit", IDEM_CAP_HANDLER, IDEM_AXIS_TYPE, ev.aggregate_type);
	/* the event (and a counter) are written without an executor, which would check this */
	PreventCommandIfReadOnly("idem_outbox_emit()");
	txid = emitting_transaction();

	idem_spi_connect_as_owner(&as);
	h = aggregate_hash(ev.aggregate_type, ev.aggregate_id);
	lock_emits(&h, 1);
	open_seq_reader(&r);
	ev.created_at = idem_row_time(txid);
	load_partitions(&r, ev.created_at);
	ev.seq = newest_seq(&r, ev.aggregate_type, ev.aggregate_id) + 1;
	if (outbox_mode != MODE_WAL)
		rel = open_events_target(&r, ev.created_at, &bucket);
	else
	{
		bucket = idem_store_target(IDEM_STORE_OUTBOX, ev.created_at, NULL, NULL);
		write_wal_counters(ev.aggregate_type, (char **) &ev.aggregate_id, &ev.seq, 1);
	}
	idem_row_id(ev.created_at, bucket, txid, &ev.id);
	close_seq_reader(&r);
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


/* for sorting a batch's aggregate ids */
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
	int		   *of;				/* each event's index in names */
	int64	   *next_seq;
	uint64	   *hs;
	OutboxEvent *evs;
	Jsonb	   *none = idem_empty_object();
	FullTransactionId txid = emitting_transaction();
	TimestampTz now;
	int32		bucket;
	Relation	rel = NULL;
	IdemAsOwner as;
	SeqReader	r;

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
		names[i] = (char *) evs[i].aggregate_id;
	}

	/* distinct aggregates, sorted */
	qsort(names, n, sizeof(char *), cstring_cmp);
	for (int i = 0; i < n; i++)
		if (nagg == 0 || strcmp(names[i], names[nagg - 1]) != 0)
			names[nagg++] = names[i];
	of = palloc(sizeof(int) * n);
	for (int i = 0; i < n; i++)
		of[i] = sorted_index(names, nagg, evs[i].aggregate_id);
	hs = palloc(sizeof(uint64) * nagg);
	for (int a = 0; a < nagg; a++)
		hs[a] = aggregate_hash(aggregate_type, names[a]);
	next_seq = palloc(sizeof(int64) * nagg);

	idem_spi_connect_as_owner(&as);
	lock_emits(hs, nagg);
	open_seq_reader(&r);
	now = idem_row_time(txid);
	load_partitions(&r, now);
	for (int a = 0; a < nagg; a++)
		next_seq[a] = newest_seq(&r, aggregate_type, names[a]) + 1;
	if (outbox_mode != MODE_WAL)
		rel = open_events_target(&r, now, &bucket);
	else
		bucket = idem_store_target(IDEM_STORE_OUTBOX, now, NULL, NULL);

	/* seqs in array order */
	for (int i = 0; i < n; i++)
	{
		evs[i].created_at = i == 0 ? now : idem_row_time(txid);
		idem_row_id(evs[i].created_at, bucket, txid, &evs[i].id);
		evs[i].seq = next_seq[of[i]]++;
	}
	if (outbox_mode == MODE_WAL)
	{
		for (int a = 0; a < nagg; a++)
			next_seq[a]--;		/* the newest of each */
		write_wal_counters(aggregate_type, names, next_seq, nagg);
	}
	close_seq_reader(&r);
	idem_spi_finish_as_owner(&as);

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
