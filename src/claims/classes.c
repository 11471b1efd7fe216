/*-------------------------------------------------------------------------
 *
 * classes.c
 *	  Retention per scope: which retention class a scope's claims go into,
 *	  and how long a partition is kept.
 *
 * idempotency.scope_retention names scopes ('webhooks:stripe') and scope
 * prefixes ('webhooks:*') whose claims are kept for a retention of their
 * own.  Every distinct retention there is a class: maintenance keeps a
 * series of partitions for each (partition_registry.retention; NULL is the
 * default class, which follows idem_configure()), and a claim goes into the
 * series of its scope's class, so a short class is reclaimed by dropping
 * its own partitions, early, and a long one keeps only its own claims.
 *
 * A claim is never dropped before its scope's retention, whatever class it
 * went into: a claimer with a stale cache can put a claim into the class
 * its scope had before, and a scope's retention can be raised after its
 * claims were made.  So a partition is kept for the longest of its class's
 * retention and keep_retention, which the seal sets from the scopes it
 * counts there (claim_partitions.c) and idem_configure_scope() raises on
 * the sealed partitions that hold claims of the scope.  Probes look in
 * every class (claims.c), so a scope whose class changed finds its older
 * claims where they are.
 *
 * Locking rules: the table is read with the partition registry, under the
 * same locks and snapshot (partitions.c), so a claimer's classes and
 * partitions always come from one moment; nothing here takes a lock.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/classes.h"
#include "common/args.h"
#include "common/catalog.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/tableam.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

/* Column numbers of idempotency.scope_retention. */
#define Anum_scope_retention_scope		1
#define Anum_scope_retention_retention	2

static int
class_ascending(const void *a, const void *b)
{
	int64		x = *(const int64 *) a;
	int64		y = *(const int64 *) b;

	return x < y ? -1 : (x > y ? 1 : 0);
}

/* Add a retention to the set's classes unless it is one already (the caller made room). */
static void
add_class(IdemPartitionSet *set, int64 retention)
{
	for (int i = 0; i < set->nclasses; i++)
		if (set->classes[i] == retention)
			return;
	set->classes[set->nclasses++] = retention;
}

/*
 * Read idempotency.scope_retention into set (allocating in the current
 * memory context): its patterns, and its distinct retentions, ascending.
 */
void
idem_scope_retentions_read(Relation rel, Snapshot snap, IdemPartitionSet *set)
{
	TupleDesc	desc = RelationGetDescr(rel);
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	HeapTuple	tup;
	int			cap = 0;

	set->nscopes = 0;
	set->nclasses = 0;
	set->scopes = NULL;
	set->classes = NULL;
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		text	   *scope = DatumGetTextPP(heap_getattr(tup, Anum_scope_retention_scope, desc, &isnull));
		Interval   *iv = DatumGetIntervalP(heap_getattr(tup, Anum_scope_retention_retention, desc, &isnull));
		IdemScopeRetention *r;

		if (set->nscopes == cap)
		{
			cap = Max(cap * 2, 8);
			set->scopes = set->scopes == NULL ? palloc(cap * sizeof(IdemScopeRetention)) :
				repalloc(set->scopes, cap * sizeof(IdemScopeRetention));
			set->classes = set->classes == NULL ? palloc(cap * sizeof(int64)) :
				repalloc(set->classes, cap * sizeof(int64));
		}
		r = &set->scopes[set->nscopes++];
		r->len = VARSIZE_ANY_EXHDR(scope);
		r->scope = pnstrdup(VARDATA_ANY(scope), r->len);
		r->prefix = r->len > 0 && r->scope[r->len - 1] == '*';
		if (r->prefix)
			r->scope[--r->len] = '\0';
		r->retention = idem_interval_seconds(iv) * USECS_PER_SEC;
		add_class(set, r->retention);
	}
	table_endscan(scan);
	if (set->nclasses > 1)
		qsort(set->classes, set->nclasses, sizeof(int64), class_ascending);
}

/*
 * Add a prefix pattern (without its '*') of a retention in microseconds,
 * unless the table has a row for the same prefix: the dedup claims of the
 * inbox and of the requests follow their store's retention, unless a row
 * of idempotency.scope_retention says otherwise.
 */
void
idem_scope_retention_add(IdemPartitionSet *set, const char *prefix, int64 retention)
{
	int			len = strlen(prefix);
	IdemScopeRetention *r;

	for (int i = 0; i < set->nscopes; i++)
		if (set->scopes[i].prefix && set->scopes[i].len == len &&
			memcmp(set->scopes[i].scope, prefix, len) == 0)
			return;
	set->scopes = set->scopes == NULL ? palloc(sizeof(IdemScopeRetention)) :
		repalloc(set->scopes, (set->nscopes + 1) * sizeof(IdemScopeRetention));
	set->classes = set->classes == NULL ? palloc(sizeof(int64)) :
		repalloc(set->classes, (set->nclasses + 1) * sizeof(int64));
	r = &set->scopes[set->nscopes++];
	r->scope = pstrdup(prefix);
	r->len = len;
	r->prefix = true;
	r->retention = retention;
	add_class(set, retention);
	qsort(set->classes, set->nclasses, sizeof(int64), class_ascending);
}

/*
 * The retention class of a scope's new claims, in microseconds (0: the
 * default class): the scope's own row, else its longest prefix's.
 */
int64
idem_scope_class(const IdemPartitionSet *set, const char *scope, int len)
{
	int64		best = 0;
	int			best_len = -1;

	for (int i = 0; i < set->nscopes; i++)
	{
		const IdemScopeRetention *r = &set->scopes[i];

		if (!r->prefix)
		{
			if (r->len == len && memcmp(r->scope, scope, len) == 0)
				return r->retention;
		}
		else if (r->len > best_len && r->len <= len && memcmp(r->scope, scope, r->len) == 0)
		{
			best = r->retention;
			best_len = r->len;
		}
	}
	return best;
}

/*
 * The retention class the scopes a pattern names are in, in microseconds
 * (0: the default class): a scope's as idem_scope_class() finds it; for a
 * prefix, the class of its longest prefix pattern no longer than it, which
 * every scope it covers falls into unless a longer pattern covers that
 * scope (whose claims were never the prefix's).
 */
int64
idem_pattern_class(const IdemPartitionSet *set, const char *pattern)
{
	int			len = strlen(pattern);
	int64		best = 0;
	int			best_len = -1;

	if (len == 0 || pattern[len - 1] != '*')
		return idem_scope_class(set, pattern, len);
	len--;
	for (int i = 0; i < set->nscopes; i++)
	{
		const IdemScopeRetention *r = &set->scopes[i];

		if (r->prefix && r->len > best_len && r->len <= len &&
			memcmp(r->scope, pattern, r->len) == 0)
		{
			best = r->retention;
			best_len = r->len;
		}
	}
	return best;
}

/*
 * How long after its newest claim (or its upper bound) a partition is kept,
 * in microseconds: its class's retention, or longer if it holds claims of
 * scopes kept longer (keep_retention, and the default's if they follow it).
 */
int64
idem_partition_retention(const IdemPartitionSet *set, const IdemPartition *p)
{
	int64		r = p->class_retention > 0 ? p->class_retention : set->retention;

	if (p->keep_default)
		r = Max(r, set->retention);
	return Max(r, p->keep_retention);
}

/*
 * Error out unless a pattern is a scope or a prefix ending in one '*', of at
 * most IDEM_MAX_SCOPE_BYTES before the '*'.  The table's CHECK says the
 * shape too; this says it with a hint, before any write.
 */
void
idem_scope_pattern_check(const char *pattern)
{
	int			len = strlen(pattern);
	const char *star = strchr(pattern, '*');

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope must not be empty")));
	if (star != NULL && star != pattern + len - 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope pattern \"%s\" may only have \"*\" at its end", pattern),
				 errhint("Name one scope, or a prefix followed by \"*\".")));
	if (len == 1 && star != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope pattern \"*\" would cover every scope"),
				 errhint("Set the retention of every scope with idem_configure().")));
	/* a prefix is as long as a scope may be, and its '*' comes on top */
	if (len - (star != NULL) > IDEM_MAX_SCOPE_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("scope must be at most %d bytes", IDEM_MAX_SCOPE_BYTES)));
}
