/*-------------------------------------------------------------------------
 *
 * shards.c
 *	  The shard ownership guard for scale-out with PL/Proxy: a database
 *	  knows which of N hash partitions it owns, and refuses routed calls
 *	  whose routing key hashes elsewhere.
 *
 * A router runs "RUN ON hashtext(<routing key>)", and PL/Proxy sends the
 * call to partition hashtext(key) & (N - 1).  Here the same number is
 * computed (idem_shard_partition), so router and shard agree by
 * construction.  The ownership record is one row of
 * idempotency.shard_ownership (a configuration table: pg_dump carries it
 * with the claims when a database moves); no row means "not sharded" and
 * every routed call passes.  idem_shard_assert() raises IK006 for a
 * partition not owned and IK007 while the database is frozen for a move;
 * idem_claim_routed() checks, then claims as idem_claim() does.
 *
 * Locking rules:
 *	- Every check takes AccessShareLock on idempotency.shard_ownership and
 *	  keeps it to the end of the transaction; idem_shard_configure() takes
 *	  AccessExclusiveLock.  A reconfiguration (a freeze, say) therefore
 *	  waits for every transaction that passed the check to end, and a check
 *	  that waited for a reconfiguration sees it: the lock is taken before
 *	  the cache is read, and taking it processes the invalidation the
 *	  reconfiguration sent.  A direct UPDATE of the table by its owner
 *	  takes only RowExclusiveLock and so waits for nobody: the caches follow
 *	  it, but only idem_shard_configure() freezes safely.
 *	- The record is cached per backend and dropped by a relcache callback
 *	  on the table, which a statement trigger on the table sends on any
 *	  change (idem_shard_configure, a DELETE by the owner, pg_restore's
 *	  COPY).  The cache is read with the latest snapshot: ownership is
 *	  configuration, not data of the caller's snapshot.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_type.h"
#include "commands/dbcommands.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

PG_FUNCTION_INFO_V1(idem_shard_partition);
PG_FUNCTION_INFO_V1(idem_shard_assert);
PG_FUNCTION_INFO_V1(idem_claim_routed);
PG_FUNCTION_INFO_V1(idem_shard_configure);
PG_FUNCTION_INFO_V1(idem_shard_changed);

/* PL/Proxy has no limit; this keeps the owned set small and messages short */
#define IDEM_MAX_SHARD_PARTITIONS	65536

/* The ownership record as this backend last read it. */
typedef struct ShardOwnership
{
	bool		valid;
	Oid			relid;			/* idempotency.shard_ownership */
	bool		configured;		/* a row exists */
	int32		partitions;
	bool		frozen;
	bool	   *owned;			/* [partitions], in TopMemoryContext */
	char	   *owned_text;		/* "{0,3}" for messages */
} ShardOwnership;

static ShardOwnership ownership;
static bool callback_registered = false;
static uint64 ownership_invals = 0;	/* invalidations seen, to detect one during a load */

static void
shard_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == ownership.relid)
	{
		ownership.valid = false;
		ownership_invals++;
	}
}

/* hashtext(key) & (partitions - 1): PL/Proxy's choice of partition */
static int32
partition_of(text *routing_key, int32 partitions)
{
	int32		hash = DatumGetInt32(DirectFunctionCall1Coll(hashtext, C_COLLATION_OID,
															 PointerGetDatum(routing_key)));

	return (int32) ((uint32) hash & (uint32) (partitions - 1));
}

static void
check_partitions(int32 partitions)
{
	if (partitions < 1 || partitions > IDEM_MAX_SHARD_PARTITIONS
		|| (partitions & (partitions - 1)) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("partitions must be a power of 2 between 1 and %d", IDEM_MAX_SHARD_PARTITIONS),
				 errdetail("PL/Proxy maps a hash to partition hash & (partitions - 1), which needs a power of 2.")));
}

/* Read the record (the caller holds AccessShareLock on the table). */
static void
load_ownership(Oid relid)
{
	Relation	rel = table_open(relid, NoLock);
	TableScanDesc scan = table_beginscan(rel, GetLatestSnapshot(), 0, NULL);
	TupleTableSlot *slot = table_slot_create(rel, NULL);

	ownership.relid = relid;	/* the callback counts its invalidations now */
	if (ownership.owned)
		pfree(ownership.owned);
	if (ownership.owned_text)
		pfree(ownership.owned_text);
	ownership.owned = NULL;
	ownership.owned_text = NULL;
	ownership.configured = false;
	if (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		Datum	   *elems;
		int			n;
		StringInfoData buf;

		ownership.partitions = DatumGetInt32(slot_getattr(slot, 2, &isnull));
		deconstruct_array(DatumGetArrayTypeP(slot_getattr(slot, 3, &isnull)), INT4OID,
						  sizeof(int32), true, TYPALIGN_INT, &elems, NULL, &n);
		ownership.frozen = DatumGetBool(slot_getattr(slot, 4, &isnull));
		ownership.owned = MemoryContextAllocZero(TopMemoryContext,
												 sizeof(bool) * ownership.partitions);
		initStringInfo(&buf);
		appendStringInfoChar(&buf, '{');
		/* the table's CHECK constraints keep elements in range */
		for (int i = 0; i < n; i++)
		{
			ownership.owned[DatumGetInt32(elems[i])] = true;
			appendStringInfo(&buf, "%s%d", i > 0 ? "," : "", DatumGetInt32(elems[i]));
		}
		appendStringInfoChar(&buf, '}');
		ownership.owned_text = MemoryContextStrdup(TopMemoryContext, buf.data);
		ownership.configured = true;
	}
	ExecDropSingleTupleTableSlot(slot);
	table_endscan(scan);
	table_close(rel, NoLock);
	ownership.valid = true;
}

/*
 * The ownership record, current for this transaction: locked, so that no
 * reconfiguration takes effect before the caller's transaction ends.
 */
static ShardOwnership *
current_ownership(void)
{
	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(shard_cache_callback, (Datum) 0);
		callback_registered = true;
	}
	/* lock the cached table first: taking the lock processes invalidations */
	if (ownership.valid)
		LockRelationOid(ownership.relid, AccessShareLock);
	while (!ownership.valid)
	{
		Oid			relid = idem_internal_relid("shard_ownership");
		uint64		invals;

		LockRelationOid(relid, AccessShareLock);
		invals = ownership_invals;
		load_ownership(relid);
		/* a direct UPDATE (which does not wait for our lock) ended meanwhile */
		if (ownership_invals != invals)
			ownership.valid = false;
	}
	return &ownership;
}

/* A routing key argument: not NULL, not empty. */
static text *
routing_key_arg(FunctionCallInfo fcinfo, int argno)
{
	text	   *key;

	if (PG_ARGISNULL(argno))
		idem_null_argument("routing_key");
	key = PG_GETARG_TEXT_PP(argno);
	if (VARSIZE_ANY_EXHDR(key) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("routing_key must not be empty")));
	return key;
}

/* IK006 unless this database owns the routing key's partition; IK007 if frozen. */
static void
assert_owned(text *routing_key)
{
	ShardOwnership *o = current_ownership();
	int32		p;

	if (!o->configured)
		return;
	p = partition_of(routing_key, o->partitions);
	if (o->frozen)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_SHARD_FROZEN),
				 errmsg("database \"%s\" is frozen for a move of its hash partitions",
						get_database_name(MyDatabaseId)),
				 errdetail("It owns hash partitions %s of %d and refuses routed calls while frozen; routing key \"%s\" is in partition %d.",
						   o->owned_text, o->partitions, idem_key_for_message(routing_key), p),
				 errhint("Retry the call once the move is over.")));
	if (!o->owned[p])
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_WRONG_SHARD),
				 errmsg("routing key \"%s\" is in hash partition %d, which database \"%s\" does not own",
						idem_key_for_message(routing_key), p, get_database_name(MyDatabaseId)),
				 errdetail("This database owns hash partitions %s of %d; nothing was claimed.",
						   o->owned_text, o->partitions),
				 errhint("The call came with another routing key than the router hashed, or through a router whose partition map is stale.")));
}

/*
 * idem_shard_partition(routing_key text, partitions integer) returns
 * integer: the partition PL/Proxy's RUN ON hashtext(routing_key) picks.
 */
Datum
idem_shard_partition(PG_FUNCTION_ARGS)
{
	text	   *key = routing_key_arg(fcinfo, 0);

	if (PG_ARGISNULL(1))
		idem_null_argument("partitions");
	check_partitions(PG_GETARG_INT32(1));
	PG_RETURN_INT32(partition_of(key, PG_GETARG_INT32(1)));
}

/* idem_shard_assert(routing_key text) */
Datum
idem_shard_assert(PG_FUNCTION_ARGS)
{
	assert_owned(routing_key_arg(fcinfo, 0));
	PG_RETURN_VOID();
}

/*
 * idem_claim_routed(routing_key text, key text, scope text = 'default',
 * payload jsonb = NULL): idem_shard_assert, then idem_claim.
 */
Datum
idem_claim_routed(PG_FUNCTION_ARGS)
{
	text	   *routing_key = routing_key_arg(fcinfo, 0);
	text	   *scope;

	if (PG_ARGISNULL(1))
		idem_null_argument("key");
	if (PG_ARGISNULL(2))
		idem_null_argument("scope");
	scope = PG_GETARG_TEXT_PP(2);
	idem_check_scope(scope, IDEM_MAX_SCOPE_BYTES);
	assert_owned(routing_key);
	PG_RETURN_BOOL(idem_claim_key(scope, PG_GETARG_TEXT_PP(1),
								  PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3),
								  "idem_claim_routed()"));
}

/*
 * idem_shard_configure(partitions integer, owned integer[], frozen boolean
 * = false): store the ownership record, after every transaction that
 * passed a check has ended.
 */
Datum
idem_shard_configure(PG_FUNCTION_ARGS)
{
	Oid			relid = idem_internal_relid("shard_ownership");
	int32		partitions;
	Datum	   *elems;
	int			n;
	bool	   *seen;
	Oid			types[3] = {INT4OID, INT4ARRAYOID, BOOLOID};
	Datum		values[3];
	int			nestlevel;

	if (!pg_class_ownercheck(relid, GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to configure shard ownership"),
				 errdetail("Only the owner of table idempotency.shard_ownership may change which partitions this database owns.")));
	if (PG_ARGISNULL(0))
		idem_null_argument("partitions");
	if (PG_ARGISNULL(2))
		idem_null_argument("frozen");
	partitions = PG_GETARG_INT32(0);
	check_partitions(partitions);
	n = idem_array_arg(fcinfo, 1, "owned", INT4OID, &elems);
	seen = palloc0(sizeof(bool) * partitions);
	for (int i = 0; i < n; i++)
	{
		int32		p = DatumGetInt32(elems[i]);

		if (p < 0 || p >= partitions)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("owned partition %d is out of range", p),
					 errdetail("Partitions are numbered 0 to %d.", partitions - 1)));
		if (seen[p])
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("owned partition %d is listed twice", p)));
		seen[p] = true;
	}
	PreventCommandIfReadOnly("idem_shard_configure()");

	/* wait for every transaction that passed a check */
	LockRelationOid(relid, AccessExclusiveLock);
	values[0] = Int32GetDatum(partitions);
	values[1] = idem_build_array(elems, NULL, n, INT4OID);
	values[2] = PG_GETARG_DATUM(2);
	nestlevel = idem_pin_search_path();
	SPI_connect();
	idem_spi_exec("INSERT INTO idempotency.shard_ownership (partitions, owned, frozen)"
				  " VALUES ($1, COALESCE((SELECT pg_catalog.array_agg(p ORDER BY p)"
				  " FROM pg_catalog.unnest($2) p), '{}'), $3)"
				  " ON CONFLICT (singleton) DO UPDATE"
				  " SET partitions = excluded.partitions, owned = excluded.owned,"
				  " frozen = excluded.frozen, configured_at = pg_catalog.now()",
				  3, types, values, SPI_OK_INSERT);
	SPI_finish();
	AtEOXact_GUC(true, nestlevel);
	PG_RETURN_VOID();
}

/* Statement trigger on idempotency.shard_ownership: drop every backend's cache. */
Datum
idem_shard_changed(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"shard_changed\" was not called by the trigger manager")));
	CacheInvalidateRelcacheByRelid(RelationGetRelid(trigdata->tg_relation));
	PG_RETURN_POINTER(NULL);
}
