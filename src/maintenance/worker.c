/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The maintenance background worker: a launcher, and one worker per
 *	  database listed in idempotency.database that runs idem_maintain_round()
 *	  every idempotency.naptime seconds.
 *
 * With shared_preload_libraries = 'idempotency', _PG_init registers one
 * static worker, the launcher ("idempotency launcher").  It connects to no
 * database (it reads only the shared catalog pg_database), and for each
 * database named in idempotency.database starts a dynamic worker
 * ("idempotency maintenance") bound to that database for life.  The launcher
 * is told by the postmaster when one of its workers exits and starts it
 * again, but starts a database's worker at most once per naptime, so a
 * worker that dies at once never loops faster than that.  A listed database
 * that does not exist (yet), does not allow connections or is a template
 * (a connected worker would block CREATE DATABASE from it) is logged once
 * and looked up again every naptime; no worker is started for it.  On SIGHUP
 * the launcher re-reads the list: new databases get a worker, workers of
 * databases no longer listed are terminated.  When the launcher exits it
 * terminates its workers, so a restarted launcher never doubles them.
 *
 * Each maintenance worker sleeps on its latch, so SIGHUP (which reloads the
 * configuration, and with it the naptime) and SIGTERM wake it at once.  A
 * round is one transaction: if the extension is not installed in the
 * database the round does nothing (logged once per change of that state);
 * otherwise it calls idem_maintain_round().  An error in a round is caught,
 * logged, the transaction aborted, and the next round retries; the worker
 * does not exit for it.
 *
 * Both the launcher and the workers start only once recovery has finished
 * (BgWorkerStart_RecoveryFinished): nothing runs on a standby, and the
 * postmaster starts the launcher when the standby is promoted.  A worker
 * also skips rounds while RecoveryInProgress(), should it ever see one.
 *
 * Locking rules:
 *	- The launcher takes only AccessShareLock on pg_database, briefly, in
 *	  its own transaction, and BackgroundWorkerLock inside the bgworker API.
 *	- A maintenance round takes what idem_maintain_round() takes (see
 *	  retention.c): a transaction-level advisory lock with try semantics, so
 *	  a concurrent idem_maintain() (pg_cron, a user) makes the round a no-op
 *	  instead of a wait, and conditional locks for drops.  All of it is
 *	  released at the end of the round's transaction; the worker holds no
 *	  lock while it sleeps.
 *
 * A worker stays connected to its database, so DROP DATABASE of a served
 * database needs the database removed from idempotency.database first (and
 * a reload), or DROP DATABASE ... WITH (FORCE).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "maintenance/maintenance.h"

#include <limits.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "commands/dbcommands.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#define IDEM_LIBRARY_NAME		"idempotency"
#define LAUNCHER_TYPE			"idempotency launcher"
#define WORKER_TYPE				"idempotency maintenance"

/* how long the postmaster waits before restarting a launcher that died */
#define LAUNCHER_RESTART_SECS	5

/*---- GUC variables ----*/

static char *idem_worker_databases = NULL;	/* idempotency.database */
#define NAPTIME_DEFAULT_SECS	60
#define NAPTIME_MAX_SECS		(INT_MAX / 1000)

static int	idem_worker_naptime = NAPTIME_DEFAULT_SECS;	/* idempotency.naptime */

/*---- launcher state ----*/

/* Why a listed database has no worker; each reason is logged once. */
typedef enum ServedProblem
{
	SERVED_OK,
	SERVED_MISSING,				/* no such database */
	SERVED_NO_CONNECTIONS,		/* datallowconn = false, or invalid */
	SERVED_TEMPLATE,			/* a template: a worker would block CREATE
								 * DATABASE */
	SERVED_NO_SLOT,				/* max_worker_processes exhausted */
	SERVED_LOOKUP_FAILED		/* error looking it up (logged each time) */
} ServedProblem;

typedef struct ServedDatabase
{
	char		name[NAMEDATALEN];
	BackgroundWorkerHandle *handle; /* its worker, or NULL if none */
	TimestampTz last_attempt;	/* last start or lookup; 0 = never */
	ServedProblem problem;		/* last problem logged */
	bool		listed;			/* still in idempotency.database */
} ServedDatabase;

static MemoryContext launcher_cxt = NULL;
static List *served = NIL;		/* ServedDatabase *, in launcher_cxt */

/*---- maintenance worker state ----*/

static char *worker_dbname = NULL;
static bool worker_reported_missing = false;

static long
naptime_ms(void)
{
	return (long) idem_worker_naptime * 1000L;
}

/*
 * Error recovery of the launcher's and the workers' transactions, called
 * in PG_CATCH: log the error, abort the transaction, clear the error state
 * and go back to oldcxt, the caller's memory context before the
 * transaction, so that the process carries on.
 */
static void
abort_failed_transaction(MemoryContext oldcxt)
{
	HOLD_INTERRUPTS();
	MemoryContextSwitchTo(oldcxt);
	EmitErrorReport();
	AbortCurrentTransaction();
	FlushErrorState();
	RESUME_INTERRUPTS();
}

/* GUC check hook: idempotency.database must be a list of identifiers. */
static bool
check_database_list(char **newval, void **extra, GucSource source)
{
	char	   *raw = pstrdup(*newval);
	List	   *names;
	bool		ok = SplitIdentifierString(raw, ',', &names);

	list_free(names);
	pfree(raw);
	if (!ok)
	{
		GUC_check_errdetail("List syntax is invalid.");
		return false;
	}
	return true;
}

/*
 * Define the GUCs (always) and, when loaded by shared_preload_libraries,
 * register the launcher.
 */
void
idem_worker_init(void)
{
	BackgroundWorker worker;

	DefineCustomStringVariable("idempotency.database",
							   "Databases the maintenance background worker serves.",
							   "A comma-separated list of database names; empty serves none. "
							   "Needs idempotency in shared_preload_libraries.",
							   &idem_worker_databases,
							   "",
							   PGC_SIGHUP,
							   GUC_LIST_INPUT,
							   check_database_list, NULL, NULL);

	DefineCustomIntVariable("idempotency.naptime",
							"Time between maintenance rounds of the background worker.",
							NULL,
							&idem_worker_naptime,
							NAPTIME_DEFAULT_SECS, 1, NAPTIME_MAX_SECS,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	if (!process_shared_preload_libraries_in_progress)
		return;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = LAUNCHER_RESTART_SECS;
	strlcpy(worker.bgw_library_name, IDEM_LIBRARY_NAME, BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_launcher_main", BGW_MAXLEN);
	strlcpy(worker.bgw_name, LAUNCHER_TYPE, BGW_MAXLEN);
	strlcpy(worker.bgw_type, LAUNCHER_TYPE, BGW_MAXLEN);
	worker.bgw_main_arg = (Datum) 0;
	worker.bgw_notify_pid = 0;
	RegisterBackgroundWorker(&worker);
}

/*---- launcher ----*/

static ServedDatabase *
find_served(const char *name)
{
	ListCell   *lc;

	foreach(lc, served)
	{
		ServedDatabase *sd = lfirst(lc);

		if (strcmp(sd->name, name) == 0)
			return sd;
	}
	return NULL;
}

/* Bring the served list in line with idempotency.database. */
static void
launcher_sync_list(void)
{
	char	   *raw = pstrdup(idem_worker_databases ? idem_worker_databases : "");
	List	   *names;
	ListCell   *lc;
	MemoryContext oldcxt;

	if (!SplitIdentifierString(raw, ',', &names))
	{
		/* the check hook rejects this; treat as empty if it gets through */
		ereport(WARNING,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid list syntax in parameter \"%s\"", "idempotency.database")));
		names = NIL;
	}

	foreach(lc, served)
		((ServedDatabase *) lfirst(lc))->listed = false;

	oldcxt = MemoryContextSwitchTo(launcher_cxt);
	foreach(lc, names)
	{
		const char *name = lfirst(lc);
		ServedDatabase *sd = find_served(name);

		if (sd == NULL)
		{
			sd = palloc0(sizeof(ServedDatabase));
			strlcpy(sd->name, name, NAMEDATALEN);
			served = lappend(served, sd);
		}
		sd->listed = true;
	}
	MemoryContextSwitchTo(oldcxt);

	foreach(lc, served)
	{
		ServedDatabase *sd = lfirst(lc);

		if (sd->listed)
			continue;
		if (sd->handle != NULL)
		{
			ereport(LOG,
					(errmsg("stopping idempotency maintenance of database \"%s\"",
							sd->name),
					 errdetail("The database is no longer listed in idempotency.database.")));
			TerminateBackgroundWorker(sd->handle);
			pfree(sd->handle);
		}
		served = foreach_delete_current(served, lc);
		pfree(sd);
	}

	list_free(names);
	pfree(raw);
}

/* Log a problem with a listed database once, until it changes. */
static void
report_problem(ServedDatabase *sd, ServedProblem problem)
{
	if (sd->problem == problem)
		return;
	sd->problem = problem;
	switch (problem)
	{
		case SERVED_OK:
		case SERVED_LOOKUP_FAILED:
			break;
		case SERVED_MISSING:
			ereport(LOG,
					(errmsg("database \"%s\" listed in idempotency.database does not exist",
							sd->name),
					 errdetail("It is looked up again every %d s.", idem_worker_naptime)));
			break;
		case SERVED_NO_CONNECTIONS:
			ereport(LOG,
					(errmsg("database \"%s\" listed in idempotency.database does not accept connections",
							sd->name),
					 errdetail("It is looked up again every %d s.", idem_worker_naptime)));
			break;
		case SERVED_TEMPLATE:
			ereport(LOG,
					(errmsg("database \"%s\" listed in idempotency.database is a template database and is not served",
							sd->name),
					 errdetail("A connected worker would make CREATE DATABASE from this template fail.")));
			break;
		case SERVED_NO_SLOT:
			ereport(WARNING,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("could not start idempotency maintenance worker for database \"%s\"",
							sd->name),
					 errdetail("All background worker slots are in use; it is tried again every %d s.",
							   idem_worker_naptime),
					 errhint("You might need to increase max_worker_processes.")));
			break;
	}
}

/* Scan pg_database for the named database; inside a transaction. */
static Oid
scan_pg_database(const char *name, ServedProblem *problem)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;
	Oid			dboid = InvalidOid;

	*problem = SERVED_MISSING;
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);

		if (strcmp(NameStr(db->datname), name) != 0)
			continue;
#ifdef DATCONNLIMIT_INVALID_DB
		if (database_is_invalid_form(db))
			*problem = SERVED_NO_CONNECTIONS;
		else
#endif
		if (!db->datallowconn)
			*problem = SERVED_NO_CONNECTIONS;
		else if (db->datistemplate)
			*problem = SERVED_TEMPLATE;
		else
		{
			*problem = SERVED_OK;
			dboid = db->oid;
		}
		break;
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	return dboid;
}

/*
 * Look the database up in pg_database, in a transaction of its own: its
 * OID, or InvalidOid with *problem set.  An error is logged and reported
 * as SERVED_LOOKUP_FAILED, so the launcher (whose exit would take every
 * worker down) survives it and tries again a naptime later.
 */
static Oid
lookup_database(const char *name, ServedProblem *problem)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	volatile Oid dboid = InvalidOid;
	volatile ServedProblem result = SERVED_LOOKUP_FAILED;

	StartTransactionCommand();
	PG_TRY();
	{
		ServedProblem found;

		(void) GetTransactionSnapshot();
		dboid = scan_pg_database(name, &found);
		result = found;
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		abort_failed_transaction(oldcxt);
		dboid = InvalidOid;
		result = SERVED_LOOKUP_FAILED;
	}
	PG_END_TRY();
	MemoryContextSwitchTo(oldcxt);

	*problem = result;
	return dboid;
}

/* Register the dynamic maintenance worker of one database. */
static void
start_worker(ServedDatabase *sd, Oid dboid)
{
	BackgroundWorker worker;
	MemoryContext oldcxt;
	bool		ok;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;	/* the launcher restarts it */
	strlcpy(worker.bgw_library_name, IDEM_LIBRARY_NAME, BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_worker_main", BGW_MAXLEN);
	snprintf(worker.bgw_name, BGW_MAXLEN, "idempotency maintenance of database %s", sd->name);
	strlcpy(worker.bgw_type, WORKER_TYPE, BGW_MAXLEN);
	worker.bgw_main_arg = ObjectIdGetDatum(dboid);
	worker.bgw_notify_pid = MyProcPid;

	oldcxt = MemoryContextSwitchTo(launcher_cxt);
	ok = RegisterDynamicBackgroundWorker(&worker, &sd->handle);
	MemoryContextSwitchTo(oldcxt);

	if (!ok)
	{
		sd->handle = NULL;
		report_problem(sd, SERVED_NO_SLOT);
		return;
	}
	report_problem(sd, SERVED_OK);
	elog(DEBUG1, "idempotency launcher started a maintenance worker for database \"%s\"",
		 sd->name);
}

/*
 * Reap exited workers and start the ones that are due.  Returns how long
 * the launcher may sleep, in milliseconds.
 */
static long
launcher_start_workers(void)
{
	TimestampTz now = GetCurrentTimestamp();
	long		timeout = naptime_ms();
	ListCell   *lc;

	foreach(lc, served)
	{
		ServedDatabase *sd = lfirst(lc);
		TimestampTz due;
		ServedProblem problem;
		Oid			dboid;

		if (sd->handle != NULL)
		{
			pid_t		pid;

			switch (GetBackgroundWorkerPid(sd->handle, &pid))
			{
				case BGWH_STARTED:
				case BGWH_NOT_YET_STARTED:
					continue;
				case BGWH_POSTMASTER_DIED:
					proc_exit(1);
					break;
				case BGWH_STOPPED:
					elog(DEBUG1, "idempotency maintenance worker of database \"%s\" exited",
						 sd->name);
					pfree(sd->handle);
					sd->handle = NULL;
					break;
			}
		}

		/* at most one start (or lookup) per naptime */
		due = TimestampTzPlusMilliseconds(sd->last_attempt, naptime_ms());
		if (sd->last_attempt != 0 && due > now)
		{
			long		wait = TimestampDifferenceMilliseconds(now, due);

			timeout = Min(timeout, Max(wait, 1));
			continue;
		}

		sd->last_attempt = now;
		dboid = lookup_database(sd->name, &problem);
		if (OidIsValid(dboid))
			start_worker(sd, dboid);
		else
			report_problem(sd, problem);
	}
	return timeout;
}

/* before_shmem_exit callback: take the launcher's workers down with it. */
static void
launcher_on_exit(int code, Datum arg)
{
	ListCell   *lc;

	foreach(lc, served)
	{
		ServedDatabase *sd = lfirst(lc);

		if (sd->handle != NULL)
			TerminateBackgroundWorker(sd->handle);
	}
}

void
idem_launcher_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	/* no database: the launcher reads only the shared catalog pg_database */
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);

	launcher_cxt = AllocSetContextCreate(TopMemoryContext,
										 "idempotency launcher",
										 ALLOCSET_DEFAULT_SIZES);
	before_shmem_exit(launcher_on_exit, (Datum) 0);

	elog(DEBUG1, "idempotency launcher started");

	for (;;)
	{
		long		timeout;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}

		launcher_sync_list();
		timeout = launcher_start_workers();

		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 timeout,
						 PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}

/*---- maintenance worker ----*/

/* The body of a round, inside its transaction. */
static void
worker_round_body(void)
{
	int			nactions;

	if (!OidIsValid(get_extension_oid("idempotency", true)))
	{
		if (!worker_reported_missing)
			ereport(LOG,
					(errmsg("extension \"idempotency\" is not installed in database \"%s\"",
							worker_dbname),
					 errdetail("The maintenance worker checks again every %d s.",
							   idem_worker_naptime),
					 errhint("Run CREATE EXTENSION idempotency in it, or remove it from idempotency.database.")));
		worker_reported_missing = true;
		return;
	}
	if (worker_reported_missing)
		ereport(LOG,
				(errmsg("extension \"idempotency\" is now installed in database \"%s\", maintenance starts",
						worker_dbname)));
	worker_reported_missing = false;

	/* each action taken is logged; a round with nothing to do is silent */
	nactions = idem_maintain_round(LOG);
	if (nactions < 0)
		elog(DEBUG1, "idempotency maintenance round skipped: another session is maintaining database \"%s\"",
			 worker_dbname);
	else
		elog(DEBUG1, "idempotency maintenance round in database \"%s\": %d actions",
			 worker_dbname, nactions);
}

/*
 * One maintenance round in its own transaction.  An error is logged and
 * the transaction aborted; the caller carries on with the next round.
 */
static void
worker_round(void)
{
	MemoryContext oldcxt = CurrentMemoryContext;

	if (RecoveryInProgress())
	{
		elog(DEBUG1, "idempotency maintenance round skipped: recovery is in progress");
		return;
	}

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PG_TRY();
	{
		PushActiveSnapshot(GetTransactionSnapshot());
		pgstat_report_activity(STATE_RUNNING, "idempotency maintenance round");

		worker_round_body();

		PopActiveSnapshot();
		CommitTransactionCommand();
	}
	PG_CATCH();
	{
		abort_failed_transaction(oldcxt);
		ereport(LOG,
				(errmsg("idempotency maintenance round in database \"%s\" failed, retrying in %d s",
						worker_dbname, idem_worker_naptime)));
	}
	PG_END_TRY();

	MemoryContextSwitchTo(oldcxt);
	pgstat_report_stat(true);
	pgstat_report_activity(STATE_IDLE, NULL);
}

void
idem_worker_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	TimestampTz last_round = 0;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	/* FATAL if the database vanished since the launcher looked it up */
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);

	StartTransactionCommand();
	worker_dbname = get_database_name(dboid);
	worker_dbname = MemoryContextStrdup(TopMemoryContext,
										worker_dbname ? worker_dbname : "?");
	CommitTransactionCommand();

	ereport(LOG,
			(errmsg("idempotency maintenance worker started for database \"%s\"",
					worker_dbname)));

	for (;;)
	{
		TimestampTz now;
		TimestampTz due;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}

		/* the naptime is re-read each time: a reload shortens the wait */
		now = GetCurrentTimestamp();
		due = TimestampTzPlusMilliseconds(last_round, naptime_ms());
		if (last_round == 0 || due <= now)
		{
			last_round = now;
			worker_round();
			due = TimestampTzPlusMilliseconds(last_round, naptime_ms());
			now = GetCurrentTimestamp();
		}

		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Max(TimestampDifferenceMilliseconds(now, due), 1),
						 PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}
