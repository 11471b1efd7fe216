/*-------------------------------------------------------------------------
 *
 * store_settings.h
 *	  Each store's own retention: idem_configure_store(), its validation
 *	  (which idem_configure() runs as well) and what a round uses
 *	  (store_settings.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_MAINTENANCE_STORE_SETTINGS_H
#define IDEM_MAINTENANCE_STORE_SETTINGS_H

#include "claims/settings.h"
#include "common/store_retention.h"

extern void idem_validate_store_settings(const IdemSettings *s);
extern void idem_store_retentions(const IdemSettings *s, Snapshot snap,
								  int64 out[IDEM_NSTORES]);

#endif							/* IDEM_MAINTENANCE_STORE_SETTINGS_H */
