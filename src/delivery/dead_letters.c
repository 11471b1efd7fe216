/*-------------------------------------------------------------------------
 *
 * dead_letters.c
 *	  The dead letters an operator may see: idem_outbox_dead() and
 *	  idem_inbox_dead(), the rows of the views idempotency.outbox_dead and
 *	  idempotency.inbox_dead that the caller's operator capability covers
 *	  (its aggregate types and subscriptions, or its sources).
 *
 * The views are for the extension's owner and pg_monitor; an operator
 * needs the ids of dead letters to redrive, discard or replay them, and
 * no right on our schema, so it reads them here: the capability is
 * checked first, then the view is read as the extension's owner and rows
 * outside the caller's limits are left out.
 *
 * Locking rules: AccessShareLock on the view's tables, through SPI, to the
 * end of the transaction; nothing else.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/capabilities.h"
#include "common/ownership.h"

#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(idem_outbox_dead);
PG_FUNCTION_INFO_V1(idem_inbox_dead);

/* Does g allow the text column attno of tup (a row of SPI_tuptable) on axis? */
static bool
allowed(const IdemCapGrants *g, HeapTuple tup, IdemCapAxis axis, int attno)
{
	bool		isnull;
	Datum		name = SPI_getbinval(tup, SPI_tuptable->tupdesc, attno, &isnull);

	return !isnull && idem_capability_allows(g, axis, TextDatumGetCString(name));
}

/*
 * Put into the result the rows of "sql" (a fixed query of one of our
 * views) whose text column "attno" the caller's operator capability allows
 * on "axis", and column "attno2" on "axis2" (attno2 0: no second axis).
 */
static void
dead_letters(FunctionCallInfo fcinfo, const char *fname, const char *sql,
			 IdemCapAxis axis, int attno, IdemCapAxis axis2, int attno2)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	const IdemCapGrants *g = idem_capability_require_any(fname, IDEM_CAP_OPERATOR);
	IdemAsOwner as;

	InitMaterializedSRF(fcinfo, 0);
	idem_spi_connect_as_owner(&as);
	if (SPI_execute(sql, true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the dead letters for %s", fname);
	for (uint64 r = 0; r < SPI_processed; r++)
	{
		HeapTuple	tup = SPI_tuptable->vals[r];

		if (!allowed(g, tup, axis, attno) || (attno2 > 0 && !allowed(g, tup, axis2, attno2)))
			continue;
		tuplestore_puttuple(rsinfo->setResult, tup);
	}
	idem_spi_finish_as_owner(&as);
}

/* idem_outbox_dead(): dead outbox events of the caller's aggregate types */
Datum
idem_outbox_dead(PG_FUNCTION_ARGS)
{
	/* the view's second column is aggregate_type, its twelfth subscription */
	dead_letters(fcinfo, "idem_outbox_dead",
				 "SELECT * FROM idempotency.outbox_dead ORDER BY dead_at, id",
				 IDEM_AXIS_TYPE, 2, IDEM_AXIS_SUBSCRIPTION, 12);
	return (Datum) 0;
}

/* idem_inbox_dead(): dead inbox messages of the caller's sources */
Datum
idem_inbox_dead(PG_FUNCTION_ARGS)
{
	/* the view's second column is source */
	dead_letters(fcinfo, "idem_inbox_dead",
				 "SELECT * FROM idempotency.inbox_dead ORDER BY dead_at, id",
				 IDEM_AXIS_SOURCE, 2, IDEM_AXIS_SOURCE, 0);
	return (Datum) 0;
}
