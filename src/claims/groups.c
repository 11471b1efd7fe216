/*-------------------------------------------------------------------------
 *
 * groups.c
 *	  Filter groups: when maintenance seals a claims partition, the hashes
 *	  of its keys go into the Bloom filter of a group of up to
 *	  IDEM_GROUP_MAX_MEMBERS sealed partitions as well as into its own
 *	  filter; a claim tests each group first, and a group whose filter rules
 *	  the key out spares the tests of all its members.  So a new key costs
 *	  about one filter test per group, not one per sealed partition.
 *
 * Groups are rows of idempotency.filter_groups (so they survive restarts
 * and dumps): the members (the partitions whose keys were added), the keys
 * added and the capacity the filter was sized for, and the filter, of the
 * summaries' kind (filters.c).  A seal adds to the newest group while it
 * has fewer than IDEM_GROUP_MAX_MEMBERS members and room for the keys,
 * else starts one sized for IDEM_GROUP_MAX_MEMBERS partitions like this
 * one.  A group is deleted once none of its members is in the registry.
 * Sizes and the false-positive rate: doc/claims.md, "Filter groups".
 *
 * Why it is safe: a group lists exactly the partitions whose keys it holds,
 * written in the transaction that seals the last of them, and a sealed
 * partition takes no more claims; so "not in the group" is "in none of its
 * members".  A backend whose list of groups is older than its partition
 * list does not know a member yet and tests that partition alone; one
 * whose list is newer skips only partitions its set shows sealed.  A group
 * whose filter is damaged or not in memory rules nothing out.
 *
 * Locking rules: the per-backend list is dropped by a relcache
 * invalidation of idempotency.filter_groups (the statement trigger
 * partition_cache_invalidate() sends it at the writer's commit), noted
 * before the build reads the table under AccessShareLock; an invalidation
 * during the build restarts it.  Only maintenance writes the table, under
 * its round's lock, in the transactions that seal and drop partitions.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/groups.h"
#include "common/catalog.h"
#include "common/spi.h"
#include "claims/filters.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

/* One group as this backend knows it. */
typedef struct FilterGroup
{
	IdemPartition filter;		/* its filter: relid is the group's id */
	int			nmembers;
	Oid		   *members;
	int			nidx;			/* members found sealed in the mapped set ... */
	int		   *idx;			/* ... at these positions of set->parts */
} FilterGroup;

/*---- the per-backend list ----*/
static MemoryContext groups_cxt = NULL;
static bool groups_valid = false;
static Oid	groups_relid = InvalidOid;
static uint64 groups_invals = 0;
static int	groups_n = 0;
static FilterGroup *groups = NULL;

/* the partition set the members were mapped to (its generation) */
static bool groups_mapped = false;
static uint64 mapped_generation = 0;

/* sealed partitions of that set with claims that no group holds */
static int	loose_n = 0;
static int *loose = NULL;

/* what idem_groups_candidates() returns: positions in set->parts */
static int *candidates = NULL;
static int	candidates_cap = 0;

static void
groups_cache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == groups_relid)
	{
		groups_valid = false;
		groups_invals++;
	}
}

/* The table, or InvalidOid (a database still at version 1.0). */
static Oid
filter_groups_relid(void)
{
	return get_relname_relid("filter_groups", idem_schema_oid());
}

/* The groups in snap, newest first, into cxt; *out (n of them). */
static int
read_groups(Relation rel, Snapshot snap, MemoryContext cxt, FilterGroup **out)
{
	TupleDesc	desc = RelationGetDescr(rel);
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	HeapTuple	tup;
	int			n = 0;
	int			cap = 16;
	FilterGroup *g = MemoryContextAllocZero(cxt, cap * sizeof(FilterGroup));

	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Oid			id = (Oid) DatumGetInt32(heap_getattr(tup, Anum_group_id, desc, &isnull));
		Datum		members = heap_getattr(tup, Anum_group_members, desc, &isnull);
		ArrayType  *arr;
		Datum	   *elems;
		int			nelems;
		int			at;
		MemoryContext old;

		if (n == cap)
		{
			cap *= 2;
			g = repalloc(g, cap * sizeof(FilterGroup));
		}
		/* insertion sort by id, newest (highest) first */
		for (at = n; at > 0 && g[at - 1].filter.relid < id; at--)
			g[at] = g[at - 1];
		memset(&g[at], 0, sizeof(FilterGroup));
		g[at].filter.relid = id;
		g[at].filter.filter_xmin = HeapTupleHeaderGetRawXmin(tup->t_data);
		g[at].filter.filter_source = RelationGetRelid(rel);
		g[at].filter.has_filter = true;
		g[at].filter.sealed = true;
		old = MemoryContextSwitchTo(cxt);
		arr = DatumGetArrayTypeP(members);
		deconstruct_array(arr, REGCLASSOID, sizeof(Oid), true, TYPALIGN_INT, &elems, NULL, &nelems);
		g[at].members = palloc(Max(nelems, 1) * sizeof(Oid));
		for (int i = 0; i < nelems; i++)
			g[at].members[i] = DatumGetObjectId(elems[i]);
		g[at].nmembers = nelems;
		MemoryContextSwitchTo(old);
		n++;
	}
	table_endscan(scan);
	*out = g;
	return n;
}

/* The filters of the groups, for idem_filters_forget_unlisted(). */
static IdemPartition *
group_filters(FilterGroup *g, int n)
{
	IdemPartition *parts = palloc(Max(n, 1) * sizeof(IdemPartition));

	for (int i = 0; i < n; i++)
		parts[i] = g[i].filter;
	return parts;
}

static void
groups_read(Relation rel, Snapshot snap, MemoryContext cxt)
{
	groups_n = read_groups(rel, snap, cxt, &groups);
}

/* (Re)build this backend's list of groups. */
static void
groups_build(void)
{
	bool		read;

	groups_relid = filter_groups_relid();
	groups_mapped = false;
	if (groups_cxt == NULL)
		groups_cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency filter groups",
										   ALLOCSET_SMALL_SIZES);
	read = idem_summaries_read(groups_relid, groups_cxt, &groups_invals, groups_read);
	groups_valid = true;
	if (!read)
	{
		groups_n = 0;			/* no table: nothing to look at */
		groups = NULL;
		return;
	}
	/* this backend's copies of groups gone or rewritten are freed */
	idem_filters_forget_unlisted(groups_relid, group_filters(groups, groups_n), groups_n, false);
}

/* A sealed partition of the set being mapped: its relid and position. */
typedef struct SealedAt
{
	Oid			relid;
	int			idx;
	bool		grouped;
} SealedAt;

static int
sealed_at_cmp(const void *a, const void *b)
{
	Oid			ra = ((const SealedAt *) a)->relid;
	Oid			rb = ((const SealedAt *) b)->relid;

	return ra < rb ? -1 : ra > rb ? 1 : 0;
}

static int
sealed_idx_cmp(const void *a, const void *b)
{
	return ((const SealedAt *) a)->idx - ((const SealedAt *) b)->idx;
}

static int
int_cmp(const void *a, const void *b)
{
	return *(const int *) a - *(const int *) b;
}

/*
 * Where each group's members are in set (those the set shows sealed), and
 * which sealed partitions with claims are in no group.
 */
static void
groups_map(IdemPartitionSet *set)
{
	SealedAt   *sealed = palloc(Max(set->nparts, 1) * sizeof(SealedAt));
	int			nsealed = 0;
	int			need;

	for (int i = 0; i < set->nparts; i++)
		if (set->parts[i].sealed)
		{
			sealed[nsealed].relid = set->parts[i].relid;
			sealed[nsealed].idx = i;
			sealed[nsealed].grouped = false;
			nsealed++;
		}
	qsort(sealed, nsealed, sizeof(SealedAt), sealed_at_cmp);

	for (int g = 0; g < groups_n; g++)
	{
		FilterGroup *fg = &groups[g];

		if (fg->idx == NULL)
			fg->idx = MemoryContextAlloc(groups_cxt, Max(fg->nmembers, 1) * sizeof(int));
		fg->nidx = 0;
		for (int m = 0; m < fg->nmembers; m++)
		{
			SealedAt	key = {.relid = fg->members[m]};
			SealedAt   *at = bsearch(&key, sealed, nsealed, sizeof(SealedAt), sealed_at_cmp);

			if (at == NULL)
				continue;
			at->grouped = true;
			fg->idx[fg->nidx++] = at->idx;
		}
	}

	/* room for every listing (a damaged table may list a partition twice) */
	need = nsealed;
	for (int g = 0; g < groups_n; g++)
		need += groups[g].nidx;
	if (candidates_cap < need)
	{
		candidates_cap = Max(need, 64);
		if (candidates == NULL)
		{
			candidates = MemoryContextAlloc(TopMemoryContext, candidates_cap * sizeof(int));
			loose = MemoryContextAlloc(TopMemoryContext, candidates_cap * sizeof(int));
		}
		else
		{
			candidates = repalloc(candidates, candidates_cap * sizeof(int));
			loose = repalloc(loose, candidates_cap * sizeof(int));
		}
	}
	/* loose in the set's order (newest first), as each group's members */
	qsort(sealed, nsealed, sizeof(SealedAt), sealed_idx_cmp);
	loose_n = 0;
	for (int i = 0; i < nsealed; i++)
		if (!sealed[i].grouped && !set->parts[sealed[i].idx].empty)
			loose[loose_n++] = sealed[i].idx;
	for (int g = 0; g < groups_n; g++)
		qsort(groups[g].idx, groups[g].nidx, sizeof(int), int_cmp);
	pfree(sealed);
	groups_mapped = true;
	mapped_generation = set->generation;
}

/*
 * The sealed partitions of set that the key with this hash may be in, by
 * the filters of their groups: their positions in set->parts, in its order
 * (newest first), go to *idx (valid until the next call), and their number
 * is returned; -1 if there
 * are no groups, and every sealed partition is to be tested.  Partitions
 * in no group are always listed; a sealed partition without claims never
 * (it holds no key).  The caller has accepted invalidations
 * (idem_partition_set()).
 */
int
idem_groups_candidates(IdemPartitionSet *set, uint64 hash, const int **idx)
{
	int			n;

	if (!groups_valid)
		groups_build();
	if (groups_n == 0 || set->nparts == 0)
		return -1;
	if (!groups_mapped || mapped_generation != set->generation)
		groups_map(set);
	/* the blocks of all groups load at once, not one after the other */
	for (int g = 0; g < groups_n; g++)
		if (groups[g].nidx > 0)
			idem_filter_prefetch(&groups[g].filter, hash);
	memcpy(candidates, loose, loose_n * sizeof(int));
	n = loose_n;
	for (int g = 0; g < groups_n; g++)
	{
		FilterGroup *fg = &groups[g];
		int			at = n;

		if (fg->nidx == 0 || idem_filter_summary_excludes(&fg->filter, hash))
			continue;
		/* merged in the set's order: newer partitions are tested first */
		for (int m = 0; m < fg->nidx; m++)
		{
			int			v = fg->idx[m];
			int			j = at++;

			while (j > 0 && candidates[j - 1] > v)
			{
				candidates[j] = candidates[j - 1];
				j--;
			}
			candidates[j] = v;
		}
		n = at;
	}
	*idx = candidates;
	return n;
}

/*---- maintenance ----*/

/*
 * Partition relid is being sealed (in this transaction), with these key
 * hashes: add them to the newest group, or to a new one.
 */
void
idem_groups_add(Oid relid, const uint64 *hashes, int64 n)
{
	bool		found;
	int32		id = 1;
	int64		capacity;
	int64		max_keys;
	bytea	   *bloom = NULL;
	Oid			types[5] = {INT4OID, OIDOID, INT8OID, INT8OID, BYTEAOID};
	Datum		values[5];

	if (n == 0 || !OidIsValid(filter_groups_relid()))
		return;

	/*
	 * A group's filter must fit in a quarter of what a backend without the
	 * preload may hold (idempotency.local_filter_memory, as this session has
	 * it: the worker's is the server's), or such backends could never load
	 * it.  A partition too big to share one is left to be tested alone.
	 */
	max_keys = (int64) (idem_filter_local_budget() / IDEM_GROUP_BUDGET_SHARE) * 8 /
		IDEM_GROUP_BITS_PER_KEY;
	if (n > max_keys)
		return;
	idem_spi_exec("SELECT id, nkeys, capacity, pg_catalog.cardinality(members), bloom"
				  " FROM idempotency.filter_groups ORDER BY id DESC LIMIT 1",
				  0, NULL, NULL, SPI_OK_SELECT);
	found = SPI_processed > 0;
	if (found)
	{
		bool		isnull;
		int32		newest = DatumGetInt32(idem_spi_col(0, 1, &isnull));
		int64		nkeys = DatumGetInt64(idem_spi_col(0, 2, &isnull));
		int32		nmembers = DatumGetInt32(idem_spi_col(0, 4, &isnull));

		capacity = DatumGetInt64(idem_spi_col(0, 3, &isnull));
		if (nmembers < IDEM_GROUP_MAX_MEMBERS && nkeys + n <= capacity)
		{
			id = newest;
			bloom = DatumGetByteaPCopy(idem_spi_col(0, 5, &isnull));
		}
		else
			id = newest + 1;
	}
	if (bloom == NULL)
	{
		/* sized for a group of partitions like this one */
		capacity = Max((int64) IDEM_GROUP_MIN_CAPACITY, n * IDEM_GROUP_MAX_MEMBERS);
		capacity = Min(capacity, max_keys);
		bloom = idem_filter_new(&capacity, n, IDEM_GROUP_BITS_PER_KEY);
	}
	if (!idem_filter_add_hashes(bloom, hashes, n))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("summary %d of idempotency.filter_groups is damaged", id),
				 errhint("Delete its row from idempotency.filter_groups.")));
	values[0] = Int32GetDatum(id);
	values[1] = ObjectIdGetDatum(relid);
	values[2] = Int64GetDatum(n);
	values[3] = Int64GetDatum(capacity);
	values[4] = PointerGetDatum(bloom);
	idem_spi_exec("INSERT INTO idempotency.filter_groups AS g (id, members, nkeys, capacity, bloom)"
				  " VALUES ($1, ARRAY[$2::pg_catalog.regclass], $3, $4, $5)"
				  " ON CONFLICT (id) DO UPDATE SET bloom = excluded.bloom, nkeys = g.nkeys + excluded.nkeys,"
				  " members = g.members || excluded.members",
				  5, types, values, SPI_OK_INSERT);
}

/*
 * Delete the groups none of whose members is in the registry any more, and
 * forget the filters of groups gone or rewritten in the shared area.
 * Returns how many were deleted.
 */
int
idem_groups_expire(void)
{
	Oid			relid = filter_groups_relid();
	int			deleted;
	Relation	rel;
	Snapshot	snap;
	FilterGroup *g;
	int			n;

	if (!OidIsValid(relid))
		return 0;
	idem_spi_exec("DELETE FROM idempotency.filter_groups g WHERE NOT EXISTS"
				  " (SELECT FROM idempotency.partition_registry r"
				  "   WHERE r.relid OPERATOR(pg_catalog.=) ANY (g.members))",
				  0, NULL, NULL, SPI_OK_DELETE);
	deleted = (int) SPI_processed;

	rel = table_open(relid, AccessShareLock);
	snap = RegisterSnapshot(GetLatestSnapshot());
	n = read_groups(rel, snap, CurrentMemoryContext, &g);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	idem_filters_forget_unlisted(relid, group_filters(g, n), n, true);
	return deleted;
}

void
idem_groups_init(void)
{
	CacheRegisterRelcacheCallback(groups_cache_callback, (Datum) 0);
}
