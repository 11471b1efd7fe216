/*-------------------------------------------------------------------------
 *
 * guard_rules.c
 *	  The rules of guarded columns: version column types, comparisons and
 *	  finite checks; transition maps and the equality of states.
 *
 * Column rules: a version must be a finite value (NULL: 22004; NaN and
 * +/-infinity: 22023); a stored NULL or NaN is no version yet.  States are
 * parsed with the column type's input function and compared with its
 * default equality operator, never as text, so char(n), booleans, integers,
 * enums and domains behave as their values.
 *
 * The guard triggers (guard_triggers.c) and idem_upsert() /
 * idem_transition() (guard_helpers.c) both judge by these functions, so a
 * guard and a helper never disagree on what is newer or which state is
 * which.  Nothing here keeps state: a transition map is built in the
 * caller's memory context, a state type's equality function is copied into
 * the context the caller names.
 *
 * Locking rules: none of its own.  Types, operators and I/O functions are
 * looked up through the syscache and the typcache, which take and release
 * AccessShareLock on the catalogs they read.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "guards/guards.h"

#include "catalog/pg_type.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/numeric.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"


/*------------------------------------------------------------------------
 * Version columns
 *------------------------------------------------------------------------
 */

/* Is typid (a base type) one a version column may have? */
bool
idem_version_type_ok(Oid typid)
{
	switch (typid)
	{
		case INT2OID:
		case INT4OID:
		case INT8OID:
		case NUMERICOID:
		case TIMESTAMPOID:
		case TIMESTAMPTZOID:
			return true;
		default:
			return false;
	}
}

void
idem_check_version_type(Oid atttypid, const char *colname, Oid relid)
{
	if (!idem_version_type_ok(getBaseType(atttypid)))
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("version column \"%s\" of relation \"%s\" has unsupported type %s",
						colname, get_rel_name(relid), format_type_be(atttypid)),
				 errdetail("A version column must be smallint, integer, bigint, numeric, timestamp or timestamptz.")));
}

/* Three-way comparison of two non-null versions of base type typid. */
static int
version_cmp(Oid typid, Datum a, Datum b)
{
	switch (typid)
	{
		case INT2OID:
			{
				int16		x = DatumGetInt16(a),
							y = DatumGetInt16(b);

				return (x > y) - (x < y);
			}
		case INT4OID:
			{
				int32		x = DatumGetInt32(a),
							y = DatumGetInt32(b);

				return (x > y) - (x < y);
			}
		case INT8OID:
			{
				int64		x = DatumGetInt64(a),
							y = DatumGetInt64(b);

				return (x > y) - (x < y);
			}
		case TIMESTAMPOID:
		case TIMESTAMPTZOID:
			{
				Timestamp	x = DatumGetTimestamp(a),
							y = DatumGetTimestamp(b);

				return (x > y) - (x < y);
			}
		case NUMERICOID:
			return DatumGetInt32(DirectFunctionCall2(numeric_cmp, a, b));
		default:
			elog(ERROR, "unsupported version type %u", typid);
	}
	return 0;					/* keep compiler quiet */
}

/*
 * Is v usable as a new version?  NaN sorts above every number and infinity
 * above every finite value, so either would block every later update for
 * good; -infinity goes with them, so that a version is simply a finite value.
 */
bool
idem_version_finite(Oid typid, Datum v)
{
	switch (typid)
	{
		case NUMERICOID:
			return !numeric_is_nan(DatumGetNumeric(v)) &&
				!numeric_is_inf(DatumGetNumeric(v));
		case TIMESTAMPOID:
		case TIMESTAMPTZOID:
			return !TIMESTAMP_NOT_FINITE(DatumGetTimestamp(v));
		default:
			return true;
	}
}

/* Raise 22023 unless v (non-null, of base type typid) is finite. */
void
idem_check_version_finite(Oid typid, Datum v, const char *colname, const char *relname)
{
	Oid			outfn;
	bool		isvarlena;

	if (idem_version_finite(typid, v))
		return;
	getTypeOutputInfo(typid, &outfn, &isvarlena);
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("new value of version column \"%s\" of relation \"%s\" is not finite",
					colname, relname),
			 errdetail("A version must be a finite value, not %s.",
					   OidOutputFunctionCall(outfn, v))));
}

/*
 * Does a new version (non-null, finite) raise the stored one?  A stored NULL
 * or NaN (written before the guard, or by INSERT, which is not guarded) is
 * no version yet: any version raises it.
 */
bool
idem_version_raised(Oid typid, Datum newv, Datum oldv, bool oldnull)
{
	if (oldnull)
		return true;
	if (typid == NUMERICOID && numeric_is_nan(DatumGetNumeric(oldv)))
		return true;
	return version_cmp(typid, newv, oldv) > 0;
}

/* "stored - incoming" as text, for the log line of a skip. */
char *
idem_version_gap(Oid typid, Datum stored, Datum incoming)
{
	switch (typid)
	{
		case INT2OID:
			return psprintf(INT64_FORMAT,
							(int64) DatumGetInt16(stored) - DatumGetInt16(incoming));
		case INT4OID:
			return psprintf(INT64_FORMAT,
							(int64) DatumGetInt32(stored) - DatumGetInt32(incoming));
		case INT8OID:
			/* via numeric: the difference of two int8 can overflow int8 */
			stored = DirectFunctionCall1(int8_numeric, stored);
			incoming = DirectFunctionCall1(int8_numeric, incoming);
			/* FALLTHROUGH */
		case NUMERICOID:
			return DatumGetCString(DirectFunctionCall1(numeric_out,
													   DirectFunctionCall2(numeric_sub, stored, incoming)));
		case TIMESTAMPOID:
		case TIMESTAMPTZOID:
			if (TIMESTAMP_NOT_FINITE(DatumGetTimestamp(stored)) ||
				TIMESTAMP_NOT_FINITE(DatumGetTimestamp(incoming)))
				return pstrdup("infinite");
			return DatumGetCString(DirectFunctionCall1(interval_out,
													   DirectFunctionCall2(timestamp_mi, stored, incoming)));
		default:
			return pstrdup("?");
	}
}


/*------------------------------------------------------------------------
 * State columns and transition maps
 *------------------------------------------------------------------------
 */

/*
 * Set up stt for a state column of type typid: its input function and the
 * default equality of its base type.  A type without one cannot be a state
 * column: 42883, as PostgreSQL says for DISTINCT on such a type.
 */
void
idem_state_type_init(StateType *stt, Oid typid, int32 typmod, Oid collation,
					 const char *colname, MemoryContext cxt)
{
	TypeCacheEntry *tc = lookup_type_cache(getBaseType(typid), TYPECACHE_EQ_OPR_FINFO);

	if (!OidIsValid(tc->eq_opr) || !OidIsValid(tc->eq_opr_finfo.fn_oid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("could not identify an equality operator for type %s",
						format_type_be(typid)),
				 errdetail("A transition guard compares the states of column \"%s\" with the default equality operator of its type.",
						   colname)));
	stt->typid = typid;
	stt->typmod = typmod;
	stt->collation = collation;
	getTypeInputInfo(typid, &stt->typinput, &stt->typioparam);
	fmgr_info_copy(&stt->eqfn, &tc->eq_opr_finfo, cxt);
}

bool
idem_state_eq(StateType *stt, Datum a, Datum b)
{
	return DatumGetBool(FunctionCall2Coll(&stt->eqfn, stt->collation, a, b));
}

/* The value of a state named in the map; 22023 if the column cannot hold it. */
static Datum
state_parse(StateType *stt, const char *state)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	Datum		result = (Datum) 0;

	PG_TRY();
	{
		result = OidInputFunctionCall(stt->typinput, (char *) state,
									  stt->typioparam, stt->typmod);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		/* rethrown at once as our own error, so no subtransaction is needed */
		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("transitions name state \"%s\", which the state column cannot hold", state),
				 errdetail_internal("%s", edata->message)));
	}
	PG_END_TRY();
	return result;
}

/*
 * Check a transitions map -- a non-empty JSON object whose values are arrays
 * of strings -- and parse each state with stt.  The map is built in the
 * current memory context.
 */
StateMap *
idem_statemap_build(Jsonb *jb, StateType *stt)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	int			depth = 0;
	int			cap = 0;
	char	   *key = NULL;
	StateMap   *m = palloc0(sizeof(StateMap));

	if (JB_ROOT_IS_SCALAR(jb) || !JB_ROOT_IS_OBJECT(jb))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("transitions must be a JSON object"),
				 errdetail("Map each state to an array of the states it may move to, e.g. {\"pending\": [\"dispatched\"]}.")));

	it = JsonbIteratorInit(&jb->root);
	while ((tok = JsonbIteratorNext(&it, &v, false)) != WJB_DONE)
	{
		switch (tok)
		{
			case WJB_BEGIN_OBJECT:
				if (depth != 0)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("transitions for state \"%s\" must be an array of strings", key)));
				depth++;
				break;
			case WJB_KEY:
				key = pnstrdup(v.val.string.val, v.val.string.len);
				if (m->nstates == cap)
				{
					cap = cap ? cap * 2 : 8;
					m->from = m->from ? repalloc(m->from, cap * sizeof(Datum)) : palloc(cap * sizeof(Datum));
					m->ntargets = m->ntargets ? repalloc(m->ntargets, cap * sizeof(int)) : palloc(cap * sizeof(int));
					m->targets = m->targets ? repalloc(m->targets, cap * sizeof(Datum *)) : palloc(cap * sizeof(Datum *));
				}
				m->from[m->nstates] = state_parse(stt, key);
				m->ntargets[m->nstates] = 0;
				m->targets[m->nstates] = NULL;
				m->nstates++;
				break;
			case WJB_VALUE:
				/* a scalar directly under a key */
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("transitions for state \"%s\" must be an array of strings", key)));
				break;
			case WJB_BEGIN_ARRAY:
				if (depth != 1)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("transitions for state \"%s\" must be an array of strings", key)));
				/* the array's size is known: room for all its targets */
				m->targets[m->nstates - 1] = palloc((v.val.array.nElems + 1) * sizeof(Datum));
				depth++;
				break;
			case WJB_ELEM:
				{
					int			i = m->nstates - 1;

					if (v.type != jbvString)
						ereport(ERROR,
								(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
								 errmsg("transitions for state \"%s\" must be an array of strings", key)));
					m->targets[i][m->ntargets[i]++] =
						state_parse(stt, pnstrdup(v.val.string.val, v.val.string.len));
				}
				break;
			case WJB_END_ARRAY:
			case WJB_END_OBJECT:
				depth--;
				break;
			default:
				break;
		}
	}
	if (m->nstates == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("transitions must name at least one state")));
	return m;
}

/*
 * Does the map allow from -> to?  Two keys of the JSON object may be one
 * state of the column ("t" and "true" for a boolean), so every source equal
 * to from is looked at.
 */
bool
idem_statemap_allows(StateMap *m, StateType *stt, Datum from, Datum to)
{
	int			i,
				j;

	for (i = 0; i < m->nstates; i++)
	{
		if (!idem_state_eq(stt, from, m->from[i]))
			continue;
		for (j = 0; j < m->ntargets[i]; j++)
			if (idem_state_eq(stt, to, m->targets[i][j]))
				return true;
	}
	return false;
}
