/*-------------------------------------------------------------------------
 *
 * filters.h
 *	  Bloom filters of sealed claims partitions, in shared or backend
 *	  memory (filters.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_FILTERS_H
#define IDEM_CLAIMS_FILTERS_H

#include "claims/partitions.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"

#define IDEM_BLOOM_HASHES		7		/* partitions' filters */
#define IDEM_SUMMARY_HASHES		10		/* summaries' (late.c) */
#define IDEM_BLOOM_BITS_PER_KEY	10
#define IDEM_BLOOM_BLOCK_BITS	512		/* one cache line; sizes are multiples */

/* what idem_filter_build() learned about a partition while scanning it */
typedef struct IdemSealInfo
{
	int64		nkeys;
	TimestampTz max_claimed_at; /* DT_NOBEGIN when empty */
	int			nholders;		/* transactions whose claims there are not
								 * visible yet (see idem_filter_build) */
	FullTransactionId *holders; /* their top-level ids */
	uint64	   *hashes;			/* the keys' hashes (nkeys of them), for groups.c */
} IdemSealInfo;

extern bytea *idem_filter_build(Relation rel, Snapshot visible, IdemSealInfo *info);
extern bool idem_filter_maybe(IdemPartitionSet *set, IdemPartition *p, uint64 hash);
extern void idem_filter_prefetch(IdemPartition *p, uint64 hash);
extern void idem_filters_forget_others(IdemPartitionSet *set);
extern bytea *idem_filter_new(int64 *capacity, int64 n, int bits_per_key);
extern bool idem_filter_add_hashes(bytea *stored, const uint64 *hashes, int64 n);
extern bool idem_filter_summary_maybe(IdemPartition *p, uint64 hash);
extern bool idem_filter_summary_excludes(IdemPartition *p, uint64 hash);
extern Size idem_filter_local_budget(void);
extern uint32 idem_filter_stored_nbits(Datum raw);
typedef void (*IdemSummariesReader) (Relation rel, Snapshot snap, MemoryContext cxt);
extern bool idem_summaries_read(Oid relid, MemoryContext cxt, const uint64 *invals,
								IdemSummariesReader read);
extern void idem_filters_forget_unlisted(Oid source, IdemPartition *parts, int nparts,
										 bool shared);
extern void idem_filters_init(void);

#endif							/* IDEM_CLAIMS_FILTERS_H */
