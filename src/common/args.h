/*-------------------------------------------------------------------------
 *
 * args.h
 *	  Checks of SQL-function arguments and result helpers (args.c), and the
 *	  bounds they enforce for every wing.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_ARGS_H
#define IDEM_COMMON_ARGS_H

#include "datatype/timestamp.h"
#include "fmgr.h"
#include "utils/jsonb.h"

/* most rows one call of a relay function leases */
#define IDEM_MAX_BATCH					10000
/* most failed attempts before a dead letter (the settings' maximum) */
#define IDEM_MAX_ATTEMPTS				1000
/* interval arguments (lease, wait, retry_after) are at most this long */
#define IDEM_MAX_ARG_INTERVAL_YEARS		100
#define IDEM_MAX_ARG_INTERVAL_SECS \
	((int64) IDEM_MAX_ARG_INTERVAL_YEARS * DAYS_PER_YEAR * SECS_PER_DAY)

extern void idem_null_argument(const char *what) pg_attribute_noreturn();
extern void idem_check_not_null(FunctionCallInfo fcinfo, int argno, const char *argname);
extern text *idem_text_arg(FunctionCallInfo fcinfo, int argno, const char *what);
extern char *idem_check_name(text *t, const char *what, int maxbytes);
extern char *idem_name_arg(FunctionCallInfo fcinfo, int argno, const char *what, int maxbytes);
extern Jsonb *idem_check_object(Jsonb *j, const char *what);
extern Jsonb *idem_empty_object(void);
extern int64 idem_interval_seconds(Interval *iv);
extern int64 idem_positive_interval_arg(FunctionCallInfo fcinfo, int argno, const char *what);
extern int64 idem_retry_after_arg(FunctionCallInfo fcinfo, int argno, const char *what);
extern int32 idem_batch_arg(FunctionCallInfo fcinfo, int argno, const char *what, int32 max);
extern int	idem_array_arg(FunctionCallInfo fcinfo, int argno, const char *what, Oid elemtype,
						   Datum **elems);
extern Datum idem_build_array(Datum *elems, bool *nulls, int n, Oid elemtype);
extern Datum idem_text_array(char **names, int n);
extern struct TupleDescData *idem_result_tupdesc(FunctionCallInfo fcinfo);

#endif							/* IDEM_COMMON_ARGS_H */
