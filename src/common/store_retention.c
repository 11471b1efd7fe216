/*-------------------------------------------------------------------------
 *
 * store_retention.c
 *	  The retention of each store that keeps rows by time beside the
 *	  claims: its row of idempotency.store_settings (written by
 *	  idem_configure_store(), maintenance/store_settings.c), else the
 *	  retention of idem_configure(), which the caller passes.  The
 *	  maintenance round drops each store's partitions by it
 *	  (maintenance/store_partitions.c); the dedup claims of the inbox and
 *	  of requests follow it too.
 *
 * Locking rules: reads idempotency.store_settings with a heap scan under
 * AccessShareLock and the caller's snapshot; nothing is cached (the table
 * has at most one row per store).  A database still on 1.0 under a newer
 * library has no such table: no store has an override there.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/store_retention.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "common/args.h"
#include "common/catalog.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

static const char *const store_names[IDEM_NSTORES] = {
	[IDEM_STORE_OUTBOX] = "outbox",
	[IDEM_STORE_REQUESTS] = "requests",
	[IDEM_STORE_INBOX] = "inbox",
};

const char *
idem_store_name(IdemStoreId store)
{
	Assert(store >= 0 && store < IDEM_NSTORES);
	return store_names[store];
}

bool
idem_store_by_name(const char *name, IdemStoreId *store)
{
	for (int i = 0; i < IDEM_NSTORES; i++)
		if (strcmp(name, store_names[i]) == 0)
		{
			*store = (IdemStoreId) i;
			return true;
		}
	return false;
}

void
idem_store_overrides(Snapshot snap, IdemStoreOverride out[IDEM_NSTORES])
{
	Oid			relid = get_relname_relid("store_settings", idem_schema_oid());
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;

	memset(out, 0, sizeof(IdemStoreOverride) * IDEM_NSTORES);
	if (!OidIsValid(relid))
		return;
	rel = idem_open_internal(relid);
	snap = RegisterSnapshot(snap);
	scan = table_beginscan(rel, snap, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		TupleDesc	desc = RelationGetDescr(rel);
		bool		isnull;
		Datum		name = heap_getattr(tup, Anum_store_settings_store, desc, &isnull);
		Datum		iv;
		IdemStoreId store;

		/* the table's CHECK admits only the stores' names */
		if (isnull || !idem_store_by_name(TextDatumGetCString(name), &store))
			continue;
		iv = heap_getattr(tup, Anum_store_settings_retention, desc, &isnull);
		if (isnull)
			continue;
		out[store].set = true;
		out[store].retention_iv = *DatumGetIntervalP(iv);
		out[store].retention = idem_interval_seconds(&out[store].retention_iv);
	}
	table_endscan(scan);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
}

int64
idem_store_retention(IdemStoreId store, int64 default_secs)
{
	IdemStoreOverride o[IDEM_NSTORES];

	idem_store_overrides(GetActiveSnapshot(), o);
	return o[store].set ? o[store].retention : default_secs;
}
