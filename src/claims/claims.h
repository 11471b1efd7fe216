/*-------------------------------------------------------------------------
 *
 * claims.h
 *	  The claim protocol, for the subsystems built on it (claims.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLAIMS_CLAIMS_H
#define IDEM_CLAIMS_CLAIMS_H

#include "utils/jsonb.h"

extern bool idem_claim_key(text *scope, text *key, Jsonb *payload, const char *fname);

#endif							/* IDEM_CLAIMS_CLAIMS_H */
