/*-------------------------------------------------------------------------
 *
 * scopes.c
 *	  Claims per scope of a partition of idempotency.claims, counted by a
 *	  plain heap scan: for the seal, which adds a partition's counts to
 *	  idempotency.scope_history, and for idempotency.consumers' live part.
 *
 * Both run with more rights than a partition's owner may have (the worker,
 * a SECURITY DEFINER view function), so they do not plan a query over the
 * partition: a heap scan builds no index entries and runs no rule, policy
 * or expression.  Callers check first that the partition is ours
 * (idem_relation_distrust()).
 *
 * Locking rules: the caller holds a lock on the partition (AccessShareLock
 * at least) and chooses the snapshot: the seal's own, under the ShareLock
 * that keeps claimers out; the caller's, for the view.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/scopes.h"
#include "common/catalog.h"
#include "common/ownership.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/tableam.h"
#include "funcapi.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_live_scopes);

/* Counts per scope, to fill with idem_scope_counts_add(). */
HTAB *
idem_scope_counts_create(void)
{
	HASHCTL		ctl;

	ctl.keysize = IDEM_SCOPE_COUNT_KEY_BYTES;
	ctl.entrysize = sizeof(IdemScopeCount);
	ctl.hcxt = CurrentMemoryContext;
	return hash_create("idempotency scope counts", 64, &ctl,
					   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
}

/* Add the claims of rel that snap sees to counts, per scope. */
void
idem_scope_counts_add(HTAB *counts, Relation rel, Snapshot snap)
{
	TupleDesc	desc = RelationGetDescr(rel);
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	MemoryContext rowcxt = AllocSetContextCreate(CurrentMemoryContext,
												 "idempotency scope count row",
												 ALLOCSET_SMALL_SIZES);
	HeapTuple	tup;

	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(rowcxt);
		bool		isnull;
		text	   *scope = DatumGetTextPP(heap_getattr(tup, Anum_claims_scope, desc, &isnull));
		TimestampTz at = DatumGetTimestampTz(heap_getattr(tup, Anum_claims_claimed_at, desc, &isnull));
		char		key[IDEM_SCOPE_COUNT_KEY_BYTES];
		int			len = VARSIZE_ANY_EXHDR(scope);
		IdemScopeCount *c;
		bool		found;

		if (len >= IDEM_SCOPE_COUNT_KEY_BYTES)
			ereport(ERROR,
					(errcode(ERRCODE_DATA_CORRUPTED),
					 errmsg("scope of %d bytes in partition \"%s\" is longer than any claim makes",
							len, RelationGetRelationName(rel))));
		memcpy(key, VARDATA_ANY(scope), len);
		key[len] = '\0';
		MemoryContextSwitchTo(old);
		c = hash_search(counts, key, HASH_ENTER, &found);
		if (!found)
		{
			c->first_claim_at = at;
			c->last_claim_at = at;
			c->claims = 0;
		}
		c->first_claim_at = Min(c->first_claim_at, at);
		c->last_claim_at = Max(c->last_claim_at, at);
		c->claims++;
		MemoryContextReset(rowcxt);
	}
	table_endscan(scan);
	MemoryContextDelete(rowcxt);
}

/*
 * The unsealed partitions the registry lists in snap, and that are ours
 * (idem_relation_distrust()): each locked AccessShareLock and checked
 * again under the lock, which keeps it as it was checked.  A registry
 * entry that names anything else is skipped without a word: a scraper
 * reads this, and idempotency.partitions and maintenance report it.
 */
static List *
trusted_unsealed_partitions(Oid claims, Snapshot snap)
{
	Relation	registry = table_open(idem_internal_relid("partition_registry"), AccessShareLock);
	TupleDesc	desc = RelationGetDescr(registry);
	TableScanDesc scan = table_beginscan(registry, snap, 0, NULL);
	List	   *relids = NIL;
	List	   *trusted = NIL;
	HeapTuple	tup;
	ListCell   *lc;

	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Oid			relid = DatumGetObjectId(heap_getattr(tup, Anum_registry_relid, desc, &isnull));

		if (!DatumGetBool(heap_getattr(tup, Anum_registry_sealed, desc, &isnull)))
			relids = lappend_oid(relids, relid);
	}
	table_endscan(scan);
	table_close(registry, AccessShareLock);

	foreach(lc, relids)
	{
		Oid			relid = lfirst_oid(lc);

		/* not even locked unless it is ours: another owner's lock could stall us */
		if (idem_relation_distrust(relid, claims) != NULL)
			continue;
		LockRelationOid(relid, AccessShareLock);
		if (idem_relation_distrust(relid, claims) != NULL)
		{
			UnlockRelationOid(relid, AccessShareLock);
			continue;
		}
		trusted = lappend_oid(trusted, relid);
	}
	list_free(relids);
	return trusted;
}

/*
 * idempotency.live_scopes(): per scope, the claims of the unsealed
 * partitions, in the caller's snapshot -- the one in which the view reads
 * idempotency.scope_history, so a seal that committed is seen in both or
 * in neither.  A heap scan of each partition (scopes.c): nothing of a
 * partition is planned, so no rule, policy or index expression runs; and
 * no SECURITY DEFINER is needed, since reading in C checks no table
 * privilege (EXECUTE is granted to pg_monitor only).
 */
Datum
idem_live_scopes(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			claims = idem_internal_relid("claims");
	Snapshot	snap = GetActiveSnapshot();
	HTAB	   *counts = idem_scope_counts_create();
	List	   *parts;
	ListCell   *lc;
	HASH_SEQ_STATUS seq;
	IdemScopeCount *c;

	InitMaterializedSRF(fcinfo, 0);
	parts = trusted_unsealed_partitions(claims, snap);
	foreach(lc, parts)
	{
		Relation	rel = table_open(lfirst_oid(lc), NoLock);

		idem_scope_counts_add(counts, rel, snap);
		table_close(rel, NoLock);
	}

	hash_seq_init(&seq, counts);
	while ((c = hash_seq_search(&seq)) != NULL)
	{
		Datum		values[4];
		bool		nulls[4] = {false};

		values[0] = CStringGetTextDatum(c->scope);
		values[1] = TimestampTzGetDatum(c->first_claim_at);
		values[2] = TimestampTzGetDatum(c->last_claim_at);
		values[3] = Int64GetDatum(c->claims);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	hash_destroy(counts);
	list_free(parts);
	return (Datum) 0;
}
