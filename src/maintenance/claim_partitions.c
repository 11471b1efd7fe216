/*-------------------------------------------------------------------------
 *
 * claim_partitions.c
 *	  The claims store's step of a maintenance round: creating partitions
 *	  of idempotency.claims ahead, extending the newest after a lag,
 *	  sealing (or closing) passed ones, rebuilding filters, dropping expired
 *	  ones.
 *
 * Locking rules:
 *	- Creating a partition takes ShareUpdateExclusiveLock on the parent
 *	  (CREATE TABLE ... INHERITS), which claimers never lock, and holds
 *	  AccessExclusiveLock on the new table until commit, after the registry
 *	  invalidation is sent: no claim can go into it before every backend can
 *	  know of it (see partitions.c).
 *	- Sealing takes ShareLock on the partition, conditionally: holding it
 *	  proves no claimer is inserting there; one that comes later waits for
 *	  our commit, sees the seal and chooses another partition.  If the lock
 *	  is not free (a transaction that claimed there keeps RowExclusiveLock
 *	  until it ends, however long), the round closes the partition instead,
 *	  a registry change that claimers honour once they see it.  A later
 *	  round, once the close can have been seen (the locks of the
 *	  transaction that wrote it, released after its invalidation, are
 *	  free), waits without queueing until every value lock held at that
 *	  moment has been released once -- a claim that did not see the close
 *	  holds its value lock until its row is in -- and seals the partition
 *	  under AccessShareLock, taken conditionally.  No lock that a claimer or
 *	  a lesser role holds for long keeps a partition from being sealed.
 *	- The seal's scan uses a dirty snapshot: it records the Bloom filter,
 *	  the number of claims and the newest claimed_at of every claim there,
 *	  those still in progress included (a rollback only leaves a false
 *	  positive).  If there were such, the partition is held: claimers use
 *	  its filter at once, but its scopes are counted in the history (in the
 *	  transaction that marks it sealed) only once those transactions have
 *	  ended, so idempotency.consumers counts each claim exactly once.
 *	- Only sealed partitions are dropped (never held ones), and only once
 *	  their newest claim (or their upper bound, if later) is older than the
 *	  retention, or when they are empty: that is the condition under which
 *	  claimers stop looking at them, so no claimer holds a lock on them.  The
 *	  AccessExclusiveLock is taken conditionally all the same (a reader of
 *	  idempotency.claims, or a transaction that probed the partition before
 *	  it expired, may hold a lock), and a busy partition waits for a
 *	  later round: claimers never queue behind a drop.  Under that lock,
 *	  before the drop, a heap scan adds the partition's keys to a
 *	  late-duplicate summary (claims/late.c), in the drop's subtransaction.
 *	- Changing partition_interval seals (or closes) the premade partitions
 *	  of the old width (empty ones are then dropped like any empty sealed
 *	  partition) instead of dropping them outright, so a claim that a stale
 *	  claimer put into one is never lost.
 *
 * Claims never fail for want of a partition: when maintenance lags and no
 * partition covers the current time, claims go into the newest partition
 * (idem_target_partition()), and the next round extends that same
 * partition's upper bound before creating new ones.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/catalog.h"
#include "maintenance/actions.h"

#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "claims/classes.h"
#include "claims/filters.h"
#include "claims/groups.h"
#include "claims/late.h"
#include "claims/partitions.h"
#include "claims/scopes.h"
#include "claims/settings.h"
#include "commands/extension.h"
#include "common/args.h"
#include "common/clock.h"
#include "common/ownership.h"
#include "common/spi.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/procarray.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"
#include "utils/xid8.h"

/*
 * How long a round waits for the claims in flight when a partition was
 * closed (they take microseconds; a longer one is left for the next round).
 */
#define IDEM_SEAL_WAIT_MS	1000

/*
 * Create one partition of idempotency.claims for [lower, upper) in a
 * retention class (microseconds; 0: the default) and register it.
 */
static void
create_partition(const char *qualified, TimestampTz lower, TimestampTz upper,
				 int64 class_retention)
{
	Oid			types[4] = {TEXTOID, TIMESTAMPTZOID, TIMESTAMPTZOID, INT8OID};
	Datum		values[4];
	char		nulls[4] = {' ', ' ', ' ', ' '};

	idem_exec_ddl_as_data(psprintf("CREATE TABLE %s () INHERITS (%s.claims)",
								   qualified, IDEM_SCHEMA));
	idem_exec_ddl_as_data(psprintf("CREATE UNIQUE INDEX ON %s (scope, key)", qualified));

	values[0] = CStringGetTextDatum(qualified);
	values[1] = TimestampTzGetDatum(lower);
	values[2] = TimestampTzGetDatum(upper);
	values[3] = Int64GetDatum(class_retention / USECS_PER_SEC);
	/* the default class names no retention (a 1.0 registry has no such column) */
	if (SPI_execute_with_args(class_retention == 0 ?
							  "INSERT INTO idempotency.partition_registry (relid, lower, upper)"
							  " VALUES ($1::pg_catalog.regclass, $2, $3)" :
							  "INSERT INTO idempotency.partition_registry (relid, lower, upper, retention)"
							  " VALUES ($1::pg_catalog.regclass, $2, $3,"
							  " pg_catalog.make_interval(secs => $4::pg_catalog.float8))",
							  class_retention == 0 ? 3 : 4, types, values, nulls, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not register partition %s", qualified);
}


/*---- a round and its actions ----*/

/* What one round works from. */
typedef struct Round
{
	MaintainReport *rep;
	IdemSettings s;
	TimestampTz now;
	IdemPartitionSet *set;		/* the registry as of the round's start */
	int64		class_retention;	/* the retention class being made (0: the
									 * default) */
} Round;

/* An action on one partition; false: not done now (reported by itself). */
typedef bool (*PartitionAction) (Round *r, IdemPartition *p, const char *name);

static char *
partition_name(Oid relid)
{
	char	   *relname = get_rel_name(relid);

	if (relname == NULL)
		return NULL;
	return psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
}

typedef struct PartitionActionCall
{
	Round	   *r;
	PartitionAction fn;
	IdemPartition *p;
	const char *name;
} PartitionActionCall;

static bool
call_partition_action(void *arg)
{
	PartitionActionCall *call = arg;

	return call->fn(call->r, call->p, call->name);
}

static bool
run_action(Round *r, PartitionAction fn, IdemPartition *p, const char *verb)
{
	PartitionActionCall call = {r, fn, p, partition_name(p->relid)};

	if (call.name == NULL)
		return false;			/* dropped by hand: idem_forget_missing() sees to it */
	if (!idem_partition_trusted(r->rep, verb, p->relid, r->set->claims_relid, call.name))
		return false;
	return idem_run_guarded(r->rep, verb, call.name, call_partition_action, &call);
}

static TimestampTz
add_seconds(TimestampTz t, int64 secs)
{
	return t + secs * USECS_PER_SEC;
}

static void
set_upper(Oid relid, TimestampTz upper)
{
	Oid			types[2] = {OIDOID, TIMESTAMPTZOID};
	Datum		values[2] = {ObjectIdGetDatum(relid), TimestampTzGetDatum(upper)};

	idem_spi_exec("UPDATE idempotency.partition_registry SET upper = $2 WHERE relid = $1",
			 2, types, values, SPI_OK_UPDATE);
}

/* A copy of a partition set that outlives the next cache rebuild. */
static IdemPartitionSet *
copy_partition_set(IdemPartitionSet *set)
{
	IdemPartitionSet *copy = palloc(sizeof(IdemPartitionSet));

	*copy = *set;
	copy->parts = palloc(sizeof(IdemPartition) * Max(set->nparts, 1));
	memcpy(copy->parts, set->parts, sizeof(IdemPartition) * set->nparts);
	copy->classes = palloc(sizeof(int64) * Max(set->nclasses, 1));
	memcpy(copy->classes, set->classes, sizeof(int64) * set->nclasses);
	copy->nscopes = 0;			/* its patterns are not copied */
	copy->scopes = NULL;
	return copy;
}

/*---- sealing ----*/

/*
 * Add what a partition being sealed holds, per scope, to
 * idempotency.scope_history (idempotency.consumers), in the sealing
 * transaction: once sealed, a partition's claims are counted there and no
 * longer live.  Counted by a heap scan (scopes.c), not a query over the
 * partition.  Returns the longest retention of its scopes' classes
 * (microseconds; 0 if all are the default's), which the partition is kept
 * for, and sets *follows_default if one of them is in the default class.
 */
static int64
fold_scopes(IdemPartitionSet *set, Relation rel, Snapshot snap, bool *follows_default)
{
	HTAB	   *counts = idem_scope_counts_create();
	HASH_SEQ_STATUS seq;
	IdemScopeCount *c;
	long		n;
	Datum	   *scopes;
	Datum	   *firsts;
	Datum	   *lasts;
	Datum	   *claims;
	int			i = 0;
	Oid			types[4] = {TEXTARRAYOID, TIMESTAMPTZARRAYOID, TIMESTAMPTZARRAYOID, INT8ARRAYOID};
	Datum		values[4];
	int64		longest = 0;

	*follows_default = false;
	idem_scope_counts_add(counts, rel, snap);
	n = hash_get_num_entries(counts);
	if (n == 0)
		return 0;
	scopes = palloc(sizeof(Datum) * n);
	firsts = palloc(sizeof(Datum) * n);
	lasts = palloc(sizeof(Datum) * n);
	claims = palloc(sizeof(Datum) * n);
	hash_seq_init(&seq, counts);
	while ((c = hash_seq_search(&seq)) != NULL)
	{
		int64		class = idem_scope_class(set, c->scope, strlen(c->scope));

		scopes[i] = CStringGetTextDatum(c->scope);
		firsts[i] = TimestampTzGetDatum(c->first_claim_at);
		lasts[i] = TimestampTzGetDatum(c->last_claim_at);
		claims[i] = Int64GetDatum(c->claims);
		longest = Max(longest, class);
		if (class == 0)
			*follows_default = true;
		i++;
	}
	values[0] = idem_build_array(scopes, NULL, n, TEXTOID);
	values[1] = idem_build_array(firsts, NULL, n, TIMESTAMPTZOID);
	values[2] = idem_build_array(lasts, NULL, n, TIMESTAMPTZOID);
	values[3] = idem_build_array(claims, NULL, n, INT8OID);
	idem_spi_exec("INSERT INTO idempotency.scope_history AS h"
				  " SELECT * FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2),"
				  " pg_catalog.unnest($3), pg_catalog.unnest($4))"
				  " ON CONFLICT (scope) DO UPDATE SET"
				  " first_claim_at = least(h.first_claim_at, excluded.first_claim_at),"
				  " last_claim_at = greatest(h.last_claim_at, excluded.last_claim_at),"
				  " claims = h.claims + excluded.claims",
				  4, types, values, SPI_OK_INSERT);
	return longest;
}

/*
 * Keep a partition at least "retention" (microseconds) after its newest
 * claim: it holds claims of a scope whose class is kept longer than its own
 * (they went in before the scope's class changed, or were claimed by a
 * backend that had not seen the change yet).  Never shortens.
 */
static void
keep_longer(IdemPartition *p, int64 retention)
{
	Oid			types[2] = {OIDOID, INT8OID};
	Datum		values[2] = {ObjectIdGetDatum(p->relid), Int64GetDatum(retention / USECS_PER_SEC)};

	if (retention <= p->class_retention || retention <= p->keep_retention)
		return;
	idem_spi_exec("UPDATE idempotency.partition_registry"
				  " SET keep_retention = pg_catalog.make_interval(secs => $2::pg_catalog.float8)"
				  " WHERE relid = $1", 2, types, values, SPI_OK_UPDATE);
	p->keep_retention = retention;
}

/*
 * Keep a partition of a class of its own at least idem_configure()'s
 * retention, as that changes: it holds claims of scopes that follow it now
 * (claimed before their own retention was removed, or by a backend that had
 * not seen it set).
 */
static void
keep_default(IdemPartition *p)
{
	Oid			types[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(p->relid)};

	if (p->class_retention == 0 || p->keep_default)
		return;
	idem_spi_exec("UPDATE idempotency.partition_registry SET keep_default = true"
				  " WHERE relid = $1", 1, types, values, SPI_OK_UPDATE);
	p->keep_default = true;
}

/* Keep a partition as long as the scopes fold_scopes() found there need. */
static void
keep_for_scopes(IdemPartition *p, int64 longest, bool follows_default)
{
	keep_longer(p, longest);
	if (follows_default)
		keep_default(p);
}

/* The transactions a seal found claims of, as the registry stores them. */
static Datum
holders_array(IdemSealInfo *info)
{
	Datum	   *elems;

	if (info->nholders == 0)
		return (Datum) 0;
	elems = palloc(sizeof(Datum) * info->nholders);
	for (int i = 0; i < info->nholders; i++)
		elems[i] = FullTransactionIdGetDatum(info->holders[i]);
	return PointerGetDatum(construct_array(elems, info->nholders, XID8OID, sizeof(uint64),
										   FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
}

/*
 * Does the transaction with this full id still hold a partition: is it
 * running (or prepared), or did it commit after the snapshot that
 * fold_scopes() would count with?
 */
static bool
holder_running(FullTransactionId fx)
{
	uint64		next = U64FromFullTransactionId(ReadNextFullTransactionId());
	TransactionId xid = XidFromFullTransactionId(fx);

	/* more than 2^31 ids ago (or from another cluster): its 32-bit id is reused */
	if (next - U64FromFullTransactionId(fx) >= (UINT64CONST(1) << 31))
		return false;
	return TransactionIdIsInProgress(xid) || XidInMVCCSnapshot(xid, GetTransactionSnapshot());
}

/*
 * Seal a partition that no claim can go into any more (the caller made sure
 * of that, and holds a lock that keeps it from being dropped): record its
 * Bloom filter, which lets claimers check it without the value lock, its
 * number of claims and its newest claimed_at -- claims of transactions
 * still open included (idem_filter_build()).  If there are such claims (or
 * claims committed after the snapshot the scopes would be counted with),
 * the partition is only held: claimers use its filter at once, but its
 * scopes are counted, and it is marked sealed, once those transactions
 * have ended (finish_held()).
 */
static bool
seal_one(Round *r, IdemPartition *p, const char *name)
{
	Relation	rel;
	Snapshot	snap;
	IdemSealInfo info;
	bytea	   *bloom;
	Oid			types[5] = {OIDOID, BYTEAOID, INT8OID, TIMESTAMPTZOID, XID8ARRAYOID};
	Datum		values[5];
	char		nulls[5] = {' ', ' ', ' ', ' ', ' '};
	bool		v10;
	bool		held;
	int64		longest = 0;
	bool		follows_default = false;

	/* a database still at version 1.0 has no room for what the seal found */
	v10 = get_attnum(r->set->registry_relid, "max_claimed_at") == InvalidAttrNumber;

	/* the scopes are counted with the snapshot the filter was built with */
	snap = RegisterSnapshot(GetTransactionSnapshot());
	rel = table_open(p->relid, NoLock);
	bloom = idem_filter_build(rel, snap, &info);
	held = info.nholders > 0;
	if (!v10 && !held)
		longest = fold_scopes(r->set, rel, snap, &follows_default);	/* 1.0 has no scope history */
	table_close(rel, NoLock);
	UnregisterSnapshot(snap);

	values[0] = ObjectIdGetDatum(p->relid);
	values[1] = PointerGetDatum(bloom);
	nulls[1] = bloom == NULL ? 'n' : ' ';
	values[2] = Int64GetDatum(info.nkeys);
	values[3] = TimestampTzGetDatum(info.max_claimed_at);
	nulls[3] = info.nkeys == 0 ? 'n' : ' ';
	values[4] = holders_array(&info);
	nulls[4] = held ? ' ' : 'n';

	if (v10 && held)
		return false;			/* only under ShareLock, which it lacked */
	if (SPI_execute_with_args(v10 ?
							  "UPDATE idempotency.partition_registry"
							  " SET sealed = true, bloom = $2 WHERE relid = $1" :
							  "UPDATE idempotency.partition_registry"
							  " SET sealed = $5 IS NULL, closed = true, bloom = $2, nkeys = $3,"
							  " max_claimed_at = $4, held_by = $5"
							  " WHERE relid = $1",
							  v10 ? 2 : 5, types, values, nulls, false, 0) != SPI_OK_UPDATE)
		elog(ERROR, "could not update idempotency.partition_registry");
	keep_for_scopes(p, longest, follows_default);
	/* its keys join a group in the same transaction (groups.c) */
	if (!v10 && bloom != NULL)
		idem_groups_add(p->relid, info.hashes, info.nkeys);
	idem_report_action(r->rep, held ? "hold" : "seal", name);
	return true;
}

/*
 * Build the filter of a sealed partition again (its bloom was set to NULL,
 * the repair of a damaged one), under a conditional ShareLock.  Nothing
 * else of its registry row changes: it was counted when it was sealed.
 */
static bool
rebuild_one(Round *r, IdemPartition *p, const char *name)
{
	Relation	rel;
	Snapshot	snap;
	IdemSealInfo info;
	bytea	   *bloom;
	Oid			types[2] = {OIDOID, BYTEAOID};
	Datum		values[2];
	char		nulls[2] = {' ', ' '};

	if (!ConditionalLockRelationOid(p->relid, ShareLock))
		return false;
	snap = RegisterSnapshot(GetTransactionSnapshot());
	rel = table_open(p->relid, NoLock);
	bloom = idem_filter_build(rel, snap, &info);
	table_close(rel, NoLock);
	UnregisterSnapshot(snap);
	values[0] = ObjectIdGetDatum(p->relid);
	values[1] = PointerGetDatum(bloom);
	nulls[1] = bloom == NULL ? 'n' : ' ';
	if (SPI_execute_with_args("UPDATE idempotency.partition_registry SET bloom = $2 WHERE relid = $1",
							  2, types, values, nulls, false, 0) != SPI_OK_UPDATE)
		elog(ERROR, "could not update idempotency.partition_registry");
	idem_report_action(r->rep, "rebuild filter", name);
	return true;
}

/*
 * Rebuild the filters of sealed partitions that hold claims but have none:
 * the repair of a damaged filter is to set its bloom to NULL.
 */
static void
rebuild_filters(Round *r)
{
	if (get_attnum(r->set->registry_relid, "max_claimed_at") == InvalidAttrNumber)
		return;					/* 1.0 cannot tell an empty partition from one without */
	for (int i = 0; i < r->set->nparts; i++)
	{
		IdemPartition *p = &r->set->parts[i];

		if (p->sealed && !p->empty && !p->has_filter &&
			!idem_partition_expired(r->set, p, r->now))
			run_action(r, rebuild_one, p, "rebuild filter");
	}
}

/*
 * Finish sealing a held partition once every transaction that had claims
 * in progress there when it was sealed has ended: count its scopes into the
 * history and mark it sealed, in one transaction (so idempotency.consumers
 * counts those claims live until then, and in the history after).
 */
static bool
finish_held(Round *r, IdemPartition *p, const char *name)
{
	Oid			types[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(p->relid)};
	bool		isnull;
	Datum	   *elems;
	int			n;

	if (SPI_execute_with_args("SELECT held_by FROM idempotency.partition_registry WHERE relid = $1",
							  1, types, values, NULL, false, 1) != SPI_OK_SELECT || SPI_processed != 1)
		return false;			/* changed by hand meanwhile: next round */
	values[0] = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (isnull)
		return false;
	deconstruct_array(DatumGetArrayTypeP(values[0]), XID8OID, sizeof(uint64), FLOAT8PASSBYVAL,
					  TYPALIGN_DOUBLE, &elems, NULL, &n);
	for (int i = 0; i < n; i++)
		if (holder_running(DatumGetFullTransactionId(elems[i])))
			return false;		/* still held: the view shows by whom */

	if (!ConditionalLockRelationOid(p->relid, AccessShareLock))
	{
		idem_report_action(r->rep, "skip seal (in use)", name);
		return false;
	}
	values[0] = ObjectIdGetDatum(p->relid);
	idem_spi_exec("UPDATE idempotency.partition_registry SET sealed = true, held_by = NULL"
				  " WHERE relid = $1", 1, types, values, SPI_OK_UPDATE);
	/* the holders have ended: the transaction snapshot sees what they committed */
	{
		Snapshot	snap = RegisterSnapshot(GetTransactionSnapshot());
		Relation	rel = table_open(p->relid, NoLock);
		bool		follows_default;
		int64		longest = fold_scopes(r->set, rel, snap, &follows_default);

		table_close(rel, NoLock);
		UnregisterSnapshot(snap);
		keep_for_scopes(p, longest, follows_default);
	}
	idem_report_action(r->rep, "seal", name);
	return true;
}

/*
 * A partition whose range has passed (or a premade one a reshape retires):
 * seal it now if no claimer holds RowExclusiveLock on it -- our ShareLock
 * then proves that nobody is inserting there, and one that comes later
 * waits for our commit and sees the seal.  Otherwise close it: a claimer
 * that sees the close never inserts there, and the next round seals it once
 * the claims in flight before the close was seen are done (seal_passed()),
 * without waiting for the transactions that hold the lock: one that
 * claimed there earlier is not necessarily still inserting.
 */
static bool
seal_or_close(Round *r, IdemPartition *p, const char *name)
{
	Oid			types[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(p->relid)};

	if (ConditionalLockRelationOid(p->relid, ShareLock))
		return seal_one(r, p, name);
	if (get_attnum(r->set->registry_relid, "closed") == InvalidAttrNumber)
		return false;			/* version 1.0: only the lock will do */
	idem_spi_exec("UPDATE idempotency.partition_registry SET closed = true WHERE relid = $1",
				  1, types, values, SPI_OK_UPDATE);
	idem_report_action(r->rep, "close", name);
	return true;
}

/* Seal a partition an earlier round closed, after wait_for_claims_in_flight(). */
static bool
seal_closed(Round *r, IdemPartition *p, const char *name)
{
	if (!ConditionalLockRelationOid(p->relid, AccessShareLock))
	{
		idem_report_action(r->rep, "skip seal (in use)", name);
		return false;
	}
	return seal_one(r, p, name);
}

/*
 * Has the close of p committed, and had every backend the chance to see
 * it?  Its registry row was written by a transaction other than ours whose
 * locks are released -- after its invalidation was sent.
 */
static bool
close_seen(IdemPartition *p)
{
	TransactionId xmin = p->filter_xmin;	/* xmin of its registry row */

	if (!TransactionIdIsNormal(xmin))
		return true;
	return !TransactionIdIsCurrentTransactionId(xmin) && ConditionalXactLockTableWait(xmin);
}

/*
 * Wait until every value lock (claims.c) that another backend holds now has
 * been released once.  Every insert into a claims partition happens under
 * the value lock of its key, taken before the last look at the registry:
 * once the close of a partition has been seen (close_seen()), a claim that
 * still goes there holds its value lock now.  Polls instead of queueing for
 * the locks, so claimers never wait behind maintenance and no deadlock can
 * form; false (with the holder's pid) if one is still held after
 * IDEM_SEAL_WAIT_MS.
 */
static bool
wait_for_claims_in_flight(int *pid)
{
	LockData   *locks = GetLockStatusData();
	LockInstanceData **held = palloc(sizeof(LockInstanceData *) * Max(locks->nelements, 1));
	int			nheld = 0;
	TimestampTz start = GetCurrentTimestamp();
	MemoryContext pollcxt = AllocSetContextCreate(CurrentMemoryContext, "idempotency seal wait",
												  ALLOCSET_SMALL_SIZES);
	bool		done = false;

	for (int i = 0; i < locks->nelements; i++)
	{
		LockInstanceData *l = &locks->locks[i];

		if (l->locktag.locktag_type == LOCKTAG_ADVISORY &&
			l->locktag.locktag_field1 == MyDatabaseId &&
			l->locktag.locktag_field4 == IDEM_LOCKTAG_CLAIM &&
			(l->holdMask & LOCKBIT_ON(ExclusiveLock)) != 0 && l->pid != MyProcPid)
			held[nheld++] = l;
	}
	while (!done)
	{
		MemoryContext oldcxt = MemoryContextSwitchTo(pollcxt);

		done = true;
		for (int i = 0; i < nheld; i++)
		{
			VirtualTransactionId *vxids;

			if (held[i] == NULL)
				continue;
			vxids = GetLockConflicts(&held[i]->locktag, ExclusiveLock, NULL);
			while (VirtualTransactionIdIsValid(*vxids) &&
				   (vxids->backendId != held[i]->backend ||
					vxids->localTransactionId != held[i]->lxid))
				vxids++;
			if (VirtualTransactionIdIsValid(*vxids))
			{
				done = false;	/* the same transaction still holds it */
				*pid = held[i]->pid;
			}
			else
				held[i] = NULL;
		}
		MemoryContextSwitchTo(oldcxt);
		MemoryContextReset(pollcxt);
		if (done || TimestampDifferenceExceeds(start, GetCurrentTimestamp(), IDEM_SEAL_WAIT_MS))
			break;
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH, 1,
						 PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
	MemoryContextDelete(pollcxt);
	return done;
}

/*
 * Is a retention class (0: the default) one that maintenance keeps
 * partitions for: the default, or a retention of idempotency.scope_retention?
 * A class no scope has any more gets no new partitions, and its last ones
 * are sealed once their range has passed, like any other.
 */
static bool
class_configured(Round *r, int64 class_retention)
{
	if (class_retention == 0)
		return true;
	for (int i = 0; i < r->set->nclasses; i++)
		if (r->set->classes[i] == class_retention)
			return true;
	return false;
}

/* The partition a class's claims go into now (NULL: none, or not configured). */
static IdemPartition *
class_target(Round *r, int64 class_retention)
{
	bool		covers;

	if (!class_configured(r, class_retention))
		return NULL;
	return idem_class_partition(r->set, class_retention, r->now, &covers);
}

/*
 * Seal what can be sealed.  First what earlier rounds held (once their
 * holders have ended) or closed (once the claims in flight when the close
 * was seen are done), before this round takes any ShareLock a claimer in
 * flight could be waiting for; then seal or close the partitions whose
 * range has passed (by a second, for claimers whose clock reads a little
 * behind), except the one claims go into while maintenance lags, and every
 * partition of a retention class no scope has any more.
 */
static void
seal_passed(Round *r)
{
	int			waited = 0;		/* 1: claims in flight are done, -1: not */
	int			pid = 0;

	for (int i = r->set->nparts - 1; i >= 0; i--)
	{
		IdemPartition *p = &r->set->parts[i];
		char	   *name;

		if (p->held)
			run_action(r, finish_held, p, "seal");
		if (!p->closed || p->sealed || !close_seen(p))
			continue;
		if (waited == 0)
			waited = wait_for_claims_in_flight(&pid) ? 1 : -1;
		if (waited > 0)
			run_action(r, seal_closed, p, "seal");
		else if ((name = partition_name(p->relid)) != NULL)
			idem_report_action(r->rep, psprintf("skip seal (claim in flight in process %d)", pid),
							   name);
	}
	for (int i = r->set->nparts - 1; i >= 0; i--)
	{
		IdemPartition *p = &r->set->parts[i];

		/* a class no scope has any more takes no claims: seal all of it */
		if (!p->closed &&
			(!class_configured(r, p->class_retention) ||
			 (p != class_target(r, p->class_retention) && p->upper <= r->now - USECS_PER_SEC)))
			run_action(r, seal_or_close, p, "seal");
	}
}

static bool
spi_exists(const char *sql, Oid *types, Datum *values)
{
	if (SPI_execute_with_args(sql, 1, types, values, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not run: %s", sql);
	return SPI_processed > 0;
}

/*
 * Does a sealed partition hold a claim of a scope the pattern covers?  Read
 * through its (scope, key) index as the extension's owner: the caller made
 * sure the partition is ours.
 */
static bool
holds_scope(const char *name, const char *pattern)
{
	int			len = strlen(pattern);
	Oid			types[1] = {TEXTOID};
	Datum		values[1];
	StringInfoData like;

	if (pattern[len - 1] != '*')
	{
		values[0] = CStringGetTextDatum(pattern);
		return spi_exists(psprintf("SELECT 1 FROM ONLY %s WHERE scope = $1 LIMIT 1", name),
						  types, values);
	}
	initStringInfo(&like);
	for (int i = 0; i < len - 1; i++)
	{
		if (pattern[i] == '%' || pattern[i] == '_' || pattern[i] == '\\')
			appendStringInfoChar(&like, '\\');
		appendStringInfoChar(&like, pattern[i]);
	}
	appendStringInfoChar(&like, '%');
	values[0] = CStringGetTextDatum(like.data);
	return spi_exists(psprintf("SELECT 1 FROM ONLY %s WHERE scope LIKE $1 LIMIT 1", name),
					  types, values);
}

/*
 * The retention of a pattern's scopes changed: keep every sealed partition
 * that holds their claims at least as long as they are kept now, unless it
 * has expired already -- the pattern's retention (microseconds) when it was
 * set, or, when it was removed, that of the class the scopes fall back to
 * (0: the default class, whose retention may change later).  Partitions not
 * sealed yet get it when they are (fold_scopes()), and held ones when they
 * are sealed for good (finish_held()), both under the maintenance lock,
 * which the caller holds, acting as the extension's owner, connected to SPI,
 * after the write to the patterns.  A partition that is not ours is kept
 * longer without being read.
 */
void
idem_claim_partitions_keep(const char *pattern, bool removed, int64 retention)
{
	IdemPartitionSet *fresh = idem_partition_set_fresh();
	IdemPartitionSet *set;
	TimestampTz now = idem_now();

	if (removed)
		retention = idem_pattern_class(fresh, pattern);	/* a copy has no patterns */
	set = copy_partition_set(fresh);
	for (int i = 0; i < set->nparts; i++)
	{
		IdemPartition *p = &set->parts[i];
		char	   *name;

		/*
		 * Against what the partition keeps for good (its class, its
		 * keep_retention), not idem_configure()'s retention that a default-
		 * class or keep_default partition follows: that can be lowered later.
		 */
		if (!p->sealed || p->held || idem_partition_expired(set, p, now) ||
			(retention > 0 ? Max(p->class_retention, p->keep_retention) >= retention :
			 p->class_retention == 0 || p->keep_default) ||
			(name = partition_name(p->relid)) == NULL)
			continue;
		if (idem_relation_distrust(p->relid, set->claims_relid) == NULL &&
			!holds_scope(name, pattern))
			continue;
		if (retention > 0)
			keep_longer(p, retention);
		else
			keep_default(p);
	}
}

/*---- dropping ----*/

static bool
drop_one(Round *r, IdemPartition *p, const char *name)
{
	Oid			types[1] = {OIDOID};
	Datum		values[1] = {ObjectIdGetDatum(p->relid)};

	if (!ConditionalLockRelationOid(p->relid, AccessExclusiveLock))
	{
		idem_report_action(r->rep, "skip drop (in use)", name);
		return false;
	}
	if (!p->empty)
	{
		/* its keys outlive it in a summary, for late duplicates (late.c) */
		Relation	rel = table_open(p->relid, NoLock);
		int64		retention = idem_partition_retention(r->set, p);

		idem_late_fold(rel, p->lower + retention, Min(p->keep_until + retention, r->now), r->now);
		table_close(rel, NoLock);
	}
	idem_spi_exec("DELETE FROM idempotency.partition_registry WHERE relid = $1",
			 1, types, values, SPI_OK_DELETE);
	idem_spi_exec(psprintf("DROP TABLE %s", name), 0, NULL, NULL, SPI_OK_UTILITY);
	idem_report_action(r->rep, "drop", name);
	return true;
}

/*
 * Drop the sealed partitions whose claims have all expired.  Only those
 * sealed before this round: every claimer has seen that seal commit, so none
 * still takes the partition for one that can take claims (and waits behind
 * our lock to probe it).  Never a held one: its scopes are not counted yet.
 */
static void
drop_expired(Round *r, IdemPartitionSet *sealed_before)
{
	for (int i = r->set->nparts - 1; i >= 0; i--)
	{
		IdemPartition *p = &r->set->parts[i];
		bool		was_sealed = false;

		for (int j = 0; j < sealed_before->nparts && !was_sealed; j++)
			was_sealed = sealed_before->parts[j].relid == p->relid &&
				sealed_before->parts[j].sealed && !sealed_before->parts[j].held;
		if (was_sealed && !p->held && idem_partition_expired(r->set, p, r->now))
		{
			idem_debug_wait("claims_drop_checked");
			run_action(r, drop_one, p, "drop");
		}
	}
}

/*---- creating and extending ----*/

static bool
extend_one(Round *r, IdemPartition *p, const char *name)
{
	set_upper(p->relid, p->upper);
	idem_report_action(r->rep, "extend", name);
	return true;
}

static bool
cut_one(Round *r, IdemPartition *p, const char *name)
{
	set_upper(p->relid, p->upper);
	idem_report_action(r->rep, "cut", name);
	return true;
}

static bool
create_one(void *arg)
{
	IdemCreateCall *c = arg;

	create_partition(c->name, c->lower, c->upper, ((Round *) c->step)->class_retention);
	return true;
}

/*
 * Create and register a partition for [lower, upper) in the round's class,
 * as one action.  A class other than the default has its retention in
 * seconds in the partitions' names.
 */
static bool
create_guarded(Round *r, TimestampTz lower, TimestampTz upper)
{
	const char *prefix = r->class_retention == 0 ? "claims" :
		psprintf("claims_r%lld", (long long) (r->class_retention / USECS_PER_SEC));
	IdemCreateCall call = {r, lower, upper, idem_partition_name(prefix, lower)};

	if (!idem_run_guarded(r->rep, "create", call.name, create_one, &call))
		return false;
	idem_report_action(r->rep, "create", call.name);
	return true;
}

/* The earliest lower bound of a partition that takes claims and lies ahead. */
static bool
first_future_lower(Round *r, TimestampTz *lower)
{
	bool		found = false;

	for (int i = 0; i < r->set->nparts; i++)
	{
		IdemPartition *p = &r->set->parts[i];

		if (!p->closed && p->class_retention == r->class_retention &&
			p->lower > r->now && (!found || p->lower < *lower))
		{
			*lower = p->lower;
			found = true;
		}
	}
	return found;
}

/*
 * Make sure a partition covers now, and others [now, now + premake
 * intervals).  If the partition claims go into ends in the past
 * (maintenance lagged), claims have been going into it: extend its upper
 * bound past now (up to the next partition made ahead, if any) instead of
 * leaving a gap.  If none has begun (the registry is empty, or only holds
 * partitions ahead), create one from the start of the current interval.
 */
static void
ensure_partitions(Round *r)
{
	bool		covers;
	IdemPartition *target = idem_class_partition(r->set, r->class_retention, r->now, &covers);
	TimestampTz next = idem_next_boundary(r->now, r->s.interval);
	TimestampTz horizon = add_seconds(r->now, r->s.interval * r->s.premake);
	TimestampTz upper = next;
	TimestampTz ahead = 0;
	TimestampTz cursor = r->now;

	if (first_future_lower(r, &ahead) && ahead < upper)
		upper = ahead;
	if (!covers && target != NULL && target->lower <= r->now)
	{
		IdemPartition extended = *target;

		extended.upper = upper;
		if (run_action(r, extend_one, &extended, "extend"))
			target->upper = upper;
	}
	else if (!covers)
	{
		TimestampTz lower = next - r->s.interval * USECS_PER_SEC;

		if (lower > r->now)
			lower -= r->s.interval * USECS_PER_SEC;
		if (!create_guarded(r, lower, upper))
			return;				/* claims go into the newest partition meanwhile */
		cursor = upper;
	}

	/* new partitions follow the class's last one that can take claims */
	for (int i = 0; i < r->set->nparts; i++)
	{
		IdemPartition *p = &r->set->parts[i];

		if (!p->closed && p->class_retention == r->class_retention && p->upper > cursor)
			cursor = p->upper;
	}
	while (cursor < horizon)
	{
		TimestampTz u = add_seconds(cursor, r->s.interval);

		if (!create_guarded(r, cursor, u))
			break;
		cursor = u;
	}
}

/*
 * After partition_interval changed: seal (or close, see seal_or_close())
 * the premade partitions of the old width, newest first, and end the
 * current one at the next boundary of the new grid, so the new width
 * applies from then on.  A premade partition that can be neither (a
 * database still at version 1.0, while a claimer is inserting there) stays,
 * and the new width starts after it.
 */
static void
reshape_partitions(Round *r)
{
	bool		covers;
	IdemPartition *target = idem_class_partition(r->set, r->class_retention, r->now, &covers);
	TimestampTz next = idem_next_boundary(r->now, r->s.interval);
	bool		all_sealed = true;

	for (int i = 0; i < r->set->nparts && all_sealed; i++)
	{
		IdemPartition *p = &r->set->parts[i];

		if (p->closed || p == target || p->lower <= r->now ||
			p->class_retention != r->class_retention)
			continue;
		if (run_action(r, seal_or_close, p, "seal"))
			p->closed = true;
		else
			all_sealed = false;
	}
	if (all_sealed && target != NULL && covers && target->upper != next)
	{
		IdemPartition cut = *target;

		cut.upper = next;
		if (run_action(r, cut_one, &cut, "cut"))
			target->upper = next;
	}
}

/*
 * The claims store's step of a round (the caller holds the maintenance
 * lock, acts as the extension's owner and is connected to SPI): reshape
 * after partition_interval changed, create and extend, seal or close,
 * rebuild filters set to NULL, drop what expired.  Each step works from
 * the registry as the previous one left it.
 */
void
idem_claim_partitions_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now,
							   bool reshape)
{
	Round		r;
	IdemPartitionSet *before;
	int			expired;

	r.rep = rep;
	r.s = *s;
	r.now = now;
	r.class_retention = 0;
	idem_forget_missing(rep, "partition_registry");
	r.set = idem_partition_set_fresh();

	/*
	 * Inside CREATE or ALTER EXTENSION a round only makes what a store
	 * lacks: an update leaves the claims partitions as they are.
	 */
	if (creating_extension && r.set->nparts > 0)
		return;
	before = copy_partition_set(r.set);
	for (int c = -1; c < before->nclasses; c++)
	{
		/* the default class, then each of idempotency.scope_retention */
		r.class_retention = c < 0 ? 0 : before->classes[c];
		if (reshape)
		{
			reshape_partitions(&r);
			r.set = idem_partition_set_fresh();
		}
		ensure_partitions(&r);
		r.set = idem_partition_set_fresh();
	}
	seal_passed(&r);
	r.set = idem_partition_set_fresh();
	rebuild_filters(&r);
	r.set = idem_partition_set_fresh();
	drop_expired(&r, before);
	idem_filters_forget_others(idem_partition_set_fresh());
	idem_groups_expire();
	expired = idem_late_expire(now);
	if (expired > 0)
		idem_report_action(rep, "expire", psprintf("%d late-duplicate summar%s", expired,
												   expired == 1 ? "y" : "ies"));
}
