/*-------------------------------------------------------------------------
 *
 * maintenance.c
 *	  A maintenance round: the lock that serialises rounds, acting as the
 *	  extension's owner, the claims store's step (claim_partitions.c) and
 *	  the other stores' (store_partitions.c); idem_configure() and
 *	  idem_maintain().  The worker (worker.c) runs rounds too.
 *
 * Locking rules:
 *	- Concurrent rounds are serialised by a transaction-level advisory lock
 *	  taken with try semantics: the loser returns at once.  idem_configure()
 *	  waits for it instead, and reads and validates the settings only once
 *	  it holds it, so two configurations never combine into an invalid one.
 *	- The round's DDL runs under a lock_timeout of
 *	  IDEM_MAINTENANCE_LOCK_TIMEOUT_MS, set once the maintenance lock is
 *	  held (whose wait it does not bound).
 *
 * Who acts: a round runs as the extension's owner in a security-restricted
 * operation, whoever calls it (the worker, a role granted EXECUTE on
 * idem_maintain()), so the partitions it makes are the owner's; it acts
 * only on partitions that are ours (ownership.c: owner, kind, parent,
 * plain-column indexes) and reports any other as "skip ... (not ours:
 * ...)", reading nothing of it.  Seal and rebuild read a partition by
 * heap scans only (filters.c, scopes.c): no query is planned over it.
 * Its DDL waits at most IDEM_MAINTENANCE_LOCK_TIMEOUT_MS for a lock, then
 * the action is reported as "skip ... (in use)" and the round goes on.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/args.h"
#include "delivery/store.h"
#include "maintenance/actions.h"
#include "maintenance/maintenance.h"
#include "maintenance/store_settings.h"

#include "catalog/pg_type.h"
#include "claims/classes.h"
#include "claims/partitions.h"
#include "claims/settings.h"
#include "common/clock.h"
#include "common/ownership.h"
#include "common/capabilities.h"
#include "common/spi.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "stats/stats.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_configure);
PG_FUNCTION_INFO_V1(idem_configure_scope);
PG_FUNCTION_INFO_V1(idem_maintain);

/* Who started the round now running (InvalidOid: none runs). */
static Oid	round_caller = InvalidOid;

/* Take the maintenance lock; false if busy and not waiting. */
static bool
lock_maintenance(bool wait)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 0, IDEM_LOCKTAG_MAINTAIN);
	return LockAcquire(&tag, ExclusiveLock, false, !wait) != LOCKACQUIRE_NOT_AVAIL;
}


/* Wait for the maintenance lock (idem_configure_store(), store_settings.c). */
void
idem_maintenance_lock_wait(void)
{
	(void) lock_maintenance(true);
}

/*
 * May the round honour its caller's settings where they let it drop more
 * (idempotency.outbox_keep_undelivered = off)?  Only if the caller has the
 * extension owner's rights: the round runs as that owner, and a role that
 * may only start rounds must not make one drop undelivered events.
 */
bool
idem_round_caller_trusted(void)
{
	return OidIsValid(round_caller) && has_privs_of_role(round_caller, idem_extension_owner());
}


/*
 * Act as the extension's owner for a round (see ownership.c), with a short
 * lock_timeout: the round's DDL (CREATE TABLE ... INHERITS, ATTACH
 * PARTITION) waits for any role that can LOCK a parent, and must never
 * wait long for one.  Called once the maintenance lock is held (its wait
 * is not bounded by that timeout).
 */
static void
begin_round_as_owner(IdemAsOwner *as)
{
	char		timeout[32];

	idem_check_members_owned();
	round_caller = GetUserId();
	idem_become_owner(as);
	snprintf(timeout, sizeof(timeout), "%d", IDEM_MAINTENANCE_LOCK_TIMEOUT_MS);
	(void) set_config_option("lock_timeout", timeout, PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
}


static bool
maintain(MaintainReport *rep, bool wait, bool reshape)
{
	IdemSettings s;
	TimestampTz now;
	IdemAsOwner as;

	if (!lock_maintenance(wait))
		return false;

	begin_round_as_owner(&as);
	SPI_connect();
	s = idem_read_settings(GetLatestSnapshot());
	now = idem_now();
	idem_claim_partitions_maintain(rep, &s, now, reshape);
	idem_stores_maintain(rep, &s, now);
	SPI_finish();
	idem_unbecome_owner(&as);
	round_caller = InvalidOid;
	idem_stats_maintained();
	return true;
}


/*
 * One maintenance round for callers outside SQL (the background worker),
 * which must have a transaction and an active snapshot.  Each action is
 * logged at elevel.  Returns the number of actions, or -1 if another
 * session was maintaining this database.
 */
int
idem_maintain_round(int elevel)
{
	MaintainReport rep = {NULL, NULL, elevel, 0};

	if (!maintain(&rep, false, false))
		return -1;
	return rep.nactions;
}


/* Validate settings with the retention classes of a partition set. */
static void
validate_with_classes(const IdemSettings *s, IdemPartitionSet *set)
{
	int64	   *classes = palloc(sizeof(int64) * Max(set->nclasses, 1));

	for (int i = 0; i < set->nclasses; i++)
		classes[i] = set->classes[i] / USECS_PER_SEC;
	idem_validate_settings(s, classes, set->nclasses);
}

/*
 * idem_configure(retention, partition_interval, premake): validate, store,
 * and create the partitions the new settings call for.  NULL keeps a value.
 */
Datum
idem_configure(PG_FUNCTION_ARGS)
{
	IdemSettings s;
	int64		old_interval;
	Oid			types[3] = {INTERVALOID, INTERVALOID, INT4OID};
	Datum		values[3];
	IdemAsOwner as;
	MaintainReport rep = {NULL, NULL, DEBUG1, 0};

	idem_capability_require_unlimited("idem_configure", IDEM_CAP_OPERATOR);
	/* validate against the settings no other configuration can change now */
	lock_maintenance(true);
	idem_become_owner(&as);
	SPI_connect();
	s = idem_read_settings(GetLatestSnapshot());
	old_interval = s.interval;
	if (!PG_ARGISNULL(0))
		s.retention_iv = *PG_GETARG_INTERVAL_P(0);
	if (!PG_ARGISNULL(1))
	{
		s.interval_iv = *PG_GETARG_INTERVAL_P(1);
		if (s.interval_iv.time % USECS_PER_SEC != 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("partition_interval must be a whole number of seconds")));
	}
	if (!PG_ARGISNULL(2))
		s.premake = PG_GETARG_INT32(2);
	s.retention = idem_interval_seconds(&s.retention_iv);
	s.interval = idem_interval_seconds(&s.interval_iv);
	/* a store's own retention first: its message names what to change */
	idem_validate_store_settings(&s);
	validate_with_classes(&s, idem_partition_set_fresh());

	/* store intervals as given; NULL kept the stored (or default) value */
	values[0] = IntervalPGetDatum(&s.retention_iv);
	values[1] = IntervalPGetDatum(&s.interval_iv);
	values[2] = Int32GetDatum(s.premake);
	if (SPI_execute_with_args("INSERT INTO idempotency.settings (retention, partition_interval, premake)"
							  " VALUES ($1, $2, $3)"
							  " ON CONFLICT (singleton) DO UPDATE"
							  " SET retention = $1, partition_interval = $2, premake = $3",
							  3, types, values, NULL, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not update idempotency.settings");
	SPI_finish();
	idem_unbecome_owner(&as);

	/* new settings take effect now; the round's actions are logged */
	maintain(&rep, true, s.interval != old_interval);
	PG_RETURN_VOID();
}


/*
 * Error out unless the claims' retention classes -- the patterns of
 * idempotency.scope_retention and the stores' retentions their dedup claims
 * follow (classes.c) -- as this transaction sees them, fit the bounds on
 * patterns, classes and live partitions.  For idem_configure_scope() and
 * idem_configure_store(), after their write, under the maintenance lock.
 */
void
idem_validate_claim_classes(void)
{
	IdemPartitionSet *set = idem_partition_set_fresh();
	IdemSettings s;

	if (set->nscopes > IDEM_MAX_SCOPE_PATTERNS)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("too many scopes with a retention of their own: at most %d",
						IDEM_MAX_SCOPE_PATTERNS),
				 errhint("Give scopes a common prefix, and its retention to \"prefix*\".")));
	if (set->nclasses > IDEM_MAX_RETENTION_CLASSES)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("too many distinct scope retentions: at most %d",
						IDEM_MAX_RETENTION_CLASSES),
				 errdetail("Each distinct retention has partitions of its own; the inbox's and the requests' own retentions count too."),
				 errhint("Give scopes one of the retentions already in use.")));
	s = idem_read_settings(GetLatestSnapshot());
	validate_with_classes(&s, set);
}

/*
 * idem_configure_scope(scope, retention): keep the claims of a scope, or of
 * every scope starting with a prefix ('prefix*'), for a retention of their
 * own; NULL retention removes it.  Validated with the other classes under
 * the maintenance lock, like idem_configure().  Raising a scope's retention
 * keeps the sealed partitions that hold its claims longer
 * (idem_claim_partitions_keep()); the round that follows makes the class's
 * partitions, so that its new claims go there at once.
 */
Datum
idem_configure_scope(PG_FUNCTION_ARGS)
{
	text	   *scope;
	char	   *pattern;
	IdemAsOwner as;
	MaintainReport rep = {NULL, NULL, DEBUG1, 0};
	Oid			types[2] = {TEXTOID, INTERVALOID};
	Datum		values[2];
	int64		retention = 0;

	idem_capability_require_unlimited("idem_configure_scope", IDEM_CAP_OPERATOR);
	if (PG_ARGISNULL(0))
		idem_null_argument("scope");
	scope = PG_GETARG_TEXT_PP(0);
	pattern = text_to_cstring(scope);
	idem_scope_pattern_check(pattern);
	if (!PG_ARGISNULL(1))
	{
		Interval   *iv = PG_GETARG_INTERVAL_P(1);

		retention = idem_interval_seconds(iv);
		if (retention <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("retention must be positive")));
		if (retention > IDEM_MAX_RETENTION_SECS)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("retention must not exceed %d years", IDEM_MAX_RETENTION_YEARS)));
		values[1] = IntervalPGetDatum(iv);
	}
	PreventCommandIfReadOnly("idem_configure_scope()");

	lock_maintenance(true);
	idem_become_owner(&as);
	SPI_connect();
	values[0] = PointerGetDatum(scope);
	if (retention == 0)
		idem_spi_exec("DELETE FROM idempotency.scope_retention WHERE scope = $1",
					  1, types, values, SPI_OK_DELETE);
	else
		idem_spi_exec("INSERT INTO idempotency.scope_retention (scope, retention) VALUES ($1, $2)"
					  " ON CONFLICT (scope) DO UPDATE SET retention = $2",
					  2, types, values, SPI_OK_INSERT);

	idem_validate_claim_classes();
	idem_claim_partitions_keep(pattern, retention == 0, retention * USECS_PER_SEC);
	SPI_finish();
	idem_unbecome_owner(&as);

	maintain(&rep, true, false);
	PG_RETURN_VOID();
}

/*
 * idem_maintain(): one maintenance round, one row per action taken.  Returns
 * no rows at once if another session is maintaining this database.
 */
Datum
idem_maintain(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	MaintainReport rep;

	idem_capability_require_unlimited("idem_maintain", IDEM_CAP_OPERATOR);
	InitMaterializedSRF(fcinfo, 0);
	rep.store = rsinfo->setResult;
	rep.desc = rsinfo->setDesc;
	rep.nactions = 0;
	maintain(&rep, false, false);
	return (Datum) 0;
}

