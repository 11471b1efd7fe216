/*-------------------------------------------------------------------------
 *
 * groups.h
 *	  Filter groups: one Bloom filter over the keys of up to
 *	  IDEM_GROUP_MAX_MEMBERS sealed claims partitions (groups.c), so that a
 *	  new key costs one filter test per group, not one per partition.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_GROUPS_H
#define IDEM_CLAIMS_GROUPS_H

#include "claims/partitions.h"

#define IDEM_GROUP_MAX_MEMBERS	16
#define IDEM_GROUP_BITS_PER_KEY	10
#define IDEM_GROUP_MIN_CAPACITY	1024
/* a group's filter takes at most this share of idempotency.local_filter_memory */
#define IDEM_GROUP_BUDGET_SHARE	4

extern int	idem_groups_candidates(IdemPartitionSet *set, uint64 hash, const int **idx);
extern void idem_groups_add(Oid relid, const uint64 *hashes, int64 n);
extern int	idem_groups_expire(void);
extern void idem_groups_init(void);

#endif							/* IDEM_CLAIMS_GROUPS_H */
