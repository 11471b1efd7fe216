/*-------------------------------------------------------------------------
 *
 * partitions.h
 *	  The claims store's partition registry and its per-backend cache
 *	  (partitions.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_PARTITIONS_H
#define IDEM_CLAIMS_PARTITIONS_H

#include "access/transam.h"
#include "datatype/timestamp.h"

/*
 * Partitions starting this far in the future are still probed, so that a
 * claimer whose clock reads slightly behind another's sees its claims.
 */
#define IDEM_CLOCK_SKEW_USECS	USECS_PER_SEC

typedef struct IdemPartition
{
	Oid			relid;			/* partition table */
	TimestampTz lower;			/* claims made at or after ... */
	TimestampTz upper;			/* ... and before this go here */
	bool		closed;			/* no more claims will go here (sealed, or
								 * closed until the next round seals it) */
	bool		sealed;			/* closed, and its claims (in progress ones
								 * too) are summarised: filter, keep_until */
	bool		held;			/* sealed while transactions that claimed
								 * there were open: not yet counted in the
								 * scope history, not droppable */
	bool		empty;			/* sealed without a single claim */
	TimestampTz keep_until;		/* sealed: no claim in it is younger than
								 * keep_until - retention */
	int64		class_retention;	/* its retention class, microseconds; 0:
									 * the default (set->retention) */
	int64		keep_retention; /* kept at least this long (microseconds):
								 * it holds claims of scopes kept longer */
	bool		keep_default;	/* kept at least set->retention too: it
								 * holds claims of scopes that follow it */
	bool		has_filter;		/* the registry holds a Bloom filter */
	TransactionId filter_xmin;	/* names that filter (its registry row) */
	Oid			filter_source;	/* InvalidOid: the filter is in the registry;
								 * else in this table (idempotency.late_summaries,
								 * relid then being the summary's id) */
	Oid			indexid;		/* last seen (scope, key) index, a hint */
	/* where this backend found the filter (filters.c) */
	const uint8 *filter_bits;
	uint32		filter_nbits;
	uint64		filter_epoch;
	bool		filter_missing; /* not loadable now: probe instead */
	uint32		local_lookups;	/* consulted without a filter in memory */
} IdemPartition;

typedef struct IdemPartitionSet
{
	Oid			claims_relid;	/* idempotency.claims, the parent */
	Oid			registry_relid; /* idempotency.partition_registry */
	int64		retention;		/* microseconds */
	int64		interval;		/* microseconds */
	int			premake;
	uint64		generation;		/* changes whenever the set is rebuilt */
	int			nparts;
	IdemPartition *parts;		/* sorted by lower, newest first */
	int			nscopes;		/* idempotency.scope_retention (classes.c) */
	struct IdemScopeRetention *scopes;
	int			nclasses;		/* its distinct retentions, ascending */
	int64	   *classes;		/* microseconds */
} IdemPartitionSet;

extern IdemPartitionSet *idem_partition_set(void);
extern IdemPartitionSet *idem_partition_set_fresh(void);
extern IdemPartition *idem_target_partition(IdemPartitionSet *set, int64 class_retention,
											TimestampTz now, bool *covers);
extern IdemPartition *idem_class_partition(IdemPartitionSet *set, int64 class_retention,
										   TimestampTz now, bool *covers);
extern bool idem_partition_expired(IdemPartitionSet *set, IdemPartition *p,
								   TimestampTz now);
extern void idem_partitions_init(void);

#endif							/* IDEM_CLAIMS_PARTITIONS_H */
