/*-------------------------------------------------------------------------
 *
 * scopes.h
 *	  Claims per scope of a partition, counted without the planner
 *	  (scopes.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_SCOPES_H
#define IDEM_CLAIMS_SCOPES_H

#include "datatype/timestamp.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"

#define IDEM_SCOPE_COUNT_KEY_BYTES 128	/* longest scope a count keeps, + 1 */

typedef struct IdemScopeCount
{
	char		scope[IDEM_SCOPE_COUNT_KEY_BYTES];	/* the hash key */
	TimestampTz first_claim_at;
	TimestampTz last_claim_at;
	int64		claims;
} IdemScopeCount;

struct HTAB;
extern struct HTAB *idem_scope_counts_create(void);
extern void idem_scope_counts_add(struct HTAB *counts, Relation rel, Snapshot snap);

#endif							/* IDEM_CLAIMS_SCOPES_H */
