/*-------------------------------------------------------------------------
 *
 * settings.h
 *	  The claims store's settings and their defaults and bounds, written
 *	  down here only: the SQL objects ask idempotency.current_settings(),
 *	  and messages print these (settings.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_SETTINGS_H
#define IDEM_CLAIMS_SETTINGS_H

#include "datatype/timestamp.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"

/* Settings: in seconds, and as stored (intervals are kept as given). */
typedef struct IdemSettings
{
	int64		retention;
	int64		interval;
	int			premake;
	Interval	retention_iv;
	Interval	interval_iv;
} IdemSettings;

#define IDEM_DEFAULT_RETENTION_SECS	(7 * SECS_PER_DAY)
#define IDEM_DEFAULT_INTERVAL_SECS	SECS_PER_DAY
#define IDEM_DEFAULT_PREMAKE		4
#define IDEM_MAX_PREMAKE			1000
#define IDEM_MAX_INTERVAL_YEARS		10
#define IDEM_MAX_RETENTION_YEARS	100
#define IDEM_MAX_INTERVAL_SECS		((int64) IDEM_MAX_INTERVAL_YEARS * DAYS_PER_YEAR * SECS_PER_DAY)
#define IDEM_MAX_RETENTION_SECS		((int64) IDEM_MAX_RETENTION_YEARS * DAYS_PER_YEAR * SECS_PER_DAY)

/*
 * Most partitions a configuration may keep live (retention / interval +
 * premake + 1): a claim tests one filter per group of sealed partitions
 * (groups.c), so its cost still grows with them, slowly; beside 400 the
 * extension's share of a new key's claim is about twice its share beside 8
 * (doc/benchmarks.md, "Many sealed partitions").
 */
#define IDEM_MAX_LIVE_PARTITIONS	400

extern IdemSettings idem_read_settings(Snapshot snap);
extern IdemSettings idem_settings_from_scan(Relation rel, Snapshot snap);
extern void idem_validate_settings(const IdemSettings *s, const int64 *classes, int nclasses);

#endif							/* IDEM_CLAIMS_SETTINGS_H */
