/*-------------------------------------------------------------------------
 *
 * store.h
 *	  The stores that keep rows by time beside the claims (the outbox's
 *	  events, the inbox's messages, the requests): what tells them apart,
 *	  and the writers' cache of their partitions (store.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DELIVERY_STORE_H
#define IDEM_DELIVERY_STORE_H

#include "common/store_retention.h"	/* IdemStoreId */
#include "datatype/timestamp.h"
#include "utils/relcache.h"

/* partition buckets are 1 .. IDEM_STORE_BUCKETS; event ids carry 24 bits */
#define IDEM_STORE_BUCKETS		((1 << 24) - 1)

typedef struct StorePartition
{
	Oid			relid;
	int32		bucket;
	TimestampTz lower;
	TimestampTz upper;
} StorePartition;

/* What tells one store from another. */
typedef struct StoreDesc
{
	const char *name;			/* partition prefix, and "store" in the view */
	const char *parent;			/* the partitioned table, in IDEM_SCHEMA */
	const char *registry;		/* its partition registry, in IDEM_SCHEMA */
	const char *indexes[3];		/* CREATE INDEX statements, %s the partition */
	const char *newest;			/* time of a partition's newest row, %s it */
	const char *pinned;			/* function(regclass) -> boolean, or NULL */
	const char *keep_pinned;	/* boolean setting that lets pins count, or NULL */

	/*
	 * With pins: whether a partition holds a row of a transaction that the
	 * first check's snapshot could not see (%s the partition, $1 that
	 * snapshot's xmin), an index probe; NULL: check the pins again instead.
	 */
	const char *written_since;

	/*
	 * With pins: function(regclass, interval, timestamptz) -> setof text
	 * that detaches whoever pins a partition longer than the interval
	 * setting detach_after allows before the round's time, and names them;
	 * NULL: pins hold for ever.
	 */
	const char *detach;
	const char *detach_after;

	/*
	 * Run before a partition is dropped, holding the locks of the drop (%s
	 * the partition), after locking table before_drop_table (in
	 * IDEM_SCHEMA) RowExclusiveLock if free; NULL: nothing.  The outbox
	 * carries its aggregates' newest seqs into their counters.
	 */
	const char *before_drop;
	const char *before_drop_table;
} StoreDesc;

extern const StoreDesc idem_stores[IDEM_NSTORES];

extern StorePartition *idem_store_read_partitions(const StoreDesc *d, int *n);
extern int32 idem_store_target(IdemStoreId id, TimestampTz now, Oid *relid, Oid *parent);
extern void idem_store_forget(IdemStoreId id);
extern StorePartition *idem_store_partitions(IdemStoreId id, int *n);
extern int	idem_store_pick(const StorePartition *parts, int n, TimestampTz ts);
extern bool idem_store_newer(const StorePartition *a, const StorePartition *b);
extern Relation idem_store_open_partition(IdemStoreId id, Oid relid,
										  const char *const *columns, int ncolumns);
extern Relation idem_store_open_target(IdemStoreId id, TimestampTz ts, int32 *bucket,
									   const char *const *columns, int ncolumns);
extern void idem_store_init(void);

#endif							/* IDEM_DELIVERY_STORE_H */
