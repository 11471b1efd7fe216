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

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/tableam.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* columns of idempotency.claims that a count reads */
#define SCOPE_COL		1
#define CLAIMED_AT_COL	3

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
		text	   *scope = DatumGetTextPP(heap_getattr(tup, SCOPE_COL, desc, &isnull));
		TimestampTz at = DatumGetTimestampTz(heap_getattr(tup, CLAIMED_AT_COL, desc, &isnull));
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
