/*-------------------------------------------------------------------------
 *
 * stats.h
 *	  The counters behind idempotency.stats (stats.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STATS_STATS_H
#define IDEM_STATS_STATS_H

/* in the column order of idempotency.stats_counters() */
typedef enum IdemStatCounter
{
	IDEM_STAT_CLAIMS,
	IDEM_STAT_DUPLICATES,
	IDEM_STAT_PAYLOAD_MISMATCHES,
	IDEM_STAT_RELEASES,
	IDEM_STAT_STALE_SKIPS,
	IDEM_STAT_INVALID_TRANSITIONS,
	IDEM_STAT_REQUESTS_STARTED,
	IDEM_STAT_REQUESTS_COMPLETED,
	IDEM_STAT_REQUESTS_CONFLICTED,
	IDEM_STAT_LATE_DUPLICATES,
	IDEM_STAT_NCOUNTERS
} IdemStatCounter;

extern void idem_stats_count_scope(text *scope, IdemStatCounter counter, int64 n);
extern void idem_stats_count_scope_now(text *scope, IdemStatCounter counter, int64 n);
extern void idem_stats_count_relation(Oid relid, IdemStatCounter counter);
extern void idem_stats_maintained(void);
extern void idem_stats_init(void);

#endif							/* IDEM_STATS_STATS_H */
