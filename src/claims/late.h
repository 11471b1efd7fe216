/*-------------------------------------------------------------------------
 *
 * late.h
 *	  Late duplicates: summaries of dropped claims partitions, the check a
 *	  new claim makes against them, and the policy (late.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_LATE_H
#define IDEM_CLAIMS_LATE_H

#include "datatype/timestamp.h"
#include "utils/relcache.h"

/*
 * Bits per key a summary is sized for; it sets IDEM_SUMMARY_HASHES bits a
 * key (filters.h).  doc/claims.md, "Late duplicates", has the
 * false-positive arithmetic.
 */
#define IDEM_LATE_BITS_PER_KEY	20
/* Fewest keys a summary is sized for. */
#define IDEM_LATE_MIN_CAPACITY	1024
/*
 * The window is cut into this many buckets; a bucket's drops share
 * summaries.  Fewer buckets: fewer summaries for a new key to test (3 in a
 * steady state), kept up to a bucket (half a window) longer.
 */
#define IDEM_LATE_BUCKETS		2
/* Most summaries kept; beyond, the oldest go first (the window shortens). */
#define IDEM_LATE_MAX_SUMMARIES	16

/* idempotency.late_duplicate_policy */
typedef enum IdemLatePolicy
{
	IDEM_LATE_COUNT,
	IDEM_LATE_WARN,
	IDEM_LATE_ERROR
} IdemLatePolicy;

/* Where a key probably was before: when its claim's retention ended. */
typedef struct IdemLateMatch
{
	TimestampTz expired_from;
	TimestampTz expired_to;
} IdemLateMatch;

extern bool idem_late_lookup(uint64 hash, TimestampTz now, IdemLateMatch *m);
extern bool idem_late_refuses(void);
extern void idem_late_refuse(text *scope, text *key, const IdemLateMatch *m) pg_attribute_noreturn();
extern void idem_late_claimed(text *scope, text *key, const IdemLateMatch *m);

/* for maintenance (connected to SPI, holding the maintenance lock) */
extern void idem_late_fold(Relation part, TimestampTz expired_from, TimestampTz expired_to,
						   TimestampTz now);
extern int	idem_late_expire(TimestampTz now);

extern void idem_late_init(void);

#endif							/* IDEM_CLAIMS_LATE_H */
