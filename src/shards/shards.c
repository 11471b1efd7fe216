/*-------------------------------------------------------------------------
 *
 * shards.c
 *	  The shard ownership guard for scale-out with PL/Proxy: a database
 *	  knows which of N hash partitions it owns, and refuses routed calls
 *	  whose routing key hashes elsewhere.  Also the check of the routing
 *	  expression that idem_shard_router_ddl() writes into router-side DDL.
 *
 * A router runs "RUN ON hashtext(<routing key>)", and PL/Proxy sends the
 * call to partition hashtext(key) & (N - 1).  Here the same number is
 * computed (idem_shard_partition), so router and shard agree by
 * construction.  The ownership record is one row of
 * idempotency.shard_ownership (a configuration table: pg_dump carries it
 * with the claims when a database moves); no row means "not sharded" and
 * every routed call passes.  idem_shard_assert() raises IK006 for a
 * partition not owned and IK007 while the database is frozen for a move or
 * its record is being changed; idem_claim_routed() checks, then claims as
 * idem_claim() does.
 *
 * Locking rules:
 *	- A check takes AccessShareLock on idempotency.shard_ownership, then
 *	  reads the record, and keeps the lock to the end of its transaction:
 *	  that lock is how a reconfiguration finds the transactions in flight.
 *	  A check that refuses raises an error, whose (sub)transaction abort
 *	  releases the lock.
 *	- A change of the record (idem_shard_configure, a direct write by the
 *	  table's owner, pg_restore's COPY) tells every backend at once, from
 *	  the table's statement trigger, before it commits: an immediate relcache
 *	  invalidation besides the transactional one.  A check that takes its
 *	  lock after that processes the invalidation (taking the lock does) and
 *	  reads the table again, with a dirty snapshot: a row version that
 *	  another transaction is writing or deleting is a change in progress,
 *	  and the check refuses with IK007 without waiting.  So no routed call
 *	  ever queues behind a reconfiguration.
 *	- idem_shard_configure() takes ShareUpdateExclusiveLock (one
 *	  reconfiguration at a time; checks and direct writes do not conflict
 *	  with it, and no role without rights on the table can hold it beyond a
 *	  failed statement), writes the row (which sends the invalidation),
 *	  then waits for every transaction that held a lock on the table at
 *	  that moment to end (GetLockConflicts, VirtualXactLock: it never joins
 *	  the table's lock queue, and prepared transactions count).  A check
 *	  that locked before the scan of the lock table is waited for; one that
 *	  locked after it saw the invalidation (both sides go through
 *	  LWLock-protected shared state in opposite orders), so a freeze
 *	  commits only once every routed claim that passed under the old record
 *	  has ended.  The wait is bounded by lock_timeout (5 s when that is 0):
 *	  any role with USAGE on schema idempotency can hold AccessShareLock on
 *	  the table (SELECT is granted to PUBLIC, and PREPARE of a SELECT needs
 *	  no privilege at all), and then the change fails with 55P03, rolls
 *	  back, and routed calls pass again.  A direct UPDATE by the owner makes
 *	  checks refuse while it is open but waits for nobody: only
 *	  idem_shard_configure() freezes safely.
 *	- The record is cached per backend and dropped by a relcache callback
 *	  on the table; a change in progress is never cached (its rollback sends
 *	  nothing).  The cache is read after the lock is taken, and filled with
 *	  the dirty snapshot, not the caller's: ownership is configuration, not
 *	  data of the caller's snapshot.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/keys.h"
#include "common/cache.h"
#include "common/compat.h"
#include "claims/claims.h"

#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_type.h"
#include "commands/dbcommands.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/optimizer.h"
#include "parser/parse_expr.h"
#include "parser/parse_node.h"
#include "parser/parser.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "storage/sinval.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_shard_partition);
PG_FUNCTION_INFO_V1(idem_shard_assert);
PG_FUNCTION_INFO_V1(idem_claim_routed);
PG_FUNCTION_INFO_V1(idem_shard_configure);
PG_FUNCTION_INFO_V1(idem_shard_changed);
PG_FUNCTION_INFO_V1(idem_shard_routing_check);

/* PL/Proxy has no limit; this keeps the owned set small and messages short */
#define IDEM_MAX_SHARD_PARTITIONS	65536

/* how long a reconfiguration waits for checks in flight when lock_timeout is 0 */
#define IDEM_SHARD_WAIT_DEFAULT_MS	5000

/* The ownership record as this backend last read it. */
typedef struct ShardOwnership
{
	bool		valid;			/* cached: read, and no change in progress */
	Oid			relid;			/* idempotency.shard_ownership */
	bool		changing;		/* another transaction is writing the record */
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

/* Keep the committed row the scan returned (the caller holds AccessShareLock). */
static void
keep_ownership_row(TupleTableSlot *slot)
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

/*
 * Read the record with a dirty snapshot (the caller holds AccessShareLock):
 * committed rows and those of transactions in progress.  A row another
 * transaction inserted, updated or deleted and has not yet committed is a
 * change in progress: not cached.
 */
static void
load_ownership(Oid relid)
{
	Relation	rel = table_open(relid, NoLock);
	SnapshotData dirty;
	TableScanDesc scan;
	TupleTableSlot *slot = table_slot_create(rel, NULL);

	ownership.relid = relid;	/* the callback counts its invalidations now */
	if (ownership.owned)
		pfree(ownership.owned);
	if (ownership.owned_text)
		pfree(ownership.owned_text);
	ownership.owned = NULL;
	ownership.owned_text = NULL;
	ownership.configured = false;
	ownership.changing = false;
	InitDirtySnapshot(dirty);
	scan = table_beginscan(rel, &dirty, 0, NULL);
	while (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		/* the scan set these for the version it returned */
		if (TransactionIdIsValid(dirty.xmin) || TransactionIdIsValid(dirty.xmax))
			ownership.changing = true;
		else if (!ownership.configured)
			keep_ownership_row(slot);
	}
	ExecDropSingleTupleTableSlot(slot);
	table_endscan(scan);
	table_close(rel, NoLock);
	ownership.valid = !ownership.changing;
}

/*
 * The ownership record, current for this transaction: AccessShareLock on
 * the table is taken before the cache is read (taking it processes the
 * invalidations of a change), and kept.  A change in progress comes back
 * with changing set.
 */
static ShardOwnership *
current_ownership(void)
{
	Oid			relid;

	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(shard_cache_callback, (Datum) 0);
		callback_registered = true;
	}
	relid = ownership.valid ? ownership.relid : idem_internal_relid("shard_ownership");
	LockRelationOid(relid, AccessShareLock);
	idem_debug_wait("shard_check");
	while (!ownership.valid)
	{
		Oid			current = idem_internal_relid("shard_ownership");
		uint64		invals;

		if (current != relid)
		{
			/* the extension was created again since the cache was filled */
			UnlockRelationOid(relid, AccessShareLock);
			relid = current;
			LockRelationOid(relid, AccessShareLock);
			continue;
		}
		invals = ownership_invals;
		load_ownership(relid);
		if (ownership_invals == invals)
			break;
		/* a change committed during the load: read again */
		ownership.valid = false;
	}
	return &ownership;
}

/* A routing key argument: not NULL, not empty. */
static text *
routing_key_arg(FunctionCallInfo fcinfo, int argno)
{
	text	   *key = idem_text_arg(fcinfo, argno, "routing_key");

	if (VARSIZE_ANY_EXHDR(key) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("routing_key must not be empty")));
	return key;
}

/* IK006 unless this database owns the routing key's partition; IK007 if frozen or being reconfigured. */
static void
assert_owned(text *routing_key)
{
	ShardOwnership *o = current_ownership();
	int32		p;

	if (o->changing)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_SHARD_FROZEN),
				 errmsg("the hash partitions of database \"%s\" are being reconfigured",
						get_database_name(MyDatabaseId)),
				 errdetail("A change of idempotency.shard_ownership (idem_shard_configure(), say a freeze for a move) has not committed yet; routed calls are refused until it ends."),
				 errhint("Retry the call once the change is over.")));
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
	idem_capability_require("idem_claim_routed", IDEM_CAP_HANDLER, IDEM_AXIS_SCOPE,
							text_to_cstring(scope));
	assert_owned(routing_key);
	PG_RETURN_BOOL(idem_claim_key(scope, PG_GETARG_TEXT_PP(1),
								  PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3),
								  "idem_claim_routed()"));
}

/* 55P03: a transaction that may have passed a check outlived the wait. */
static void
shard_wait_failed(VirtualTransactionId vxid, int timeout_ms)
{
	ereport(ERROR,
			(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
			 errmsg("could not change the shard ownership of database \"%s\": a transaction that may have passed the ownership check is still open",
					get_database_name(MyDatabaseId)),
			 errdetail("Virtual transaction %d/%u still holds a lock on table idempotency.shard_ownership after %d ms. Nothing was changed; routed calls are served as before.",
					   vxid.backendId, vxid.localTransactionId, timeout_ms),
			 errhint("Find its session with SELECT pid FROM pg_locks WHERE virtualtransaction = '%d/%u' (none for a prepared transaction: see pg_prepared_xacts), let it end or end it, or raise lock_timeout, and retry.",
					 vxid.backendId, vxid.localTransactionId)));
}

/* Wait for one transaction to end, until deadline; 55P03 after it. */
static void
wait_for_transaction(VirtualTransactionId vxid, TimestampTz deadline, int timeout_ms)
{
	MemoryContext cxt = CurrentMemoryContext;
	long		secs;
	int			usecs;
	int64		ms;
	char		buf[32];
	int			nestlevel;

	if (VirtualXactLock(vxid, false))
		return;					/* ended already */
	TimestampDifference(GetCurrentTimestamp(), deadline, &secs, &usecs);
	ms = (int64) secs * 1000 + usecs / 1000;
	if (ms <= 0)
		shard_wait_failed(vxid, timeout_ms);
	/* a lock wait, so that it shows in pg_locks and the deadlock check sees it */
	nestlevel = NewGUCNestLevel();
	snprintf(buf, sizeof(buf), INT64_FORMAT, ms);
	(void) set_config_option("lock_timeout", buf, PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	PG_TRY();
	{
		(void) VirtualXactLock(vxid, true);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		if (edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			PG_RE_THROW();
		FlushErrorState();
		shard_wait_failed(vxid, timeout_ms);
	}
	PG_END_TRY();
	AtEOXact_GUC(true, nestlevel);
}

/*
 * Wait, at most lock_timeout (IDEM_SHARD_WAIT_DEFAULT_MS when 0), for every
 * other transaction holding a lock on the ownership table now: the checks
 * that may have passed under the record being replaced.  Checks from now
 * on see the change in progress and refuse (see the banner).
 */
static void
wait_for_checks(Oid relid)
{
	int			timeout_ms = LockTimeout > 0 ? LockTimeout : IDEM_SHARD_WAIT_DEFAULT_MS;
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
	LOCKTAG		tag;
	VirtualTransactionId *vxids;

	SET_LOCKTAG_RELATION(tag, MyDatabaseId, relid);
	vxids = GetLockConflicts(&tag, AccessExclusiveLock, NULL);
	for (; VirtualTransactionIdIsValid(*vxids); vxids++)
		wait_for_transaction(*vxids, deadline, timeout_ms);
}

/*
 * idem_shard_configure(partitions integer, owned integer[], frozen boolean
 * = false): store the ownership record, then wait for every transaction
 * that passed a check under the old one to end.
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

	if (!idem_rel_owned_by_user(relid))
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

	/* one reconfiguration at a time; no check takes a mode this conflicts with */
	LockRelationOid(relid, ShareUpdateExclusiveLock);
	values[0] = Int32GetDatum(partitions);
	values[1] = idem_build_array(elems, NULL, n, INT4OID);
	values[2] = PG_GETARG_DATUM(2);
	nestlevel = idem_pin_search_path();
	SPI_connect();
	/* the statement trigger tells every backend: checks refuse from now on */
	idem_spi_exec("INSERT INTO idempotency.shard_ownership (partitions, owned, frozen)"
				  " VALUES ($1, COALESCE((SELECT pg_catalog.array_agg(p ORDER BY p)"
				  " FROM pg_catalog.unnest($2) p), '{}'), $3)"
				  " ON CONFLICT (singleton) DO UPDATE"
				  " SET partitions = excluded.partitions, owned = excluded.owned,"
				  " frozen = excluded.frozen, configured_at = pg_catalog.now()",
				  3, types, values, SPI_OK_INSERT);
	SPI_finish();
	AtEOXact_GUC(true, nestlevel);
	idem_debug_wait("shard_configure");
	wait_for_checks(relid);
	PG_RETURN_VOID();
}

/*
 * Statement trigger on idempotency.shard_ownership: drop every backend's
 * cache now (so that checks see the change in progress and refuse) and
 * again when the change commits.
 */
Datum
idem_shard_changed(PG_FUNCTION_ARGS)
{
	return idem_cache_invalidate_trigger(fcinfo, "shard_changed", true);
}

/*
 * The routing expression of idem_shard_router_ddl().  The router's
 * "RUN ON hashtext(<expr>);" is read by PL/Proxy's scanner, not
 * PostgreSQL's: PL/Proxy copies the text into "select * from hashtext(...)",
 * replacing each unquoted word that names an argument (compared without
 * case) by $n.  The expression is accepted only where both readings agree:
 * no control characters, backslashes (their meaning follows the router's
 * standard_conforming_strings), semicolons, comments or dollar signs
 * outside quoted text; exactly one value expression (parsed after
 * "SELECT "), without subqueries, volatile or set-returning functions,
 * aggregates or window functions; every word PL/Proxy would replace is a
 * reference to that argument, and every argument reference such a word.
 */
#define ROUTING_PREFIX "SELECT "

#define ROUTING_REFUSE(...) \
	ereport(ERROR, \
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE), \
			 errmsg("routing_expr must be a single expression of the handler's arguments"), \
			 errdetail(__VA_ARGS__)))

#define WORD_START(c) ((c) == '_' || ((c) >= 'a' && (c) <= 'z') || \
					   ((c) >= 'A' && (c) <= 'Z') || (c) >= 0x80)
#define WORD_CONT(c) (WORD_START(c) || ((c) >= '0' && (c) <= '9'))

typedef struct RoutingCheck
{
	const unsigned char *expr;
	int			len;
	int			nargs;
	char	  **names;
	Oid		   *types;
	int		   *word_len;		/* [len]: length of a PL/Proxy word starting there, 0 none */
	int		   *ref_arg;		/* [len]: 1 + argument of a reference starting there, 0 none */
	bool	   *used;			/* [nargs] */
} RoutingCheck;

/* The argument a word or name denotes for PL/Proxy: the first equal without case. */
static int
routing_arg(RoutingCheck *rc, const char *name, int len)
{
	for (int i = 0; i < rc->nargs; i++)
		if (strlen(rc->names[i]) == (size_t) len && pg_strncasecmp(name, rc->names[i], len) == 0)
			return i;
	return -1;
}

/* The end of text quoted with s[i] (' or "), or of the string if unterminated. */
static int
routing_skip_quoted(const unsigned char *s, int len, int i)
{
	unsigned char q = s[i++];

	while (i < len)
	{
		if (s[i] == q && (i + 1 >= len || s[i + 1] != q))
			return i + 1;
		i += (s[i] == q) ? 2 : 1;
	}
	return len;
}

/* The end of a PL/Proxy word at i: [_a-zA-Z\x80-\xff][_a-zA-Z0-9\x80-\xff]*, dotted parts too. */
static int
routing_word_end(const unsigned char *s, int len, int i)
{
	for (;;)
	{
		int			j;

		while (i < len && WORD_CONT(s[i]))
			i++;
		for (j = i; j < len && s[j] == ' '; j++)
			;
		if (j >= len || s[j] != '.')
			return i;
		for (j++; j < len && s[j] == ' '; j++)
			;
		if (j >= len || !WORD_START(s[j]))
			return i;
		i = j;
	}
}

/* Scan the text as PL/Proxy does, refusing what the two readings may differ on. */
static void
routing_scan(RoutingCheck *rc)
{
	const unsigned char *s = rc->expr;
	int			i = 0;

	for (int k = 0; k < rc->len; k++)
	{
		if (s[k] < 0x20 || s[k] == 0x7f)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("routing_expr must not contain control characters"),
					 errdetail("Byte %d is 0x%02x; newlines, tabs and other characters below 0x20 and 0x7f are refused in text that reaches generated DDL.",
							   k + 1, s[k])));
		if (s[k] == '\\')
			ROUTING_REFUSE("Backslashes are not allowed: what they mean in a string depends on standard_conforming_strings on the router.");
	}
	while (i < rc->len)
	{
		unsigned char c = s[i];

		if (c == '\'' || c == '"')
			i = routing_skip_quoted(s, rc->len, i);
		else if ((c == 'E' || c == 'e') && i + 1 < rc->len && s[i + 1] == '\'')
			i = routing_skip_quoted(s, rc->len, i + 1);
		else if (c == ';')
			ROUTING_REFUSE("Semicolons are not allowed outside quoted text.");
		else if (c == '$')
			ROUTING_REFUSE("Dollar signs are not allowed outside quoted text: refer to arguments by name, not as $n, and quote strings with '.");
		else if ((c == '-' && i + 1 < rc->len && s[i + 1] == '-') ||
				 (c == '/' && i + 1 < rc->len && s[i + 1] == '*'))
			ROUTING_REFUSE("Comments are not allowed.");
		else if (c >= '0' && c <= '9')
		{
			/* PL/Proxy's number: [0-9][.0-9]*; what follows starts a new word */
			while (i < rc->len && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.'))
				i++;
		}
		else if (WORD_START(c))
		{
			int			end = routing_word_end(s, rc->len, i);

			rc->word_len[i] = end - i;
			i = end;
		}
		else
			i++;
	}
}

/* Raw tree: no subqueries; column references unqualified. */
static bool
routing_raw_walker(Node *node, void *context)
{
	if (node == NULL)
		return false;
	if (IsA(node, SubLink))
		ROUTING_REFUSE("Subqueries (SELECT, TABLE, VALUES, WITH, EXISTS, ARRAY(SELECT ...)) are not allowed: the router evaluates the expression on every call.");
	if (IsA(node, ColumnRef))
	{
		ColumnRef  *cref = (ColumnRef *) node;

		if (list_length(cref->fields) != 1 || !IsA(linitial(cref->fields), String))
			ROUTING_REFUSE("%s is not an argument: refer to arguments by their plain names, and to a field as (argument).field.",
						   NameListToString(cref->fields));
		return false;
	}
	return raw_expression_tree_walker(node, routing_raw_walker, context);
}

/* A column reference is an argument, written as PL/Proxy will replace it. */
static Node *
routing_columnref(ParseState *pstate, ColumnRef *cref)
{
	RoutingCheck *rc = (RoutingCheck *) pstate->p_ref_hook_state;
	const char *name = strVal(linitial(cref->fields));
	int			arg = routing_arg(rc, name, strlen(name));
	int			at = cref->location - (int) strlen(ROUTING_PREFIX);
	Param	   *param;

	if (arg < 0)
		return NULL;			/* not an argument: "column does not exist" */
	if (at < 0 || at >= rc->len || rc->word_len[at] == 0 ||
		routing_arg(rc, (const char *) rc->expr + at, rc->word_len[at]) != arg)
		ROUTING_REFUSE("Argument %s is written quoted or altered there; PL/Proxy replaces only the argument's plain name.",
					   quote_identifier(rc->names[arg]));
	rc->ref_arg[at] = arg + 1;
	rc->used[arg] = true;
	param = makeNode(Param);
	param->paramkind = PARAM_EXTERN;
	param->paramid = arg + 1;
	param->paramtype = rc->types[arg];
	param->paramtypmod = -1;
	param->paramcollid = get_typcollation(rc->types[arg]);
	param->location = cref->location;
	return (Node *) param;
}

/* The single value expression of the parsed "SELECT <expr>". */
static Node *
routing_value(RoutingCheck *rc, List *raw)
{
	SelectStmt *sel;
	ResTarget  *rt;
	int			first = 0;

	if (list_length(raw) != 1 || !IsA(linitial_node(RawStmt, raw)->stmt, SelectStmt))
		ROUTING_REFUSE("It is not one expression.");
	sel = (SelectStmt *) linitial_node(RawStmt, raw)->stmt;
	if (sel->op != SETOP_NONE || sel->distinctClause || sel->intoClause || sel->fromClause ||
		sel->whereClause || sel->groupClause || sel->havingClause || sel->windowClause ||
		sel->valuesLists || sel->sortClause || sel->limitOffset || sel->limitCount ||
		sel->lockingClause || sel->withClause || list_length(sel->targetList) != 1)
		ROUTING_REFUSE("It must be one value, with no FROM, WHERE, ORDER BY or other clause of a query, and no second value.");
	rt = linitial_node(ResTarget, sel->targetList);
	while (first < rc->len && rc->expr[first] == ' ')
		first++;
	if (rt->name != NULL || rt->indirection != NIL ||
		rt->location - (int) strlen(ROUTING_PREFIX) != first)
		ROUTING_REFUSE("It must be one value, with no alias and nothing before it.");
	if (IsA(rt->val, ColumnRef) && IsA(llast(((ColumnRef *) rt->val)->fields), A_Star))
		ROUTING_REFUSE("* is not an expression.");
	return rt->val;
}

/*
 * idempotency.shard_routing_check(routing_expr text, names text[],
 * types regtype[], OUT args integer[], OUT type regtype): check the
 * routing expression over the handler's input arguments (names, and the
 * types the expression sees), and return the arguments it uses (1-based,
 * in order) and its type.  22023 for what the router must not get; a
 * syntax or name error as the parser raises it.
 */
Datum
idem_shard_routing_check(PG_FUNCTION_ARGS)
{
	RoutingCheck rc;
	Datum	   *name_elems;
	Datum	   *type_elems;
	bool	   *nulls;
	int			ntypes;
	char	   *sql;
	Node	   *raw_value;
	ParseState *pstate;
	Node	   *value;
	Datum	   *used;
	int			nused = 0;
	TupleDesc	tupdesc;
	Datum		result[2];
	bool		result_nulls[2] = {false, false};

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(2))
		idem_null_argument(PG_ARGISNULL(0) ? "routing_expr" : PG_ARGISNULL(1) ? "names" : "types");
	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	rc.expr = (const unsigned char *) text_to_cstring(PG_GETARG_TEXT_PP(0));
	rc.len = strlen((const char *) rc.expr);
	deconstruct_array(PG_GETARG_ARRAYTYPE_P(1), TEXTOID, -1, false, TYPALIGN_INT,
					  &name_elems, &nulls, &rc.nargs);
	deconstruct_array(PG_GETARG_ARRAYTYPE_P(2), REGTYPEOID, sizeof(Oid), true, TYPALIGN_INT,
					  &type_elems, NULL, &ntypes);
	if (ntypes != rc.nargs)
		elog(ERROR, "names and types differ in length");
	rc.names = palloc(sizeof(char *) * Max(rc.nargs, 1));
	rc.types = palloc(sizeof(Oid) * Max(rc.nargs, 1));
	for (int i = 0; i < rc.nargs; i++)
	{
		if (nulls[i])
			elog(ERROR, "an argument name is null");
		rc.names[i] = TextDatumGetCString(name_elems[i]);
		rc.types[i] = DatumGetObjectId(type_elems[i]);
	}
	rc.word_len = palloc0(sizeof(int) * (rc.len + 1));
	rc.ref_arg = palloc0(sizeof(int) * (rc.len + 1));
	rc.used = palloc0(sizeof(bool) * Max(rc.nargs, 1));

	routing_scan(&rc);
	sql = psprintf(ROUTING_PREFIX "%s", (const char *) rc.expr);
	raw_value = routing_value(&rc, raw_parser(sql, RAW_PARSE_DEFAULT));
	(void) routing_raw_walker(raw_value, NULL);

	pstate = make_parsestate(NULL);
	pstate->p_sourcetext = sql;
	pstate->p_pre_columnref_hook = routing_columnref;
	pstate->p_ref_hook_state = &rc;
	value = transformExpr(pstate, raw_value, EXPR_KIND_OTHER);
	if (pstate->p_hasAggs || pstate->p_hasWindowFuncs)
		ROUTING_REFUSE("Aggregate and window functions are not allowed.");
	if (expression_returns_set(value))
		ROUTING_REFUSE("Set-returning functions are not allowed: the router needs one value per call.");
	if (contain_volatile_functions(value))
		ROUTING_REFUSE("Volatile functions are not allowed: the router computes the expression on each call, and the shard checks the routing key its handler computes.");
	free_parsestate(pstate);

	/* every word PL/Proxy replaces by an argument is a reference to it */
	for (int i = 0; i < rc.len; i++)
	{
		int			arg;

		if (rc.word_len[i] == 0)
			continue;
		arg = routing_arg(&rc, (const char *) rc.expr + i, rc.word_len[i]);
		if (arg >= 0 && rc.ref_arg[i] != arg + 1)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("routing_expr uses the name of argument %s for something else",
							quote_identifier(rc.names[arg])),
					 errdetail("At byte %d it names a function, type, field or keyword, but PL/Proxy replaces every unquoted %.*s by the argument.",
							   i + 1, rc.word_len[i], (const char *) rc.expr + i),
					 errhint("Rename the argument, or write the expression without that word.")));
	}

	used = palloc(sizeof(Datum) * Max(rc.nargs, 1));
	for (int i = 0; i < rc.nargs; i++)
		if (rc.used[i])
			used[nused++] = Int32GetDatum(i + 1);
	result[0] = PointerGetDatum(construct_array(used, nused, INT4OID, sizeof(int32), true, TYPALIGN_INT));
	result[1] = ObjectIdGetDatum(exprType(value));
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(tupdesc), result, result_nulls)));
}
