/*-------------------------------------------------------------------------
 *
 * outbox_lease.c
 *	  idem_outbox_claim(): leasing aggregates -- the parked ones that are due,
 *	  then those the cursor meets -- and handing out their runs of events.
 *
 * Storage, delivery states and locking rules: see outbox.c.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/outbox.h"

#include "common/catalog.h"
#include "common/spi.h"
#include "common/clock.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/ownership.h"
#include "common/rows.h"
#include "delivery/store.h"
#include "delivery/leases.h"

#include "access/table.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "common/hashfn.h"
#include "common/pg_prng.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "replication/message.h"
#include "storage/itemptr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/guc.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"
#include "utils/xid8.h"
PG_FUNCTION_INFO_V1(idem_outbox_claim);

/*---- claiming ----*/

/* An event read by a claim, kept until the claim returns it. */
typedef struct LeasedEvent
{
	int64		seq;
	HeapTuple	tup;			/* id, event_type, payload, headers, created_at */
	TupleDesc	desc;			/* ... from attribute number "col" on */
	int			col;
} LeasedEvent;

/* Everything one idem_outbox_claim() call works with. */
typedef struct LeaseCall
{
	int32		batch;
	int			taken;			/* events handed out so far */
	TimestampTz now;
	TimestampTz until;
	pg_uuid_t	token;
	Datum		types;			/* aggregate_types filter, or 0 */
	bool		has_types;
	char	  **type_names;
	int			ntype_names;
	const IdemCapGrants *grants;	/* the relay's limits, or NULL */
	const OutboxSubscription *sub;
	ReturnSetInfo *rsinfo;
} LeaseCall;

static bool
type_wanted(LeaseCall *c, const char *type)
{
	if (!idem_capability_allows(c->grants, IDEM_AXIS_TYPE, type))
		return false;
	if (!outbox_subscription_covers(c->sub, type))
		return false;
	if (!c->has_types)
		return true;
	for (int i = 0; i < c->ntype_names; i++)
		if (strcmp(c->type_names[i], type) == 0)
			return true;
	return false;
}

static void
put_leased(LeaseCall *c, Delivery *d, LeasedEvent *ev)
{
	OutboxEvent out;
	Datum		values[11];
	bool		nulls[11];
	bool		isnull;
	int			k = ev->col;

	memcpy(&out.id, DatumGetUUIDP(heap_getattr(ev->tup, k, ev->desc, &isnull)), sizeof(pg_uuid_t));
	out.aggregate_type = d->aggregate_type;
	out.aggregate_id = d->aggregate_id;
	out.seq = ev->seq;
	out.event_type = TextDatumGetCString(heap_getattr(ev->tup, k + 1, ev->desc, &isnull));
	out.payload = DatumGetJsonbP(heap_getattr(ev->tup, k + 2, ev->desc, &isnull));
	out.headers = DatumGetJsonbP(heap_getattr(ev->tup, k + 3, ev->desc, &isnull));
	out.created_at = DatumGetTimestampTz(heap_getattr(ev->tup, k + 4, ev->desc, &isnull));
	outbox_event_values(&out, d->attempts, &c->token, c->until, values, nulls);
	tuplestore_putvalues(c->rsinfo->setResult, c->rsinfo->setDesc, values, nulls);
}

static int
leased_event_cmp(const void *a, const void *b)
{
	int64		x = ((const LeasedEvent *) a)->seq;
	int64		y = ((const LeasedEvent *) b)->seq;

	return x < y ? -1 : (x > y ? 1 : 0);
}

/* The aggregate's undelivered events from the index, in seq order. */
static LeasedEvent *
fetch_run(LeaseCall *c, Delivery *d, int *n)
{
	Datum		values[4];
	LeasedEvent *evs;
	uint64		got;

	values[0] = CStringGetTextDatum(d->aggregate_type);
	values[1] = CStringGetTextDatum(d->aggregate_id);
	values[2] = Int64GetDatum(d->acked);
	values[3] = Int32GetDatum(c->batch - c->taken);
	got = outbox_exec(ST_RUN, values, NULL, SPI_OK_SELECT);
	evs = palloc(sizeof(LeasedEvent) * Max(got, 1));
	for (uint64 r = 0; r < got; r++)
	{
		bool		isnull;

		evs[r].tup = SPI_tuptable->vals[r];
		evs[r].desc = SPI_tuptable->tupdesc;
		evs[r].col = 1;
		evs[r].seq = DatumGetInt64(heap_getattr(evs[r].tup, 6, evs[r].desc, &isnull));
	}
	*n = (int) got;
	return evs;
}

/*
 * Lease d's run of events, from its head, in seq order.  evs are the
 * events the cursor scan found for it (NULL: read them from the index).
 * A seq at or below the newest that has no row was emitted in outbox_mode
 * 'wal' (or its partition is gone after a rewind): it is passed over at the
 * head; inside a run, the run stops before it.
 *
 * The newest seq (outbox_last_seq(), an index probe of every partition) is
 * read only where it decides something: an exhausted head, and a head
 * without a row.  There it is read before the rows it is compared with
 * (the index is read again after it): a seq at or below it has committed,
 * so a later snapshot sees its row if it has one, and an event committed
 * in between is never taken for one that was never stored.  Whether the
 * scan saw all of a run is not asked: with room in the batch, the run is
 * read from the index.
 */
static void
take_run(LeaseCall *c, Delivery *d, LeasedEvent *evs, int nevs)
{
	int			first = -1;
	int			count = 0;
	int64		expect;

	/*
	 * No live lease here: an expired one ends now (and a redrive that waited
	 * for it goes back; then the scan's events may not reach the new head,
	 * which is seen below).
	 */
	Assert(!outbox_lease_live(d, c->now));
	if (d->leased)
		outbox_end_lease(d, c->now);
	if (d->dead && !outbox_apply_dead_policy(d, c->now))
		return;
	if (d->attempts >= outbox_max_attempts && d->acked < outbox_last_seq(d))
	{
		outbox_head_exhausted(d, c->now);
		if (d->dead && !outbox_apply_dead_policy(d, c->now))
			return;
	}

	if (evs != NULL)
	{
		qsort(evs, nevs, sizeof(LeasedEvent), leased_event_cmp);
		for (first = 0; first < nevs && evs[first].seq <= d->acked; first++)
			;
		/* the scan has not reached the head: ask the index */
		if (first == nevs || evs[first].seq != d->acked + 1)
			evs = NULL;
		else
		{
			int64		next = d->acked + 1;

			for (int i = first; i < nevs && evs[i].seq <= next; i++)
				if (evs[i].seq == next)
					next++;
			/* there may be more of the run: read it from the index, if it fits */
			if (c->taken + (next - d->acked - 1) < c->batch)
				evs = NULL;
		}
	}
	if (evs == NULL)
	{
		evs = fetch_run(c, d, &nevs);
		first = 0;
		if ((nevs == 0 || evs[0].seq > d->acked + 1) && !d->last_seq_known)
		{
			/* a test holds the claim here while an emit commits */
			idem_debug_wait("outbox_claim_newest_seq");
			if (outbox_last_seq(d) > d->acked)
				evs = fetch_run(c, d, &nevs);	/* read again, after the newest seq */
		}
		if (nevs == 0 && d->last_seq_known && d->acked < d->last_seq)
		{
			d->acked = d->last_seq;		/* nothing but rows never stored */
			d->changed = true;
		}
		else if (nevs > 0 && evs[0].seq > d->acked + 1 && d->last_seq_known &&
				 evs[0].seq <= d->last_seq)
		{
			d->acked = evs[0].seq - 1;
			d->changed = true;
		}
	}

	expect = d->acked + 1;
	for (int i = first; i < nevs && c->taken < c->batch; i++)
	{
		if (evs[i].seq < expect)
			continue;			/* a duplicate row from the scan */
		if (evs[i].seq != expect)
			break;
		expect++;
		count++;
		c->taken++;
	}
	if (count == 0)
		return;

	d->attempts++;
	d->leased = true;
	d->leased_seq = expect - 1;
	d->token = c->token;
	d->until = c->until;
	d->changed = true;
	expect = d->acked + 1;
	for (int i = first; i < nevs && expect <= d->leased_seq; i++)
	{
		if (evs[i].seq != expect)
			continue;
		put_leased(c, d, &evs[i]);
		expect++;
	}
}

/* Parked aggregates whose time has come (and, under 'skip', dead ones). */
static void
lease_parked(LeaseCall *c, OutboxStatement st)
{
	Datum		values[3];
	char		nulls[3] = {' ', ' ', ' '};
	Delivery   *ds;
	int			n;

	values[0] = TimestampTzGetDatum(c->now);
	values[1] = Int32GetDatum(c->batch - c->taken);
	values[2] = c->types;
	if (!c->has_types)
		nulls[2] = 'n';
	n = (int) outbox_exec(st, values, nulls, SPI_OK_SELECT);
	ds = outbox_read_deliveries(n);
	for (int i = 0; i < n && c->taken < c->batch; i++)
	{
		if (!type_wanted(c, ds[i].aggregate_type))
			continue;			/* a relay limited by prefix: not its type */
		take_run(c, &ds[i], NULL, 0);
		if (!ds[i].leased && !ds[i].dead && ds[i].acked >= outbox_last_seq(&ds[i]))
			ds[i].unpark = true;
	}
	outbox_write_deliveries(ds, n, c->now);
}

/*---- the cursor ----*/

/*
 * A position in the scan order of events: the emitting transaction, then
 * the event id (a transaction's events are final together, so a cursor may
 * stop inside one).
 */
typedef struct OutboxPos
{
	FullTransactionId txid;
	pg_uuid_t	id;
} OutboxPos;

static int
pos_cmp(const OutboxPos *a, const OutboxPos *b)
{
	if (FullTransactionIdPrecedes(a->txid, b->txid))
		return -1;
	if (FullTransactionIdFollows(a->txid, b->txid))
		return 1;
	return memcmp(a->id.data, b->id.data, UUID_LEN);
}

static OutboxPos
pos_at(FullTransactionId txid)
{
	OutboxPos	p;

	p.txid = txid;
	memset(p.id.data, 0, UUID_LEN);
	return p;
}

/*
 * This backend's cursors, one per subscription it relays for (the most
 * recently used few), and when each was last written back.
 */
#define LOCAL_CURSORS	8
typedef struct LocalCursor
{
	int32		subscription;	/* -1: free */
	OutboxPos	pos;
	TimestampTz written;
	uint64		used;
} LocalCursor;
static LocalCursor local_cursors[LOCAL_CURSORS];
static uint64 cursor_uses = 0;

/* The subscription's local cursor, a free or the least recently used slot if none. */
static LocalCursor *
local_cursor_of(int32 subscription)
{
	LocalCursor *victim = &local_cursors[0];

	for (int i = 0; i < LOCAL_CURSORS; i++)
	{
		LocalCursor *l = &local_cursors[i];

		if (l->used > 0 && l->subscription == subscription)
		{
			l->used = ++cursor_uses;
			return l;
		}
		if (l->used < victim->used)
			victim = l;
	}
	memset(victim, 0, sizeof(LocalCursor));
	victim->subscription = subscription;
	victim->used = ++cursor_uses;
	return victim;
}

/*
 * The oldest transaction that may still commit an event, as the scan will
 * see it: the xmin of a snapshot taken now (the scan's, taken later, has a
 * later one), or under REPEATABLE READ of the transaction's snapshot, which
 * the scan uses.  Every event from below it is final and visible to the
 * scan.
 */
static OutboxPos
event_horizon(void)
{
	Snapshot	snap = IsolationUsesXactSnapshot() ? GetTransactionSnapshot()
		: GetLatestSnapshot();
	FullTransactionId next = ReadNextFullTransactionId();
	TransactionId xmin = snap->xmin;
	uint32		epoch = EpochFromFullTransactionId(next);

	if (xmin > XidFromFullTransactionId(next))
		epoch--;
	return pos_at(FullTransactionIdFromEpochAndXid(epoch, xmin));
}

static OutboxPos
read_cursor(LocalCursor *local)
{
	OutboxPos	stored = pos_at(FullTransactionIdFromU64(0));
	OutboxPos	next = pos_at(ReadNextFullTransactionId());
	bool		isnull;

	/* none (after a restore): made by one relay, without waiting for another */
	if (outbox_exec(ST_CURSOR_READ, NULL, NULL, SPI_OK_SELECT) == 0)
	{
		if (outbox_lock_new_row("", "", false))
			(void) outbox_exec(ST_CURSOR_MAKE, NULL, NULL, SPI_OK_INSERT);
	}
	else
	{
		Datum		v = idem_spi_col(0, 1, &isnull);

		if (!isnull)
		{
			stored.txid = DatumGetFullTransactionId(v);
			v = idem_spi_col(0, 2, &isnull);
			if (!isnull)
				memcpy(&stored.id, DatumGetUUIDP(v), sizeof(pg_uuid_t));
		}
	}
	/* from another cluster (a restore): worthless, scan everything */
	if (pos_cmp(&stored, &next) > 0)
		stored = pos_at(FullTransactionIdFromU64(0));
	if (pos_cmp(&local->pos, &next) > 0)
		local->pos = pos_at(FullTransactionIdFromU64(0));
	return pos_cmp(&local->pos, &stored) > 0 ? local->pos : stored;
}

static void
write_cursor(LocalCursor *local, OutboxPos pos, TimestampTz now)
{
	Datum		values[2];

	if (pos_cmp(&pos, &local->pos) > 0)
		local->pos = pos;
	if (now - local->written < OUTBOX_CURSOR_WRITE_USECS && now >= local->written)
		return;
	values[0] = FullTransactionIdGetDatum(local->pos.txid);
	values[1] = UUIDPGetDatum(&local->pos.id);
	(void) outbox_exec(ST_CURSOR_WRITE, values, NULL, SPI_OK_UPDATE);
	local->written = now;
}

/* Candidate aggregates met by the scan, with their events. */
typedef struct Candidate
{
	char	   *aggregate_type;
	char	   *aggregate_id;
	bool		has_row;		/* has a deliveries row */
	bool		tried;			/* a lease was attempted */
	int			nevents;
	int			cap;
	LeasedEvent *events;
} Candidate;

/* The candidates of a page, by aggregate, and in the order met. */
typedef struct CandidateKey
{
	const char *type;
	const char *id;
} CandidateKey;

typedef struct CandidateEntry
{
	CandidateKey key;
	uint32		hash;
	char		status;			/* simplehash's */
	Candidate  *cand;
} CandidateEntry;

static uint32
candidate_hash(const char *type, const char *id)
{
	return hash_combine(hash_bytes((const unsigned char *) type, strlen(type)),
						hash_bytes((const unsigned char *) id, strlen(id)));
}

#define SH_PREFIX		candidates
#define SH_ELEMENT_TYPE	CandidateEntry
#define SH_KEY_TYPE		CandidateKey
#define SH_KEY			key
#define SH_HASH_KEY(tb, k)	candidate_hash((k).type, (k).id)
#define SH_EQUAL(tb, a, b)	(strcmp((a).type, (b).type) == 0 && strcmp((a).id, (b).id) == 0)
#define SH_STORE_HASH
#define SH_GET_HASH(tb, a)	((a)->hash)
#define SH_SCOPE		static inline
#define SH_DECLARE
#define SH_DEFINE
#include "lib/simplehash.h"

typedef struct CandidateSet
{
	candidates_hash *byname;	/* NULL until the first candidate */
	Candidate **list;			/* in order met */
	int			nlist;
	int			cap;
} CandidateSet;

static Candidate *
candidate_get(CandidateSet *cs, const char *type, const char *id, bool create)
{
	CandidateKey key = {type, id};
	CandidateEntry *e;
	bool		found;

	if (cs->byname == NULL)
	{
		if (!create)
			return NULL;
		cs->byname = candidates_create(CurrentMemoryContext, 64, NULL);
	}
	if (!create)
	{
		e = candidates_lookup(cs->byname, key);
		return e != NULL ? e->cand : NULL;
	}
	e = candidates_insert(cs->byname, key, &found);
	if (found)
		return e->cand;
	e->key.type = pstrdup(type);
	e->key.id = pstrdup(id);
	e->cand = palloc0(sizeof(Candidate));
	e->cand->aggregate_type = (char *) e->key.type;
	e->cand->aggregate_id = (char *) e->key.id;
	if (cs->nlist == cs->cap)
	{
		cs->cap = cs->cap == 0 ? 64 : cs->cap * 2;
		cs->list = cs->list == NULL ? palloc(sizeof(Candidate *) * cs->cap)
			: repalloc(cs->list, sizeof(Candidate *) * cs->cap);
	}
	cs->list[cs->nlist++] = e->cand;
	return e->cand;
}

static void
candidate_add_event(Candidate *cand, HeapTuple tup, TupleDesc desc, int64 seq)
{
	if (cand->nevents == cand->cap)
	{
		cand->cap = cand->cap == 0 ? 4 : cand->cap * 2;
		cand->events = cand->events == NULL ? palloc(sizeof(LeasedEvent) * cand->cap)
			: repalloc(cand->events, sizeof(LeasedEvent) * cand->cap);
	}
	cand->events[cand->nevents].seq = seq;
	cand->events[cand->nevents].tup = tup;
	cand->events[cand->nevents].desc = desc;
	cand->events[cand->nevents].col = 5;
	cand->nevents++;
}

/*
 * Lease candidates not tried yet, in the order the scan met them, a group
 * at a time, until the batch is full.  A group is sized by the runs taken
 * so far, so that few rows are locked beyond those that get leased (a
 * locked row stays locked to the other relays until we commit).
 */
static void
lease_candidates(LeaseCall *c, CandidateSet *cs)
{
	char	  **types = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **ids = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **new_types = palloc(sizeof(char *) * Max(cs->nlist, 1));
	char	  **new_ids = palloc(sizeof(char *) * Max(cs->nlist, 1));
	int			next = 0;
	int			leased = 0;
	int			taken_before = c->taken;

	while (c->taken < c->batch && next < cs->nlist)
	{
		int			group = OUTBOX_LEASE_GROUP;
		int			n = 0;
		int			nnew = 0;
		Datum		values[3];
		Delivery   *ds;
		int			nlocked;

		/* runs so far average (taken / leased) events: size the group by that */
		if (leased > 0 && c->taken > taken_before)
			group = Max(1, Min(OUTBOX_SCAN_CHUNK,
							   (int) ((int64) (c->batch - c->taken) * leased /
									  (c->taken - taken_before)) + 1));
		for (; next < cs->nlist && n < group; next++)
		{
			Candidate  *cand = cs->list[next];

			if (cand->tried || cand->nevents == 0)
				continue;
			cand->tried = true;
			types[n] = cand->aggregate_type;
			ids[n++] = cand->aggregate_id;
			if (!cand->has_row)
			{
				new_types[nnew] = cand->aggregate_type;
				new_ids[nnew++] = cand->aggregate_id;
			}
		}
		if (n == 0)
			break;
		/* those another relay is making rows for now are its to lease */
		outbox_ensure_deliveries(new_types, new_ids, &nnew, false);

		outbox_key_arrays(types, ids, n, values);
		values[2] = TimestampTzGetDatum(c->now);
		nlocked = (int) outbox_exec(ST_LOCK_CANDIDATES, values, NULL, SPI_OK_SELECT);
		ds = outbox_read_deliveries(nlocked);
		for (int i = 0; i < nlocked && c->taken < c->batch; i++)
		{
			Candidate  *cand = candidate_get(cs, ds[i].aggregate_type, ds[i].aggregate_id, false);

			take_run(c, &ds[i], cand ? cand->events : NULL, cand ? cand->nevents : 0);
			if (ds[i].leased && outbox_lease_is(&ds[i], &c->token))
				leased++;
		}
		outbox_write_deliveries(ds, nlocked, c->now);
	}
}

/* Where a claim's scan of events stands between pages. */
typedef struct EventScan
{
	OutboxPos	last_seen;		/* the last event scanned */
	OutboxPos	first_pending;	/* the first event scanned that is still pending */
	bool		pending_seen;
	bool		first_page;
} EventScan;

/*
 * Scan a page of events from st->last_seen and lease the aggregates met
 * that can be leased.  The page runs at an SPI level of its own: its rows,
 * its candidates and the rows locked for them are freed when it ends (what
 * the claim hands out is in its tuplestore by then), so a claim's memory
 * does not grow with the pages it scans.  An aggregate tried on an earlier
 * page and met again is tried again: the locking statement passes over it
 * if it is leased (by this claim too) or locked.  Returns the page's rows.
 */
static uint64
scan_page(LeaseCall *c, EventScan *st)
{
	CandidateSet cs = {0};
	SPITupleTable *tt;
	uint64		got;
	Datum		args[2];

	SPI_connect();
	/* pages follow each other by key: each starts at the last row seen */
	args[0] = FullTransactionIdGetDatum(st->last_seen.txid);
	args[1] = UUIDPGetDatum(&st->last_seen.id);
	got = outbox_exec(ST_SCAN, args, NULL, SPI_OK_SELECT);
	tt = SPI_tuptable;
	for (uint64 r = 0; r < got; r++)
	{
		HeapTuple	tup = tt->vals[r];
		TupleDesc	desc = tt->tupdesc;
		bool		isnull;
		int64		seq = DatumGetInt64(heap_getattr(tup, 4, desc, &isnull));
		Datum		acked = heap_getattr(tup, 10, desc, &isnull);
		bool		has_row = !isnull;
		OutboxPos	pos;
		Datum		until;
		char	   *type;
		char	   *id;
		Candidate  *cand;

		pos.txid = DatumGetFullTransactionId(heap_getattr(tup, 1, desc, &isnull));
		memcpy(&pos.id, DatumGetUUIDP(heap_getattr(tup, 5, desc, &isnull)), UUID_LEN);
		if (!st->first_page && pos_cmp(&pos, &st->last_seen) == 0)
			continue;			/* the last row of the previous page */
		st->last_seen = pos;
		if (has_row && seq <= DatumGetInt64(acked))
			continue;			/* delivered */
		(void) heap_getattr(tup, 12, desc, &isnull);
		if (!isnull)
			continue;			/* parked: found through retry_at */
		if (!st->pending_seen)
		{
			st->first_pending = pos;
			st->pending_seen = true;
		}
		until = heap_getattr(tup, 11, desc, &isnull);
		if (!isnull && DatumGetTimestampTz(until) > c->now)
			continue;			/* leased by another relay */
		type = TextDatumGetCString(heap_getattr(tup, 2, desc, &isnull));
		if (!type_wanted(c, type))
			continue;
		id = TextDatumGetCString(heap_getattr(tup, 3, desc, &isnull));
		cand = candidate_get(&cs, type, id, true);
		if (cand->tried)
			continue;
		cand->has_row = has_row;
		candidate_add_event(cand, tup, desc, seq);
	}
	st->first_page = false;
	lease_candidates(c, &cs);
	SPI_finish();
	return got;
}

/*
 * Scan events from the cursor, a page at a time, lease the aggregates met
 * that can be leased, and move the cursor up to the first event still
 * pending.
 */
static void
lease_by_cursor(LeaseCall *c)
{
	OutboxPos	horizon = event_horizon();
	LocalCursor *local = local_cursor_of(c->sub->id);
	OutboxPos	from = read_cursor(local);
	EventScan	st = {0};
	bool		exhausted = false;

	st.last_seen = from;
	st.first_page = true;
	while (c->taken < c->batch)
	{
		if (scan_page(c, &st) < OUTBOX_SCAN_CHUNK)
		{
			exhausted = true;
			break;
		}
	}

	/* the cursor moves up to the first pending event, never past horizon */
	if (st.pending_seen && pos_cmp(&st.first_pending, &horizon) < 0)
		horizon = st.first_pending;
	else if (!st.pending_seen && !exhausted && pos_cmp(&st.last_seen, &horizon) < 0)
		horizon = st.last_seen;
	if (pos_cmp(&horizon, &from) > 0)
		write_cursor(local, horizon, c->now);
}

Datum
idem_outbox_claim(PG_FUNCTION_ARGS)
{
	LeaseCall		c = {0};
	int64		lease;
	IdemAsOwner as;

	Datum	   *elems;

	c.ntype_names = idem_lease_batch_args(fcinfo, &c.batch, &lease, "aggregate_types", &elems);
	if (c.ntype_names >= 0)
	{
		c.type_names = palloc(sizeof(char *) * Max(c.ntype_names, 1));
		for (int i = 0; i < c.ntype_names; i++)
			c.type_names[i] = TextDatumGetCString(elems[i]);
		c.types = PG_GETARG_DATUM(2);
		c.has_types = true;
	}

	/*
	 * A relay limited to some aggregate types: asking for another is
	 * refused; asking for none leases only its own (named in the statements
	 * when the limits are exact names, else filtered here).
	 */
	c.grants = idem_capability_require_any("idem_outbox_claim", IDEM_CAP_RELAY);
	for (int i = 0; i < c.ntype_names; i++)
		idem_capability_check_value("idem_outbox_claim", IDEM_CAP_RELAY, c.grants,
									IDEM_AXIS_TYPE, c.type_names[i]);
	if (!c.has_types && (c.ntype_names = idem_capability_exact_names(c.grants, IDEM_AXIS_TYPE,
																	 &c.type_names)) >= 0)
	{
		c.types = idem_text_array(c.type_names, c.ntype_names);
		c.has_types = true;
	}
	InitMaterializedSRF(fcinfo, 0);
	c.rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	c.now = idem_now();
	c.until = c.now + lease;
	idem_lease_token(&c.token);

	idem_spi_connect_as_owner(&as);
	c.sub = outbox_subscription_open(fcinfo, 3, "idem_outbox_claim", IDEM_CAP_RELAY, c.grants);
	if (!c.has_types && c.sub->ntypes >= 0)
	{
		c.types = c.sub->types_array;
		c.type_names = c.sub->types;
		c.ntype_names = c.sub->ntypes;
		c.has_types = true;
	}
	lease_parked(&c, ST_PARKED_DUE);
	if (outbox_subscription_dead_policy() == DEAD_SKIP && c.taken < c.batch)
		lease_parked(&c, ST_PARKED_DEAD);
	if (c.taken < c.batch)
		lease_by_cursor(&c);
	idem_spi_finish_as_owner(&as);
	return (Datum) 0;
}

