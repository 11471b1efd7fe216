/*-------------------------------------------------------------------------
 *
 * claims.c
 *	  idem_claim() and friends: a dedup marker that commits or rolls back
 *	  with the caller's transaction, unique across time partitions.
 *
 * A claim is a row (scope, key, claimed_at, fingerprint, digest) in one of
 * the time partitions of idempotency.claims, each with a unique btree index
 * on (scope, key).  A unique index only guards one partition, so uniqueness
 * across partitions uses its own value lock, in the way of ON CONFLICT:
 *
 *	1. without any lock, look in the partitions not sealed yet (the one
 *	   the claim would go into first) and in the sealed ones, whose
 *	   Bloom filters rule most keys out in memory (filters.c).  A committed
 *	   claim found here answers "duplicate" at once: a committed claim stays
 *	   until its retention has passed, so no lock is needed to trust it, and
 *	   a hot key's duplicates do not queue.  A claim whose backend's last
 *	   claim was of a new key (the next key of a batch, say) skips this step
 *	   and looks everywhere in step 2 instead: new keys come in runs, and
 *	   that spares a new key one probe of every partition not sealed yet
 *	   and its filter tests (a duplicate met so queues on the value lock
 *	   like a new key; the session's next claim looks first again);
 *	2. take the value lock, a transaction-level lock on a hash of
 *	   (scope, key) in a private advisory locktag space, look again in the
 *	   partitions not sealed yet (all of them, filters included, if the
 *	   partition list changed since step 1), insert into the partition that
 *	   covers the current time, and release the value lock at once.  A key
 *	   found nowhere is first looked up in the summaries of dropped
 *	   partitions (late.c): a late duplicate is counted, warned about, or
 *	   refused (IK008, after the value lock is released) before the insert.
 *
 * Every probe uses a dirty snapshot: a committed (or our own) claim means
 * "duplicate"; a claim of a transaction still in progress means: release
 * the value lock if held, wait for that transaction, then start over.
 *
 * Locking rules: nobody ever waits for another transaction while holding a
 * value lock (we release it first), so value locks never join a deadlock
 * cycle.  A row inserted under the value lock stays the marker until its
 * transaction ends; others wait on that transaction, not on the value lock.
 * Partitions are locked AccessShareLock for probes, until the call ends (it
 * keeps nothing of them), and RowExclusiveLock for the insert, held to
 * transaction end as usual.  The insert re-reads the partition list after
 * taking RowExclusiveLock, still under the value lock, and chooses again if
 * it changed.  Maintenance seals a partition at once only under ShareLock,
 * so a seal that committed before we got our lock is seen there; a
 * partition someone holds RowExclusiveLock on (a transaction that claimed
 * there and is still open, say) it closes first, and seals a round later,
 * once every value lock held after the close could be seen has been
 * released -- so a claim that did not see the close is in the table before
 * the seal's scan, which includes claims still in progress (filters.c).
 * Closed partitions take no claims, and are probed as open ones until they
 * are sealed.  Batches claim keys in sorted order, so two batches never
 * wait on each other in a cycle.
 *
 * Claims go straight into the heap and indexes of a partition: row-level
 * security, rules and triggers on the partitions are not applied (the parent
 * refuses direct inserts).  Every index of a partition is maintained; an
 * index with expressions or a predicate is refused with an error.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/claims.h"
#include "common/catalog.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/keys.h"
#include "common/rows.h"
#include "stats/stats.h"
#include "claims/partitions.h"
#include "claims/classes.h"
#include "claims/filters.h"
#include "claims/groups.h"
#include "claims/late.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/stratnum.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "common/cryptohash.h"
#include "common/sha2.h"
#include "common/hashfn.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "storage/lmgr.h"
#include "tcop/utility.h"
#include "storage/lock.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/fmgrprotos.h"
#include "utils/inval.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/numeric.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_claim_many);
PG_FUNCTION_INFO_V1(idem_claimed);
PG_FUNCTION_INFO_V1(idem_claimed_before);
PG_FUNCTION_INFO_V1(idem_release);


static const char *const claims_columns[Natts_claims] =
{"scope", "key", "claimed_at", "fingerprint", "digest"};

/* Seed of 1.0's payload fingerprints, to compare claims made by 1.0. */
#define IDEM_FINGERPRINT_SEED	INT64CONST(0x1de3907e7c1a1315)

/* One (scope, key) to claim, look up or release. */
typedef struct ClaimKey
{
	text	   *scope;
	text	   *key;
	uint64		hash;			/* idem_key_hash(scope, key) */
	Jsonb	   *payload;		/* NULL if none was given */
	bool		has_digest;
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
} ClaimKey;

/* Which partitions a probe visits. */
typedef enum ProbeWhich
{
	PROBE_OPEN,					/* those that can still take claims */
	PROBE_SEALED,				/* sealed ones, through their filters */
	PROBE_ALL,					/* both */
	PROBE_EVERY					/* both, the expired and future ones too: a
								 * release must forget a claim that a
								 * retention raised later would revive */
} ProbeWhich;

typedef enum ProbeStatus
{
	PROBE_ABSENT,				/* no live claim */
	PROBE_FOUND,				/* a committed claim, or our own */
	PROBE_BUSY					/* another transaction's claim in flight */
} ProbeStatus;

typedef struct ProbeResult
{
	ProbeStatus status;
	TransactionId xwait;		/* PROBE_BUSY: whom to wait for */
	Oid			relid;			/* PROBE_FOUND: where */
	bool		expired;		/* PROBE_FOUND by PROBE_EVERY: in an expired
								 * partition, no claim for now */
	ItemPointerData tid;
	TimestampTz claimed_at;
	bool		has_fingerprint;	/* a 1.0 fingerprint */
	int64		fingerprint;
	bool		has_digest;
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
} ProbeResult;

/*---- argument checks ----*/

static text *
checked_scope(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope = idem_text_arg(fcinfo, argno, "scope");

	idem_check_scope(scope, IDEM_MAX_SCOPE_BYTES);
	return scope;
}

/*
 * The (key, scope) arguments at argno and argno + 1, checked, as a ClaimKey
 * without payload.
 */
static void
claim_key_args(FunctionCallInfo fcinfo, int argno, ClaimKey *ck)
{
	ck->key = idem_text_arg(fcinfo, argno, "key");
	idem_check_key(ck->key);
	ck->scope = checked_scope(fcinfo, argno + 1);
	ck->hash = idem_key_hash(ck->scope, ck->key);
	ck->payload = NULL;
	ck->has_digest = false;
}

/*---- payload digests ----*/

/* Version 1.0's payload fingerprint, for claims stored by or for it. */
static Datum
legacy_fingerprint(Jsonb *payload)
{
	return DirectFunctionCall2(jsonb_hash_extended, JsonbPGetDatum(payload),
							   Int64GetDatum(IDEM_FINGERPRINT_SEED));
}

/* IK001 if the claim found was made with another payload. */
static void
check_payload(ClaimKey *ck, ProbeResult *res)
{
	bool		differs;

	if (ck->payload == NULL)
		return;
	if (res->has_digest)
		differs = memcmp(ck->digest, res->digest, PG_SHA256_DIGEST_LENGTH) != 0;
	else if (res->has_fingerprint)
	{
		/* a claim made by version 1.0: compare its weaker hash */
		differs = DatumGetInt64(legacy_fingerprint(ck->payload)) != res->fingerprint;
	}
	else
		return;					/* claimed without a payload */
	if (differs)
	{
		idem_stats_count_scope(ck->scope, IDEM_STAT_PAYLOAD_MISMATCHES, 1);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_KEY_REUSED),
				 errmsg("idempotency key reused with a different payload"),
				 errdetail("Scope \"%s\", key \"%s\" was claimed with a different payload.",
						   text_to_cstring(ck->scope), idem_key_for_message(ck->key))));
	}
}

/*---- partitions: columns and indexes ----*/

/*
 * Error out unless a partition has the claims columns where we write them.
 * Returns whether it has the digest column, which databases still at
 * version 1.0 (library updated, ALTER EXTENSION UPDATE not yet run) lack.
 */
static bool
check_partition_columns(Relation heap)
{
	TupleDesc	desc = RelationGetDescr(heap);

	for (int i = 0; i < Natts_claims; i++)
	{
		Form_pg_attribute att = i < desc->natts ? TupleDescAttr(desc, i) : NULL;

		if (att == NULL && i == Anum_claims_digest - 1)
			return false;
		if (att == NULL || att->attisdropped ||
			strcmp(NameStr(att->attname), claims_columns[i]) != 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("claims partition \"%s\" does not have the columns of idempotency.claims",
							RelationGetRelationName(heap)),
					 errdetail("Column %d should be \"%s\".", i + 1, claims_columns[i])));
	}
	return true;
}

/* Is this index the unique btree index on exactly (scope, key)? */
static bool
is_claims_index(Oid indexid)
{
	HeapTuple	tup = SearchSysCache1(INDEXRELID, ObjectIdGetDatum(indexid));
	Form_pg_index idx;
	bool		result;

	if (!HeapTupleIsValid(tup))
		return false;
	idx = (Form_pg_index) GETSTRUCT(tup);
	result = idx->indisunique && idx->indisvalid && idx->indisready && idx->indislive &&
		idx->indimmediate && idx->indnatts == 2 && idx->indnkeyatts == 2 &&
		idx->indkey.values[0] == Anum_claims_scope &&
		idx->indkey.values[1] == Anum_claims_key &&
		heap_attisnull(tup, Anum_pg_index_indexprs, NULL) &&
		heap_attisnull(tup, Anum_pg_index_indpred, NULL);
	ReleaseSysCache(tup);
	return result;
}

/*
 * The (scope, key) index of an open partition, looked up in the relcache's
 * index list each time (REINDEX CONCURRENTLY replaces it), with the last one
 * found as a hint.
 */
static Oid
claims_index(Relation heap, IdemPartition *part)
{
	List	   *indexes = RelationGetIndexList(heap);
	ListCell   *lc;

	if (!OidIsValid(part->indexid) || !list_member_oid(indexes, part->indexid))
	{
		part->indexid = InvalidOid;
		foreach(lc, indexes)
		{
			if (is_claims_index(lfirst_oid(lc)))
			{
				part->indexid = lfirst_oid(lc);
				break;
			}
		}
	}
	list_free(indexes);
	if (!OidIsValid(part->indexid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("claims partition \"%s\" has no valid unique index on (scope, key)",
						RelationGetRelationName(heap)),
				 errhint("Create one with CREATE UNIQUE INDEX ON %s.%s (scope, key).",
						 IDEM_SCHEMA, quote_identifier(RelationGetRelationName(heap)))));
	return part->indexid;
}

/*---- probing ----*/

/*---- partitions kept open for a call ----*/

/*
 * A partition opened for probes (AccessShareLock) or inserts
 * (RowExclusiveLock).  A call keeps what it opened until it ends, so a
 * batch opens each partition once, not once per key.
 */
typedef struct OpenPart
{
	Oid			relid;
	LOCKMODE	mode;
	Relation	heap;
	Relation	index;			/* the (scope, key) index */
	bool		has_digest;		/* the partition has the digest column */
	TupleTableSlot *slot;
	IndexScanDesc scan;			/* NULL until the first probe */
	Snapshot	scan_snap;		/* the snapshot scan was begun with */
	IdemIndexSet ins;			/* inserts: every index of the partition */
} OpenPart;

/*
 * Was this backend's last claim (of idem_claim(), another subsystem's, or a
 * batch's key) of a new key?  Then the next claim goes straight to the
 * value lock (claim_key(), step 1): new keys come in runs, as duplicates
 * do.  Only a guess about the next key, never trusted as a fact about it.
 */
static bool last_claim_new = false;

typedef struct ClaimCall
{
	SnapshotData dirty;			/* the dirty snapshot of every probe */
	bool		last_was_new;	/* the claim before was of a new key: go
								 * straight to the value lock */
	MemoryContext cxt;			/* where what outlives one key lives */
	int			nparts;
	int			maxparts;
	OpenPart   *parts;
} ClaimCall;

static void
claim_call_init(ClaimCall *call)
{
	InitDirtySnapshot(call->dirty);
	call->last_was_new = last_claim_new;
	call->cxt = CurrentMemoryContext;
	call->nparts = 0;
	call->maxparts = 4;
	call->parts = palloc(sizeof(OpenPart) * call->maxparts);
}

/*
 * Close what the call opened.  The locks of a partition it inserted into
 * stay until the transaction ends; those it only probed go now: the call
 * keeps nothing of such a partition, and a transaction that claims now and
 * then must not keep maintenance from dropping it once it has expired.
 */
static void
claim_call_close(ClaimCall *call)
{
	for (int i = 0; i < call->nparts; i++)
	{
		OpenPart   *op = &call->parts[i];
		LOCKMODE	release = op->mode == AccessShareLock ? AccessShareLock : NoLock;

		if (op->scan != NULL)
			index_endscan(op->scan);
		if (op->slot != NULL)
			ExecDropSingleTupleTableSlot(op->slot);
		idem_close_insert_indexes(&op->ins);
		if (op->index != NULL)
			index_close(op->index, release);
		relation_close(op->heap, release);
	}
	call->nparts = 0;
}

/* Open the (scope, key) index and a slot, the first time they are needed. */
static void
open_part_index(OpenPart *op, IdemPartition *part)
{
	if (op->index != NULL)
		return;
	op->index = index_open(claims_index(op->heap, part), op->mode);
	op->has_digest = check_partition_columns(op->heap);
	op->slot = table_slot_create(op->heap, NULL);
}

/*
 * The partition opened in this mode (its indexes too, for inserts), opening
 * it if need be; NULL if gone.
 */
static OpenPart *
open_part(ClaimCall *call, IdemPartition *part, LOCKMODE mode)
{
	OpenPart   *op;
	Relation	heap;
	MemoryContext oldcxt;

	for (int i = 0; i < call->nparts; i++)
		if (call->parts[i].relid == part->relid && call->parts[i].mode == mode)
			return &call->parts[i];

	heap = try_relation_open(part->relid, mode);
	if (heap == NULL)
		return NULL;
	oldcxt = MemoryContextSwitchTo(call->cxt);
	if (call->nparts == call->maxparts)
	{
		call->maxparts *= 2;
		call->parts = repalloc(call->parts, sizeof(OpenPart) * call->maxparts);
	}
	op = &call->parts[call->nparts++];
	memset(op, 0, sizeof(OpenPart));
	op->relid = part->relid;
	op->mode = mode;
	op->heap = heap;
	if (mode == RowExclusiveLock)
	{
		open_part_index(op, part);
		idem_open_insert_indexes(op->heap, &op->ins, "claims partition");
	}
	MemoryContextSwitchTo(oldcxt);
	return op;
}

/*
 * Look for (scope, key) in one partition; false if absent or if the
 * partition is gone.  With a dirty snapshot, a claim being inserted or
 * deleted by another transaction is reported as busy.
 */
static bool
probe_partition(ClaimCall *call, IdemPartition *part, Snapshot snap, ClaimKey *ck,
				ProbeResult *res)
{
	OpenPart   *op = open_part(call, part, AccessShareLock);
	ScanKeyData skey[2];
	TupleTableSlot *slot;
	MemoryContext oldcxt;
	bool		found;

	if (op == NULL)
		return false;

	if (op->scan == NULL || op->scan_snap != snap)
	{
		oldcxt = MemoryContextSwitchTo(call->cxt);
		open_part_index(op, part);
		if (op->scan != NULL)
			index_endscan(op->scan);
		op->scan = index_beginscan(op->heap, op->index, snap, 2, 0);
		op->scan_snap = snap;
		MemoryContextSwitchTo(oldcxt);
	}
	ScanKeyInit(&skey[0], 1, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(ck->scope));
	ScanKeyInit(&skey[1], 2, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(ck->key));
	slot = op->slot;

	/* the scan keeps what it allocates on the way (killed items): the call's */
	oldcxt = MemoryContextSwitchTo(call->cxt);
	index_rescan(op->scan, skey, 2, NULL, 0);
	found = index_getnext_slot(op->scan, ForwardScanDirection, slot);
	MemoryContextSwitchTo(oldcxt);

	if (found)
	{
		if (snap->snapshot_type == SNAPSHOT_DIRTY &&
			(TransactionIdIsValid(snap->xmin) || TransactionIdIsValid(snap->xmax)))
		{
			res->status = PROBE_BUSY;
			res->xwait = TransactionIdIsValid(snap->xmin) ? snap->xmin : snap->xmax;
		}
		else
		{
			bool		isnull;
			Datum		d;

			res->status = PROBE_FOUND;
			res->relid = part->relid;
			res->tid = slot->tts_tid;
			res->claimed_at = DatumGetTimestampTz(slot_getattr(slot, Anum_claims_claimed_at, &isnull));
			d = slot_getattr(slot, Anum_claims_fingerprint, &isnull);
			res->has_fingerprint = !isnull;
			res->fingerprint = isnull ? 0 : DatumGetInt64(d);
			d = op->has_digest ? slot_getattr(slot, Anum_claims_digest, &isnull) : (Datum) 0;
			res->has_digest = op->has_digest && !isnull &&
				VARSIZE_ANY_EXHDR(DatumGetByteaPP(d)) == PG_SHA256_DIGEST_LENGTH;
			if (res->has_digest)
				memcpy(res->digest, VARDATA_ANY(DatumGetByteaPP(d)), PG_SHA256_DIGEST_LENGTH);
		}
	}
	ExecClearTuple(slot);		/* let go of the buffer */
	return found;
}

/*
 * Positions in the set of the partitions not sealed yet, newest first, for
 * the set of this generation: so a probe never walks the sealed ones, which
 * may be hundreds, to find the few that take claims.  unsealed_oldest marks
 * the oldest open one of each retention class, which a backend whose cache
 * predates the partition covering now would claim into.
 */
static uint64 unsealed_generation = 0;	/* 0: never a set's */
static int	unsealed_n = 0;
static int *unsealed = NULL;
static bool *unsealed_oldest = NULL;
static int	unsealed_cap = 0;

static void
map_unsealed(IdemPartitionSet *set)
{
	int64		seen[IDEM_MAX_RETENTION_CLASSES + 1];
	int			nseen = 0;

	if (unsealed_generation == set->generation)
		return;
	if (unsealed_cap < set->nparts)
	{
		unsealed_cap = Max(set->nparts, 16);
		unsealed = unsealed == NULL ?
			MemoryContextAlloc(TopMemoryContext, unsealed_cap * sizeof(int)) :
			repalloc(unsealed, unsealed_cap * sizeof(int));
		unsealed_oldest = unsealed_oldest == NULL ?
			MemoryContextAlloc(TopMemoryContext, unsealed_cap * sizeof(bool)) :
			repalloc(unsealed_oldest, unsealed_cap * sizeof(bool));
	}
	unsealed_n = 0;
	for (int i = 0; i < set->nparts; i++)
		if (!set->parts[i].sealed)
			unsealed[unsealed_n++] = i;
	for (int j = unsealed_n - 1; j >= 0; j--)
	{
		IdemPartition *p = &set->parts[unsealed[j]];
		bool		first = !p->closed;

		for (int k = 0; k < nseen && first; k++)
			first = seen[k] != p->class_retention;
		/* more classes than seen holds: mark the rest too, to be safe */
		if (first && nseen < (int) lengthof(seen))
			seen[nseen++] = p->class_retention;
		unsealed_oldest[j] = first;
	}
	unsealed_generation = set->generation;
}

/*
 * The partition a claim of ck made now goes into: one of its scope's
 * retention class (classes.c).
 */
static IdemPartition *
claim_target(IdemPartitionSet *set, const ClaimKey *ck, TimestampTz now, bool *covers)
{
	int64		class_retention = 0;

	if (set->nscopes > 0)
		class_retention = idem_scope_class(set, VARDATA_ANY(ck->scope),
										   VARSIZE_ANY_EXHDR(ck->scope));
	return idem_target_partition(set, class_retention, now, covers);
}

/* Probe sealed partition p unless it is expired or its filter rules the key out. */
static bool
probe_sealed(ClaimCall *call, IdemPartitionSet *set, IdemPartition *p, IdemPartition *target,
			 TimestampTz now, Snapshot snap, ClaimKey *ck, ProbeWhich which, ProbeResult *res)
{
	bool		expired;

	if (p == target)
		return false;
	expired = idem_partition_expired(set, p, now);
	if ((expired && which != PROBE_EVERY) || !idem_filter_maybe(set, p, ck->hash))
		return false;
	if (!probe_partition(call, p, snap, ck, res))
		return false;
	res->expired = expired;
	return true;
}

/*
 * Probe partitions until the key is found: the target (where a claim made
 * now would go) first, then the others not sealed yet, newest first:
 * those that have begun (give or take clock skew), the oldest open one of
 * each retention class, which a backend whose cache predates the partition
 * covering now would claim into, and the closed ones (a claimer that chose one before it was
 * closed may still be inserting there); then the sealed ones that their
 * groups do not rule out (groups.c), unless expired or ruled out by their
 * own filter.
 */
static void
probe_set(ClaimCall *call, IdemPartitionSet *set, IdemPartition *target, TimestampTz now,
		  Snapshot snap, ClaimKey *ck, ProbeWhich which, ProbeResult *res)
{
	const int  *cand = NULL;
	int			ncand = -1;		/* -1: no groups, test every sealed one */

	res->status = PROBE_ABSENT;
	res->expired = false;
	if (target != NULL && which != PROBE_SEALED &&
		probe_partition(call, target, snap, ck, res))
		return;
	map_unsealed(set);
	if (which != PROBE_OPEN)
	{
		/* the filters' blocks load at once, not one after the other */
		ncand = idem_groups_candidates(set, ck->hash, &cand);
		if (ncand < 0)
		{
			for (int i = 0; i < set->nparts; i++)
				if (set->parts[i].sealed &&
					(which == PROBE_EVERY || !idem_partition_expired(set, &set->parts[i], now)))
					idem_filter_prefetch(&set->parts[i], ck->hash);
		}
		else
			for (int j = 0; j < ncand; j++)
				idem_filter_prefetch(&set->parts[cand[j]], ck->hash);
	}
	if (which != PROBE_SEALED)
	{
		for (int j = 0; j < unsealed_n; j++)
		{
			IdemPartition *p = &set->parts[unsealed[j]];

			if (p == target ||
				(which != PROBE_EVERY && p->lower > now + IDEM_CLOCK_SKEW_USECS &&
				 !unsealed_oldest[j] && !p->closed))
				continue;
			if (probe_partition(call, p, snap, ck, res))
				return;
		}
	}
	if (which == PROBE_OPEN)
		return;
	if (ncand < 0)
	{
		for (int i = 0; i < set->nparts; i++)
			if (set->parts[i].sealed &&
				probe_sealed(call, set, &set->parts[i], target, now, snap, ck, which, res))
				return;
	}
	else
		for (int j = 0; j < ncand; j++)
			if (probe_sealed(call, set, &set->parts[cand[j]], target, now, snap, ck, which, res))
				return;
}

/*---- value lock ----*/

static void
value_locktag(LOCKTAG *tag, ClaimKey *ck)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (ck->hash >> 32),
						 (uint32) ck->hash, IDEM_LOCKTAG_CLAIM);
}

/*---- claiming ----*/

typedef enum InsertResult
{
	INSERT_DONE,
	INSERT_CHANGED,				/* the partition list changed: choose again */
	INSERT_GONE					/* the target table does not exist */
} InsertResult;

/*
 * Insert the claim, unless the partition list changed since "generation"
 * (the target may have been sealed or dropped meanwhile).
 */
static InsertResult
insert_claim(ClaimCall *call, IdemPartition *part, uint64 generation, ClaimKey *ck,
			 TimestampTz now)
{
	OpenPart   *op;
	Datum	   *values;
	bool	   *nulls;
	TupleDesc	desc;

	idem_debug_wait("claim_insert_lock");
	op = open_part(call, part, RowExclusiveLock);
	if (op == NULL)
		return INSERT_GONE;

	/*
	 * Maintenance seals a partition at once only while nobody holds
	 * RowExclusiveLock on it, and taking that lock processed its
	 * invalidation; otherwise it closes the partition, and seals it a round
	 * later, once every value lock held after the close committed has been
	 * released (we hold ours until the row is in).  So a seal or close is
	 * seen here, or waits for our insert: if the list changed, look again
	 * ("part" may be freed here).
	 */
	if (idem_partition_set()->generation != generation)
		return INSERT_CHANGED;
	idem_debug_wait("claim_insert");

	desc = RelationGetDescr(op->heap);
	values = palloc0(desc->natts * sizeof(Datum));
	nulls = palloc(desc->natts * sizeof(bool));
	memset(nulls, true, desc->natts * sizeof(bool));

	values[Anum_claims_scope - 1] = PointerGetDatum(ck->scope);
	values[Anum_claims_key - 1] = PointerGetDatum(ck->key);
	values[Anum_claims_claimed_at - 1] = TimestampTzGetDatum(now);
	nulls[Anum_claims_scope - 1] = false;
	nulls[Anum_claims_key - 1] = false;
	nulls[Anum_claims_claimed_at - 1] = false;
	if (ck->has_digest && !op->has_digest)
	{
		/* still at version 1.0: store its fingerprint */
		values[Anum_claims_fingerprint - 1] = legacy_fingerprint(ck->payload);
		nulls[Anum_claims_fingerprint - 1] = false;
	}
	else if (ck->has_digest)
	{
		bytea	   *d = palloc(VARHDRSZ + PG_SHA256_DIGEST_LENGTH);

		SET_VARSIZE(d, VARHDRSZ + PG_SHA256_DIGEST_LENGTH);
		memcpy(VARDATA(d), ck->digest, PG_SHA256_DIGEST_LENGTH);
		values[Anum_claims_digest - 1] = PointerGetDatum(d);
		nulls[Anum_claims_digest - 1] = false;
	}

	/*
	 * In the (scope, key) index the uniqueness check is a second line of
	 * defence: under the value lock no duplicate can exist, so it never
	 * fires unless the protocol is broken, and then an error beats a doubled
	 * effect.
	 */
	idem_insert_row(&op->ins, values, nulls, RelationGetRelid(op->index));
	pfree(values);
	pfree(nulls);
	return INSERT_DONE;
}

/*
 * Claim one key.  True: this transaction now holds the claim.  False: a
 * committed claim exists, or this transaction already holds it.
 */
static bool
claim_key(ClaimCall *call, ClaimKey *ck)
{
	Snapshot	dirty = &call->dirty;
	LOCKTAG		tag;
	int			gone = 0;

	value_locktag(&tag, ck);

	for (;;)
	{
		IdemPartitionSet *set;
		TimestampTz now;
		uint64		generation = 0; /* never a set's: probe all under the lock */
		IdemPartition *target;
		ProbeResult res;
		bool		covers;
		InsertResult ins = INSERT_CHANGED;
		Oid			target_relid;
		IdemLateMatch late;
		bool		is_late = false;

		/*
		 * 1. without the value lock: a committed claim is final.  A claim
		 * whose last one was of a new key skips this and looks everywhere
		 * under the lock instead, which spares a new key a probe of every
		 * open partition and its filter tests.
		 */
		if (!call->last_was_new)
		{
			set = idem_partition_set();
			now = idem_now();
			generation = set->generation;
			target = claim_target(set, ck, now, &covers);
			probe_set(call, set, target, now, dirty, ck, PROBE_ALL, &res);
			if (res.status == PROBE_BUSY)
			{
				XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
				continue;
			}
			if (res.status == PROBE_FOUND)
			{
				last_claim_new = false;
				check_payload(ck, &res);
				idem_stats_count_scope(ck->scope, IDEM_STAT_DUPLICATES, 1);
				return false;
			}
		}

		/*
		 * 2. under the value lock: look again where an earlier holder could
		 * have inserted since -- the partitions not sealed yet, and if the
		 * list changed, the sealed ones too -- then insert.
		 */
		LockAcquire(&tag, ExclusiveLock, false, false);
		set = idem_partition_set();
		now = idem_now();
		target = claim_target(set, ck, now, &covers);
		if (target == NULL)
		{
			LockRelease(&tag, ExclusiveLock, false);
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idempotency.claims has no partition that can take claims"),
					 errhint("Run SELECT idem_maintain() to create them.")));
		}
		probe_set(call, set, target, now, dirty, ck,
				  set->generation == generation ? PROBE_OPEN : PROBE_ALL, &res);
		generation = set->generation;
		target_relid = target->relid;
		if (res.status == PROBE_ABSENT)
		{
			/* a new key: was it claimed before, and dropped? (late.c) */
			is_late = idem_late_lookup(ck->hash, now, &late);
			if (is_late && idem_late_refuses())
			{
				LockRelease(&tag, ExclusiveLock, false);
				idem_late_refuse(ck->scope, ck->key, &late);
			}
			ins = insert_claim(call, target, generation, ck, now);
		}
		LockRelease(&tag, ExclusiveLock, false);

		if (ins == INSERT_DONE)
		{
			call->last_was_new = last_claim_new = true;
			idem_stats_count_scope(ck->scope, IDEM_STAT_CLAIMS, 1);
			if (is_late)
				idem_late_claimed(ck->scope, ck->key, &late);
			return true;
		}
		if (res.status == PROBE_BUSY)
			XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
		else if (res.status == PROBE_FOUND)
		{
			call->last_was_new = last_claim_new = false;
			check_payload(ck, &res);
			idem_stats_count_scope(ck->scope, IDEM_STAT_DUPLICATES, 1);
			return false;
		}
		else if (ins == INSERT_GONE)
		{
			/* dropped by hand, or the cache is stale: re-read the registry */
			if (++gone >= 3)
				ereport(ERROR,
						(errcode(ERRCODE_UNDEFINED_TABLE),
						 errmsg("no partition of idempotency.claims can take claims"),
						 errdetail("The registry lists partition %u for this claim, which does not exist.",
								   target_relid),
						 errhint("Run SELECT idem_maintain() to repair the registry.")));
			(void) idem_partition_set_fresh();
		}
	}
}

/*
 * The common set-up of idem_claim() and idem_claim_many(); capname names
 * the function for a missing capability, NULL if the caller (another
 * subsystem) checked its own.
 */
static void
check_can_claim(const char *fname, const char *capname, text *scope)
{
	if (capname != NULL)
		idem_capability_require(capname, IDEM_CAP_HANDLER, IDEM_AXIS_SCOPE, text_to_cstring(scope));
	PreventCommandIfReadOnly(fname);
}

/*
 * idem_claim(key text, scope text = 'default', payload jsonb = NULL)
 */
/* Claim one checked key with its payload (NULL: none), for fname. */
static bool
claim_one(ClaimKey *ck, Jsonb *payload, const char *fname, const char *capname)
{
	ClaimCall	call;
	bool		claimed;

	ck->payload = payload;
	ck->has_digest = payload != NULL;
	if (payload != NULL)
		idem_payload_digest(payload, ck->digest);
	check_can_claim(fname, capname, ck->scope);
	claim_call_init(&call);
	claimed = claim_key(&call, ck);
	claim_call_close(&call);
	return claimed;
}

Datum
idem_claim(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;

	claim_key_args(fcinfo, 0, &ck);
	PG_RETURN_BOOL(claim_one(&ck, PG_ARGISNULL(2) ? NULL : PG_GETARG_JSONB_P(2),
							 "idem_claim()", "idem_claim"));
}

/*
 * Claim (scope, key) for another subsystem (the inbox, the requests, routed
 * claims), with the same protocol, uniqueness and retention as
 * idem_claim(); the caller has checked the scope, and names itself in
 * fname.  payload may be NULL.  The caller has checked the capability it
 * needs (a handler of the inbox source, of the request scope, ...).  True
 * if the caller's transaction now holds the claim; IK001 if a claim with
 * another payload exists.
 */
bool
idem_claim_key(text *scope, text *key, Jsonb *payload, const char *fname)
{
	ClaimKey	ck;

	idem_check_key(key);
	ck.scope = scope;
	ck.key = key;
	ck.hash = idem_key_hash(scope, key);
	return claim_one(&ck, payload, fname, NULL);
}

/* Byte order of keys, for claiming a batch in a canonical order. */
static int
key_cmp(text *ka, text *kb)
{
	int			la = VARSIZE_ANY_EXHDR(ka);
	int			lb = VARSIZE_ANY_EXHDR(kb);
	int			c = memcmp(VARDATA_ANY(ka), VARDATA_ANY(kb), Min(la, lb));

	if (c != 0)
		return c;
	return la < lb ? -1 : (la > lb ? 1 : 0);
}

/* qsort_arg comparator of indexes into the keys (arg) */
static int
key_index_cmp(const void *a, const void *b, void *arg)
{
	text	  **keys = arg;
	int			ia = *(const int *) a;
	int			ib = *(const int *) b;
	int			c = key_cmp(keys[ia], keys[ib]);

	/* equal keys: first occurrence first */
	return c != 0 ? c : ia - ib;
}

/*
 * idem_claim_many(keys text[], scope text = 'default') returns setof text:
 * the keys this call newly claimed, each once, in input order.
 */
Datum
idem_claim_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	ArrayType  *arr;
	Datum	   *elems;
	bool	   *elemnulls;
	int			nelems;
	text	  **keys;
	int		   *order;
	bool	   *claimed;
	ClaimKey	ck;
	ClaimCall	call;
	MemoryContext keycxt;

	if (PG_ARGISNULL(0))
		idem_null_argument("keys");
	arr = PG_GETARG_ARRAYTYPE_P(0);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("keys must be a one-dimensional array")));
	ck.scope = checked_scope(fcinfo, 1);
	ck.payload = NULL;
	ck.has_digest = false;

	deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &elems, &elemnulls, &nelems);

	/* check everything before claiming anything */
	keys = palloc(sizeof(text *) * Max(nelems, 1));
	for (int i = 0; i < nelems; i++)
	{
		if (elemnulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("keys must not contain nulls"),
					 errdetail("Element %d is null.", i + 1)));
		keys[i] = DatumGetTextPP(elems[i]);
		idem_check_key(keys[i]);
	}

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	check_can_claim("idem_claim_many()", "idem_claim_many", ck.scope);

	order = palloc(sizeof(int) * Max(nelems, 1));
	claimed = palloc0(sizeof(bool) * Max(nelems, 1));
	for (int i = 0; i < nelems; i++)
		order[i] = i;
	qsort_arg(order, nelems, sizeof(int), key_index_cmp, keys);

	/*
	 * Claim in byte order, each distinct key once (at its first occurrence),
	 * each in a memory context of its own, reset after it.
	 */
	claim_call_init(&call);
	keycxt = AllocSetContextCreate(CurrentMemoryContext, "idem_claim_many key",
								   ALLOCSET_DEFAULT_SIZES);
	for (int j = 0; j < nelems; j++)
	{
		int			i = order[j];
		MemoryContext oldcxt;

		CHECK_FOR_INTERRUPTS();
		if (j > 0 && key_cmp(keys[order[j - 1]], keys[i]) == 0)
			continue;			/* a repeat: claimed at its first occurrence */
		ck.key = keys[i];
		ck.hash = idem_key_hash(ck.scope, ck.key);
		oldcxt = MemoryContextSwitchTo(keycxt);
		claimed[i] = claim_key(&call, &ck);
		MemoryContextSwitchTo(oldcxt);
		MemoryContextReset(keycxt);
	}
	claim_call_close(&call);
	MemoryContextDelete(keycxt);

	for (int i = 0; i < nelems; i++)
	{
		if (claimed[i])
		{
			Datum		value = PointerGetDatum(keys[i]);
			bool		isnull = false;

			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, &value, &isnull);
		}
	}
	return (Datum) 0;
}

/*
 * idem_claimed(key text, scope text = 'default'): when the claim visible to
 * this transaction's snapshot was made, or NULL.
 */
Datum
idem_claimed(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;
	ClaimCall	call;
	ProbeResult res;
	IdemPartitionSet *set;
	TimestampTz now = idem_now();
	bool		covers;

	claim_key_args(fcinfo, 0, &ck);
	idem_capability_require("idem_claimed", IDEM_CAP_HANDLER, IDEM_AXIS_SCOPE,
							text_to_cstring(ck.scope));
	set = idem_partition_set();
	claim_call_init(&call);
	probe_set(&call, set, claim_target(set, &ck, now, &covers), now,
			  GetActiveSnapshot(), &ck, PROBE_ALL, &res);
	claim_call_close(&call);
	if (res.status != PROBE_FOUND)
		PG_RETURN_NULL();
	PG_RETURN_TIMESTAMPTZ(res.claimed_at);
}

/*
 * idem_claimed_before(key text, scope text = 'default'): if (scope, key) is
 * probably in a summary of dropped partitions within the late-duplicate
 * window, the latest time its earlier claim expired; else NULL (also with
 * the window off).  Whether the key is claimed now is idem_claimed()'s
 * business.
 */
Datum
idem_claimed_before(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;
	IdemLateMatch late;

	claim_key_args(fcinfo, 0, &ck);
	idem_capability_require("idem_claimed_before", IDEM_CAP_HANDLER, IDEM_AXIS_SCOPE,
							text_to_cstring(ck.scope));
	AcceptInvalidationMessages();
	if (!idem_late_lookup(ck.hash, idem_now(), &late))
		PG_RETURN_NULL();
	PG_RETURN_TIMESTAMPTZ(late.expired_to);
}

/*
 * idem_release(key text, scope text = 'default'): forget the claim so the
 * key can be processed again; true if there was one.  Every row of the key
 * goes, those of expired partitions not dropped yet too: after retention
 * was raised, a claim that had expired (and been made again) counts again,
 * so there may be more than one, and one expired now may count later.
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;
	ClaimCall	call;
	LOCKTAG		tag;
	bool		released = false;

	claim_key_args(fcinfo, 0, &ck);
	idem_capability_require("idem_release", IDEM_CAP_OPERATOR, IDEM_AXIS_SCOPE,
							text_to_cstring(ck.scope));
	PreventCommandIfReadOnly("idem_release()");

	claim_call_init(&call);
	value_locktag(&tag, &ck);
	LockAcquire(&tag, ExclusiveLock, false, false);
	for (;;)
	{
		IdemPartitionSet *set;
		ProbeResult res;
		Relation	heap;
		TimestampTz now = idem_now();
		bool		covers;

		set = idem_partition_set();
		probe_set(&call, set, claim_target(set, &ck, now, &covers), now,
				  &call.dirty, &ck, PROBE_EVERY, &res);
		if (res.status == PROBE_BUSY)
		{
			LockRelease(&tag, ExclusiveLock, false);
			XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
			LockAcquire(&tag, ExclusiveLock, false, false);
			continue;
		}
		if (res.status == PROBE_ABSENT)
			break;

		/*
		 * A claim made earlier in this very command must become deletable;
		 * a row we deleted is invisible to the next probe.
		 */
		CommandCounterIncrement();
		heap = relation_open(res.relid, RowExclusiveLock);
		simple_heap_delete(heap, &res.tid);
		relation_close(heap, NoLock);
		released |= !res.expired;
	}
	LockRelease(&tag, ExclusiveLock, false);
	claim_call_close(&call);
	if (released)
		idem_stats_count_scope(ck.scope, IDEM_STAT_RELEASES, 1);
	PG_RETURN_BOOL(released);
}
