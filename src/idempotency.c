/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Entry point of the idempotency extension: _PG_init hands off to each
 *	  wing's init function, then reserves the settings' prefix (so that a
 *	  misspelt idempotency.* setting is an error, not a silent placeholder).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "claims/filters.h"
#include "claims/groups.h"
#include "claims/late.h"
#include "claims/partitions.h"
#include "common/clock.h"
#include "delivery/delivery.h"
#include "delivery/store.h"
#include "guards/guards.h"
#include "maintenance/maintenance.h"
#include "stats/stats.h"
#include "utils/guc.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

void
_PG_init(void)
{
	idem_clock_init();
	idem_partitions_init();
	idem_filters_init();
	idem_late_init();
	idem_groups_init();
	idem_stats_init();
	idem_guards_init();
	idem_guard_helpers_init();
	idem_store_init();
	idem_outbox_init();
	idem_inbox_init();
	idem_worker_init();
	MarkGUCPrefixReserved("idempotency");
}
