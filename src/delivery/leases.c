/*-------------------------------------------------------------------------
 *
 * leases.c
 *	  What the outbox (outbox.c) and the inbox (inbox.c) share, so that it
 *	  is written once: time-ordered row ids that say where a row is, row
 *	  times unique within a transaction, lease tokens, the backoff and
 *	  dead-letter rule after a failed attempt, and the checks of their
 *	  arguments.
 *
 * Locking rules: none; nothing here touches a table.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "delivery/leases.h"
#include "common/args.h"
#include "common/clock.h"

#include "access/transam.h"
#include "catalog/pg_type.h"
#include "common/pg_prng.h"
#include "fmgr.h"
#include "funcapi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

/* backoff after a failure: 1 s, doubling, at most an hour */
#define BACKOFF_FIRST_USECS		USECS_PER_SEC
#define BACKOFF_MAX_USECS		(USECS_PER_SEC * SECS_PER_HOUR)

/* microseconds from the PostgreSQL epoch (2000) to the Unix epoch (1970) */
#define UNIX_OFFSET_USECS \
	((int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * USECS_PER_DAY)

/* ids carry 48 bits of Unix milliseconds */
#define ID_MAX_MS				((UINT64CONST(1) << 48) - 1)

/*---- ids, times and tokens ----*/

/*
 * A row's id: a UUIDv7 (RFC 9562) that says where the row is.  48 bits of
 * Unix milliseconds, the microseconds within that millisecond in the 12
 * bits of rand_a (its "increased clock precision" use); after the variant,
 * 62 bits: the partition's 24-bit bucket, the low 32 bits of the writing
 * transaction id and 6 random bits.  So a row is found with one probe of
 * one partition's index, ids sort by time, and ids are unique: a
 * transaction's rows are written by one backend, whose row times never
 * repeat (see idem_row_time()).
 */
void
idem_row_id(TimestampTz ts, int32 bucket, FullTransactionId txid, pg_uuid_t *id)
{
	int64		unix_us = ts + UNIX_OFFSET_USECS;
	uint64		ms = (uint64) (unix_us / 1000);
	uint32		sub = (uint32) (unix_us % 1000);
	uint64		low = ((uint64) (bucket & 0xFFFFFF) << 38)
		| ((uint64) XidFromFullTransactionId(txid) << 6)
		| (pg_prng_uint32(&pg_global_prng_state) & 0x3F);

	for (int i = 0; i < 6; i++)
		id->data[i] = (uint8) (ms >> (8 * (5 - i)));
	id->data[6] = (uint8) (0x70 | ((sub >> 8) & 0x0F));
	id->data[7] = (uint8) (sub & 0xFF);
	id->data[8] = (uint8) (0x80 | ((low >> 56) & 0x3F));
	for (int i = 9; i < 16; i++)
		id->data[i] = (uint8) (low >> (8 * (15 - i)));
}

/*
 * What a row id says: its time, the bucket and the writing transaction
 * (its epoch taken as the latest that makes it not newer than the next
 * transaction id; rows live far less than 2^31 transactions).  False if it
 * is not such an id.
 */
bool
idem_row_id_parts(const pg_uuid_t *id, TimestampTz *ts, int32 *bucket,
				  FullTransactionId *txid)
{
	uint64		ms = 0;
	uint64		low = 0;
	uint32		sub;

	if ((id->data[6] & 0xF0) != 0x70 || (id->data[8] & 0xC0) != 0x80)
		return false;
	for (int i = 0; i < 6; i++)
		ms = (ms << 8) | id->data[i];
	sub = ((uint32) (id->data[6] & 0x0F) << 8) | id->data[7];
	if (sub >= 1000)
		return false;
	if (ts != NULL)
		*ts = (TimestampTz) (ms * 1000 + sub) - UNIX_OFFSET_USECS;
	low = id->data[8] & 0x3F;
	for (int i = 9; i < 16; i++)
		low = (low << 8) | id->data[i];
	if (bucket != NULL)
		*bucket = (int32) (low >> 38);
	if (txid != NULL)
	{
		TransactionId xid = (TransactionId) ((low >> 6) & 0xFFFFFFFF);
		FullTransactionId next = ReadNextFullTransactionId();
		uint32		epoch = EpochFromFullTransactionId(next);

		if (xid >= XidFromFullTransactionId(next) && epoch > 0)
			epoch--;
		*txid = FullTransactionIdFromEpochAndXid(epoch, xid);
	}
	return true;
}

/*
 * The smallest id of any row whose time is ts or later: ids compare byte by
 * byte, time first, so [bound(a), bound(b)) holds exactly the ids of rows
 * with a <= time < b.  Times outside what an id can hold are clamped.
 */
void
idem_row_id_bound(TimestampTz ts, pg_uuid_t *id)
{
	uint64		unix_us;
	uint64		ms;
	uint32		sub;

	memset(id->data, 0, sizeof(id->data));
	if (TIMESTAMP_IS_NOBEGIN(ts) || ts < -UNIX_OFFSET_USECS)
		return;					/* before 1970: the smallest id */
	if (TIMESTAMP_IS_NOEND(ts) || ts > PG_INT64_MAX - UNIX_OFFSET_USECS)
	{
		memset(id->data, 0xFF, sizeof(id->data));
		return;
	}
	unix_us = (uint64) (ts + UNIX_OFFSET_USECS);
	ms = unix_us / 1000;
	sub = (uint32) (unix_us % 1000);
	if (ms > ID_MAX_MS)
	{
		memset(id->data, 0xFF, sizeof(id->data));
		return;
	}
	for (int i = 0; i < 6; i++)
		id->data[i] = (uint8) (ms >> (8 * (5 - i)));
	id->data[6] = (uint8) (0x70 | ((sub >> 8) & 0x0F));
	id->data[7] = (uint8) (sub & 0xFF);
}

/*
 * The time of a row written now by transaction txid: the extension's clock,
 * but within one transaction never the same microsecond twice (so its ids
 * are unique: see idem_row_id()) and never back.
 */
TimestampTz
idem_row_time(FullTransactionId txid)
{
	static FullTransactionId last_txid = {0};
	static TimestampTz last = 0;
	TimestampTz now = idem_now();

	if (!FullTransactionIdEquals(txid, last_txid))
	{
		last_txid = txid;
		last = now;
		return now;
	}
	last = now > last ? now : last + 1;
	return last;
}

/* A random (version 4) lease token. */
void
idem_lease_token(pg_uuid_t *token)
{
	uint64		a = pg_prng_uint64(&pg_global_prng_state);
	uint64		b = pg_prng_uint64(&pg_global_prng_state);

	memcpy(token->data, &a, 8);
	memcpy(token->data + 8, &b, 8);
	token->data[6] = (token->data[6] & 0x0F) | 0x40;
	token->data[8] = (token->data[8] & 0x3F) | 0x80;
}

/*---- failed attempts ----*/

/* The wait before retrying what failed "attempts" times: 1 s, doubling, at most 1 h. */
int64
idem_backoff_usecs(int32 attempts)
{
	int64		usecs = BACKOFF_FIRST_USECS;

	for (int i = 1; i < attempts && usecs < BACKOFF_MAX_USECS; i++)
		usecs *= 2;
	return Min(usecs, BACKOFF_MAX_USECS);
}

/*
 * What follows a failed attempt, the "attempts"-th hand-out: true if it was
 * the last one allowed (dead-letter it); otherwise *retry_at is when to try
 * again, after retry_after microseconds if that is not negative, else after
 * the backoff.
 */
bool
idem_attempt_failed(int32 attempts, int max_attempts, int64 retry_after, TimestampTz now,
					TimestampTz *retry_at)
{
	if (attempts >= max_attempts)
		return true;
	*retry_at = now + (retry_after >= 0 ? retry_after : idem_backoff_usecs(attempts));
	return false;
}

/*---- the arguments of the relay functions ----*/

/*
 * The (batch, lease, filter) arguments of idem_outbox_claim() and
 * idem_inbox_claim(), checked; returns the number of names in the filter
 * (a text[] named what, set in *names), or -1 if it is NULL.
 */
int
idem_lease_batch_args(FunctionCallInfo fcinfo, int32 *batch, int64 *lease, const char *what,
					  Datum **names)
{
	*batch = idem_batch_arg(fcinfo, 0, "batch", IDEM_MAX_BATCH);
	*lease = idem_positive_interval_arg(fcinfo, 1, "lease");
	if (PG_ARGISNULL(2))
		return -1;
	return idem_array_arg(fcinfo, 2, what, TEXTOID, names);
}

/*
 * The (id, error, retry_after) arguments of idem_outbox_nack() and
 * idem_inbox_fail(), checked; *retry_after is -1 for the backoff.
 */
void
idem_lease_fail_args(FunctionCallInfo fcinfo, pg_uuid_t **id, char **error, int64 *retry_after)
{
	if (PG_ARGISNULL(0))
		idem_null_argument("id");
	if (PG_ARGISNULL(1))
		idem_null_argument("error");
	*id = PG_GETARG_UUID_P(0);
	*error = text_to_cstring(PG_GETARG_TEXT_PP(1));
	*retry_after = idem_retry_after_arg(fcinfo, 2, "retry_after");
}

/*
 * The (lease_token, lease) arguments of idem_outbox_extend() and
 * idem_inbox_extend(), checked, as the parameters of their statements: the
 * token, the new lease_until, and now (a lease live at now is extended).
 */
void
idem_lease_extend_args(FunctionCallInfo fcinfo, Datum *values)
{
	TimestampTz now = idem_now();
	int64		lease;

	if (PG_ARGISNULL(0))
		idem_null_argument("lease_token");
	lease = idem_positive_interval_arg(fcinfo, 1, "lease");
	values[0] = PG_GETARG_DATUM(0);
	values[1] = TimestampTzGetDatum(now + lease);
	values[2] = TimestampTzGetDatum(now);
}
