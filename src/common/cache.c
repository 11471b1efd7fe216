/*-------------------------------------------------------------------------
 *
 * cache.c
 *	  The one invalidation trigger of the extension's per-backend caches.
 *
 * Every cache that a backend keeps of one of our tables (the claims
 * registry and settings: claims/partitions.c; the stores' registries:
 * delivery/store.c; the shard ownership record: shards/shards.c) is
 * dropped by a relcache callback that watches that table's OID.  A
 * statement trigger on each table sends the invalidation: at commit, like
 * any catalog change, and for the ownership record also at once, so that
 * checks see a change in progress (shards.c).  The protocol of a cache: note
 * the invalidations seen before building, take every lock the build needs
 * before its snapshot, and build again if one arrived meanwhile.
 *
 * Locking rules: none; the trigger runs in the writer's transaction.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/cache.h"

#include "commands/trigger.h"
#include "common/catalog.h"
#include "miscadmin.h"
#include "storage/sinval.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

/*
 * The body of a statement trigger on one of our tables: send the
 * invalidation that drops every backend's cache of it at commit, and, if
 * now, one that drops them at once as well.  fname names the trigger
 * function in errors.
 */
Datum
idem_cache_invalidate_trigger(FunctionCallInfo fcinfo, const char *fname, bool now)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	Oid			relid;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"%s\" was not called by the trigger manager", fname)));
	relid = RelationGetRelid(trigdata->tg_relation);
	if (get_rel_namespace(relid) != idem_schema_oid())
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"%s\" serves only the tables of schema \"%s\"",
						fname, IDEM_SCHEMA)));
	CacheInvalidateRelcacheByRelid(relid);
	if (now)
	{
		SharedInvalidationMessage msg;

		memset(&msg, 0, sizeof(msg));
		msg.rc.id = SHAREDINVALRELCACHE_ID;
		msg.rc.dbId = MyDatabaseId;
		msg.rc.relId = relid;
		SendSharedInvalidMessages(&msg, 1);
	}
	PG_RETURN_POINTER(NULL);
}
