/*-------------------------------------------------------------------------
 *
 * filters.c
 *	  Bloom filters of sealed partitions: how they are built, stored in the
 *	  registry, validated, and held in memory for claimers.
 *
 * A sealed partition takes no more claims, so its keys -- those of claims
 * still in progress too -- can be summarised once, when it is sealed, in a
 * blocked Bloom filter: all bits of a key lie in one 512-bit block (a cache
 * line), so a claim pays about one cache miss per sealed partition to learn
 * that its key is not there.  The filter is stored in
 * idempotency.partition_registry.bloom (so it survives restarts, dumps and
 * reaches standbys) with a header that carries a CRC; a filter that fails
 * validation is never used: its partition is probed instead.
 *
 * In memory, filters live in one of two places:
 *	- with shared_preload_libraries = 'idempotency': once per cluster, in a
 *	  shared area of idempotency.filter_memory, loaded from the registry on
 *	  first use and never reloaded (a sealed filter never changes);
 *	- otherwise: in each backend, up to idempotency.local_filter_memory, and
 *	  only for partitions the backend has looked at often enough to repay
 *	  reading the filter (a short-lived connection probes indexes instead).
 * A filter that does not fit is not loaded, and its partition is probed
 * through its index instead; filter_status() reports it.  In both places a
 * filter starts on a cache line, so that a block is one line: otherwise
 * most blocks would straddle two, and a test pay two misses.
 *
 * The summaries of dropped partitions (late.c) are Bloom filters of the
 * same kind, with more bits per key, stored in idempotency.late_summaries
 * and held in the same two places, named by (that table, summary id, row
 * xmin); one that cannot be held is not tested (late.c says so).  So are
 * the filters of groups of sealed partitions (groups.c, in
 * idempotency.filter_groups), which rule out a group's members at once.
 *
 * Locking rules: the shared area's directory is protected by one LWLock,
 * taken shared to find a filter and exclusive to add or remove one.
 * Claimers test bits without any lock: each backend remembers where it found
 * a filter along with the area's epoch, which is advanced before memory of a
 * removed filter can be reused; a test that sees the epoch move is repeated
 * (a sequence lock).  Loading a filter reads the registry with a fresh
 * snapshot and takes AccessShareLock on it, nothing else.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "claims/filters.h"
#include "common/catalog.h"
#include "common/keys.h"
#include "claims/partitions.h"

#include <limits.h>

#include "access/detoast.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/subtrans.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "port/pg_crc32c.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_filter_status);

/* Header of a stored filter; filters of version 1.0 have none. */
#define IDEM_FILTER_MAGIC		0x46424449	/* "IDBF" */
typedef struct FilterHeader
{
	uint32		magic;
	uint32		nbits;			/* bits that follow; a multiple of 512 */
	uint64		nkeys;			/* keys added */
	pg_crc32c	crc;			/* of the bits */
	uint32		pad;
} FilterHeader;

#define IDEM_FILTER_MAX_BITS	((uint32) 0xFFFFFE00)

typedef enum FilterAnswer
{
	FILTER_NO,					/* certainly not among its keys */
	FILTER_MAYBE,
	FILTER_UNKNOWN				/* no valid filter at hand */
} FilterAnswer;


/*
 * Without the shared area, a backend loads a partition's filter only after
 * it has looked at the partition this often: a short-lived connection would
 * spend longer reading every filter from the registry than probing indexes.
 */
#define IDEM_LOCAL_LOAD_AFTER	64

/* Most filters the shared area lists (all databases together). */
#define IDEM_FILTER_MAX_ENTRIES	4096

/*---- GUC variables ----*/
#define FILTER_MEMORY_KB_DEFAULT		(64 * 1024)
#define LOCAL_FILTER_MEMORY_KB_DEFAULT	(16 * 1024)
#define FILTER_MEMORY_KB_MAX			(INT_MAX / 2)

static int	idem_filter_memory_kb = FILTER_MEMORY_KB_DEFAULT;
static int	idem_local_filter_memory_kb = LOCAL_FILTER_MEMORY_KB_DEFAULT;

/*---- the shared area ----*/
typedef struct FilterEntry
{
	Oid			dboid;			/* InvalidOid: a free slot */
	Oid			source;			/* IdemPartition.filter_source */
	Oid			relid;
	TransactionId xmin;			/* of the registry row that held it */
	uint32		nbits;
	Size		offset;			/* in the arena */
	Size		size;
} FilterEntry;

typedef struct FilterArea
{
	LWLock	   *lock;
	pg_atomic_uint64 epoch;		/* advanced before freed memory is reused */
	Size		arena_size;
	Size		used;
	int			nentries;		/* slots in use */
	uint64		refused;		/* loads that found no room */
	FilterEntry entries[IDEM_FILTER_MAX_ENTRIES];
} FilterArea;

static FilterArea *filter_area = NULL;
static uint8 *filter_arena = NULL;
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*---- the backend-local store (library not preloaded) ----*/
typedef struct LocalFilterKey
{
	Oid			source;
	Oid			relid;
	TransactionId xmin;
} LocalFilterKey;

typedef struct LocalFilter
{
	LocalFilterKey key;
	void	   *mem;			/* the allocation; bits starts on a cache
								 * line in it, so each block is one line */
	uint8	   *bits;
	uint32		nbits;
} LocalFilter;

static HTAB *local_filters = NULL;
static Size local_used = 0;
static uint64 local_refused = 0;

/*---- Bloom filter arithmetic ----*/

/*
 * The bits of a key in a partition's filter: a block chosen by the low 32
 * bits of its hash, IDEM_BLOOM_HASHES positions in it by double hashing of
 * the high 32 bits (the stored format since 1.0).
 */
static inline uint32
bloom_bit(uint64 hash, int i, uint32 nbits)
{
	uint32		nblocks = nbits / IDEM_BLOOM_BLOCK_BITS;
	uint32		block = (uint32) hash % nblocks;
	uint32		h2 = (uint32) (hash >> 32);
	uint32		h3 = ((h2 >> 17) | (h2 << 15)) | 1;

	return block * IDEM_BLOOM_BLOCK_BITS + ((h2 + (uint32) i * h3) % IDEM_BLOOM_BLOCK_BITS);
}

/*
 * In a summary's filter, the same block, and IDEM_SUMMARY_HASHES positions
 * of 9 independent bits each, drawn from splitmix64 of the hash: double
 * hashing in a 512-bit block has only 2^17 patterns, so two keys of a
 * block share all their bits with a probability (about 1 in 10 000 at 25
 * keys a block) far above what a summary is sized for.
 */
static inline uint64
summary_word(uint64 hash, int i)
{
	uint64		z = hash + (uint64) (i / 7 + 1) * UINT64CONST(0x9E3779B97F4A7C15);

	z = (z ^ (z >> 30)) * UINT64CONST(0xBF58476D1CE4E5B9);
	z = (z ^ (z >> 27)) * UINT64CONST(0x94D049BB133111EB);
	return z ^ (z >> 31);
}

/* Position i of a key in its block; *w carries the word between calls. */
static inline uint32
summary_pos(uint64 hash, int i, uint64 *w)
{
	if (i % 7 == 0)
		*w = summary_word(hash, i);
	return (uint32) ((*w >> (9 * (i % 7))) & (IDEM_BLOOM_BLOCK_BITS - 1));
}

/* Bit i of a key (i = 0, 1, ... in turn: *w carries what a summary's needs) */
static inline uint32
filter_bit(uint64 hash, int i, uint32 nbits, bool summary, uint64 *w)
{
	if (!summary)
		return bloom_bit(hash, i, nbits);
	return ((uint32) hash % (nbits / IDEM_BLOOM_BLOCK_BITS)) * IDEM_BLOOM_BLOCK_BITS +
		summary_pos(hash, i, w);
}

static void
bloom_add(uint8 *bits, uint32 nbits, uint64 hash, bool summary)
{
	int			nhashes = summary ? IDEM_SUMMARY_HASHES : IDEM_BLOOM_HASHES;
	uint64		w = 0;

	for (int i = 0; i < nhashes; i++)
	{
		uint32		b = filter_bit(hash, i, nbits, summary, &w);

		bits[b / 8] |= (uint8) (1 << (b % 8));
	}
}

/* False: the key is certainly not among those added. */
static bool
bloom_maybe(const uint8 *bits, uint32 nbits, uint64 hash, bool summary)
{
	int			nhashes = summary ? IDEM_SUMMARY_HASHES : IDEM_BLOOM_HASHES;
	uint64		w = 0;

	for (int i = 0; i < nhashes; i++)
	{
		uint32		b = filter_bit(hash, i, nbits, summary, &w);

		if ((bits[b / 8] & (1 << (b % 8))) == 0)
			return false;
	}
	return true;
}

/*---- building and validating ----*/

static const uint8 *filter_bits(bytea *stored, uint32 *nbits);

/* Record the CRC of the bits that follow a header. */
static void
filter_seal_crc(FilterHeader *hdr)
{
	INIT_CRC32C(hdr->crc);
	COMP_CRC32C(hdr->crc, (uint8 *) (hdr + 1), hdr->nbits / 8);
	FIN_CRC32C(hdr->crc);
}

/* The full id of a recent transaction (younger than our snapshots' xmin). */
static FullTransactionId
recent_full_xid(TransactionId xid)
{
	FullTransactionId next = ReadNextFullTransactionId();
	uint32		epoch = EpochFromFullTransactionId(next);

	/* it began before the next xid: numerically greater means an epoch ago */
	if (xid > XidFromFullTransactionId(next))
		epoch--;
	return FullTransactionIdFromEpochAndXid(epoch, xid);
}

/* Note the top-level transaction of a claim, once. */
static void
add_holder(IdemSealInfo *info, TransactionId xid, int *cap)
{
	FullTransactionId fx;

	/* running or newer than our snapshots, so pg_subtrans knows it */
	fx = recent_full_xid(SubTransGetTopmostTransaction(xid));
	for (int i = 0; i < info->nholders; i++)
		if (FullTransactionIdEquals(info->holders[i], fx))
			return;
	if (info->nholders == *cap)
	{
		*cap = *cap == 0 ? 8 : *cap * 2;
		info->holders = info->holders == NULL ?
			palloc(*cap * sizeof(FullTransactionId)) :
			repalloc(info->holders, *cap * sizeof(FullTransactionId));
	}
	info->holders[info->nholders++] = fx;
}

/*
 * Scan a partition that takes no more claims and summarise it: its Bloom
 * filter (NULL when empty), how many claims it holds, the newest claimed_at
 * and the transactions whose claims there the snapshot "visible" (the one
 * its scopes will be counted with) does not show: those still open, and
 * those that committed after it was taken.  The scan uses a dirty snapshot,
 * so claims still in progress are in the filter and the figures (a claim
 * that then rolls back is only a false positive).  The caller makes sure no
 * claim can be inserted there any more (retention.c).
 */
bytea *
idem_filter_build(Relation rel, Snapshot visible, IdemSealInfo *info)
{
	TupleDesc	desc = RelationGetDescr(rel);
	SnapshotData dirty;
	TableScanDesc scan;
	HeapTuple	tup;
	uint64		nbits64;
	uint32		nbits;
	bytea	   *result;
	FilterHeader *hdr;
	uint8	   *bits;
	int			cap = 0;
	int64		nhashes,
				hashes_cap;

	info->nkeys = 0;
	info->max_claimed_at = DT_NOBEGIN;
	info->nholders = 0;
	info->holders = NULL;
	info->hashes = NULL;
	InitDirtySnapshot(dirty);

	/* one pass to size the filter, one to fill it */
	scan = table_beginscan(rel, &dirty, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		TimestampTz t = DatumGetTimestampTz(heap_getattr(tup, Anum_claims_claimed_at, desc, &isnull));

		/* the dirty check of this tuple named its inserter if still open */
		if (TransactionIdIsValid(dirty.xmin))
			add_holder(info, dirty.xmin, &cap);
		else
		{
			TransactionId xmin = HeapTupleHeaderGetRawXmin(tup->t_data);

			if (TransactionIdIsNormal(xmin) && !TransactionIdIsCurrentTransactionId(xmin) &&
				XidInMVCCSnapshot(xmin, visible))
				add_holder(info, xmin, &cap);
		}
		info->nkeys++;
		if (!isnull && t > info->max_claimed_at)
			info->max_claimed_at = t;
	}
	table_endscan(scan);
	if (info->nkeys == 0)
		return NULL;

	nbits64 = (uint64) info->nkeys * IDEM_BLOOM_BITS_PER_KEY;
	nbits64 = (nbits64 + IDEM_BLOOM_BLOCK_BITS - 1) / IDEM_BLOOM_BLOCK_BITS * IDEM_BLOOM_BLOCK_BITS;
	nbits = (uint32) Min(nbits64, (uint64) IDEM_FILTER_MAX_BITS);

	result = palloc0(VARHDRSZ + sizeof(FilterHeader) + nbits / 8);
	SET_VARSIZE(result, VARHDRSZ + sizeof(FilterHeader) + nbits / 8);
	hdr = (FilterHeader *) VARDATA(result);
	bits = (uint8 *) (hdr + 1);
	hashes_cap = info->nkeys;
	info->hashes = palloc_extended((Size) hashes_cap * sizeof(uint64), MCXT_ALLOC_HUGE);

	scan = table_beginscan(rel, &dirty, 0, NULL);
	nhashes = 0;
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		text	   *scope = DatumGetTextPP(heap_getattr(tup, Anum_claims_scope, desc, &isnull));
		text	   *key = DatumGetTextPP(heap_getattr(tup, Anum_claims_key, desc, &isnull));
		uint64		hash = idem_key_hash(scope, key);

		bloom_add(bits, nbits, hash, false);
		/* (no claim can be added meanwhile, but a group must never miss one) */
		if (nhashes == hashes_cap)
		{
			hashes_cap *= 2;
			info->hashes = repalloc_huge(info->hashes, (Size) hashes_cap * sizeof(uint64));
		}
		info->hashes[nhashes++] = hash;
	}
	table_endscan(scan);
	info->nkeys = nhashes;

	hdr->magic = IDEM_FILTER_MAGIC;
	hdr->nbits = nbits;
	hdr->nkeys = info->nkeys;
	filter_seal_crc(hdr);
	return result;
}

/*
 * An empty stored filter of nbits bits (rounded up to whole blocks), for
 * idem_filter_add_hashes().
 */
static bytea *
filter_new(uint64 nbits64)
{
	uint32		nbits;
	bytea	   *result;
	FilterHeader *hdr;

	nbits64 = (Max(nbits64, 1) + IDEM_BLOOM_BLOCK_BITS - 1) / IDEM_BLOOM_BLOCK_BITS * IDEM_BLOOM_BLOCK_BITS;
	nbits = (uint32) Min(nbits64, (uint64) IDEM_FILTER_MAX_BITS);
	result = palloc0(VARHDRSZ + sizeof(FilterHeader) + nbits / 8);
	SET_VARSIZE(result, VARHDRSZ + sizeof(FilterHeader) + nbits / 8);
	hdr = (FilterHeader *) VARDATA(result);
	hdr->magic = IDEM_FILTER_MAGIC;
	hdr->nbits = nbits;
	filter_seal_crc(hdr);
	return result;
}

/*
 * An empty stored filter for a summary of *capacity keys at bits_per_key
 * bits a key.  *capacity is lowered to what one filter can address, but
 * never below n, the keys about to be added; it is then what the filter
 * was sized for.
 */
bytea *
idem_filter_new(int64 *capacity, int64 n, int bits_per_key)
{
	*capacity = Min(*capacity, (int64) (IDEM_FILTER_MAX_BITS / (uint32) bits_per_key));
	*capacity = Max(*capacity, n);
	return filter_new((uint64) *capacity * bits_per_key);
}

/*
 * Add keys (by their idem_key_hash()) to a summary's filter made by
 * idem_filter_new(), in place.  False if the filter is damaged.
 */
bool
idem_filter_add_hashes(bytea *stored, const uint64 *hashes, int64 n)
{
	FilterHeader *hdr = (FilterHeader *) VARDATA(stored);
	uint8	   *bits;
	uint32		nbits;

	if (VARATT_IS_EXTENDED(stored) || filter_bits(stored, &nbits) == NULL ||
		VARSIZE(stored) - VARHDRSZ < sizeof(FilterHeader) || hdr->magic != IDEM_FILTER_MAGIC)
		return false;
	bits = (uint8 *) (hdr + 1);
	for (int64 i = 0; i < n; i++)
		bloom_add(bits, nbits, hashes[i], true);
	hdr->nkeys += n;
	filter_seal_crc(hdr);
	return true;
}

/*
 * The bits of a stored filter, or NULL if it is damaged.  Filters written
 * by version 1.0 have no header; their size is all there is to check.
 */
static const uint8 *
filter_bits(bytea *stored, uint32 *nbits)
{
	Size		len = VARSIZE_ANY_EXHDR(stored);
	const char *data = VARDATA_ANY(stored);
	FilterHeader hdr;
	pg_crc32c	crc;

	if (len >= sizeof(FilterHeader))
	{
		memcpy(&hdr, data, sizeof(FilterHeader));
		if (hdr.magic == IDEM_FILTER_MAGIC)
		{
			if (hdr.nbits == 0 || hdr.nbits % IDEM_BLOOM_BLOCK_BITS != 0 ||
				len != sizeof(FilterHeader) + hdr.nbits / 8)
				return NULL;
			INIT_CRC32C(crc);
			COMP_CRC32C(crc, data + sizeof(FilterHeader), hdr.nbits / 8);
			FIN_CRC32C(crc);
			if (!EQ_CRC32C(crc, hdr.crc))
				return NULL;
			*nbits = hdr.nbits;
			return (const uint8 *) data + sizeof(FilterHeader);
		}
	}
	if (len == 0 || len > PG_UINT32_MAX / 8 || (len * 8) % IDEM_BLOOM_BLOCK_BITS != 0)
		return NULL;
	*nbits = (uint32) (len * 8);
	return (const uint8 *) data;
}

/*
 * Read a partition's filter from the registry (a summary's from its table),
 * if the row that names it is still the one this backend's cache was built
 * from: length bytes from offset (of what follows the varlena header), or
 * all of it when length is -1.  NULL: gone or changed.
 */
static bytea *
read_stored_slice(IdemPartitionSet *set, IdemPartition *p, int32 offset, int32 length)
{
	bool		late = OidIsValid(p->filter_source);
	Relation	rel = table_open(late ? p->filter_source : set->registry_relid, AccessShareLock);
	AttrNumber	id_att = Anum_registry_relid,
				bloom_att = Anum_registry_bloom;
	Snapshot	snap = RegisterSnapshot(GetLatestSnapshot());
	TableScanDesc scan = table_beginscan(rel, snap, 0, NULL);
	HeapTuple	tup;
	bytea	   *stored = NULL;

	/*
	 * a summary's table (late.c's or groups.c's) starts with the id and
	 * names its filter "bloom"
	 */
	if (late)
	{
		id_att = Anum_late_id;
		bloom_att = get_attnum(p->filter_source, "bloom");
	}
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Datum		d;
		Oid			id;

		/* a registry row names its partition; a summary's, its id */
		d = heap_getattr(tup, id_att, RelationGetDescr(rel), &isnull);
		id = late ? (Oid) DatumGetInt32(d) : DatumGetObjectId(d);
		if (id != p->relid || HeapTupleHeaderGetRawXmin(tup->t_data) != p->filter_xmin)
			continue;
		d = heap_getattr(tup, bloom_att, RelationGetDescr(rel), &isnull);
		/* a copy either way: the buffer is let go */
		if (!isnull && length < 0)
			stored = DatumGetByteaPCopy(d);
		else if (!isnull)
			stored = (bytea *) detoast_attr_slice((struct varlena *) DatumGetPointer(d), offset, length);
		break;
	}
	table_endscan(scan);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
	return stored;
}

static bytea *
read_stored_filter(IdemPartitionSet *set, IdemPartition *p)
{
	return read_stored_slice(set, p, 0, -1);
}

/*
 * The bits a stored filter (a summary's, with a header) has, from its size
 * alone: what its raw datum, still toasted, says; 0 if that is no size a
 * filter has.
 */
uint32
idem_filter_stored_nbits(Datum raw)
{
	Size		len = toast_raw_datum_size(raw);

	if (len < VARHDRSZ + sizeof(FilterHeader) ||
		(len - VARHDRSZ - sizeof(FilterHeader)) * 8 > IDEM_FILTER_MAX_BITS ||
		((len - VARHDRSZ - sizeof(FilterHeader)) * 8) % IDEM_BLOOM_BLOCK_BITS != 0)
		return 0;
	return (uint32) ((len - VARHDRSZ - sizeof(FilterHeader)) * 8);
}

/*
 * Test a summary's filter by reading only the block the key's bits lie in
 * (and, once, the header) from its table: what a backend without the
 * shared area does until it has checked often enough to repay loading the
 * whole filter (IDEM_LOCAL_LOAD_AFTER), so that a short-lived connection
 * does not read every summary.  The table stores the filter uncompressed
 * (sql/tables/10_late.sql), so a slice reads one TOAST chunk or two; its
 * size is known from the list of summaries (idem_filter_stored_nbits()),
 * else the header is read once.  The CRC, which covers all bits, is not
 * checked here.
 */
static FilterAnswer
summary_slice_test(IdemPartition *p, uint64 hash)
{
	bytea	   *slice;
	const uint8 *block;
	uint32		b0;
	uint64		w = 0;

	if (p->filter_nbits == 0)
	{
		FilterHeader hdr;

		slice = read_stored_slice(NULL, p, 0, sizeof(FilterHeader));
		if (slice == NULL || VARSIZE_ANY_EXHDR(slice) != sizeof(FilterHeader))
		{
			p->filter_missing = true;
			return FILTER_UNKNOWN;
		}
		memcpy(&hdr, VARDATA_ANY(slice), sizeof(FilterHeader));
		pfree(slice);
		if (hdr.magic != IDEM_FILTER_MAGIC || hdr.nbits == 0 || hdr.nbits % IDEM_BLOOM_BLOCK_BITS != 0)
		{
			p->filter_missing = true;
			return FILTER_UNKNOWN;
		}
		p->filter_nbits = hdr.nbits;
	}
	b0 = ((uint32) hash % (p->filter_nbits / IDEM_BLOOM_BLOCK_BITS)) * IDEM_BLOOM_BLOCK_BITS;
	slice = read_stored_slice(NULL, p, sizeof(FilterHeader) + b0 / 8, IDEM_BLOOM_BLOCK_BITS / 8);
	if (slice == NULL || VARSIZE_ANY_EXHDR(slice) != IDEM_BLOOM_BLOCK_BITS / 8)
	{
		p->filter_missing = true;
		return FILTER_UNKNOWN;
	}
	block = (const uint8 *) VARDATA_ANY(slice);
	for (int i = 0; i < IDEM_SUMMARY_HASHES; i++)
	{
		uint32		b = summary_pos(hash, i, &w);

		if ((block[b / 8] & (1 << (b % 8))) == 0)
		{
			pfree(slice);
			return FILTER_NO;
		}
	}
	pfree(slice);
	return FILTER_MAYBE;
}

/*---- the shared area ----*/

static Size
filter_area_size(void)
{
	/* room to start the arena on a cache line (filters_shmem_startup()) */
	return sizeof(FilterArea) + PG_CACHE_LINE_SIZE + (Size) idem_filter_memory_kb * 1024;
}

static void
filters_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(filter_area_size());
	RequestNamedLWLockTranche("idempotency filters", 1);
}

static void
filters_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	filter_area = ShmemInitStruct("idempotency filters", filter_area_size(), &found);
	if (!found)
	{
		memset(filter_area, 0, sizeof(FilterArea));
		filter_area->lock = &(GetNamedLWLockTranche("idempotency filters"))->lock;
		pg_atomic_init_u64(&filter_area->epoch, 1);
		filter_area->arena_size = (Size) idem_filter_memory_kb * 1024;
	}
	/* filter sizes are whole blocks: each block is one cache line */
	filter_arena = (uint8 *) CACHELINEALIGN((char *) filter_area + sizeof(FilterArea));
	LWLockRelease(AddinShmemInitLock);
}

static FilterEntry *
shared_find(IdemPartition *p)
{
	for (int i = 0; i < IDEM_FILTER_MAX_ENTRIES; i++)
	{
		FilterEntry *e = &filter_area->entries[i];

		if (e->dboid == MyDatabaseId && e->relid == p->relid && e->xmin == p->filter_xmin &&
			e->source == p->filter_source)
			return e;
	}
	return NULL;
}

static int
extent_cmp(const void *a, const void *b)
{
	const FilterEntry *ea = *(FilterEntry *const *) a;
	const FilterEntry *eb = *(FilterEntry *const *) b;

	return ea->offset < eb->offset ? -1 : (ea->offset > eb->offset ? 1 : 0);
}

/* First fit in the arena; the caller holds the lock exclusively. */
static bool
shared_alloc(Size size, Size *offset)
{
	FilterEntry *used[IDEM_FILTER_MAX_ENTRIES];
	int			n = 0;
	Size		at = 0;

	for (int i = 0; i < IDEM_FILTER_MAX_ENTRIES; i++)
		if (OidIsValid(filter_area->entries[i].dboid))
			used[n++] = &filter_area->entries[i];
	qsort(used, n, sizeof(FilterEntry *), extent_cmp);
	for (int i = 0; i < n; i++)
	{
		if (used[i]->offset - at >= size)
			break;
		at = used[i]->offset + used[i]->size;
	}
	if (filter_area->arena_size - at < size)
		return false;
	*offset = at;
	return true;
}

/* Copy a filter into the shared area; false if there is no room. */
static bool
shared_add(IdemPartition *p, const uint8 *bits, uint32 nbits)
{
	Size		size = MAXALIGN(nbits / 8);
	Size		offset;
	FilterEntry *e = NULL;
	bool		ok = false;

	LWLockAcquire(filter_area->lock, LW_EXCLUSIVE);
	if (shared_find(p) != NULL)
		ok = true;				/* another backend was quicker */
	else if (shared_alloc(size, &offset))
	{
		for (int i = 0; i < IDEM_FILTER_MAX_ENTRIES && e == NULL; i++)
			if (!OidIsValid(filter_area->entries[i].dboid))
				e = &filter_area->entries[i];
		if (e != NULL)
		{
			memcpy(filter_arena + offset, bits, nbits / 8);
			e->source = p->filter_source;
			e->relid = p->relid;
			e->xmin = p->filter_xmin;
			e->nbits = nbits;
			e->offset = offset;
			e->size = size;
			pg_write_barrier();
			e->dboid = MyDatabaseId;
			filter_area->nentries++;
			filter_area->used += size;
			ok = true;
		}
	}
	if (!ok)
		filter_area->refused++;
	LWLockRelease(filter_area->lock);
	if (!ok && OidIsValid(p->filter_source))
		ereport(LOG,
				(errmsg("no room for summary %u of %s in idempotency.filter_memory",
						p->relid, get_rel_name(p->filter_source)),
				 errdetail("Late duplicates of the keys it holds are not detected, or claims test its partitions one by one; raise idempotency.filter_memory to avoid it.")));
	else if (!ok)
		ereport(LOG,
				(errmsg("no room for the Bloom filter of claims partition %u in idempotency.filter_memory",
						p->relid),
				 errdetail("Claims look in the partition's index instead; raise idempotency.filter_memory to avoid it.")));
	return ok;
}

/*---- the local store ----*/

/* Free a filter of the local store and forget it. */
static void
local_forget(LocalFilter *lf)
{
	local_used -= lf->nbits / 8;
	pfree(lf->mem);
	hash_search(local_filters, &lf->key, HASH_REMOVE, NULL);
}

static bool
local_add(IdemPartitionSet *set, IdemPartition *p, const uint8 *bits, uint32 nbits)
{
	LocalFilterKey key = {p->filter_source, p->relid, p->filter_xmin};
	LocalFilter *lf;
	bool		found;
	Size		size = nbits / 8;

	if (local_filters == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(LocalFilterKey);
		ctl.entrysize = sizeof(LocalFilter);
		ctl.hcxt = TopMemoryContext;
		local_filters = hash_create("idempotency local filters", 64, &ctl,
									HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}

	/* make room by forgetting filters of partitions no longer listed */
	if (local_used + size > (Size) idem_local_filter_memory_kb * 1024)
	{
		HASH_SEQ_STATUS seq;

		hash_seq_init(&seq, local_filters);
		while ((lf = hash_seq_search(&seq)) != NULL)
		{
			bool		listed = false;

			/*
			 * a summary's is kept (late.c and groups.c forget those they no
			 * longer list),
			 * and so is every partition's when a summary is loaded
			 */
			listed = OidIsValid(lf->key.source) || set == NULL;
			for (int i = 0; !listed && i < set->nparts; i++)
				listed = set->parts[i].relid == lf->key.relid &&
					set->parts[i].filter_xmin == lf->key.xmin;
			if (!listed)
				local_forget(lf);
		}
	}
	if (local_used + size > (Size) idem_local_filter_memory_kb * 1024)
	{
		local_refused++;
		return false;
	}

	lf = hash_search(local_filters, &key, HASH_ENTER, &found);
	if (!found)
	{
		lf->mem = MemoryContextAllocHuge(TopMemoryContext, size + PG_CACHE_LINE_SIZE - 1);
		lf->bits = (uint8 *) CACHELINEALIGN(lf->mem);
		memcpy(lf->bits, bits, size);
		lf->nbits = nbits;
		local_used += size;
	}
	p->filter_bits = lf->bits;
	p->filter_nbits = lf->nbits;
	return true;
}

/*
 * Read summary table relid (late.c's, groups.c's) for a backend's list of
 * its summaries: read() is called with the table under AccessShareLock and
 * the latest snapshot, after cxt is reset, and again if *invals moved
 * meanwhile (an invalidation of the table arrived during the read).
 * Returns false, having called nothing, if there is no such table (a
 * database still at version 1.0).
 */
bool
idem_summaries_read(Oid relid, MemoryContext cxt, const uint64 *invals,
					IdemSummariesReader read)
{
	for (;;)
	{
		Relation	rel;
		Snapshot	snap;
		uint64		seen;

		MemoryContextReset(cxt);
		rel = OidIsValid(relid) ? try_table_open(relid, AccessShareLock) : NULL;
		if (rel == NULL)
			return false;
		seen = *invals;
		snap = RegisterSnapshot(GetLatestSnapshot());
		read(rel, snap, cxt);
		UnregisterSnapshot(snap);
		table_close(rel, AccessShareLock);
		if (seen == *invals)
			return true;		/* else it changed while we read: read again */
	}
}

/*---- lookups ----*/

static uint64
current_epoch(void)
{
	return filter_area != NULL ? pg_atomic_read_u64(&filter_area->epoch) : 0;
}

/* Where this backend finds p's filter now; filter_bits NULL if nowhere. */
static void
resolve_filter(IdemPartitionSet *set, IdemPartition *p)
{
	bytea	   *stored;
	const uint8 *bits;
	uint32		nbits;

	p->filter_bits = NULL;
	p->filter_epoch = current_epoch();

	if (filter_area != NULL)
	{
		FilterEntry *e;

		LWLockAcquire(filter_area->lock, LW_SHARED);
		e = shared_find(p);
		if (e != NULL)
		{
			p->filter_bits = filter_arena + e->offset;
			p->filter_nbits = e->nbits;
		}
		LWLockRelease(filter_area->lock);
		if (p->filter_bits != NULL)
			return;
	}
	else if (local_filters != NULL)
	{
		LocalFilterKey key = {p->filter_source, p->relid, p->filter_xmin};
		LocalFilter *lf = hash_search(local_filters, &key, HASH_FIND, NULL);

		if (lf != NULL)
		{
			p->filter_bits = lf->bits;
			p->filter_nbits = lf->nbits;
			return;
		}
	}
	if (filter_area == NULL && ++p->local_lookups < IDEM_LOCAL_LOAD_AFTER)
		return;					/* not worth reading for this backend yet */

	/* not in memory yet: load it from the registry, once */
	stored = read_stored_filter(set, p);
	if (stored == NULL)
	{
		p->filter_missing = true;	/* the cache is stale; it will be rebuilt */
		return;
	}
	bits = filter_bits(stored, &nbits);
	if (bits == NULL)
	{
		bool		late = OidIsValid(p->filter_source);

		char	   *table = late ? get_rel_name(p->filter_source) : NULL;

		ereport(WARNING,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 late ? errmsg("summary %u of idempotency.%s is damaged", p->relid, table) :
				 errmsg("Bloom filter of claims partition %u is damaged", p->relid),
				 late ? errdetail("It is not used: late duplicates of the keys it holds are not detected, or its partitions are tested one by one.") :
				 errdetail("Claims look in the partition's index instead."),
				 late ? errhint("Delete its row from idempotency.%s.", table) :
				 errhint("Run idem_maintain() after setting bloom to NULL in idempotency.partition_registry to rebuild it.")));
		p->filter_missing = true;
	}
	else if (filter_area != NULL ? !shared_add(p, bits, nbits) : !local_add(set, p, bits, nbits))
		p->filter_missing = true;	/* no room: probe instead */
	else if (filter_area != NULL)
		resolve_filter(set, p);
	pfree(stored);
}

/*
 * Start loading the cache line of p's filter that the key's test will read,
 * if the filter is at hand: a claim tests many filters, and their misses
 * then overlap instead of queueing.  (Filters in memory start on a cache
 * line, so a block is one line, not parts of two.)
 */
void
idem_filter_prefetch(IdemPartition *p, uint64 hash)
{
	if (p->filter_bits != NULL && p->filter_epoch == current_epoch())
	{
		uint32		block = (uint32) hash % (p->filter_nbits / IDEM_BLOOM_BLOCK_BITS);

		__builtin_prefetch(p->filter_bits + (Size) block * (IDEM_BLOOM_BLOCK_BITS / 8));
	}
}

/*
 * Test p's filter, loading it first if need be (set: NULL for a summary;
 * slices: a summary not in memory may be tested by reading one block).
 */
static FilterAnswer
filter_test(IdemPartitionSet *set, IdemPartition *p, uint64 hash, bool slices)
{
	for (;;)
	{
		uint64		epoch;
		bool		maybe;

		if (!p->has_filter || p->filter_missing)
			return FILTER_UNKNOWN;
		epoch = current_epoch();
		if (p->filter_bits == NULL || p->filter_epoch != epoch)
		{
			resolve_filter(set, p);
			if (p->filter_bits != NULL)
				continue;
			/* not in memory (yet): a summary's block is read from its table */
			if (slices && OidIsValid(p->filter_source) && filter_area == NULL && !p->filter_missing)
				return summary_slice_test(p, hash);
			return FILTER_UNKNOWN;
		}
		pg_read_barrier();
		maybe = bloom_maybe(p->filter_bits, p->filter_nbits, hash, OidIsValid(p->filter_source));
		pg_read_barrier();
		if (current_epoch() == epoch)
			return maybe ? FILTER_MAYBE : FILTER_NO;
	}
}

/*
 * May the key with this hash be in sealed partition p?  True when its
 * filter says so, and whenever no valid filter is at hand (then the caller
 * probes the partition's index).
 */
bool
idem_filter_maybe(IdemPartitionSet *set, IdemPartition *p, uint64 hash)
{
	return filter_test(set, p, hash, false) != FILTER_NO;
}

/*
 * Does the filter of summary p (filter_source set; see late.c) say the key
 * may be there?  False too when its filter is not at hand.
 */
bool
idem_filter_summary_maybe(IdemPartition *p, uint64 hash)
{
	return filter_test(NULL, p, hash, true) == FILTER_MAYBE;
}

/*
 * Does the filter of summary p say the key is certainly not there?  False
 * when its filter is not in memory: unlike idem_filter_summary_maybe(), no
 * block is read from the table (a group's test saves probes only when it
 * is cheaper than they are).
 */
bool
idem_filter_summary_excludes(IdemPartition *p, uint64 hash)
{
	return filter_test(NULL, p, hash, false) == FILTER_NO;
}

/* What a backend without the preload may hold in filters, in bytes. */
Size
idem_filter_local_budget(void)
{
	return (Size) idem_local_filter_memory_kb * 1024;
}

/*
 * Remove from the shared area the filters of this database that the set
 * does not list (partitions dropped or resealed).  Run by maintenance.
 */
void
idem_filters_forget_others(IdemPartitionSet *set)
{
	idem_filters_forget_unlisted(InvalidOid, set->parts, set->nparts, true);
}

/*
 * Remove from memory the filters of this database stored in source (see
 * IdemPartition.filter_source) that parts does not list: those in this
 * backend's own store, and with shared those in the shared area.
 * Maintenance runs it for the registry (idem_filters_forget_others()) and
 * for the summaries (late.c), each of which leaves the other's alone.
 */
void
idem_filters_forget_unlisted(Oid source, IdemPartition *parts, int nparts, bool shared)
{
	bool		advanced = false;

	if (filter_area != NULL && !shared)
		return;
	if (filter_area == NULL)
	{
		HASH_SEQ_STATUS seq;
		LocalFilter *lf;

		if (!OidIsValid(source) || local_filters == NULL)
			return;				/* the registry's: local_add() sees to them */
		hash_seq_init(&seq, local_filters);
		while ((lf = hash_seq_search(&seq)) != NULL)
		{
			bool		listed = lf->key.source != source;

			for (int j = 0; j < nparts && !listed; j++)
				listed = parts[j].relid == lf->key.relid && parts[j].filter_xmin == lf->key.xmin;
			if (!listed)
				local_forget(lf);
		}
		return;
	}
	LWLockAcquire(filter_area->lock, LW_EXCLUSIVE);
	for (int i = 0; i < IDEM_FILTER_MAX_ENTRIES; i++)
	{
		FilterEntry *e = &filter_area->entries[i];
		bool		listed = false;

		if (e->dboid != MyDatabaseId || e->source != source)
			continue;
		for (int j = 0; j < nparts && !listed; j++)
			listed = parts[j].relid == e->relid &&
				parts[j].filter_xmin == e->xmin && parts[j].has_filter;
		if (listed)
			continue;
		if (!advanced)
		{
			/* readers holding the old address must notice before reuse */
			pg_atomic_fetch_add_u64(&filter_area->epoch, 1);
			advanced = true;
		}
		filter_area->used -= e->size;
		filter_area->nentries--;
		memset(e, 0, sizeof(FilterEntry));
	}
	LWLockRelease(filter_area->lock);
}

/*
 * idempotency.filter_status(): where filters are held and how full that is.
 */
Datum
idem_filter_status(PG_FUNCTION_ARGS)
{
	TupleDesc	desc;
	Datum		values[5];
	bool		nulls[5] = {false, false, false, false, false};

	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	if (filter_area != NULL)
	{
		LWLockAcquire(filter_area->lock, LW_SHARED);
		values[0] = CStringGetTextDatum("shared");
		values[1] = Int64GetDatum((int64) filter_area->arena_size);
		values[2] = Int64GetDatum((int64) filter_area->used);
		values[3] = Int32GetDatum(filter_area->nentries);
		values[4] = Int64GetDatum((int64) filter_area->refused);
		LWLockRelease(filter_area->lock);
	}
	else
	{
		values[0] = CStringGetTextDatum("local");
		values[1] = Int64GetDatum((int64) idem_local_filter_memory_kb * 1024);
		values[2] = Int64GetDatum((int64) local_used);
		values[3] = Int32GetDatum(local_filters ? (int32) hash_get_num_entries(local_filters) : 0);
		values[4] = Int64GetDatum((int64) local_refused);
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, values, nulls)));
}

void
idem_filters_init(void)
{
	DefineCustomIntVariable("idempotency.local_filter_memory",
							"Backend memory for Bloom filters when the library is not preloaded.",
							NULL,
							&idem_local_filter_memory_kb,
							LOCAL_FILTER_MEMORY_KB_DEFAULT, 0, FILTER_MEMORY_KB_MAX,
							PGC_USERSET,
							GUC_UNIT_KB,
							NULL, NULL, NULL);

	/* a postmaster setting can only be defined while preloading */
	if (!process_shared_preload_libraries_in_progress)
		return;
	DefineCustomIntVariable("idempotency.filter_memory",
							"Shared memory for the Bloom filters of sealed partitions.",
							"Used when the library is in shared_preload_libraries; about 1.25 bytes per retained claim.",
							&idem_filter_memory_kb,
							FILTER_MEMORY_KB_DEFAULT, 0, FILTER_MEMORY_KB_MAX,
							PGC_POSTMASTER,
							GUC_UNIT_KB,
							NULL, NULL, NULL);
	if (idem_filter_memory_kb == 0)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = filters_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = filters_shmem_startup;
}
