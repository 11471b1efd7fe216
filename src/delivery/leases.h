/*-------------------------------------------------------------------------
 *
 * leases.h
 *	  What the outbox and the inbox share (leases.c): row ids that say where
 *	  a row is, row times, lease tokens, the backoff and dead-letter rule.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DELIVERY_LEASES_H
#define IDEM_DELIVERY_LEASES_H

#include "access/transam.h"
#include "datatype/timestamp.h"
#include "utils/uuid.h"

extern void idem_row_id(TimestampTz ts, int32 bucket, FullTransactionId txid, pg_uuid_t *id);
extern bool idem_row_id_parts(const pg_uuid_t *id, TimestampTz *ts, int32 *bucket,
							  FullTransactionId *txid);
extern void idem_row_id_bound(TimestampTz ts, pg_uuid_t *id);
extern TimestampTz idem_row_time(FullTransactionId txid);
extern void idem_lease_token(pg_uuid_t *token);
extern int64 idem_backoff_usecs(int32 attempts);
extern bool idem_attempt_failed(int32 attempts, int max_attempts, int64 retry_after,
								TimestampTz now, TimestampTz *retry_at);

#endif							/* IDEM_DELIVERY_LEASES_H */
