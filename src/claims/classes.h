/*-------------------------------------------------------------------------
 *
 * classes.h
 *	  Retention per scope: the patterns of idempotency.scope_retention,
 *	  the retention class of a scope, a partition's retention (classes.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_CLASSES_H
#define IDEM_CLAIMS_CLASSES_H

#include "claims/partitions.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"

/*
 * At most this many patterns, and this many distinct retentions among them:
 * each class is a series of partitions that a new key's claim probes the
 * unsealed ones of (one index probe each), and its live partitions count
 * toward IDEM_MAX_LIVE_PARTITIONS.
 */
#define IDEM_MAX_SCOPE_PATTERNS		100
#define IDEM_MAX_RETENTION_CLASSES	8

/* A row of idempotency.scope_retention, as a claimer matches it. */
typedef struct IdemScopeRetention
{
	char	   *scope;			/* the scope, or the prefix without its '*' */
	int			len;
	bool		prefix;			/* 'prefix*': every scope that starts so */
	int64		retention;		/* microseconds */
} IdemScopeRetention;

extern void idem_scope_retentions_read(Relation rel, Snapshot snap, IdemPartitionSet *set);
extern void idem_scope_retention_add(IdemPartitionSet *set, const char *prefix,
									 int64 retention);
extern int64 idem_scope_class(const IdemPartitionSet *set, const char *scope, int len);
extern int64 idem_pattern_class(const IdemPartitionSet *set, const char *pattern);
extern int64 idem_partition_retention(const IdemPartitionSet *set, const IdemPartition *p);
extern void idem_scope_pattern_check(const char *pattern);

#endif							/* IDEM_CLAIMS_CLASSES_H */
