/*-------------------------------------------------------------------------
 *
 * keys.c
 *	  Scopes and keys: their rules (length, not empty), the hash of a
 *	  (scope, key) that the value lock and the Bloom filters share, the
 *	  SHA-256 digest of a payload, and a key cut short for messages.
 *
 * Locking rules: none; nothing here touches a table.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/keys.h"

#include "common/cryptohash.h"
#include "common/hashfn.h"
#include "common/sha2.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

/* Reject an empty scope, or one longer than maxbytes. */
void
idem_check_scope(text *scope, int maxbytes)
{
	int			len = VARSIZE_ANY_EXHDR(scope);

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("scope must not be empty")));
	if (len > maxbytes)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("scope name is too long"),
				 errdetail("Scope names are limited to %d bytes; this one has %d.",
						   maxbytes, len)));
}

/* Reject an empty or too long key. */
void
idem_check_key(text *key)
{
	int			len = VARSIZE_ANY_EXHDR(key);

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("key must not be empty")));
	if (len > IDEM_MAX_KEY_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("key is too long"),
				 errdetail("Keys are limited to %d bytes; this one has %d.",
						   IDEM_MAX_KEY_BYTES, len),
				 errhint("Claim a digest of longer keys, for example encode(sha256(convert_to(key, 'UTF8')), 'hex').")));
}

/* A key for messages: at most 100 bytes of it. */
char *
idem_key_for_message(text *key)
{
	char	   *s = text_to_cstring(key);
	int			len = strlen(s);

	if (len > 100)
	{
		len = pg_mbcliplen(s, len, 100);
		s[len] = '\0';
		return psprintf("%s...", s);
	}
	return s;
}

static void
digest_bytes(pg_cryptohash_ctx *ctx, char tag, const void *data, uint32 len)
{
	uint8		head[5];

	head[0] = (uint8) tag;
	head[1] = (uint8) (len >> 24);
	head[2] = (uint8) (len >> 16);
	head[3] = (uint8) (len >> 8);
	head[4] = (uint8) len;
	if (pg_cryptohash_update(ctx, head, sizeof(head)) < 0 ||
		(len > 0 && pg_cryptohash_update(ctx, data, len) < 0))
		elog(ERROR, "could not compute payload digest: %s", pg_cryptohash_error(ctx));
}

/*
 * SHA-256 of a jsonb value in canonical form: jsonb already sorts object
 * keys and drops duplicates, and numbers are written without insignificant
 * zeros, so equal jsonb values (1.0 and 1.00 included) get equal digests.
 * Every token is tagged and length-prefixed, so no two different values
 * feed the same bytes.
 */
void
idem_payload_digest(Jsonb *jb, uint8 *digest)
{
	pg_cryptohash_ctx *ctx = pg_cryptohash_create(PG_SHA256);
	JsonbIterator *it = JsonbIteratorInit(&jb->root);
	JsonbIteratorToken tok;
	JsonbValue	v;

	if (pg_cryptohash_init(ctx) < 0)
		elog(ERROR, "could not compute payload digest: %s", pg_cryptohash_error(ctx));
	while ((tok = JsonbIteratorNext(&it, &v, false)) != WJB_DONE)
	{
		switch (tok)
		{
			case WJB_BEGIN_ARRAY:
				digest_bytes(ctx, v.val.array.rawScalar ? 'S' : '[', NULL, 0);
				break;
			case WJB_END_ARRAY:
				digest_bytes(ctx, ']', NULL, 0);
				break;
			case WJB_BEGIN_OBJECT:
				digest_bytes(ctx, '{', NULL, 0);
				break;
			case WJB_END_OBJECT:
				digest_bytes(ctx, '}', NULL, 0);
				break;
			case WJB_KEY:
				digest_bytes(ctx, 'k', v.val.string.val, v.val.string.len);
				break;
			case WJB_VALUE:
			case WJB_ELEM:
				switch (v.type)
				{
					case jbvNull:
						digest_bytes(ctx, 'n', NULL, 0);
						break;
					case jbvBool:
						digest_bytes(ctx, v.val.boolean ? 't' : 'f', NULL, 0);
						break;
					case jbvString:
						digest_bytes(ctx, 's', v.val.string.val, v.val.string.len);
						break;
					case jbvNumeric:
						{
							char	   *n = numeric_normalize(v.val.numeric);

							digest_bytes(ctx, 'd', n, strlen(n));
							pfree(n);
							break;
						}
					default:
						elog(ERROR, "unexpected jsonb value type %d", (int) v.type);
				}
				break;
			default:
				elog(ERROR, "unexpected jsonb token %d", (int) tok);
		}
	}
	if (pg_cryptohash_final(ctx, digest, PG_SHA256_DIGEST_LENGTH) < 0)
		elog(ERROR, "could not compute payload digest: %s", pg_cryptohash_error(ctx));
	pg_cryptohash_free(ctx);
}

/*
 * 64-bit hash of (scope, key): names the value lock and indexes the Bloom
 * filters of sealed partitions (so it must never change).
 */
uint64
idem_key_hash(text *scope, text *key)
{
	uint64		h;

	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
							VARSIZE_ANY_EXHDR(scope), 0);
	return hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key), h);
}
