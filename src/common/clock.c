/*-------------------------------------------------------------------------
 *
 * clock.c
 *	  The extension's clock (idem_now()) and the test-only injection point
 *	  (idem_debug_wait()), with the two test settings behind them.
 *
 * Locking rules: idem_debug_wait() waits for advisory lock 7370 only when
 * idempotency.debug_wait_point names its point (tests only).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/clock.h"

#include <limits.h>

#include "miscadmin.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "utils/guc.h"
#include "utils/timestamp.h"

/*---- GUC variables ----*/

/* testing only: shifts the extension's clock (seconds) */
static int	idem_debug_clock_offset = 0;

/* testing only: name of a point where the code pauses (see idem_debug_wait) */
static char *idem_debug_wait_point = NULL;

void
idem_clock_init(void)
{
	DefineCustomIntVariable("idempotency.debug_clock_offset",
							"Shifts the clock of claims and maintenance (for tests only).",
							NULL,
							&idem_debug_clock_offset,
							0, INT_MIN, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S | GUC_NOT_IN_SAMPLE,
							NULL, NULL, NULL);
	DefineCustomStringVariable("idempotency.debug_wait_point",
							   "Names a point where the extension waits for advisory lock 7370 (for tests only).",
							   NULL,
							   &idem_debug_wait_point,
							   "",
							   PGC_SUSET,
							   GUC_NOT_IN_SAMPLE,
							   NULL, NULL, NULL);
}

/* The extension's clock: the wall clock, shifted in tests. */
TimestampTz
idem_now(void)
{
	return GetCurrentTimestamp() + (int64) idem_debug_clock_offset * USECS_PER_SEC;
}

/*
 * Injection point for isolation tests: when idempotency.debug_wait_point
 * names this point, wait until no other session holds advisory lock 7370
 * (pg_advisory_lock(7370)), so a test can hold this backend here while
 * another session commits something.
 */
void
idem_debug_wait(const char *point)
{
	LOCKTAG		tag;

	if (idem_debug_wait_point == NULL || strcmp(idem_debug_wait_point, point) != 0)
		return;
	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, 0, 7370, 1);
	(void) LockAcquire(&tag, ShareLock, false, false);
	LockRelease(&tag, ShareLock, false);
}
