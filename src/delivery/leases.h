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
#include "fmgr.h"
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

extern int	idem_lease_batch_args(FunctionCallInfo fcinfo, int32 *batch, int64 *lease,
								  const char *what, Datum **names);
extern void idem_lease_fail_args(FunctionCallInfo fcinfo, pg_uuid_t **id, char **error,
								 int64 *retry_after);
extern void idem_lease_extend_args(FunctionCallInfo fcinfo, Datum *values);

#endif							/* IDEM_DELIVERY_LEASES_H */
