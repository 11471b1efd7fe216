/*-------------------------------------------------------------------------
 *
 * maintenance.h
 *	  Maintenance rounds for callers outside SQL, and the background worker
 *	  (maintenance.c, worker.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_MAINTENANCE_MAINTENANCE_H
#define IDEM_MAINTENANCE_MAINTENANCE_H

#include "fmgr.h"

extern int	idem_maintain_round(int elevel);
extern void idem_maintenance_lock_wait(void);
extern void idem_validate_claim_classes(void);
extern void idem_worker_init(void);
extern PGDLLEXPORT void idem_launcher_main(Datum main_arg);
extern PGDLLEXPORT void idem_worker_main(Datum main_arg);

#endif							/* IDEM_MAINTENANCE_MAINTENANCE_H */
