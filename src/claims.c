/*-------------------------------------------------------------------------
 *
 * claims.c
 *	  idem_claim() and friends: a dedup marker that commits or rolls back
 *	  with the caller's transaction, unique across time partitions.
 *
 * A claim is a row (scope, key, claimed_at, fingerprint) in one of the time
 * partitions of idempotency.claims, each with a unique btree index on
 * (scope, key).  A unique index only guards one partition, so uniqueness
 * across partitions uses its own value lock, in the way of ON CONFLICT:
 *
 *	1. look in the sealed partitions, which take no more claims, without any
 *	   lock (their Bloom filters rule most keys out in memory);
 *	2. take the value lock, a transaction-level lock on a hash of
 *	   (scope, key) in a private advisory locktag space, and look in the
 *	   partitions that still take claims; insert into the one that covers
 *	   the current time, and release the value lock at once.
 *
 * Every probe uses a dirty snapshot: a committed (or our own) claim means
 * "duplicate"; a claim of a transaction still in progress means: release
 * the value lock, wait for that transaction, then start over.
 *
 * Locking rules: nobody ever waits for another transaction while holding a
 * value lock (we release it first), so value locks never join a deadlock
 * cycle.  A row inserted under the value lock stays the marker until its
 * transaction ends; others wait on that transaction, not on the value lock.
 * Partitions are locked AccessShareLock for probes and RowExclusiveLock for
 * the insert, held to transaction end as usual; the partition registry is
 * only read through a per-backend cache (retention.c).  Batches claim keys in
 * sorted order, so two batches never wait on each other in a cycle.
 *
 * Partitions whose claims are all older than the retention window are not
 * probed: their claims have expired, and leaving them alone lets
 * maintenance drop them without waiting for claimers.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/stratnum.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_type.h"
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
#include "utils/jsonb.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_claim);
PG_FUNCTION_INFO_V1(idem_claim_many);
PG_FUNCTION_INFO_V1(idem_claimed);
PG_FUNCTION_INFO_V1(idem_release);

/* Longest key we store as is: a btree tuple must fit a third of a page. */
#define IDEM_MAX_KEY_BYTES		2000
#define IDEM_MAX_SCOPE_BYTES	63

/* field4 of our value-lock locktags; user advisory locks use 1 and 2 */
#define IDEM_LOCKTAG_CLAIM		0x4943

/*
 * Partitions starting this far in the future are still probed, so that a
 * claimer whose clock reads slightly behind another's sees its claims.
 */
#define IDEM_CLOCK_SKEW_USECS	USECS_PER_SEC

/* Claims table columns */
#define Anum_claims_scope		1
#define Anum_claims_key			2
#define Anum_claims_claimed_at	3
#define Anum_claims_fingerprint	4
#define Natts_claims			4

/* Seed for payload fingerprints: any fixed value, never to change. */
#define IDEM_FINGERPRINT_SEED	INT64CONST(0x1de3907e7c1a1315)

/* One (scope, key) to claim, look up or release. */
typedef struct ClaimKey
{
	text	   *scope;
	text	   *key;
	uint64		hash;			/* idem_key_hash(scope, key) */
	bool		has_fingerprint;
	int64		fingerprint;
} ClaimKey;

/* Which partitions a probe visits. */
typedef enum ProbeScope
{
	PROBE_LIVE,					/* all live ones; sealed ones via their filter */
	PROBE_SEALED,				/* only sealed ones, via their filter */
	PROBE_UNSEALED				/* only those that can still take claims */
} ProbeScope;

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
	ItemPointerData tid;
	TimestampTz claimed_at;
	bool		has_fingerprint;
	int64		fingerprint;
} ProbeResult;

/*---- argument checks ----*/

static text *
checked_scope(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope;
	int			len;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("scope must not be null")));
	scope = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(scope);
	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope must not be empty")));
	if (len > IDEM_MAX_SCOPE_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("scope name is too long"),
				 errdetail("Scope names are limited to %d bytes; this one has %d.",
						   IDEM_MAX_SCOPE_BYTES, len)));
	return scope;
}

static void
check_key(text *key)
{
	int			len = VARSIZE_ANY_EXHDR(key);

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("key must not be empty")));
	if (len > IDEM_MAX_KEY_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("key is too long"),
				 errdetail("Keys are limited to %d bytes; this one has %d.",
						   IDEM_MAX_KEY_BYTES, len),
				 errhint("Claim a digest of longer keys, for example encode(sha256(convert_to(key, 'UTF8')), 'hex').")));
}

static text *
checked_key(FunctionCallInfo fcinfo, int argno)
{
	text	   *key;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("key must not be null")));
	key = PG_GETARG_TEXT_PP(argno);
	check_key(key);
	return key;
}

/* The privilege on idempotency.claims that an operation needs. */
static void
check_claims_privilege(IdemPartitionSet *set, AclMode mode, const char *what)
{
	if (pg_class_aclcheck(set->claims_relid, GetUserId(), mode) != ACLCHECK_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to %s", what),
				 errhint("Grant %s on table idempotency.claims to the role.",
						 mode == ACL_INSERT ? "INSERT" :
						 mode == ACL_DELETE ? "DELETE" : "SELECT")));
}

/* A key for messages: at most 100 bytes of it. */
static char *
key_for_message(text *key)
{
	char	   *s = text_to_cstring(key);
	int			len = strlen(s);

	if (len > 100)
	{
		len = pg_mbcliplen(s, len, 100);
		s[len] = '\0';
		return psprintf("%s...", s);
	}
	return s;
}

/*---- probing ----*/

/* Open a partition and its (scope, key) index; false if it is gone. */
static bool
open_partition(IdemPartition *part, LOCKMODE mode, Relation *heap, Relation *index)
{
	*heap = try_relation_open(part->relid, mode);
	if (*heap == NULL)
		return false;
	if (!OidIsValid(part->indexid))
	{
		List	   *indexes = RelationGetIndexList(*heap);

		if (indexes == NIL)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("claims partition \"%s\" has no index on (scope, key)",
							RelationGetRelationName(*heap))));
		part->indexid = linitial_oid(indexes);
		list_free(indexes);
	}
	*index = index_open(part->indexid, mode);
	return true;
}

static void
close_partition(Relation heap, Relation index)
{
	index_close(index, NoLock);
	relation_close(heap, NoLock);
}

/*
 * Look for (scope, key) in one partition.  With a dirty snapshot, a claim
 * being inserted or deleted by another transaction is reported as busy.
 */
static bool
probe_partition(IdemPartition *part, Snapshot snap, ClaimKey *ck, ProbeResult *res)
{
	Relation	heap;
	Relation	index;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	TupleTableSlot *slot;
	bool		found = false;

	if (!open_partition(part, AccessShareLock, &heap, &index))
		return false;

	ScanKeyInit(&skey[0], 1, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(ck->scope));
	ScanKeyInit(&skey[1], 2, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(ck->key));
	slot = table_slot_create(heap, NULL);
	scan = index_beginscan(heap, index, snap, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);

	if (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		found = true;
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
		}
	}

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	close_partition(heap, index);
	return found;
}

/*
 * Probe partitions newest first until the key is found.  Live partitions:
 * begun (give or take clock skew) and not entirely past the retention
 * window; and always the partition this claim would go into, which while
 * maintenance lags is past its recorded range.  A sealed partition takes no
 * more claims, so its Bloom filter can rule the key out, and a probe under
 * the value lock can skip it if it was sealed before the first probe.
 */
static void
probe_all(IdemPartitionSet *set, TimestampTz now, Snapshot snap, ClaimKey *ck,
		  IdemPartition *target, ProbeScope scope, ProbeResult *res)
{
	res->status = PROBE_ABSENT;
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];

		if (p != target &&
			(p->lower > now + IDEM_CLOCK_SKEW_USECS || p->upper <= now - set->retention))
			continue;
		if (p->sealed && p != target)
		{
			if (scope == PROBE_UNSEALED)
				continue;
			if (p->bloom_bits > 0 && !idem_bloom_maybe(p->bloom, p->bloom_bits, ck->hash))
				continue;
		}
		else if (scope == PROBE_SEALED)
			continue;
		if (probe_partition(p, snap, ck, res))
			return;
	}
}

/*
 * The partition a claim made at "now" goes into: the unsealed one whose range
 * covers it (the newest such, should ranges overlap after a restore), else
 * the newest unsealed one that started before now, else the oldest unsealed.
 */
static IdemPartition *
covering_partition(IdemPartitionSet *set, TimestampTz now, bool *covers)
{
	IdemPartition *begun = NULL;

	*covers = false;
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];

		if (p->sealed)
			continue;
		if (p->lower <= now && now < p->upper)
		{
			*covers = true;
			return p;
		}
		if (begun == NULL && p->lower <= now)
			begun = p;
	}
	if (begun != NULL)
		return begun;
	for (int i = set->nparts - 1; i >= 0; i--)
		if (!set->parts[i].sealed)
			return &set->parts[i];
	return NULL;
}

/*---- value lock ----*/

/*
 * 64-bit hash of (scope, key): names the value lock and indexes the Bloom
 * filters of sealed partitions.
 */
uint64
idem_key_hash(text *scope, text *key)
{
	uint64		h;

	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
							VARSIZE_ANY_EXHDR(scope), 0);
	return hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key), h);
}

static void
value_locktag(LOCKTAG *tag, ClaimKey *ck)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (ck->hash >> 32),
						 (uint32) ck->hash, IDEM_LOCKTAG_CLAIM);
}

/*---- Bloom filters of sealed partitions ----*/

/*
 * Blocked Bloom filter: all bits of a key lie in one 512-bit block (a cache
 * line), chosen by the low half of the hash; the high half places the bits
 * in it (double hashing).  One cache miss per sealed partition instead of
 * one per bit keeps many filters cheap to consult.
 */
#define IDEM_BLOOM_BLOCK_BITS	IDEM_BLOOM_ROUND_BITS

static inline uint32
bloom_bit(uint64 hash, int i, uint32 nbits)
{
	uint32		nblocks = nbits / IDEM_BLOOM_BLOCK_BITS;
	uint32		block = (uint32) hash % nblocks;
	uint32		h2 = (uint32) (hash >> 32);
	uint32		h3 = ((h2 >> 17) | (h2 << 15)) | 1;

	return block * IDEM_BLOOM_BLOCK_BITS + ((h2 + (uint32) i * h3) % IDEM_BLOOM_BLOCK_BITS);
}

void
idem_bloom_add(uint8 *bloom, uint32 nbits, uint64 hash)
{
	for (int i = 0; i < IDEM_BLOOM_HASHES; i++)
	{
		uint32		b = bloom_bit(hash, i, nbits);

		bloom[b / 8] |= (uint8) (1 << (b % 8));
	}
}

/* False: the key is certainly not in the partition. */
bool
idem_bloom_maybe(const uint8 *bloom, uint32 nbits, uint64 hash)
{
	for (int i = 0; i < IDEM_BLOOM_HASHES; i++)
	{
		uint32		b = bloom_bit(hash, i, nbits);

		if ((bloom[b / 8] & (1 << (b % 8))) == 0)
			return false;
	}
	return true;
}

/*---- claiming ----*/

static void
check_fingerprint(ClaimKey *ck, ProbeResult *res)
{
	if (ck->has_fingerprint && res->has_fingerprint &&
		ck->fingerprint != res->fingerprint)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_KEY_REUSED),
				 errmsg("idempotency key reused with a different payload"),
				 errdetail("Scope \"%s\", key \"%s\" was claimed with a different payload.",
						   text_to_cstring(ck->scope), key_for_message(ck->key))));
}

/* Insert the claim; false if the partition was dropped or sealed meanwhile. */
static bool
insert_claim(IdemPartition *part, ClaimKey *ck, TimestampTz now)
{
	Relation	heap;
	Relation	index;
	Datum	   *values;
	bool	   *nulls;
	HeapTuple	tup;
	TupleDesc	desc;
	Oid			relid = part->relid;
	IdemPartitionSet *set;
	bool		still_open = false;

	if (!open_partition(part, RowExclusiveLock, &heap, &index))
		return false;

	/*
	 * Maintenance seals a partition only while nobody holds RowExclusiveLock
	 * on it, and its commit reached us when we took that lock: if the
	 * partition is sealed now, choose again.  ("part" may be freed here.)
	 */
	set = idem_partition_set(false);
	for (int i = 0; i < set->nparts; i++)
		if (set->parts[i].relid == relid)
			still_open = !set->parts[i].sealed;
	if (!still_open)
	{
		close_partition(heap, index);
		return false;
	}

	desc = RelationGetDescr(heap);
	if (desc->natts < Natts_claims)
		elog(ERROR, "claims partition \"%s\" has %d columns, expected %d",
			 RelationGetRelationName(heap), desc->natts, Natts_claims);
	values = palloc0(desc->natts * sizeof(Datum));
	nulls = palloc(desc->natts * sizeof(bool));
	memset(nulls, true, desc->natts * sizeof(bool));

	values[Anum_claims_scope - 1] = PointerGetDatum(ck->scope);
	values[Anum_claims_key - 1] = PointerGetDatum(ck->key);
	values[Anum_claims_claimed_at - 1] = TimestampTzGetDatum(now);
	values[Anum_claims_fingerprint - 1] = Int64GetDatum(ck->fingerprint);
	nulls[Anum_claims_scope - 1] = false;
	nulls[Anum_claims_key - 1] = false;
	nulls[Anum_claims_claimed_at - 1] = false;
	nulls[Anum_claims_fingerprint - 1] = !ck->has_fingerprint;

	tup = heap_form_tuple(desc, values, nulls);
	heap_insert(heap, tup, GetCurrentCommandId(true), 0, NULL);

	/*
	 * The unique index is a second line of defence: under the value lock no
	 * duplicate can exist, so its check never fires unless the protocol above
	 * is broken, and then an error beats a doubled effect.
	 */
	index_insert(index, values, nulls, &tup->t_self, heap,
				 UNIQUE_CHECK_YES, false, BuildIndexInfo(index));

	heap_freetuple(tup);
	pfree(values);
	pfree(nulls);
	close_partition(heap, index);
	return true;
}

/*
 * Claim one key.  True: this transaction now holds the claim.  False: a
 * committed claim exists, or this transaction already holds it.
 */
static bool
claim_key(ClaimKey *ck)
{
	SnapshotData dirty;
	LOCKTAG		tag;
	int			target_failures = 0;
	Oid			target_relid;

	InitDirtySnapshot(dirty);
	value_locktag(&tag, ck);

	for (;;)
	{
		IdemPartitionSet *set = idem_partition_set(false);
		TimestampTz now = GetCurrentTimestamp();
		IdemPartition *target;
		ProbeResult res;
		bool		covers;
		uint64		generation = set->generation;

		/*
		 * Sealed partitions take no more claims: look there without the
		 * value lock, once.  Partitions that still take claims are looked at
		 * under it, right before the insert.
		 */
		target = covering_partition(set, now, &covers);
		probe_all(set, now, &dirty, ck, target, PROBE_SEALED, &res);
		if (res.status == PROBE_BUSY)
		{
			XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
			continue;
		}
		if (res.status == PROBE_FOUND)
		{
			check_fingerprint(ck, &res);
			return false;
		}

		LockAcquire(&tag, ExclusiveLock, false, false);

		/*
		 * Under the value lock, see every partition that an earlier holder
		 * could have inserted into: one covering our (later) clock reading is
		 * in the cache, or else re-read the registry.
		 */
		now = GetCurrentTimestamp();
		set = idem_partition_set(false);
		target = covering_partition(set, now, &covers);
		if (!covers)
		{
			set = idem_partition_set(true);
			target = covering_partition(set, now, &covers);
		}
		if (target == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idempotency.claims has no partition that can take claims"),
					 errhint("Run SELECT idem_maintain() to create them.")));

		/*
		 * A partition sealed before the first probe has taken no claim since,
		 * so only unsealed ones need a look -- unless the partition list
		 * changed in between, and then all of them do.
		 */
		probe_all(set, now, &dirty, ck, target,
				  set->generation == generation ? PROBE_UNSEALED : PROBE_LIVE, &res);
		target_relid = target->relid;
		if (res.status == PROBE_ABSENT && insert_claim(target, ck, now))
		{
			LockRelease(&tag, ExclusiveLock, false);
			return true;
		}
		LockRelease(&tag, ExclusiveLock, false);

		if (res.status == PROBE_BUSY)
			XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
		else if (res.status == PROBE_FOUND)
		{
			check_fingerprint(ck, &res);
			return false;
		}
		else if (++target_failures < 3)
		{
			/* target sealed or dropped meanwhile: re-read the registry */
			(void) idem_partition_set(true);
		}
		else
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_TABLE),
					 errmsg("no partition of idempotency.claims can take claims"),
					 errdetail("The registry lists partition %u for this claim, which is missing or sealed.",
							   target_relid),
					 errhint("Run SELECT idem_maintain() to repair the registry.")));
	}
}

/*
 * idem_claim(key text, scope text = 'default', payload jsonb = NULL)
 */
Datum
idem_claim(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;

	ck.key = checked_key(fcinfo, 0);
	ck.scope = checked_scope(fcinfo, 1);
	ck.hash = idem_key_hash(ck.scope, ck.key);
	ck.has_fingerprint = !PG_ARGISNULL(2);
	ck.fingerprint = 0;
	if (ck.has_fingerprint)
		ck.fingerprint = DatumGetInt64(DirectFunctionCall2(jsonb_hash_extended,
														   PG_GETARG_DATUM(2),
														   Int64GetDatum(IDEM_FINGERPRINT_SEED)));

	check_claims_privilege(idem_partition_set(false), ACL_INSERT, "claim keys");
	PreventCommandIfReadOnly("idem_claim()");
	PG_RETURN_BOOL(claim_key(&ck));
}

/* Byte order of keys, for claiming a batch in a canonical order. */
static text **sort_keys_base;

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

static int
key_index_cmp(const void *a, const void *b)
{
	int			ia = *(const int *) a;
	int			ib = *(const int *) b;
	int			c = key_cmp(sort_keys_base[ia], sort_keys_base[ib]);

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

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("keys must not be null")));
	arr = PG_GETARG_ARRAYTYPE_P(0);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("keys must be a one-dimensional array")));
	ck.scope = checked_scope(fcinfo, 1);
	ck.has_fingerprint = false;
	ck.fingerprint = 0;

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
		check_key(keys[i]);
	}

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	check_claims_privilege(idem_partition_set(false), ACL_INSERT, "claim keys");
	PreventCommandIfReadOnly("idem_claim_many()");

	order = palloc(sizeof(int) * Max(nelems, 1));
	claimed = palloc0(sizeof(bool) * Max(nelems, 1));
	for (int i = 0; i < nelems; i++)
		order[i] = i;
	sort_keys_base = keys;
	qsort(order, nelems, sizeof(int), key_index_cmp);

	/* claim in byte order, each distinct key once (at its first occurrence) */
	for (int j = 0; j < nelems; j++)
	{
		int			i = order[j];

		CHECK_FOR_INTERRUPTS();
		if (j > 0 && key_cmp(keys[order[j - 1]], keys[i]) == 0)
			continue;			/* a repeat: claimed at its first occurrence */
		ck.key = keys[i];
		ck.hash = idem_key_hash(ck.scope, ck.key);
		claimed[i] = claim_key(&ck);
	}

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
	ProbeResult res;
	IdemPartitionSet *set;
	TimestampTz now = GetCurrentTimestamp();
	bool		covers;

	ck.key = checked_key(fcinfo, 0);
	ck.scope = checked_scope(fcinfo, 1);
	ck.hash = idem_key_hash(ck.scope, ck.key);
	ck.has_fingerprint = false;

	set = idem_partition_set(false);
	check_claims_privilege(set, ACL_SELECT, "look up claims");
	probe_all(set, now, GetActiveSnapshot(), &ck, covering_partition(set, now, &covers),
			  PROBE_LIVE, &res);
	if (res.status != PROBE_FOUND)
		PG_RETURN_NULL();
	PG_RETURN_TIMESTAMPTZ(res.claimed_at);
}

/*
 * idem_release(key text, scope text = 'default'): forget the claim so the
 * key can be processed again; true if there was one.
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	ClaimKey	ck;
	SnapshotData dirty;
	LOCKTAG		tag;

	ck.key = checked_key(fcinfo, 0);
	ck.scope = checked_scope(fcinfo, 1);
	ck.hash = idem_key_hash(ck.scope, ck.key);
	ck.has_fingerprint = false;
	check_claims_privilege(idem_partition_set(false), ACL_DELETE, "release claims");
	PreventCommandIfReadOnly("idem_release()");

	InitDirtySnapshot(dirty);
	value_locktag(&tag, &ck);
	for (;;)
	{
		IdemPartitionSet *set;
		ProbeResult res;
		Relation	heap;
		TimestampTz now = GetCurrentTimestamp();
		bool		covers;

		LockAcquire(&tag, ExclusiveLock, false, false);
		set = idem_partition_set(false);
		probe_all(set, now, &dirty, &ck, covering_partition(set, now, &covers),
				  PROBE_LIVE, &res);
		if (res.status == PROBE_BUSY)
		{
			LockRelease(&tag, ExclusiveLock, false);
			XactLockTableWait(res.xwait, NULL, NULL, XLTW_None);
			continue;
		}
		if (res.status == PROBE_ABSENT)
		{
			LockRelease(&tag, ExclusiveLock, false);
			PG_RETURN_BOOL(false);
		}

		/* a claim made earlier in this very command must become deletable */
		CommandCounterIncrement();
		heap = relation_open(res.relid, RowExclusiveLock);
		simple_heap_delete(heap, &res.tid);
		relation_close(heap, NoLock);
		LockRelease(&tag, ExclusiveLock, false);
		PG_RETURN_BOOL(true);
	}
}
