/*-------------------------------------------------------------------------
 *
 * outbox_settle.c
 *	  Settling leases: idem_outbox_ack, nack and extend, and the dead letters
 *	  (idem_outbox_redrive, idem_outbox_discard).
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
PG_FUNCTION_INFO_V1(idem_outbox_ack);
PG_FUNCTION_INFO_V1(idem_outbox_nack);
PG_FUNCTION_INFO_V1(idem_outbox_extend);
PG_FUNCTION_INFO_V1(idem_outbox_redrive);
PG_FUNCTION_INFO_V1(idem_outbox_discard);

/*---- settling: ack, nack, extend ----*/

/* (aggregate, seq) of an event */
typedef struct FoundEvent
{
	char	   *aggregate_type;
	char	   *aggregate_id;
	int64		seq;
} FoundEvent;

static int
found_event_cmp(const void *a, const void *b)
{
	const FoundEvent *x = a;
	const FoundEvent *y = b;
	int			c = strcmp(x->aggregate_type, y->aggregate_type);

	if (c == 0)
		c = strcmp(x->aggregate_id, y->aggregate_id);
	if (c == 0)
		c = x->seq < y->seq ? -1 : (x->seq > y->seq ? 1 : 0);
	return c;
}

/*
 * The events with these ids, sorted by aggregate and seq; unknown ids are
 * left out, and so are events of aggregate types that g (the caller's
 * limits, NULL for none) does not allow: to a limited relay, another
 * type's event is as good as unknown.
 */
static FoundEvent *
find_events(Datum *ids, int n, int *nfound, const IdemCapGrants *g)
{
	int32	   *buckets = palloc(sizeof(int32) * n);
	FullTransactionId *txids = palloc(sizeof(FullTransactionId) * n);
	Datum	   *k_txids = palloc(sizeof(Datum) * n);
	Datum	   *k_ids = palloc(sizeof(Datum) * n);
	FoundEvent *found = NULL;
	int			cap = 0;

	*nfound = 0;
	for (int i = 0; i < n; i++)
		if (!idem_row_id_parts(DatumGetUUIDP(ids[i]), NULL, &buckets[i], &txids[i]))
			buckets[i] = 0;		/* not an event id */

	/* one statement per partition the ids name (usually one) */
	for (int i = 0; i < n; i++)
	{
		bool		seen = buckets[i] == 0;
		int			m = 0;
		Datum		values[3];
		uint64		got;

		for (int j = 0; j < i && !seen; j++)
			seen = buckets[j] == buckets[i];
		if (seen)
			continue;
		for (int j = i; j < n; j++)
		{
			if (buckets[j] != buckets[i])
				continue;
			k_txids[m] = FullTransactionIdGetDatum(txids[j]);
			k_ids[m++] = ids[j];
		}
		values[0] = idem_build_array(k_txids, NULL, m, XID8OID);
		values[1] = idem_build_array(k_ids, NULL, m, UUIDOID);
		values[2] = Int32GetDatum(buckets[i]);
		got = outbox_exec(ST_FIND_EVENTS, values, NULL, SPI_OK_SELECT);
		if (*nfound + (int) got > cap)
		{
			cap = *nfound + (int) got + 16;
			found = found == NULL ? palloc(sizeof(FoundEvent) * cap)
				: repalloc(found, sizeof(FoundEvent) * cap);
		}
		for (uint64 r = 0; r < got; r++)
		{
			FoundEvent *f = &found[*nfound];
			bool		isnull;

			f->aggregate_type = TextDatumGetCString(idem_spi_col(r, 1, &isnull));
			if (!idem_capability_allows(g, IDEM_AXIS_TYPE, f->aggregate_type))
				continue;
			f->aggregate_id = TextDatumGetCString(idem_spi_col(r, 2, &isnull));
			f->seq = DatumGetInt64(idem_spi_col(r, 3, &isnull));
			(*nfound)++;
		}
	}
	if (*nfound > 1)
		qsort(found, *nfound, sizeof(FoundEvent), found_event_cmp);
	return found;
}

static bool
same_aggregate(const char *t1, const char *i1, const char *t2, const char *i2)
{
	return strcmp(t1, t2) == 0 && strcmp(i1, i2) == 0;
}

/* The distinct aggregates of sorted found events, as key arrays. */
static int
distinct_aggregates(FoundEvent *f, int n, char ***types, char ***ids)
{
	int			m = 0;

	*types = palloc(sizeof(char *) * Max(n, 1));
	*ids = palloc(sizeof(char *) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		if (m > 0 && same_aggregate((*types)[m - 1], (*ids)[m - 1],
									f[i].aggregate_type, f[i].aggregate_id))
			continue;
		(*types)[m] = f[i].aggregate_type;
		(*ids)[m++] = f[i].aggregate_id;
	}
	return m;
}

/*
 * Mark d delivered up to a seq; the lease ends once its run is delivered
 * (and a redrive that waited for that goes back).  attempts counts the
 * hand-outs of the head: a new head that was handed out in the run (a
 * partial ack) keeps the count, a new one starts at 0.  A dead head acked
 * by hand (no lease token) is passed like 'skip' would.  A parked aggregate
 * with nothing known to be pending tries to unpark.
 */
static void
advance(Delivery *d, int64 to, TimestampTz now)
{
	d->acked = to;
	d->error = NULL;
	d->changed = true;
	if (d->dead && d->dead_seq <= to)
		outbox_clear_dead(d, now);
	if (d->leased && d->acked >= d->leased_seq)
		outbox_end_lease(d, now);
	if (!d->leased)
		d->attempts = 0;
	if (d->parked && !d->dead && !d->leased && d->acked >= outbox_last_seq(d))
		d->unpark = true;
}

Datum
idem_outbox_ack(PG_FUNCTION_ARGS)
{
	Datum	   *ids;
	int			n = idem_array_arg(fcinfo, 0, "ids", UUIDOID, &ids);
	bool		fenced = !PG_ARGISNULL(1);
	pg_uuid_t  *token = fenced ? PG_GETARG_UUID_P(1) : NULL;
	TimestampTz now = idem_now();
	FoundEvent *found;
	int			nfound;
	char	  **types;
	char	  **aggs;
	int			nagg;
	Delivery   *ds;
	int			nlocked;
	int			marked = 0;
	const IdemCapGrants *g = idem_capability_require_any("idem_outbox_ack", IDEM_CAP_RELAY);
	IdemAsOwner as;

	idem_spi_connect_as_owner(&as);
	(void) outbox_subscription_open(fcinfo, 2, "idem_outbox_ack", IDEM_CAP_RELAY, g);
	if (n == 0)
	{
		idem_spi_finish_as_owner(&as);
		PG_RETURN_INT32(0);
	}
	found = find_events(ids, n, &nfound, g);
	nagg = distinct_aggregates(found, nfound, &types, &aggs);
	if (!fenced)
		outbox_ensure_deliveries(types, aggs, &nagg, true);
	ds = outbox_lock_deliveries(types, aggs, nagg, &nlocked);
	for (int i = 0, f = 0; i < nlocked; i++)
	{
		Delivery   *d = &ds[i];
		int64		expect = d->acked + 1;

		/* found events and locked rows are both in key order */
		while (f < nfound && !same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											 d->aggregate_type, d->aggregate_id))
			f++;
		if (fenced && !outbox_lease_held(d, token, now))
			continue;
		for (; f < nfound && same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											d->aggregate_type, d->aggregate_id); f++)
		{
			if (found[f].seq < expect)
				continue;
			if (found[f].seq != expect || (fenced && found[f].seq > d->leased_seq))
				break;
			expect++;
		}
		if (expect > d->acked + 1)
		{
			marked += (int) (expect - 1 - d->acked);
			advance(d, expect - 1, now);
		}
	}
	outbox_write_deliveries(ds, nlocked, now);
	idem_spi_finish_as_owner(&as);
	PG_RETURN_INT32(marked);
}

Datum
idem_outbox_nack(PG_FUNCTION_ARGS)
{
	pg_uuid_t  *id;
	char	   *error;
	bool		fenced = !PG_ARGISNULL(3);
	int64		retry_after;
	TimestampTz now = idem_now();
	Datum		idd;
	FoundEvent *found;
	int			nfound;
	Delivery   *d;
	int			nlocked;
	const IdemCapGrants *g;
	IdemAsOwner as;

	idem_lease_fail_args(fcinfo, &id, &error, &retry_after);
	g = idem_capability_require_any("idem_outbox_nack", IDEM_CAP_RELAY);

	idem_spi_connect_as_owner(&as);
	(void) outbox_subscription_open(fcinfo, 4, "idem_outbox_nack", IDEM_CAP_RELAY, g);
	idd = UUIDPGetDatum(id);
	found = find_events(&idd, 1, &nfound, g);
	if (nfound == 0)
	{
		idem_spi_finish_as_owner(&as);
		PG_RETURN_VOID();		/* not an event (any more): nothing to retry */
	}
	if (!fenced)
	{
		int			one = 1;

		outbox_ensure_deliveries(&found[0].aggregate_type, &found[0].aggregate_id, &one, true);
	}
	d = outbox_lock_deliveries(&found[0].aggregate_type, &found[0].aggregate_id, 1, &nlocked);
	if (nlocked == 1 && found[0].seq > d->acked && !d->dead &&
		(!fenced || outbox_lease_held(d, PG_GETARG_UUID_P(3), now)))
	{
		if (d->redrive)
		{
			/* a redrive waited for this lease: back to it, no failure counted */
			outbox_end_lease(d, now);
		}
		else
		{
			TimestampTz retry_at;

			d->error = error;
			outbox_end_lease(d, now);
			if (idem_attempt_failed(d->attempts, outbox_max_attempts, retry_after, now, &retry_at))
			{
				/* dead now; the next claim applies the dead policy */
				outbox_head_exhausted(d, now);
				retry_at = now;
			}
			outbox_park(d, retry_at);
		}
		outbox_write_deliveries(d, 1, now);
	}
	idem_spi_finish_as_owner(&as);
	PG_RETURN_VOID();
}

Datum
idem_outbox_extend(PG_FUNCTION_ARGS)
{
	Datum		values[3];
	uint64		n;
	int64		covered = 0;
	const IdemCapGrants *g;
	IdemAsOwner as;

	idem_lease_extend_args(fcinfo, values);
	g = idem_capability_require_any("idem_outbox_extend", IDEM_CAP_RELAY);
	idem_spi_connect_as_owner(&as);
	(void) outbox_subscription_open(fcinfo, 2, "idem_outbox_extend", IDEM_CAP_RELAY, g);

	/* a limited relay extends nothing if the lease holds another type */
	if (idem_capability_limited(g, IDEM_AXIS_TYPE))
	{
		n = outbox_exec(ST_LEASE_TYPES, values, NULL, SPI_OK_SELECT);
		for (uint64 r = 0; r < n; r++)
		{
			bool		isnull;

			if (!idem_capability_allows(g, IDEM_AXIS_TYPE,
										TextDatumGetCString(idem_spi_col(r, 1, &isnull))))
			{
				idem_spi_finish_as_owner(&as);
				PG_RETURN_INT32(0);
			}
		}
	}
	n = outbox_exec(ST_EXTEND, values, NULL, SPI_OK_UPDATE_RETURNING);
	for (uint64 r = 0; r < n; r++)
	{
		bool		isnull;
		Datum		v = idem_spi_col(r, 1, &isnull);

		if (!isnull)
			covered += DatumGetInt64(v);
	}
	idem_spi_finish_as_owner(&as);
	PG_RETURN_INT32((int32) Min(covered, PG_INT32_MAX));
}

/*---- dead letters: redrive, discard ----*/

/*
 * Lock the dead letters with these ids and their aggregates' deliveries
 * rows; apply fn to each aggregate with the seqs of its dead letters; delete
 * the dead letters.  Returns how many there were.
 */
typedef void (*DeadLetterAction) (Delivery *d, int64 *seqs, int nseqs, TimestampTz now);

static int
settle_dead_letters(FunctionCallInfo fcinfo, DeadLetterAction fn, const char *fname)
{
	Datum	   *ids;
	int			n = idem_array_arg(fcinfo, 0, "ids", UUIDOID, &ids);
	Datum		arr;
	FoundEvent *found;
	int64	   *seqs;
	uint64		got;
	char	  **types;
	char	  **aggs;
	int			nagg;
	Delivery   *ds;
	int			nlocked;
	TimestampTz now = idem_now();
	const IdemCapGrants *g = idem_capability_require_any(fname, IDEM_CAP_OPERATOR);
	IdemAsOwner as;
	Datum	   *mine;
	uint64		nmine = 0;

	idem_spi_connect_as_owner(&as);
	(void) outbox_subscription_open(fcinfo, 1, fname, IDEM_CAP_OPERATOR, g);
	if (n == 0)
	{
		idem_spi_finish_as_owner(&as);
		return 0;
	}
	arr = idem_build_array(ids, NULL, n, UUIDOID);
	got = outbox_exec(ST_FIND_DEAD, &arr, NULL, SPI_OK_SELECT);
	found = palloc(sizeof(FoundEvent) * Max(got, 1));
	seqs = palloc(sizeof(int64) * Max(got, 1));
	mine = palloc(sizeof(Datum) * Max(got, 1));
	/* an operator limited to some aggregate types settles only theirs */
	for (uint64 r = 0; r < got; r++)
	{
		bool		isnull;
		FoundEvent *f = &found[nmine];

		f->aggregate_type = TextDatumGetCString(idem_spi_col(r, 2, &isnull));
		if (!idem_capability_allows(g, IDEM_AXIS_TYPE, f->aggregate_type))
			continue;
		f->aggregate_id = TextDatumGetCString(idem_spi_col(r, 3, &isnull));
		f->seq = DatumGetInt64(idem_spi_col(r, 4, &isnull));
		mine[nmine++] = idem_spi_col(r, 1, &isnull);
	}
	got = nmine;
	arr = idem_build_array(mine, NULL, (int) nmine, UUIDOID);
	nagg = distinct_aggregates(found, (int) got, &types, &aggs);
	outbox_ensure_deliveries(types, aggs, &nagg, true);
	ds = outbox_lock_deliveries(types, aggs, nagg, &nlocked);
	for (int i = 0, f = 0; i < nlocked; i++)
	{
		int			k = 0;

		while (f < (int) got && !same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
												ds[i].aggregate_type, ds[i].aggregate_id))
			f++;
		for (; f < (int) got && same_aggregate(found[f].aggregate_type, found[f].aggregate_id,
											   ds[i].aggregate_type, ds[i].aggregate_id); f++)
			seqs[k++] = found[f].seq;
		if (k > 0)
			fn(&ds[i], seqs, k, now);
	}
	outbox_write_deliveries(ds, nlocked, now);
	(void) outbox_exec(ST_DELETE_DEAD, &arr, NULL, SPI_OK_DELETE);
	idem_spi_finish_as_owner(&as);
	return (int) got;
}

/* Park an aggregate, due now: the next claim takes it from its head. */
static void
park_now(Delivery *d, TimestampTz now)
{
	d->attempts = 0;
	d->error = NULL;
	outbox_end_lease(d, now);
	outbox_park(d, now);
}

/*
 * Redrive: a blocked head is unblocked; an aggregate that went on past a
 * dead event (policy 'skip') goes back to it, so what followed it is
 * delivered again, in order (consumers dedupe on seq).  While a relay holds
 * a live lease on the aggregate, going back waits for that lease to end
 * (end_lease): the holder is never revoked without knowing, and no other
 * relay is handed the aggregate meanwhile.  A dead letter of an event still
 * ahead of the head (it died, and a rewind came back before it) needs
 * nothing: it is delivered in turn.  seqs are sorted.
 */
static void
redrive_aggregate(Delivery *d, int64 *seqs, int nseqs, TimestampTz now)
{
	if (seqs[0] <= d->acked)
	{
		if (outbox_lease_live(d, now))
		{
			if (!d->redrive || seqs[0] < d->redrive_seq)
			{
				d->redrive = true;
				d->redrive_seq = seqs[0];
				d->changed = true;
			}
			return;
		}
		outbox_rewind_to(d, seqs[0], now);
		return;
	}
	for (int i = 0; i < nseqs; i++)
	{
		if (d->dead && seqs[i] == d->dead_seq)
		{
			outbox_clear_dead(d, now);
			park_now(d, now);
		}
	}
}

/* Discard: a blocked head is passed over for good. */
static void
discard_aggregate(Delivery *d, int64 *seqs, int nseqs, TimestampTz now)
{
	for (int i = 0; i < nseqs; i++)
	{
		if (d->dead && seqs[i] == d->dead_seq)
		{
			d->acked = d->dead_seq;
			outbox_clear_dead(d, now);
			park_now(d, now);
		}
	}
}

Datum
idem_outbox_redrive(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(settle_dead_letters(fcinfo, redrive_aggregate, "idem_outbox_redrive"));
}

Datum
idem_outbox_discard(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(settle_dead_letters(fcinfo, discard_aggregate, "idem_outbox_discard"));
}
