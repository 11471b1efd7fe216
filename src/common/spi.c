/*-------------------------------------------------------------------------
 *
 * spi.c
 *	  Running the extension's own SQL: the fixed statements a subsystem
 *	  prepares once per backend (IdemStatement), one-off statements, and
 *	  search_path pinned while either runs.
 *
 * Locking rules: none of its own; a statement takes what it takes.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/spi.h"

#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "utils/guc.h"
#include "utils/memutils.h"

/*
 * Pin search_path to pg_catalog while preparing or running internal SQL
 * (maintenance often runs as a superuser): no operator or function a user
 * put on the path can stand in for the built-in ones.  Returns the GUC nest
 * level to undo with AtEOXact_GUC(true, level).
 */
int
idem_pin_search_path(void)
{
	int			nestlevel = NewGUCNestLevel();

	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	return nestlevel;
}

/*
 * The plan of one of a subsystem's fixed statements, prepared on first use
 * with search_path pinned and kept for the backend's life in *slot.  The
 * plan cache parses it again if it is run under another search_path (the
 * caller's), which is why the statements name every table with its schema;
 * callers that run as someone else (maintenance) or that must not see the
 * caller's operators pin search_path around the run as well.
 * Generic plans: each statement is an index probe or an ordered index scan
 * whatever the arguments, and planning each call would cost more than the
 * work.  The caller is connected to SPI.
 */
SPIPlanPtr
idem_statement_plan(const IdemStatement *st, SPIPlanPtr *slot)
{
	if (*slot == NULL)
	{
		int			nestlevel = idem_pin_search_path();
		SPIPlanPtr	plan;

		plan = SPI_prepare_cursor(st->sql, st->nargs, (Oid *) st->argtypes,
								  CURSOR_OPT_GENERIC_PLAN);
		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed (%s): %s",
				 SPI_result_code_string(SPI_result), st->sql);
		AtEOXact_GUC(true, nestlevel);
		SPI_keepplan(plan);
		*slot = plan;
	}
	return *slot;
}

/*
 * Rethrow the error being handled without our SQL text: no message or
 * CONTEXT a user sees contains the internal statements (a lock timeout, a
 * read-only transaction, a cancel would otherwise print SPI's "SQL
 * statement ..." line).  cxt: the memory context to copy the error into.
 */
void
idem_rethrow_without_sql(MemoryContext cxt, const char *sql)
{
	ErrorData  *edata;

	MemoryContextSwitchTo(cxt);
	edata = CopyErrorData();
	FlushErrorState();
	if (edata->context != NULL)
	{
		char	   *line = psprintf("SQL statement \"%s\"", sql);
		char	   *at = strstr(edata->context, line);

		if (at != NULL)
		{
			StringInfoData buf;
			char	   *rest = at + strlen(line);

			if (*rest == '\n')
				rest++;
			initStringInfo(&buf);
			appendBinaryStringInfo(&buf, edata->context, at - edata->context);
			appendStringInfoString(&buf, rest);
			while (buf.len > 0 && buf.data[buf.len - 1] == '\n')
				buf.data[--buf.len] = '\0';
			edata->context = buf.len > 0 ? buf.data : NULL;
		}
	}
	edata->internalquery = NULL;
	edata->internalpos = 0;
	ReThrowError(edata);
}

/*
 * Run one of those statements; nulls as SPI wants them (' ' or 'n'), NULL
 * for none.  Errors out unless SPI returns "expected"; returns the number
 * of rows processed.  An error inside does not show the statement.
 */
uint64
idem_statement_exec(const IdemStatement *st, SPIPlanPtr *slot, Datum *values,
					const char *nulls, int expected)
{
	MemoryContext cxt = CurrentMemoryContext;
	volatile int rc = 0;

	PG_TRY();
	{
		rc = SPI_execute_plan(idem_statement_plan(st, slot), values, nulls, false, 0);
	}
	PG_CATCH();
	{
		idem_rethrow_without_sql(cxt, st->sql);
	}
	PG_END_TRY();
	if (rc != expected)
		elog(ERROR, "SPI_execute_plan failed (%s): %s", SPI_result_code_string(rc), st->sql);
	return SPI_processed;
}

/* Column col (from 1) of row "row" of the last SPI result. */
Datum
idem_spi_col(uint64 row, int col, bool *isnull)
{
	return SPI_getbinval(SPI_tuptable->vals[row], SPI_tuptable->tupdesc, col, isnull);
}

/* Run one utility or DML statement through SPI, with arguments. */
void
idem_spi_exec(const char *sql, int nargs, Oid *types, Datum *values, int expected)
{
	int			rc = SPI_execute_with_args(sql, nargs, types, values, NULL, false, 0);

	if (rc != expected)
		elog(ERROR, "SPI_execute_with_args failed (%d): %s", rc, sql);
}
