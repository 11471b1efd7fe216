/*-------------------------------------------------------------------------
 *
 * args.c
 *	  Checks of the arguments of the extension's SQL functions, and the few
 *	  helpers that build their results: one place for "must not be null",
 *	  names, JSON objects, intervals, batches and arrays.
 *
 * Locking rules: none; nothing here touches a table.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/args.h"

#include "catalog/pg_type.h"
#include "funcapi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

/*---- argument checks ----*/

void
idem_null_argument(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
			 errmsg("%s must not be null", what)));
}

/* A text argument that must not be NULL. */
text *
idem_text_arg(FunctionCallInfo fcinfo, int argno, const char *what)
{
	if (PG_ARGISNULL(argno))
		idem_null_argument(what);
	return PG_GETARG_TEXT_PP(argno);
}

/* A name: not empty, at most maxbytes. */
char *
idem_check_name(text *t, const char *what, int maxbytes)
{
	int			len = VARSIZE_ANY_EXHDR(t);

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", what)));
	if (len > maxbytes)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("%s is too long", what),
				 errdetail("It is %d bytes long; the limit is %d bytes.", len, maxbytes)));
	return text_to_cstring(t);
}

/* A name argument: not NULL, not empty, at most maxbytes. */
char *
idem_name_arg(FunctionCallInfo fcinfo, int argno, const char *what, int maxbytes)
{
	if (PG_ARGISNULL(argno))
		idem_null_argument(what);
	return idem_check_name(PG_GETARG_TEXT_PP(argno), what, maxbytes);
}

/* A jsonb that must be an object (headers). */
Jsonb *
idem_check_object(Jsonb *j, const char *what)
{
	if (!JB_ROOT_IS_OBJECT(j) || JB_ROOT_IS_SCALAR(j))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a JSON object", what)));
	return j;
}

Jsonb *
idem_empty_object(void)
{
	return DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum("{}")));
}

/*
 * An interval argument as microseconds, months counting as 30 days; more
 * than 100 years either way is refused, so that it cannot overflow, nor
 * make a timestamp out of range when added to now.
 */
static int64
interval_usecs(Interval *iv, const char *what)
{
	int64		secs = IDEM_MAX_ARG_INTERVAL_SECS;

	/* each field bounded on its own, so that no sum of them overflows */
	if (iv->time / USECS_PER_SEC > secs || iv->time / USECS_PER_SEC < -secs ||
		Abs((int64) iv->day) > secs / SECS_PER_DAY ||
		Abs((int64) iv->month) > secs / SECS_PER_DAY / DAYS_PER_MONTH ||
		Abs(idem_interval_seconds(iv)) > secs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not exceed %d years", what, IDEM_MAX_ARG_INTERVAL_YEARS)));
	return iv->time + ((int64) iv->month * DAYS_PER_MONTH + iv->day) * USECS_PER_DAY;
}

int64
idem_positive_interval_arg(FunctionCallInfo fcinfo, int argno, const char *what)
{
	int64		usecs;

	if (PG_ARGISNULL(argno))
		idem_null_argument(what);
	usecs = interval_usecs(PG_GETARG_INTERVAL_P(argno), what);
	if (usecs <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", what)));
	return usecs;
}

/* An optional interval that must not be negative; -1 if NULL. */
int64
idem_retry_after_arg(FunctionCallInfo fcinfo, int argno, const char *what)
{
	int64		usecs;

	if (PG_ARGISNULL(argno))
		return -1;
	usecs = interval_usecs(PG_GETARG_INTERVAL_P(argno), what);
	if (usecs < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be negative", what)));
	return usecs;
}

/* A batch size: not NULL, 1 .. max. */
int32
idem_batch_arg(FunctionCallInfo fcinfo, int argno, const char *what, int32 max)
{
	int32		batch;

	if (PG_ARGISNULL(argno))
		idem_null_argument(what);
	batch = PG_GETARG_INT32(argno);
	if (batch <= 0 || batch > max)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be between 1 and %d", what, max)));
	return batch;
}

/* The non-NULL elements of a one-dimensional array argument. */
int
idem_array_arg(FunctionCallInfo fcinfo, int argno, const char *what, Oid elemtype,
			   Datum **elems)
{
	ArrayType  *arr;
	bool	   *nulls;
	int			n;
	int16		typlen;
	bool		typbyval;
	char		typalign;

	if (PG_ARGISNULL(argno))
		idem_null_argument(what);
	arr = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a one-dimensional array", what)));
	get_typlenbyvalalign(elemtype, &typlen, &typbyval, &typalign);
	deconstruct_array(arr, elemtype, typlen, typbyval, typalign, elems, &nulls, &n);
	for (int i = 0; i < n; i++)
		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%s must not contain nulls", what)));
	return n;
}

Datum
idem_build_array(Datum *elems, bool *nulls, int n, Oid elemtype)
{
	int			dims[1] = {n};
	int			lbs[1] = {1};
	int16		typlen;
	bool		typbyval;
	char		typalign;

	get_typlenbyvalalign(elemtype, &typlen, &typbyval, &typalign);
	return PointerGetDatum(construct_md_array(elems, nulls, 1, dims, lbs, elemtype,
											  typlen, typbyval, typalign));
}

/* A text[] of n C strings. */
Datum
idem_text_array(char **names, int n)
{
	Datum	   *d = palloc(sizeof(Datum) * Max(n, 1));

	for (int i = 0; i < n; i++)
		d[i] = CStringGetTextDatum(names[i]);
	return idem_build_array(d, NULL, n, TEXTOID);
}

/* The blessed descriptor of a function's composite result. */
TupleDesc
idem_result_tupdesc(FunctionCallInfo fcinfo)
{
	TupleDesc	desc;

	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("function returning record called in context that cannot accept type record")));
	return BlessTupleDesc(desc);
}

/* Argument argno must not be NULL. */
void
idem_check_not_null(FunctionCallInfo fcinfo, int argno, const char *argname)
{
	if (PG_ARGISNULL(argno))
		idem_null_argument(argname);
}

/* An interval in seconds, months counting as 30 days. */
int64
idem_interval_seconds(Interval *iv)
{
	/* months count as 30 days, as in EXTRACT(EPOCH FROM interval) */
	return iv->time / USECS_PER_SEC +
		(int64) iv->day * SECS_PER_DAY +
		(int64) iv->month * DAYS_PER_MONTH * SECS_PER_DAY;
}
