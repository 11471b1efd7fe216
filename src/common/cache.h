/*-------------------------------------------------------------------------
 *
 * cache.h
 *	  The invalidation trigger of the per-backend caches (cache.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_CACHE_H
#define IDEM_COMMON_CACHE_H

#include "fmgr.h"

extern Datum idem_cache_invalidate_trigger(FunctionCallInfo fcinfo, const char *fname, bool now);

#endif							/* IDEM_COMMON_CACHE_H */
