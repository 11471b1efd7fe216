/*-------------------------------------------------------------------------
 *
 * keys.h
 *	  Scopes, keys, their hash and payload digests (keys.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_KEYS_H
#define IDEM_COMMON_KEYS_H

#include "utils/jsonb.h"

extern void idem_check_scope(text *scope, int maxbytes);
extern void idem_check_key(text *key);
extern uint64 idem_key_hash(text *scope, text *key);
extern void idem_payload_digest(Jsonb *payload, uint8 *digest);
extern char *idem_key_for_message(text *key);

#endif							/* IDEM_COMMON_KEYS_H */
