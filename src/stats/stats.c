/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Cluster-wide counters behind idempotency.stats: claims, duplicates,
 *	  payload mismatches and releases per scope, stale and invalid writes per
 *	  guarded table, started, completed and conflicting requests; and
 *	  idempotency.live_scopes(), the claims per scope of the partitions not
 *	  sealed yet, behind idempotency.consumers.
 *
 * With shared_preload_libraries = 'idempotency' the counters live in one
 * shared hash table for the whole cluster, keyed by (database, relation,
 * scope).  Without preload there is no shared memory, counting costs a
 * pointer test, and the view answers from the tables instead
 * (sql/functions/65_stats.sql).  Counters start at zero when the server starts:
 * nothing is written to disk.  idempotency.track_stats = off stops the
 * counting (for one session, or everywhere).
 *
 * What counts (SPEC section 6).  Claims, duplicates, releases and started
 * and completed requests count what committed: a backend keeps them in
 * memory, per (sub)transaction level, while its transaction runs; a
 * subtransaction that commits hands its part to its parent, one that
 * aborts drops it; the top level publishes to shared memory as it commits
 * (XACT_EVENT_COMMIT: after the commit record, so a transaction that fails
 * at commit -- a deferred constraint, a serialization failure -- publishes
 * nothing).  A prepared transaction publishes when it is prepared: no hook
 * of an extension runs at COMMIT PREPARED, and it almost always commits.
 * Late duplicates count what committed too, except those refused (IK008),
 * which count at once (idem_stats_count_scope_now()), as do payload
 * mismatches, request conflicts, stale and invalid guarded writes: they count
 * at once, although their error (or the caller) may roll the
 * transaction back: the event happened, and for the errors the transaction
 * always fails.  With idempotency.stats_sandbox = on (idem_check_replay()
 * sets it for its call, and the GUC machinery puts it back, on error too)
 * those count only if they commit as well, so the replay's rolled-back
 * runs leave the counters as they were; it hides nothing that commits.
 * A transaction keeps counts for at most IDEM_STATS_PENDING_MAX keys; the
 * scopes it counts in beyond count in its database's overflow row.
 *
 * Room.  The table holds idempotency.stats_max_scopes scope and table rows
 * (all databases together), and one overflow row per database for
 * IDEM_STATS_DATABASES databases, which also hold when the database's
 * counters were last reset and its last maintenance round.  Each database
 * that holds rows may keep a fair share of them: stats_max_scopes divided
 * by the number of such databases (itself included).  A database takes a
 * free row whatever it holds; when none is free, a database below its
 * share takes one from the database holding the most (its least recently
 * counted row of a sample, whose counts move to that database's overflow
 * row: totals are kept), and a database at or above its share counts a
 * new scope in its overflow row.  So one database (a claimer making up
 * scopes) cannot push another's scopes out, and a lone database uses the
 * whole table.  A database beyond IDEM_STATS_DATABASES counts nowhere
 * (stats_info() reports how many events were dropped so).
 *
 * Locking rules: one LWLock guards the table.  Counts are added with
 * atomics under it held shared, to a row looked up under that same hold;
 * rows are made, moved to an overflow row or removed (reset) only under it
 * held exclusively.  So no count lands in a row that was removed and made
 * again for another key meanwhile -- the lookup and the add are one hold.
 * Nothing that can fail runs at commit: the shared hash is preallocated
 * (HASH_ENTER_NULL), and the backend's memory is only freed then.
 * live_scopes() reads the registry and each unsealed partition under the
 * caller's snapshot with AccessShareLock, and only a partition that
 * idem_relation_distrust() accepts (checked before the lock, so another
 * owner's lock cannot stall it, and again under it).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "stats/stats.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/ownership.h"
#include "common/capabilities.h"

#include <limits.h>

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_stats_counters);
PG_FUNCTION_INFO_V1(idem_stats_info);
PG_FUNCTION_INFO_V1(idem_stats_reset);


/* Slots kept for the overflow rows of this many databases. */
#define IDEM_STATS_DATABASES	64

/*
 * Most keys a transaction keeps counts for; those it counts in beyond go
 * to its database's overflow row, so a backfill claiming in very many
 * scopes keeps bounded memory.
 */
#define IDEM_STATS_PENDING_MAX	4096

/* Rows of the fullest database looked at to find one to take back. */
#define IDEM_STATS_EVICT_SAMPLE	64

/* What identifies a row: a scope (relid 0) or a table (scope ""), or neither: the overflow row. */
typedef struct StatsKey
{
	Oid			dboid;
	Oid			relid;
	char		scope[IDEM_MAX_SCOPE_BYTES + 1];
} StatsKey;

typedef struct StatsEntry
{
	StatsKey	key;
	pg_atomic_uint64 counters[IDEM_STAT_NCOUNTERS];
	pg_atomic_uint64 last_claim_at; /* 0: none yet */
	pg_atomic_uint64 last_duplicate_at;
	pg_atomic_uint64 touched_at;	/* last count (a transaction's start) */
	/* overflow rows only */
	TimestampTz reset_at;		/* the database's last reset */
	pg_atomic_uint64 maintained_at; /* its last maintenance round; 0: none */
	int			nrows;			/* its scope and table rows */
} StatsEntry;

typedef struct StatsArea
{
	LWLock	   *lock;
	pg_atomic_uint64 dropped;	/* events of databases without an overflow slot */
	int			nentries;		/* scope and table rows (not overflow rows) */
	int			ndatabases;		/* overflow rows */
	TimestampTz started_at;
	TimestampTz reset_at;		/* server start, or the last reset of all databases */
	StatsEntry *databases[IDEM_STATS_DATABASES];	/* the overflow rows */
} StatsArea;

#define STATS_MAX_SCOPES_DEFAULT	1000
#define STATS_MAX_SCOPES_MAX		1000000
#define STATS_TRACK_DEFAULT			true
#define STATS_SANDBOX_DEFAULT		false

static int	stats_max_scopes = STATS_MAX_SCOPES_DEFAULT;
static bool stats_track = STATS_TRACK_DEFAULT;
static bool stats_sandbox = STATS_SANDBOX_DEFAULT;
static StatsArea *stats_area = NULL;
static HTAB *stats_hash = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*---- this backend's counts of its transaction ----*/

typedef struct PendingCounts
{
	int64		n[IDEM_STAT_NCOUNTERS];
	TimestampTz last_claim_at;	/* 0: none */
	TimestampTz last_duplicate_at;
} PendingCounts;

/* One key's counts at one (sub)transaction level. */
typedef struct PendingFrame
{
	PendingCounts c;
	int			level;
	struct PendingKey *owner;
	struct PendingFrame *below; /* the owner's frame of an enclosing level */
	struct PendingFrame *next;	/* the next frame of this level */
} PendingFrame;

typedef struct PendingKey
{
	StatsKey	key;			/* the hash key */
	PendingFrame *top;			/* innermost level first; NULL: nothing */
	struct PendingKey *next;	/* in the order first counted */
} PendingKey;

static MemoryContext pending_cxt = NULL;	/* emptied as every transaction ends */
static HTAB *pending_hash = NULL;
static PendingKey *pending_last = NULL; /* a handler counts in one scope, over and over */
static PendingKey *pending_first = NULL;	/* published in this order ... */
static PendingKey **pending_tail = &pending_first;	/* ... so the first scopes get rows */
static PendingFrame **level_frames = NULL;	/* per nesting level, its frames */
static int	nlevels = 0;
static bool maintained_pending = false;

/*---- shared memory ----*/

static Size
stats_area_size(void)
{
	return add_size(MAXALIGN(sizeof(StatsArea)),
					hash_estimate_size(stats_max_scopes + IDEM_STATS_DATABASES,
									   sizeof(StatsEntry)));
}

static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(stats_area_size());
	RequestNamedLWLockTranche("idempotency stats", 1);
}

static void
stats_shmem_startup(void)
{
	HASHCTL		info;
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats_area = ShmemInitStruct("idempotency stats", sizeof(StatsArea), &found);
	if (!found)
	{
		memset(stats_area, 0, sizeof(StatsArea));
		stats_area->lock = &(GetNamedLWLockTranche("idempotency stats"))->lock;
		pg_atomic_init_u64(&stats_area->dropped, 0);
		stats_area->started_at = GetCurrentTimestamp();
		stats_area->reset_at = stats_area->started_at;
	}
	/* init size = max size: every element is allocated now, none at commit */
	info.keysize = sizeof(StatsKey);
	info.entrysize = sizeof(StatsEntry);
	stats_hash = ShmemInitHash("idempotency stats entries",
							   stats_max_scopes + IDEM_STATS_DATABASES,
							   stats_max_scopes + IDEM_STATS_DATABASES,
							   &info, HASH_ELEM | HASH_BLOBS);
	LWLockRelease(AddinShmemInitLock);
}

static bool
is_overflow_key(const StatsKey *key)
{
	return key->relid == InvalidOid && key->scope[0] == '\0';
}

static void
zero_counters(StatsEntry *e)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		pg_atomic_write_u64(&e->counters[i], 0);
	pg_atomic_write_u64(&e->last_claim_at, 0);
	pg_atomic_write_u64(&e->last_duplicate_at, 0);
}

/* A new row; the caller holds the lock exclusively. */
static void
init_entry(StatsEntry *e)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		pg_atomic_init_u64(&e->counters[i], 0);
	pg_atomic_init_u64(&e->last_claim_at, 0);
	pg_atomic_init_u64(&e->last_duplicate_at, 0);
	pg_atomic_init_u64(&e->touched_at, 0);
	pg_atomic_init_u64(&e->maintained_at, 0);
	e->reset_at = stats_area->reset_at;
	e->nrows = 0;
}

static void
atomic_max(pg_atomic_uint64 *v, uint64 x)
{
	uint64		old = pg_atomic_read_u64(v);

	while (old < x && !pg_atomic_compare_exchange_u64(v, &old, x))
		;
}

/* Add counts to a row; the caller holds the lock (shared is enough). */
static void
add_counts(StatsEntry *e, const PendingCounts *c, TimestampTz now)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		if (c->n[i] != 0)
			pg_atomic_fetch_add_u64(&e->counters[i], (uint64) c->n[i]);
	if (c->last_claim_at != 0)
		atomic_max(&e->last_claim_at, (uint64) c->last_claim_at);
	if (c->last_duplicate_at != 0)
		atomic_max(&e->last_duplicate_at, (uint64) c->last_duplicate_at);
	pg_atomic_write_u64(&e->touched_at, (uint64) now);
}

static void
add_dropped(const PendingCounts *c)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		pg_atomic_fetch_add_u64(&stats_area->dropped, (uint64) c->n[i]);
}

/*
 * A database's overflow row, made if a slot is free; NULL if none is.  The
 * caller holds the lock exclusively.
 */
static StatsEntry *
database_row(Oid dboid)
{
	StatsKey	okey;
	StatsEntry *e;
	bool		found;

	for (int i = 0; i < stats_area->ndatabases; i++)
		if (stats_area->databases[i]->key.dboid == dboid)
			return stats_area->databases[i];
	if (stats_area->ndatabases >= IDEM_STATS_DATABASES)
		return NULL;
	memset(&okey, 0, sizeof(okey));
	okey.dboid = dboid;
	e = hash_search(stats_hash, &okey, HASH_ENTER_NULL, &found);
	if (e == NULL)
		return NULL;
	init_entry(e);
	stats_area->databases[stats_area->ndatabases++] = e;
	return e;
}

/* The rows a database may keep: an equal part for each database holding rows. */
static int
fair_share(const StatsEntry *db)
{
	int			holders = 0;

	for (int i = 0; i < stats_area->ndatabases; i++)
		if (stats_area->databases[i]->nrows > 0)
			holders++;
	if (db == NULL || db->nrows == 0)
		holders++;
	return stats_max_scopes / holders;
}

/*
 * Take a row back from the database holding the most rows for db, below
 * its share: the least recently counted of a sample of its rows, whose
 * counts move to that database's overflow row.  The caller holds the lock
 * exclusively.
 */
static bool
take_row_back(StatsEntry *db)
{
	StatsEntry *victim = NULL;
	StatsEntry *oldest = NULL;
	StatsEntry *e;
	HASH_SEQ_STATUS seq;
	int			seen = 0;

	for (int i = 0; i < stats_area->ndatabases; i++)
	{
		StatsEntry *d = stats_area->databases[i];

		if (d != db && (victim == NULL || d->nrows > victim->nrows))
			victim = d;
	}
	if (victim == NULL || victim->nrows <= db->nrows)
		return false;

	hash_seq_init(&seq, stats_hash);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		if (e->key.dboid != victim->key.dboid || is_overflow_key(&e->key))
			continue;
		if (oldest == NULL ||
			pg_atomic_read_u64(&e->touched_at) < pg_atomic_read_u64(&oldest->touched_at))
			oldest = e;
		if (++seen >= IDEM_STATS_EVICT_SAMPLE)
		{
			hash_seq_term(&seq);
			break;
		}
	}
	if (oldest == NULL)
		return false;			/* not reached: nrows counts its rows */

	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		pg_atomic_fetch_add_u64(&victim->counters[i], pg_atomic_read_u64(&oldest->counters[i]));
	atomic_max(&victim->last_claim_at, pg_atomic_read_u64(&oldest->last_claim_at));
	atomic_max(&victim->last_duplicate_at, pg_atomic_read_u64(&oldest->last_duplicate_at));
	(void) hash_search(stats_hash, &oldest->key, HASH_REMOVE, NULL);
	victim->nrows--;
	stats_area->nentries--;
	return true;
}

/*
 * The row of a key, made if the database may have one more (see the
 * banner); else its database's overflow row; NULL if that has no slot.
 * The caller holds the lock exclusively.  Fails on nothing.
 */
static StatsEntry *
make_entry(const StatsKey *key)
{
	StatsEntry *e = hash_search(stats_hash, key, HASH_FIND, NULL);
	StatsEntry *db;
	bool		found;

	if (e != NULL)
		return e;
	db = database_row(key->dboid);
	if (db == NULL || is_overflow_key(key))
		return db;
	if (stats_area->nentries >= stats_max_scopes &&
		(db->nrows >= fair_share(db) || !take_row_back(db)))
		return db;
	e = hash_search(stats_hash, key, HASH_ENTER_NULL, &found);
	if (e == NULL)
		return db;
	init_entry(e);
	db->nrows++;
	stats_area->nentries++;
	return e;
}

/*
 * Add the counts of n keys to shared memory: to the rows found under the
 * lock held shared, then, if some have none yet, under it held
 * exclusively.  done[] says which were added.  Runs at commit: fails on
 * nothing.
 */
static void
publish(const StatsKey *const *keys, const PendingCounts *const *counts, bool *done, int n)
{
	TimestampTz now = GetCurrentTransactionStartTimestamp();
	bool		missing = false;

	LWLockAcquire(stats_area->lock, LW_SHARED);
	for (int i = 0; i < n; i++)
	{
		StatsEntry *e = hash_search(stats_hash, keys[i], HASH_FIND, NULL);

		done[i] = e != NULL;
		if (e != NULL)
			add_counts(e, counts[i], now);
		else
			missing = true;
	}
	LWLockRelease(stats_area->lock);
	if (!missing)
		return;

	LWLockAcquire(stats_area->lock, LW_EXCLUSIVE);
	for (int i = 0; i < n; i++)
	{
		StatsEntry *e;

		if (done[i])
			continue;
		e = make_entry(keys[i]);
		if (e != NULL)
			add_counts(e, counts[i], now);
		else
			add_dropped(counts[i]);
		done[i] = true;
	}
	LWLockRelease(stats_area->lock);
}

/*---- counting ----*/

static bool
counts_at_once(IdemStatCounter counter)
{
	return counter == IDEM_STAT_PAYLOAD_MISMATCHES || counter == IDEM_STAT_REQUESTS_CONFLICTED ||
		counter == IDEM_STAT_STALE_SKIPS || counter == IDEM_STAT_INVALID_TRANSITIONS;
}

static void
counts_add(PendingCounts *c, IdemStatCounter counter, int64 n)
{
	c->n[counter] += n;
	if (counter == IDEM_STAT_CLAIMS)
		c->last_claim_at = idem_now();
	else if (counter == IDEM_STAT_DUPLICATES)
		c->last_duplicate_at = idem_now();
}

static void
pending_forget(void)
{
	if (pending_cxt != NULL)
		MemoryContextReset(pending_cxt);
	pending_hash = NULL;
	pending_last = NULL;
	pending_first = NULL;
	pending_tail = &pending_first;
	level_frames = NULL;
	nlevels = 0;
}

/* Keep a count until the transaction at this level commits (see the banner). */
static void
pend(const StatsKey *key, IdemStatCounter counter, int64 n)
{
	int			level = GetCurrentTransactionNestLevel();
	PendingKey *pk = pending_last;
	PendingFrame *f;

	if (pk == NULL || memcmp(&pk->key, key, sizeof(StatsKey)) != 0)
	{
		bool		found;
		StatsKey	okey;

		if (pending_hash == NULL)
		{
			HASHCTL		info;

			if (pending_cxt == NULL)
				pending_cxt = AllocSetContextCreate(TopMemoryContext,
													"idempotency stats of the transaction",
													ALLOCSET_SMALL_SIZES);
			info.keysize = sizeof(StatsKey);
			info.entrysize = sizeof(PendingKey);
			info.hcxt = pending_cxt;
			pending_hash = hash_create("idempotency stats of the transaction", 16, &info,
									   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
		}
		if (hash_get_num_entries(pending_hash) >= IDEM_STATS_PENDING_MAX &&
			hash_search(pending_hash, key, HASH_FIND, NULL) == NULL)
		{
			memset(&okey, 0, sizeof(okey));
			okey.dboid = key->dboid;
			key = &okey;
		}
		pk = hash_search(pending_hash, key, HASH_ENTER, &found);
		if (!found)
		{
			pk->top = NULL;
			pk->next = NULL;
			*pending_tail = pk;
			pending_tail = &pk->next;
		}
		pending_last = pk;
	}
	f = pk->top;
	if (f == NULL || f->level != level)
	{
		if (level >= nlevels)
		{
			int			grown = Max(8, level * 2);

			level_frames = level_frames == NULL ?
				MemoryContextAllocZero(pending_cxt, grown * sizeof(PendingFrame *)) :
				repalloc(level_frames, grown * sizeof(PendingFrame *));
			memset(level_frames + nlevels, 0, (grown - nlevels) * sizeof(PendingFrame *));
			nlevels = grown;
		}
		f = MemoryContextAllocZero(pending_cxt, sizeof(PendingFrame));
		f->level = level;
		f->owner = pk;
		f->below = pk->top;
		pk->top = f;
		f->next = level_frames[level];
		level_frames[level] = f;
	}
	counts_add(&f->c, counter, n);
}

/* Count n events of a key: now, or when the transaction commits. */
static void
count(const StatsKey *key, IdemStatCounter counter, int64 n, bool at_once)
{
	if (!(at_once || counts_at_once(counter)) || stats_sandbox)
		pend(key, counter, n);
	else
	{
		PendingCounts c;
		const StatsKey *keys[1] = {key};
		const PendingCounts *counts[1] = {&c};
		bool		done[1];

		memset(&c, 0, sizeof(c));
		counts_add(&c, counter, n);
		idem_debug_wait("stats-count");
		publish(keys, counts, done, 1);
	}
}

/*
 * Count n events of a scope (at most IDEM_MAX_SCOPE_BYTES bytes), at once
 * if at_once or the counter always counts so, else when the transaction
 * commits.
 */
static void
count_scope(text *scope, IdemStatCounter counter, int64 n, bool at_once)
{
	StatsKey	key;
	int			len;

	if (stats_area == NULL || !stats_track)
		return;
	len = VARSIZE_ANY_EXHDR(scope);
	Assert(len > 0 && len <= IDEM_MAX_SCOPE_BYTES);
	len = Min(len, IDEM_MAX_SCOPE_BYTES);
	memset(&key, 0, sizeof(key));
	key.dboid = MyDatabaseId;
	memcpy(key.scope, VARDATA_ANY(scope), len);
	count(&key, counter, n, at_once);
}

void
idem_stats_count_scope(text *scope, IdemStatCounter counter, int64 n)
{
	count_scope(scope, counter, n, false);
}

/*
 * The same, counted at once although the counter usually counts what
 * commits: for an event whose transaction fails by its error (a late
 * duplicate refused).
 */
void
idem_stats_count_scope_now(text *scope, IdemStatCounter counter, int64 n)
{
	count_scope(scope, counter, n, true);
}

/* Count an event of a guarded table. */
void
idem_stats_count_relation(Oid relid, IdemStatCounter counter)
{
	StatsKey	key;

	if (stats_area == NULL || !stats_track)
		return;
	memset(&key, 0, sizeof(key));
	key.dboid = MyDatabaseId;
	key.relid = relid;
	count(&key, counter, 1, false);
}

/*
 * A maintenance round ran in this transaction: as it commits, record the
 * time in the database's overflow row (idempotency.stats_info()), for
 * monitoring that alerts when maintenance stops.
 */
void
idem_stats_maintained(void)
{
	if (stats_area != NULL)
		maintained_pending = true;
}

/* Keys published under one hold of the lock. */
#define PUBLISH_BATCH 64

/*
 * The transaction commits (or is prepared): publish what it counted, in
 * batches on the stack (nothing is allocated after the commit record).
 */
static void
publish_pending(void)
{
	PendingKey *pk;
	const StatsKey *keys[PUBLISH_BATCH];
	const PendingCounts *counts[PUBLISH_BATCH];
	bool		done[PUBLISH_BATCH];
	int			n = 0;

	for (pk = pending_first; pk != NULL; pk = pk->next)
	{
		if (pk->top == NULL)
			continue;
		/* every subtransaction has ended: what is left is the top level's */
		Assert(pk->top->level == 1 && pk->top->below == NULL);
		keys[n] = &pk->key;
		counts[n] = &pk->top->c;
		if (++n == PUBLISH_BATCH)
		{
			publish(keys, counts, done, n);
			n = 0;
		}
	}
	if (n > 0)
		publish(keys, counts, done, n);
}

static void
publish_maintained(void)
{
	StatsEntry *db;

	LWLockAcquire(stats_area->lock, LW_EXCLUSIVE);
	db = database_row(MyDatabaseId);
	if (db != NULL)
		pg_atomic_write_u64(&db->maintained_at, (uint64) GetCurrentTimestamp());
	LWLockRelease(stats_area->lock);
}

static void
stats_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			publish_pending();
			if (maintained_pending)
				publish_maintained();
			break;
		case XACT_EVENT_PREPARE:
			/* counts, yes (see the banner); a prepared round is not recorded */
			publish_pending();
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			break;
		default:
			return;
	}
	pending_forget();
	maintained_pending = false;
}

/* A subtransaction ends: its counts go to its parent's level, or away. */
static void
stats_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					   SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();
	PendingFrame *f;
	PendingFrame *next;

	if (event != SUBXACT_EVENT_COMMIT_SUB && event != SUBXACT_EVENT_ABORT_SUB)
		return;
	if (level >= nlevels)
		return;
	for (f = level_frames[level], level_frames[level] = NULL; f != NULL; f = next)
	{
		PendingKey *pk = f->owner;

		next = f->next;
		Assert(pk->top == f);
		if (event == SUBXACT_EVENT_ABORT_SUB)
		{
			pk->top = f->below;
			pfree(f);
		}
		else if (f->below != NULL && f->below->level == level - 1)
		{
			PendingFrame *below = f->below;

			for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
				below->c.n[i] += f->c.n[i];
			below->c.last_claim_at = Max(below->c.last_claim_at, f->c.last_claim_at);
			below->c.last_duplicate_at = Max(below->c.last_duplicate_at, f->c.last_duplicate_at);
			pk->top = below;
			pfree(f);
		}
		else
		{
			f->level = level - 1;
			f->next = level_frames[level - 1];
			level_frames[level - 1] = f;
		}
	}
}

/*---- SQL functions ----*/

static bool
counted_any(StatsEntry *e)
{
	for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
		if (pg_atomic_read_u64(&e->counters[i]) != 0)
			return true;
	return false;
}

static Datum
timestamp_or_null(pg_atomic_uint64 *v, bool *isnull)
{
	uint64		t = v != NULL ? pg_atomic_read_u64(v) : 0;

	*isnull = t == 0;
	return TimestampTzGetDatum((TimestampTz) t);
}

/*
 * idempotency.stats_counters(): this database's rows, as counted since the
 * last reset; none without preload.  Columns: scope, relation, the counters
 * in IdemStatCounter order, last_claim_at, last_duplicate_at.
 */
Datum
idem_stats_counters(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	HASH_SEQ_STATUS seq;
	StatsEntry *e;

	InitMaterializedSRF(fcinfo, 0);
	if (stats_area == NULL)
		return (Datum) 0;

	LWLockAcquire(stats_area->lock, LW_SHARED);
	hash_seq_init(&seq, stats_hash);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		Datum		values[IDEM_STAT_NCOUNTERS + 4];
		bool		nulls[IDEM_STAT_NCOUNTERS + 4] = {false};
		int			col = 0;

		if (e->key.dboid != MyDatabaseId)
			continue;
		if (is_overflow_key(&e->key) && !counted_any(e))
			continue;			/* nothing overflowed (it holds the reset time) */
		values[col] = CStringGetTextDatum(e->key.scope);
		nulls[col++] = e->key.scope[0] == '\0';
		values[col] = ObjectIdGetDatum(e->key.relid);
		nulls[col++] = e->key.relid == InvalidOid;
		for (int i = 0; i < IDEM_STAT_NCOUNTERS; i++)
			values[col++] = Int64GetDatum((int64) pg_atomic_read_u64(&e->counters[i]));
		values[col] = timestamp_or_null(&e->last_claim_at, &nulls[col]);
		col++;
		values[col] = timestamp_or_null(&e->last_duplicate_at, &nulls[col]);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	LWLockRelease(stats_area->lock);
	return (Datum) 0;
}

/* This database's overflow row, or NULL; the caller holds the lock. */
static StatsEntry *
my_database_row(void)
{
	for (int i = 0; i < stats_area->ndatabases; i++)
		if (stats_area->databases[i]->key.dboid == MyDatabaseId)
			return stats_area->databases[i];
	return NULL;
}

/*
 * idempotency.stats_info(): whether the counters are kept, the bound, how
 * much of it is used (all databases), events that found no row, when
 * this database's counters were last reset (or the server started), when
 * its last maintenance round committed (since the server started), how
 * many rows it holds and the fair share it may keep.
 */
Datum
idem_stats_info(PG_FUNCTION_ARGS)
{
	TupleDesc	desc = idem_result_tupdesc(fcinfo);
	Datum		values[9];
	bool		nulls[9] = {false};

	values[0] = BoolGetDatum(stats_area != NULL);
	values[1] = Int32GetDatum(stats_max_scopes);
	if (stats_area != NULL)
	{
		StatsEntry *db;

		LWLockAcquire(stats_area->lock, LW_SHARED);
		db = my_database_row();
		values[2] = Int32GetDatum(stats_area->nentries);
		values[3] = Int32GetDatum(stats_area->ndatabases);
		values[5] = TimestampTzGetDatum(db != NULL ? db->reset_at : stats_area->reset_at);
		values[6] = timestamp_or_null(db != NULL ? &db->maintained_at : NULL, &nulls[6]);
		values[7] = Int32GetDatum(db != NULL ? db->nrows : 0);
		values[8] = Int32GetDatum(fair_share(db));
		LWLockRelease(stats_area->lock);
		values[4] = Int64GetDatum((int64) pg_atomic_read_u64(&stats_area->dropped));
	}
	else
	{
		for (int i = 1; i < 9; i++)
			nulls[i] = true;
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, values, nulls)));
}

/*
 * Remove the overflow rows of the databases that were dropped (and hold no
 * row); the caller holds the lock exclusively.
 */
static void
forget_databases(const Oid *gone, int ngone)
{
	for (int g = 0; g < ngone; g++)
	{
		for (int i = 0; i < stats_area->ndatabases; i++)
		{
			StatsEntry *db = stats_area->databases[i];

			if (db->key.dboid != gone[g] || db->nrows != 0)
				continue;
			(void) hash_search(stats_hash, &db->key, HASH_REMOVE, NULL);
			stats_area->databases[i] = stats_area->databases[--stats_area->ndatabases];
			break;
		}
	}
}

/*
 * idem_stats_reset(all_databases boolean DEFAULT false): start this
 * database's counters afresh -- or, for a superuser, every database's.
 * Their scopes and tables give their rows back (an overflowing scope may
 * find one again); their overflow rows are zeroed and record the time.
 * Resetting every database also forgets the dropped events and the
 * overflow rows of databases that no longer exist.
 */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	bool		all;
	HASH_SEQ_STATUS seq;
	StatsEntry *e;
	TimestampTz now = GetCurrentTimestamp();
	Oid			gone[IDEM_STATS_DATABASES];
	int			ngone = 0;

	if (PG_ARGISNULL(0))
		idem_null_argument("all_databases");
	all = PG_GETARG_BOOL(0);
	idem_capability_require_unlimited("idem_stats_reset", IDEM_CAP_OPERATOR);
	if (all && !superuser())
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to reset the statistics of every database"),
				 errdetail("Only a superuser may reset the counters of every database."),
				 errhint("SELECT idem_stats_reset() resets this database's.")));
	if (stats_area == NULL)
	{
		ereport(NOTICE,
				(errmsg("idempotency statistics are not kept"),
				 errdetail("The library is not in shared_preload_libraries.")));
		PG_RETURN_VOID();
	}

	/* which databases are gone is read from the catalog before the lock is taken */
	if (all)
	{
		LWLockAcquire(stats_area->lock, LW_SHARED);
		for (int i = 0; i < stats_area->ndatabases; i++)
			gone[ngone++] = stats_area->databases[i]->key.dboid;
		LWLockRelease(stats_area->lock);
		for (int i = ngone - 1; i >= 0; i--)
			if (SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(gone[i])))
				gone[i] = gone[--ngone];
	}

	LWLockAcquire(stats_area->lock, LW_EXCLUSIVE);
	if (!all)
		(void) database_row(MyDatabaseId);	/* it records the reset */
	hash_seq_init(&seq, stats_hash);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		if (!all && e->key.dboid != MyDatabaseId)
			continue;
		if (is_overflow_key(&e->key))
		{
			zero_counters(e);
			e->reset_at = now;
			e->nrows = 0;
		}
		else
		{
			(void) hash_search(stats_hash, &e->key, HASH_REMOVE, NULL);
			stats_area->nentries--;
		}
	}
	if (all)
	{
		forget_databases(gone, ngone);
		pg_atomic_write_u64(&stats_area->dropped, 0);
		stats_area->reset_at = now;
	}
	LWLockRelease(stats_area->lock);
	PG_RETURN_VOID();
}

/*---- set-up ----*/

void
idem_stats_init(void)
{
	DefineCustomBoolVariable("idempotency.track_stats",
							 "Counts claims, duplicates and guarded writes for idempotency.stats.",
							 "Has effect only when the library is in shared_preload_libraries.",
							 &stats_track,
							 STATS_TRACK_DEFAULT,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);

	DefineCustomBoolVariable("idempotency.stats_sandbox",
							 "Payload mismatches, request conflicts and stale or invalid guarded writes count only if they commit.",
							 "idem_check_replay() sets it for its runs, which all roll back.",
							 &stats_sandbox,
							 STATS_SANDBOX_DEFAULT,
							 PGC_USERSET,
							 GUC_NOT_IN_SAMPLE,
							 NULL, NULL, NULL);

	/* a postmaster setting can only be defined while preloading */
	if (!process_shared_preload_libraries_in_progress)
		return;
	DefineCustomIntVariable("idempotency.stats_max_scopes",
							"Scopes and guarded tables whose counters idempotency.stats keeps.",
							"All databases together, each keeping a fair share when rows run out; "
							"others count in their database's overflow row.",
							&stats_max_scopes,
							STATS_MAX_SCOPES_DEFAULT, 0, STATS_MAX_SCOPES_MAX,
							PGC_POSTMASTER,
							0,
							NULL, NULL, NULL);
	RegisterXactCallback(stats_xact_callback, NULL);
	RegisterSubXactCallback(stats_subxact_callback, NULL);
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}
