/*-------------------------------------------------------------------------
 *
 * actions.c
 *	  What every step of a maintenance round uses: actions run one by one
 *	  in subtransactions and reported as rows (or logged), partition names,
 *	  DDL that makes data rather than extension members, the grid of
 *	  partition boundaries, and forgetting registry rows whose table was
 *	  dropped by hand.
 *
 * A round is a list of independent actions, each in its own
 * subtransaction: one object that cannot be handled (a partition another
 * object depends on, say) costs one reported row and the rest of the round
 * goes on.
 *
 * Locking rules: none of its own; an action takes what it takes, and a
 * lock it could not get in time is reported as "skip <verb> (in use)".
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "maintenance/actions.h"

#include "commands/extension.h"
#include "common/catalog.h"
#include "common/ownership.h"
#include "common/pg_prng.h"
#include "common/spi.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

/*
 * A new name for a partition of "prefix" starting at lower, schema-qualified
 * and quoted.  It carries the lower bound and a random suffix, so a restored
 * dump never collides with partitions that CREATE EXTENSION made in the
 * target database.
 */
char *
idem_partition_name(const char *prefix, TimestampTz lower)
{
	struct pg_tm tm;
	fsec_t		fsec;
	char		relname[NAMEDATALEN];

	if (timestamp2tm(lower, NULL, &tm, &fsec, NULL, NULL) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_DATETIME_VALUE_OUT_OF_RANGE),
				 errmsg("timestamp out of range")));
	snprintf(relname, sizeof(relname), "%s_%04d%02d%02d_%02d%02d%02d_%08x", prefix,
			 tm.tm_year, tm.tm_mon, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
			 (unsigned int) pg_prng_uint32(&pg_global_prng_state));
	return psprintf("%s.%s", IDEM_SCHEMA, quote_identifier(relname));
}


/*
 * Run DDL that creates data, not parts of the extension: pg_dump must dump
 * partitions like user tables, so even when the install script creates the
 * first ones, they must not become extension members.
 */
void
idem_exec_ddl_as_data(const char *sql)
{
	bool		save_creating = creating_extension;
	Oid			save_extension = CurrentExtensionObject;

	creating_extension = false;
	CurrentExtensionObject = InvalidOid;
	PG_TRY();
	{
		idem_spi_exec(sql, 0, NULL, NULL, SPI_OK_UTILITY);
	}
	PG_FINALLY();
	{
		creating_extension = save_creating;
		CurrentExtensionObject = save_extension;
	}
	PG_END_TRY();
}


void
idem_report_action(MaintainReport *rep, const char *action, const char *object)
{
	Datum		values[2];
	bool		nulls[2] = {false, false};

	rep->nactions++;
	if (rep->store == NULL)
	{
		elog(rep->elevel, "idempotency maintenance: %s %s", action, object);
		return;
	}
	values[0] = CStringGetTextDatum(action);
	values[1] = CStringGetTextDatum(object);
	tuplestore_putvalues(rep->store, rep->desc, values, nulls);
}


/*
 * Run one action in a subtransaction.  An error is reported as a row
 * ("skip <verb> (<message>)") and rolled back alone; the round goes on.
 */
bool
idem_run_guarded(MaintainReport *rep, const char *verb, const char *object,
				 IdemGuardedAction fn, void *arg)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	bool		done = false;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcxt);
	PG_TRY();
	{
		done = fn(arg);
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
		/* a lock the round could not get in time: another session holds it */
		idem_report_action(rep, psprintf("skip %s (%s)", verb,
										 edata->sqlerrcode == ERRCODE_LOCK_NOT_AVAILABLE ?
										 "in use" : edata->message),
						   object);
		FreeErrorData(edata);
		done = false;
	}
	PG_END_TRY();
	return done;
}


/*
 * May maintenance act on relid, a partition of parent?  Only if it is one
 * as we make them (ownership.c); else the action is reported as skipped,
 * with the reason, and nothing of the relation is read.
 */
bool
idem_partition_trusted(MaintainReport *rep, const char *verb, Oid relid, Oid parent,
					   const char *name)
{
	const char *why = idem_relation_distrust(relid, parent);

	if (why == NULL)
		return true;
	idem_report_action(rep, psprintf("skip %s (not ours: %s)", verb, why), name);
	return false;
}


/* The next boundary of the interval grid at least a second after now. */
TimestampTz
idem_next_boundary(TimestampTz now, int64 interval_secs)
{
	int64		iv = interval_secs * USECS_PER_SEC;
	TimestampTz next = now - (now % iv) + iv;

	if (next - now < USECS_PER_SEC)
		next += iv;
	return next;
}


/*
 * Forget the rows of a registry (idempotency.<registry>, keyed by relid)
 * whose table was dropped by hand.
 */
void
idem_forget_missing(MaintainReport *rep, const char *registry)
{
	if (SPI_execute(psprintf("DELETE FROM %s.%s reg"
							 " WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = reg.relid)"
							 " RETURNING reg.relid::pg_catalog.oid::pg_catalog.text",
							 IDEM_SCHEMA, registry),
					false, 0) != SPI_OK_DELETE_RETURNING)
		elog(ERROR, "could not update %s.%s", IDEM_SCHEMA, registry);
	for (uint64 i = 0; i < SPI_processed; i++)
		idem_report_action(rep, "forget missing partition",
						   SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1));
}

