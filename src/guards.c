/*-------------------------------------------------------------------------
 *
 * guards.c
 *	  Guarded writes: version and state-transition guards that live on the
 *	  table, plus the idem_upsert() and idem_transition() helpers.
 *
 * A guard is an ordinary BEFORE UPDATE row trigger on the user's table whose
 * configuration is held entirely in its trigger arguments:
 *
 *	  idem_guard_version      -> idempotency.version_guard(column, mode)
 *	  idem_guard_transitions  -> idempotency.transition_guard(column, json, mode)
 *
 * Nothing is stored in extension tables, so pg_dump dumps a guard as the
 * CREATE TRIGGER of a user table and pg_restore brings it back unchanged.
 * The trigger returns NULL to leave the row as it was ("skip"), which also
 * works in the DO UPDATE arm of INSERT ... ON CONFLICT, or raises IK004 /
 * IK005 ("error").  Trigger state (column number, the transition map parsed
 * into values of the state column) is cached in the trigger's FmgrInfo for
 * the life of one statement.
 *
 * Column rules: a version must be a finite value (NULL: 22004; NaN and
 * +/-infinity: 22023); a stored NULL or NaN is no version yet.  States are
 * parsed with the column type's input function and compared with its
 * default equality operator, never as text, so char(n), booleans, integers,
 * enums and domains behave as their values.  Generated columns cannot be
 * guarded (BEFORE triggers do not see their new values).  On a table with
 * both guards, an update that names the state column with the row's state
 * and raises the version is applied: the version tells a newer snapshot
 * from a redelivery.  A partition's guard cloned from its partitioned table
 * can only be changed there.
 *
 * idem_upsert() and idem_transition() run ordinary SQL through SPI as the
 * calling role: no SECURITY DEFINER anywhere, so privileges, RLS and the
 * guards themselves apply exactly as for hand-written statements.  Their
 * plans are prepared once per table and kept in backend-local caches of at
 * most GUARD_PLAN_CACHE_SIZE tables each, least recently used evicted, that
 * a relcache callback invalidates when a table changes; an entry in use by
 * a running call is never freed.
 *
 * Locking rules:
 *	- Installing or removing a guard checks ownership first, then takes
 *	  ShareRowExclusiveLock on the table (what CREATE/DROP TRIGGER take
 *	  anyway), held to the end of the transaction.  Installing on a
 *	  partitioned table takes the same lock on all its partitions (as
 *	  CREATE TRIGGER does) before looking at their triggers; pg_trigger is
 *	  read with AccessShareLock.
 *	- The triggers take no locks of their own; the UPDATE that fires them
 *	  holds the row.  Only when describing a row in a message is the primary
 *	  key index opened, with AccessShareLock.
 *	- idem_upsert() / idem_transition() take AccessShareLock on the table
 *	  while (re)building a plan; executing takes what the statements take
 *	  (RowExclusiveLock; idem_transition locks the row FOR UPDATE before it
 *	  updates it, so its read and its write see the same row version; on a
 *	  table with a transition guard, idem_upsert's first statement leaves
 *	  the conflicting row locked when it declines to update it, so the
 *	  second statement sees the same row version).
 *
 * Counters are per backend (idem_guard_counts below, exposed through
 * idempotency.guard_stats()); no shared memory is used here.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/sysattr.h"
#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/objectaddress.h"
#include "catalog/pg_class.h"
#include "catalog/pg_inherits.h"
#include "catalog/pg_operator.h"
#include "catalog/pg_trigger.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "access/stratnum.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "lib/ilist.h"
#include "miscadmin.h"
#include "nodes/bitmapset.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/numeric.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

/*---- version shims ----*/

#if PG_VERSION_NUM >= 160000
#define guard_is_owner(relid) object_ownercheck(RelationRelationId, (relid), GetUserId())
#else
#define guard_is_owner(relid) pg_class_ownercheck((relid), GetUserId())
#endif

#if PG_VERSION_NUM < 140000
/* message_level_is_interesting() appeared in 14; be conservative before */
#define message_level_is_interesting(lvl) true
#endif

/*---- names ----*/

#define VERSION_TRIGGER_NAME	"idem_guard_version"
#define TRANSITION_TRIGGER_NAME	"idem_guard_transitions"
#define VERSION_TRIGGER_FUNC	IDEM_SCHEMA ".version_guard"
#define TRANSITION_TRIGGER_FUNC	IDEM_SCHEMA ".transition_guard"

/*---- GUC variables ----*/

static int	guard_log_level = DEBUG1;

static const struct config_enum_entry guard_log_level_options[] = {
	{"debug5", DEBUG5, false},
	{"debug4", DEBUG4, false},
	{"debug3", DEBUG3, false},
	{"debug2", DEBUG2, false},
	{"debug1", DEBUG1, false},
	{"debug", DEBUG2, true},
	{"info", INFO, false},
	{"notice", NOTICE, false},
	{"warning", WARNING, false},
	{"log", LOG, false},
	{NULL, 0, false}
};

/*---- per-backend counters ----*/

static IdemGuardCounters idem_guard_counts;

/*---- function declarations ----*/

PG_FUNCTION_INFO_V1(idem_version_guard);
PG_FUNCTION_INFO_V1(idem_transition_guard);
PG_FUNCTION_INFO_V1(idem_guard_version);
PG_FUNCTION_INFO_V1(idem_guard_transitions);
PG_FUNCTION_INFO_V1(idem_unguard);
PG_FUNCTION_INFO_V1(idem_upsert);
PG_FUNCTION_INFO_V1(idem_transition);
PG_FUNCTION_INFO_V1(idem_guard_stats);
PG_FUNCTION_INFO_V1(idem_guard_stats_reset);

/* Which guard a trigger invocation or an install call is about. */
typedef enum GuardKind
{
	GUARD_VERSION,
	GUARD_TRANSITIONS
} GuardKind;

/*
 * How the states of one state column are parsed and compared: with the
 * column type's input function (so a domain's checks and a char(n)'s
 * padding apply) and the default equality operator of its base type, under
 * the column's collation.  Never by output text: 'pending' and 'pending   '
 * are one char(10) state, 't' and 'true' one boolean.
 */
typedef struct StateType
{
	Oid			typid;			/* column type, possibly a domain */
	int32		typmod;
	Oid			collation;
	Oid			typinput;
	Oid			typioparam;
	FmgrInfo	eqfn;			/* equality of the base type */
} StateType;

/* A transition map, its states parsed into values of the state column. */
typedef struct StateMap
{
	int			nstates;		/* number of source states */
	Datum	   *from;			/* each source state */
	int		   *ntargets;
	Datum	  **targets;		/* the states each source may move to */
} StateMap;

/* What a guard trigger needs per statement, cached in flinfo->fn_extra. */
typedef struct GuardTrigState
{
	Oid			tgoid;			/* trigger this was built for */
	MemoryContext cxt;			/* holds what the map needs */
	AttrNumber	attnum;			/* guarded column in tg_relation */
	Oid			typid;			/* its base type */
	bool		raise;			/* mode 'error' rather than 'skip' */
	FmgrInfo	outfn;			/* output function, for messages */
	/* transition guard only */
	StateType	stt;
	StateMap   *map;
	AttrNumber	verattnum;		/* the table's version guard column, or 0 */
	Oid			vertypid;		/* its base type */
} GuardTrigState;


/*------------------------------------------------------------------------
 * Small helpers
 *------------------------------------------------------------------------
 */

/* Public copy of the counters, for a future stats view. */
void
idem_guard_counters(IdemGuardCounters *out)
{
	*out = idem_guard_counts;
}

/* Is typid (a base type) one a version column may have? */
static bool
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

static void
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
static bool
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
static void
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
static bool
idem_version_raised(Oid typid, Datum newv, Datum oldv, bool oldnull)
{
	if (oldnull)
		return true;
	if (typid == NUMERICOID && numeric_is_nan(DatumGetNumeric(oldv)))
		return true;
	return version_cmp(typid, newv, oldv) > 0;
}

/* "stored - incoming" as text, for the log line of a skip. */
static char *
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

/*
 * "(id)=(42)" for the primary key of a row, or NULL when the table has no
 * primary key on plain columns or the caller may not read it.
 */
static char *
row_key_desc(Relation rel, HeapTuple tuple)
{
	Oid			indexoid = RelationGetPrimaryKeyIndex(rel);
	Relation	idx;
	Datum		values[INDEX_MAX_KEYS];
	bool		isnull[INDEX_MAX_KEYS];
	char	   *desc = NULL;
	int			i,
				nkeys;

	if (!OidIsValid(indexoid))
		return NULL;
	idx = index_open(indexoid, AccessShareLock);
	nkeys = IndexRelationGetNumberOfKeyAttributes(idx);
	for (i = 0; i < nkeys; i++)
	{
		AttrNumber	attno = idx->rd_index->indkey.values[i];

		if (attno <= 0)
			break;
		values[i] = heap_getattr(tuple, attno, RelationGetDescr(rel), &isnull[i]);
	}
	/* BuildIndexValueDescription checks the caller's SELECT rights */
	if (i == nkeys)
		desc = BuildIndexValueDescription(idx, values, isnull);
	index_close(idx, AccessShareLock);
	return desc;
}

/* May the current user read column attnum of relid (for messages)? */
static bool
column_readable(Oid relid, AttrNumber attnum)
{
	return pg_class_aclcheck(relid, GetUserId(), ACL_SELECT) == ACLCHECK_OK ||
		pg_attribute_aclcheck(relid, attnum, GetUserId(), ACL_SELECT) == ACLCHECK_OK;
}

/* Parse an on_stale / on_invalid argument. Returns true for 'error'. */
static bool
parse_mode(const char *mode, const char *argname)
{
	if (strcmp(mode, "skip") == 0)
		return false;
	if (strcmp(mode, "error") == 0)
		return true;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("invalid value for %s: \"%s\"", argname, mode),
			 errhint("Use 'skip' or 'error'.")));
	return false;				/* keep compiler quiet */
}

/*
 * Set up stt for a state column of type typid: its input function and the
 * default equality of its base type.  A type without one cannot be a state
 * column: 42883, as PostgreSQL says for DISTINCT on such a type.
 */
static void
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

static bool
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
static StateMap *
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
static bool
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


/*
 * A stored generated column is computed after BEFORE UPDATE triggers fire,
 * so a guard on it would compare the old value with itself: refuse it.
 */
static void
check_not_generated(char attgenerated, const char *colname, const char *relname)
{
	if (attgenerated)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("cannot guard generated column \"%s\" of relation \"%s\"",
						colname, relname),
				 errdetail("A generated column gets its new value only after BEFORE UPDATE triggers have fired, so a guard cannot see it."),
				 errhint("Guard a column that writers set.")));
}

/* The enabled-or-not guard trigger called name on rel, as the guards make it. */
static Trigger *
idem_find_guard_trigger(Relation rel, const char *name)
{
	TriggerDesc *trigdesc = rel->trigdesc;
	int			nargs = strcmp(name, VERSION_TRIGGER_NAME) == 0 ? 2 : 3;
	int			i;

	for (i = 0; trigdesc && i < trigdesc->numtriggers; i++)
		if (strcmp(trigdesc->triggers[i].tgname, name) == 0 &&
			trigdesc->triggers[i].tgnargs == nargs)
			return &trigdesc->triggers[i];
	return NULL;
}


/*------------------------------------------------------------------------
 * The guard triggers
 *------------------------------------------------------------------------
 */

/* Check the trigger protocol and return (building if needed) its state. */
static GuardTrigState *
guard_trig_state(FunctionCallInfo fcinfo, GuardKind kind)
{
	TriggerData *td = (TriggerData *) fcinfo->context;
	Trigger    *tg;
	GuardTrigState *st = (GuardTrigState *) fcinfo->flinfo->fn_extra;
	TupleDesc	tupdesc;
	Form_pg_attribute att;
	int			attnum;
	Oid			outfn;
	bool		isvarlena;
	int			nargs = (kind == GUARD_VERSION) ? 2 : 3;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"%s\" was not called by trigger manager",
						kind == GUARD_VERSION ? VERSION_TRIGGER_FUNC : TRANSITION_TRIGGER_FUNC)));
	if (!TRIGGER_FIRED_BY_UPDATE(td->tg_event) ||
		!TRIGGER_FIRED_BEFORE(td->tg_event) ||
		!TRIGGER_FIRED_FOR_ROW(td->tg_event))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("guard trigger must be fired BEFORE UPDATE FOR EACH ROW")));

	tg = td->tg_trigger;
	if (st != NULL && st->tgoid == tg->tgoid)
		return st;

	if (tg->tgnargs != nargs)
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("guard trigger \"%s\" on relation \"%s\" has %d arguments, expected %d",
						tg->tgname, RelationGetRelationName(td->tg_relation),
						tg->tgnargs, nargs),
				 errhint("Install guards with idem_guard_version() or idem_guard_transitions().")));

	tupdesc = RelationGetDescr(td->tg_relation);
	attnum = SPI_fnumber(tupdesc, tg->tgargs[0]);
	if (attnum <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_COLUMN),
				 errmsg("column \"%s\" guarded by trigger \"%s\" does not exist in relation \"%s\"",
						tg->tgargs[0], tg->tgname, RelationGetRelationName(td->tg_relation)),
				 errhint("A renamed column needs its guard installed again.")));
	att = TupleDescAttr(tupdesc, attnum - 1);
	/* a trigger made by hand or restored from elsewhere: same rules as installing */
	check_not_generated(att->attgenerated, NameStr(att->attname),
						RelationGetRelationName(td->tg_relation));
	if (kind == GUARD_VERSION)
		idem_check_version_type(att->atttypid, tg->tgargs[0], RelationGetRelid(td->tg_relation));

	if (st == NULL)
		st = MemoryContextAllocZero(fcinfo->flinfo->fn_mcxt, sizeof(GuardTrigState));
	else if (st->cxt)
		MemoryContextDelete(st->cxt);
	st->tgoid = InvalidOid;		/* not valid until filled in */
	st->cxt = NULL;
	st->map = NULL;
	st->verattnum = InvalidAttrNumber;
	st->attnum = attnum;
	st->typid = getBaseType(att->atttypid);
	getTypeOutputInfo(att->atttypid, &outfn, &isvarlena);
	fmgr_info_cxt(outfn, &st->outfn, fcinfo->flinfo->fn_mcxt);
	if (kind == GUARD_VERSION)
		st->raise = parse_mode(tg->tgargs[1], "on_stale");
	else
	{
		Trigger    *vtg = idem_find_guard_trigger(td->tg_relation, VERSION_TRIGGER_NAME);
		MemoryContext oldcxt;

		st->raise = parse_mode(tg->tgargs[2], "on_invalid");
		/* the map's values live as long as this state, in a context of their own */
		st->cxt = AllocSetContextCreate(fcinfo->flinfo->fn_mcxt, "idempotency transition map",
										ALLOCSET_SMALL_SIZES);
		oldcxt = MemoryContextSwitchTo(st->cxt);
		idem_state_type_init(&st->stt, att->atttypid, att->atttypmod, att->attcollation,
							 NameStr(att->attname), st->cxt);
		st->map = idem_statemap_build(DatumGetJsonbP(DirectFunctionCall1(jsonb_in,
																		 CStringGetDatum(tg->tgargs[1]))),
									  &st->stt);
		MemoryContextSwitchTo(oldcxt);

		/* with a version guard beside it, the version tells a repeat from news */
		if (vtg != NULL && vtg->tgenabled != TRIGGER_DISABLED)
		{
			int			vatt = SPI_fnumber(tupdesc, vtg->tgargs[0]);

			if (vatt > 0 &&
				idem_version_type_ok(getBaseType(TupleDescAttr(tupdesc, vatt - 1)->atttypid)))
			{
				st->verattnum = vatt;
				st->vertypid = getBaseType(TupleDescAttr(tupdesc, vatt - 1)->atttypid);
			}
		}
	}
	fcinfo->flinfo->fn_extra = st;
	st->tgoid = tg->tgoid;
	return st;
}

/*
 * idempotency.version_guard(column, mode): BEFORE UPDATE row trigger that
 * lets an update through only if it raises the version.
 */
Datum
idem_version_guard(PG_FUNCTION_ARGS)
{
	GuardTrigState *st = guard_trig_state(fcinfo, GUARD_VERSION);
	TriggerData *td = (TriggerData *) fcinfo->context;
	Relation	rel = td->tg_relation;
	TupleDesc	tupdesc = RelationGetDescr(rel);
	HeapTuple	oldtup = td->tg_trigtuple;
	HeapTuple	newtup = td->tg_newtuple;
	Datum		oldv,
				newv;
	bool		oldnull,
				newnull;
	int			elevel;

	newv = heap_getattr(newtup, st->attnum, tupdesc, &newnull);
	if (newnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("new value of version column \"%s\" of relation \"%s\" is null",
						NameStr(TupleDescAttr(tupdesc, st->attnum - 1)->attname),
						RelationGetRelationName(rel)),
				 errdetail("A version-guarded table needs a version on every update.")));
	idem_check_version_finite(st->typid, newv,
							  NameStr(TupleDescAttr(tupdesc, st->attnum - 1)->attname),
							  RelationGetRelationName(rel));
	oldv = heap_getattr(oldtup, st->attnum, tupdesc, &oldnull);

	if (idem_version_raised(st->typid, newv, oldv, oldnull))
		return PointerGetDatum(newtup);

	/* stale or equal: leave the row as it is, or refuse */
	if (st->raise)
	{
		idem_guard_counts.stale_rejected++;
		elevel = ERROR;
	}
	else
	{
		idem_guard_counts.stale_skipped++;
		elevel = guard_log_level;
	}

	if (elevel >= ERROR || message_level_is_interesting(elevel))
	{
		StringInfoData detail;
		char	   *key = row_key_desc(rel, oldtup);
		const char *colname = NameStr(TupleDescAttr(tupdesc, st->attnum - 1)->attname);

		initStringInfo(&detail);
		if (key)
			appendStringInfo(&detail, "Key %s: ", key);
		if (column_readable(RelationGetRelid(rel), st->attnum))
			appendStringInfo(&detail, "%s %s %s is not greater than the stored %s (gap %s).",
							 key ? "new" : "New",
							 colname, OutputFunctionCall(&st->outfn, newv),
							 OutputFunctionCall(&st->outfn, oldv),
							 idem_version_gap(st->typid, oldv, newv));
		else
			appendStringInfo(&detail, "%s %s is not greater than the stored one.",
							 key ? "new" : "New", colname);

		ereport(elevel,
				(errcode(elevel >= ERROR ? ERRCODE_IDEM_STALE_VERSION : ERRCODE_SUCCESSFUL_COMPLETION),
				 elevel >= ERROR ?
				 errmsg("stale version in update of relation \"%s\"", RelationGetRelationName(rel)) :
				 errmsg("skipped stale update of relation \"%s\"", RelationGetRelationName(rel)),
				 errdetail_internal("%s", detail.data)));
	}
	return PointerGetDatum(NULL);
}

/*
 * idempotency.transition_guard(column, transitions, mode): BEFORE UPDATE OF
 * column row trigger that lets a state change through only along an edge of
 * the map, and turns a repeat of the current state into a no-op.
 */
Datum
idem_transition_guard(PG_FUNCTION_ARGS)
{
	GuardTrigState *st = guard_trig_state(fcinfo, GUARD_TRANSITIONS);
	TriggerData *td = (TriggerData *) fcinfo->context;
	Relation	rel = td->tg_relation;
	TupleDesc	tupdesc = RelationGetDescr(rel);
	HeapTuple	oldtup = td->tg_trigtuple;
	HeapTuple	newtup = td->tg_newtuple;
	Datum		oldd,
				newd;
	bool		oldnull,
				newnull;
	int			elevel;
	char	   *key;
	StringInfoData detail;

	/* updates that do not name the state column are none of our business */
	if (!bms_is_member(st->attnum - FirstLowInvalidHeapAttributeNumber,
					   td->tg_updatedcols))
		return PointerGetDatum(newtup);

	oldd = heap_getattr(oldtup, st->attnum, tupdesc, &oldnull);
	newd = heap_getattr(newtup, st->attnum, tupdesc, &newnull);

	/* the state it already has */
	if ((oldnull && newnull) ||
		(!oldnull && !newnull && idem_state_eq(&st->stt, oldd, newd)))
	{
		/*
		 * Beside a version guard, an update that raises the version is news
		 * (a newer snapshot in the same state): let it through.  Otherwise it
		 * is a repeat of an applied transition: keep the whole row.
		 */
		if (st->verattnum != InvalidAttrNumber)
		{
			Datum		oldv,
						newv;
			bool		oldvnull,
						newvnull;

			newv = heap_getattr(newtup, st->verattnum, tupdesc, &newvnull);
			oldv = heap_getattr(oldtup, st->verattnum, tupdesc, &oldvnull);
			if (!newvnull && idem_version_finite(st->vertypid, newv) &&
				idem_version_raised(st->vertypid, newv, oldv, oldvnull))
				return PointerGetDatum(newtup);
		}
		idem_guard_counts.already_applied++;
		if (message_level_is_interesting(guard_log_level))
			ereport(guard_log_level,
					(errmsg("skipped already-applied transition of relation \"%s\" to state %s",
							RelationGetRelationName(rel),
							newnull ? "NULL" :
							quote_literal_cstr(OutputFunctionCall(&st->outfn, newd)))));
		return PointerGetDatum(NULL);
	}

	/* a row without a state yet may take any state */
	if (oldnull)
		return PointerGetDatum(newtup);
	if (!newnull && idem_statemap_allows(st->map, &st->stt, oldd, newd))
		return PointerGetDatum(newtup);

	if (st->raise)
	{
		idem_guard_counts.invalid_rejected++;
		elevel = ERROR;
	}
	else
	{
		idem_guard_counts.invalid_skipped++;
		elevel = guard_log_level;
		if (!message_level_is_interesting(elevel))
			return PointerGetDatum(NULL);
	}

	key = row_key_desc(rel, oldtup);
	initStringInfo(&detail);
	if (key)
		appendStringInfo(&detail, "Key %s. ", key);
	appendStringInfo(&detail, "The guard on column \"%s\" does not allow moving from %s to %s.",
					 NameStr(TupleDescAttr(tupdesc, st->attnum - 1)->attname),
					 quote_literal_cstr(OutputFunctionCall(&st->outfn, oldd)),
					 newnull ? "NULL" : quote_literal_cstr(OutputFunctionCall(&st->outfn, newd)));
	ereport(elevel,
			(errcode(elevel >= ERROR ? ERRCODE_IDEM_INVALID_TRANSITION : ERRCODE_SUCCESSFUL_COMPLETION),
			 elevel >= ERROR ?
			 errmsg("invalid state transition in relation \"%s\"", RelationGetRelationName(rel)) :
			 errmsg("skipped invalid state transition in relation \"%s\"", RelationGetRelationName(rel)),
			 errdetail_internal("%s", detail.data)));
	return PointerGetDatum(NULL);
}


/*------------------------------------------------------------------------
 * Installing and removing guards
 *------------------------------------------------------------------------
 */

static void
idem_check_not_null(FunctionCallInfo fcinfo, int argno, const char *argname)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", argname)));
}

/*
 * Check that relid is a table the caller owns, then lock it against
 * concurrent guard changes.  Returns its relkind.
 */
static void
guard_target_check(Oid relid)
{
	char		relkind = get_rel_relkind(relid);

	if (relkind == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation with OID %u does not exist", relid)));
	if (relkind != RELKIND_RELATION && relkind != RELKIND_PARTITIONED_TABLE)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("\"%s\" is not a table", get_rel_name(relid)),
				 errdetail("Guards can only be installed on tables.")));
	if (!guard_is_owner(relid))
		aclcheck_error(ACLCHECK_NOT_OWNER, get_relkind_objtype(relkind),
					   get_rel_name(relid));
	LockRelationOid(relid, ShareRowExclusiveLock);
	/* it may have been dropped while we waited */
	if (!SearchSysCacheExists1(RELOID, ObjectIdGetDatum(relid)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation with OID %u does not exist", relid)));
}

/* Attribute number of a user column, or 42703. */
static AttrNumber
guard_column(Oid relid, const char *colname)
{
	AttrNumber	attnum = get_attnum(relid, colname);

	if (attnum == InvalidAttrNumber)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_COLUMN),
				 errmsg("column \"%s\" of relation \"%s\" does not exist",
						colname, get_rel_name(relid))));
	if (attnum < 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("cannot guard system column \"%s\"", colname)));
	check_not_generated(get_attgenerated(relid, attnum), colname, get_rel_name(relid));
	return attnum;
}

static char *
idem_qualified_relname(Oid relid)
{
	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/* The relation and parent trigger of trigger tgoid (InvalidOid: none). */
static void
trigger_lookup(Oid tgoid, Oid *tgrelid, Oid *tgparentid)
{
	Relation	tgrel = table_open(TriggerRelationId, AccessShareLock);
	ScanKeyData skey;
	SysScanDesc scan;
	HeapTuple	tup;

	ScanKeyInit(&skey, Anum_pg_trigger_oid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(tgoid));
	scan = systable_beginscan(tgrel, TriggerOidIndexId, true, NULL, 1, &skey);
	tup = systable_getnext(scan);
	if (!HeapTupleIsValid(tup))
		elog(ERROR, "could not find trigger %u", tgoid);
	*tgrelid = ((Form_pg_trigger) GETSTRUCT(tup))->tgrelid;
	*tgparentid = ((Form_pg_trigger) GETSTRUCT(tup))->tgparentid;
	systable_endscan(scan);
	table_close(tgrel, AccessShareLock);
}

/*
 * If relid's guard trigger tgname is a clone of a partitioned table's guard,
 * the partitioned table it was installed on; else InvalidOid.
 */
static Oid
guard_inherited_from(Oid relid, const char *tgname)
{
	Oid			tgoid = get_trigger_oid(relid, tgname, true);
	Oid			tgrelid = InvalidOid,
				parentid = InvalidOid;

	if (!OidIsValid(tgoid))
		return InvalidOid;
	trigger_lookup(tgoid, &tgrelid, &parentid);
	if (!OidIsValid(parentid))
		return InvalidOid;
	/* up to the top of the chain */
	while (OidIsValid(parentid))
		trigger_lookup(parentid, &tgrelid, &parentid);
	return tgrelid;
}

/*
 * A guard installed on a partitioned table is cloned onto every partition
 * under the same trigger name, and PostgreSQL keeps the clones tied to it.
 * So a partition whose guard is such a clone cannot have it replaced on its
 * own, and a partitioned table cannot take a guard while one of its
 * partitions has a guard of that kind of its own.  Say so plainly rather
 * than let DROP/CREATE TRIGGER fail on a dependency.  Called with the table
 * locked; this locks its partitions, as CREATE TRIGGER would.
 */
static void
check_guard_partitions(Oid relid, const char *tgname, const char *what)
{
	Oid			owner = guard_inherited_from(relid, tgname);

	if (OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("cannot install a %s guard on partition \"%s\"", what, get_rel_name(relid)),
				 errdetail("The partition has the %s guard of partitioned table \"%s\", which applies to all of its partitions.",
						   what, get_rel_name(owner)),
				 errhint("Change the guard of \"%s\" instead.", get_rel_name(owner))));

	if (get_rel_relkind(relid) == RELKIND_PARTITIONED_TABLE)
	{
		List	   *parts = find_all_inheritors(relid, ShareRowExclusiveLock, NULL);
		ListCell   *lc;

		foreach(lc, parts)
		{
			Oid			part = lfirst_oid(lc);

			if (part != relid && OidIsValid(get_trigger_oid(part, tgname, true)) &&
				!OidIsValid(guard_inherited_from(part, tgname)))
				ereport(ERROR,
						(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
						 errmsg("cannot install a %s guard on partitioned table \"%s\"",
								what, get_rel_name(relid)),
						 errdetail("Its partition \"%s\" has a %s guard of its own.",
								   get_rel_name(part), what),
						 errhint("Remove that guard first with idem_unguard().")));
		}
	}
}

/* Drop the named guard trigger if it exists. Caller is connected to SPI. */
static void
drop_guard_trigger(Oid relid, const char *tgname)
{
	if (OidIsValid(get_trigger_oid(relid, tgname, true)))
	{
		char	   *sql = psprintf("DROP TRIGGER %s ON %s",
								   quote_identifier(tgname), idem_qualified_relname(relid));

		if (SPI_execute(sql, false, 0) != SPI_OK_UTILITY)
			elog(ERROR, "could not drop trigger \"%s\"", tgname);
	}
}

/* (Re)create a guard trigger. Caller is connected to SPI. */
static void
create_guard_trigger(Oid relid, const char *tgname, const char *of_column,
					 const char *func, const char *args)
{
	char	   *sql;

	drop_guard_trigger(relid, tgname);
	sql = psprintf("CREATE TRIGGER %s BEFORE UPDATE%s%s ON %s FOR EACH ROW EXECUTE FUNCTION %s(%s)",
				   quote_identifier(tgname),
				   of_column ? " OF " : "",
				   of_column ? quote_identifier(of_column) : "",
				   idem_qualified_relname(relid), func, args);
	if (SPI_execute(sql, false, 0) != SPI_OK_UTILITY)
		elog(ERROR, "could not create trigger \"%s\"", tgname);
}

/* idem_guard_version(target regclass, version_column name, on_stale text) */
Datum
idem_guard_version(PG_FUNCTION_ARGS)
{
	Oid			relid;
	char	   *colname;
	char	   *mode;
	AttrNumber	attnum;

	idem_check_not_null(fcinfo, 0, "target");
	idem_check_not_null(fcinfo, 1, "version_column");
	idem_check_not_null(fcinfo, 2, "on_stale");
	relid = PG_GETARG_OID(0);
	colname = NameStr(*PG_GETARG_NAME(1));
	mode = text_to_cstring(PG_GETARG_TEXT_PP(2));

	(void) parse_mode(mode, "on_stale");
	guard_target_check(relid);
	attnum = guard_column(relid, colname);
	idem_check_version_type(get_atttype(relid, attnum), colname, relid);
	check_guard_partitions(relid, VERSION_TRIGGER_NAME, "version");

	SPI_connect();
	create_guard_trigger(relid, VERSION_TRIGGER_NAME, NULL, VERSION_TRIGGER_FUNC,
						 psprintf("%s, %s", quote_literal_cstr(colname),
								  quote_literal_cstr(mode)));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * idem_guard_transitions(target regclass, state_column name,
 *						  transitions jsonb, on_invalid text)
 */
Datum
idem_guard_transitions(PG_FUNCTION_ARGS)
{
	Oid			relid;
	char	   *colname;
	Jsonb	   *map;
	char	   *mode;
	AttrNumber	attnum;
	Oid			atttypid;
	int32		atttypmod;
	Oid			attcoll;
	StateType	stt;
	char	   *maptext;

	idem_check_not_null(fcinfo, 0, "target");
	idem_check_not_null(fcinfo, 1, "state_column");
	idem_check_not_null(fcinfo, 2, "transitions");
	idem_check_not_null(fcinfo, 3, "on_invalid");
	relid = PG_GETARG_OID(0);
	colname = NameStr(*PG_GETARG_NAME(1));
	map = PG_GETARG_JSONB_P(2);
	mode = text_to_cstring(PG_GETARG_TEXT_PP(3));

	(void) parse_mode(mode, "on_invalid");
	guard_target_check(relid);
	attnum = guard_column(relid, colname);
	get_atttypetypmodcoll(relid, attnum, &atttypid, &atttypmod, &attcoll);
	/* states are compared by the type's equality, so it must have one */
	idem_state_type_init(&stt, atttypid, atttypmod, attcoll, colname, CurrentMemoryContext);
	/* every state named must be a value the column can hold */
	(void) idem_statemap_build(map, &stt);
	check_guard_partitions(relid, TRANSITION_TRIGGER_NAME, "transition");

	maptext = JsonbToCString(NULL, &map->root, VARSIZE(map));
	SPI_connect();
	create_guard_trigger(relid, TRANSITION_TRIGGER_NAME, colname, TRANSITION_TRIGGER_FUNC,
						 psprintf("%s, %s, %s", quote_literal_cstr(colname),
								  quote_literal_cstr(maptext),
								  quote_literal_cstr(mode)));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * idem_unguard(target regclass): remove both guards, if present.  On a
 * partition, guards inherited from its partitioned table stay: they can only
 * be removed there.
 */
Datum
idem_unguard(PG_FUNCTION_ARGS)
{
	static const char *const names[] = {VERSION_TRIGGER_NAME, TRANSITION_TRIGGER_NAME};
	static const char *const kinds[] = {"version", "transition"};
	Oid			relid;
	Oid			owner = InvalidOid;
	const char *kind = NULL;
	bool		dropped = false;
	int			i;

	idem_check_not_null(fcinfo, 0, "target");
	relid = PG_GETARG_OID(0);
	guard_target_check(relid);
	SPI_connect();
	for (i = 0; i < 2; i++)
	{
		Oid			from = guard_inherited_from(relid, names[i]);

		if (OidIsValid(from))
		{
			owner = from;
			kind = kinds[i];
		}
		else if (OidIsValid(get_trigger_oid(relid, names[i], true)))
		{
			drop_guard_trigger(relid, names[i]);
			dropped = true;
		}
	}
	SPI_finish();
	if (OidIsValid(owner))
		ereport(dropped ? NOTICE : ERROR,
				(errcode(dropped ? ERRCODE_SUCCESSFUL_COMPLETION : ERRCODE_FEATURE_NOT_SUPPORTED),
				 dropped ?
				 errmsg("the %s guard of partition \"%s\" stays", kind, get_rel_name(relid)) :
				 errmsg("cannot remove the %s guard of partition \"%s\"", kind, get_rel_name(relid)),
				 errdetail("The partition has the %s guard of partitioned table \"%s\", which applies to all of its partitions.",
						   kind, get_rel_name(owner)),
				 errhint("Remove the guard of \"%s\" instead.", get_rel_name(owner))));
	PG_RETURN_VOID();
}


/*------------------------------------------------------------------------
 * Plan caches for idem_upsert / idem_transition
 *
 * One hash per helper, keyed by table (and version column, or key type),
 * whose entries hold kept SPI plans.  A backend that writes to many tables
 * must not keep plans for all of them forever, so each cache holds at most
 * GUARD_PLAN_CACHE_SIZE entries and evicts the least recently used one,
 * freeing its plans.  An entry used by a call still running further up the
 * stack (a trigger may call the helpers again) is never freed: eviction
 * passes it by, and a nested call that finds it invalid builds plans of its
 * own, which SPI_finish frees.
 *------------------------------------------------------------------------
 */

#define GUARD_PLAN_CACHE_SIZE	128

typedef struct PlanCacheLink
{
	dlist_node	lru;			/* in PlanCache.lru, most recently used first */
	int			refcount;		/* calls running with the entry's plans */
	bool		valid;			/* false: the table changed, rebuild */
} PlanCacheLink;

typedef struct PlanCache
{
	const char *name;
	HTAB	   *htab;
	dlist_head	lru;
	int			nentries;
	Size		keysize;
	Size		entrysize;
	Size		linkoff;		/* where an entry's PlanCacheLink is */
	void		(*free_plans) (void *entry);
} PlanCache;

#define PLAN_LINK(pc, entry) ((PlanCacheLink *) ((char *) (entry) + (pc)->linkoff))

typedef struct UpsertKey
{
	Oid			relid;
	NameData	vcol;
} UpsertKey;

typedef struct UpsertPlans
{
	SPIPlanPtr	plan;			/* the upsert */
	SPIPlanPtr	same_state_plan;	/* with a transition guard: the upsert
									 * for a row whose state is unchanged,
									 * which leaves the state column out */
	AttrNumber	vattnum;		/* version column in the row type */
	Oid			vtypid;			/* its base type */
} UpsertPlans;

typedef struct UpsertEntry
{
	UpsertKey	key;
	PlanCacheLink link;
	UpsertPlans plans;
} UpsertEntry;

typedef struct TransitionKey
{
	Oid			relid;
	Oid			idtype;
} TransitionKey;

typedef struct TransitionPlans
{
	SPIPlanPtr	select_plan;	/* is the state already to_state? row locked */
	SPIPlanPtr	update_plan;	/* set the new state */
} TransitionPlans;

typedef struct TransitionEntry
{
	TransitionKey key;
	PlanCacheLink link;
	TransitionPlans plans;
} TransitionEntry;

static void
upsert_free_plans(void *entry)
{
	UpsertPlans *p = &((UpsertEntry *) entry)->plans;

	if (p->plan)
		SPI_freeplan(p->plan);
	if (p->same_state_plan)
		SPI_freeplan(p->same_state_plan);
	p->plan = p->same_state_plan = NULL;
}

static void
transition_free_plans(void *entry)
{
	TransitionPlans *p = &((TransitionEntry *) entry)->plans;

	if (p->select_plan)
		SPI_freeplan(p->select_plan);
	if (p->update_plan)
		SPI_freeplan(p->update_plan);
	p->select_plan = p->update_plan = NULL;
}

static PlanCache upsert_cache = {
	"idempotency upsert plans", NULL, {{NULL, NULL}}, 0,
	sizeof(UpsertKey), sizeof(UpsertEntry), offsetof(UpsertEntry, link),
	upsert_free_plans
};
static PlanCache transition_cache = {
	"idempotency transition plans", NULL, {{NULL, NULL}}, 0,
	sizeof(TransitionKey), sizeof(TransitionEntry), offsetof(TransitionEntry, link),
	transition_free_plans
};

/* Relcache callback: forget plans built for a relation that changed. */
static void
plan_cache_invalidate(PlanCache *pc, Oid relid)
{
	HASH_SEQ_STATUS seq;
	void	   *entry;

	if (pc->htab == NULL)
		return;
	hash_seq_init(&seq, pc->htab);
	while ((entry = hash_seq_search(&seq)) != NULL)
		/* both keys start with the relation's OID */
		if (relid == InvalidOid || *(Oid *) entry == relid)
			PLAN_LINK(pc, entry)->valid = false;
}

static void
guard_relcache_callback(Datum arg, Oid relid)
{
	plan_cache_invalidate(&upsert_cache, relid);
	plan_cache_invalidate(&transition_cache, relid);
}

/* Free least recently used entries, other than keep, down to the bound. */
static void
plan_cache_evict(PlanCache *pc, void *keep)
{
	while (pc->nentries > GUARD_PLAN_CACHE_SIZE)
	{
		dlist_node *node;
		void	   *victim = NULL;

		for (node = pc->lru.head.prev; node != &pc->lru.head; node = node->prev)
		{
			void	   *entry = (char *) node - pc->linkoff;

			if (entry != keep && PLAN_LINK(pc, entry)->refcount == 0)
			{
				victim = entry;
				break;
			}
		}
		if (victim == NULL)
			return;				/* all in use: over the bound for a while */
		pc->free_plans(victim);
		dlist_delete(&PLAN_LINK(pc, victim)->lru);
		(void) hash_search(pc->htab, victim, HASH_REMOVE, NULL);
		pc->nentries--;
	}
}

/*
 * The entry for key, created if need be, marked most recently used and in
 * use: the caller must plan_cache_release() it, also on error.
 */
static void *
plan_cache_acquire(PlanCache *pc, const void *key)
{
	void	   *entry;
	PlanCacheLink *link;
	bool		found;

	if (pc->htab == NULL)
	{
		HASHCTL		ctl;

		memset(&ctl, 0, sizeof(ctl));
		ctl.keysize = pc->keysize;
		ctl.entrysize = pc->entrysize;
		ctl.hcxt = CacheMemoryContext;
		pc->htab = hash_create(pc->name, 32, &ctl, HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
		dlist_init(&pc->lru);
	}
	entry = hash_search(pc->htab, key, HASH_ENTER, &found);
	link = PLAN_LINK(pc, entry);
	if (!found)
	{
		memset((char *) entry + pc->keysize, 0, pc->entrysize - pc->keysize);
		dlist_push_head(&pc->lru, &link->lru);
		pc->nentries++;
		plan_cache_evict(pc, entry);
	}
	else
		dlist_move_head(&pc->lru, &link->lru);
	link->refcount++;
	return entry;
}

static void
plan_cache_release(PlanCache *pc, void *entry)
{
	PLAN_LINK(pc, entry)->refcount--;
}

/* Open a table the helpers write to; 42P01 / 42809 otherwise. */
static Relation
helper_open_table(Oid relid)
{
	Relation	rel = try_relation_open(relid, AccessShareLock);

	if (rel == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation with OID %u does not exist", relid)));
	if (rel->rd_rel->relkind != RELKIND_RELATION &&
		rel->rd_rel->relkind != RELKIND_PARTITIONED_TABLE)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("\"%s\" is not a table", RelationGetRelationName(rel))));
	return rel;
}

/* Open the primary key index of rel, or raise 42P10. */
static Relation
helper_open_pkey(Relation rel, const char *caller)
{
	Oid			pkoid = RelationGetPrimaryKeyIndex(rel);

	if (!OidIsValid(pkoid))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_COLUMN_REFERENCE),
				 errmsg("relation \"%s\" has no primary key", RelationGetRelationName(rel)),
				 errdetail("%s() finds the row to update by the primary key.", caller)));
	return index_open(pkoid, AccessShareLock);
}

/* "OPERATOR(schema.name)" for operator opno: no search_path games. */
static char *
operator_sql(Oid opno)
{
	HeapTuple	optup = SearchSysCache1(OPEROID, ObjectIdGetDatum(opno));
	Form_pg_operator opform;
	char	   *result;

	if (!HeapTupleIsValid(optup))
		elog(ERROR, "cache lookup failed for operator %u", opno);
	opform = (Form_pg_operator) GETSTRUCT(optup);
	result = psprintf("OPERATOR(%s.%s)",
					  quote_identifier(get_namespace_name(opform->oprnamespace)),
					  NameStr(opform->oprname));
	ReleaseSysCache(optup);
	return result;
}

/* The default equality operator of typid (or its base type), as SQL. */
static char *
equality_sql(Oid typid)
{
	TypeCacheEntry *tc = lookup_type_cache(getBaseType(typid), TYPECACHE_EQ_OPR);

	if (!OidIsValid(tc->eq_opr))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("could not identify an equality operator for type %s",
						format_type_be(typid))));
	return operator_sql(tc->eq_opr);
}

static SPIPlanPtr
helper_prepare(const char *sql, int nargs, Oid *argtypes, bool keep)
{
	SPIPlanPtr	plan = SPI_prepare(sql, nargs, argtypes);

	if (plan == NULL)
		elog(ERROR, "could not prepare \"%s\": %s", sql, SPI_result_code_string(SPI_result));
	if (keep && SPI_keepplan(plan) != 0)
		elog(ERROR, "could not keep plan for \"%s\"", sql);
	return plan;
}

/*
 * Build the upsert for key->relid into *out (kept for the cache if keep):
 *
 *	 INSERT INTO s.t AS t (c1, ...) [OVERRIDING SYSTEM VALUE] SELECT ($1).c1, ...
 *	 ON CONFLICT (pk) DO UPDATE SET c = EXCLUDED.c, ...
 *	 WHERE (t.v < EXCLUDED.v OR t.v IS NULL [OR t.v = 'NaN']) AND $2
 *	 RETURNING 1
 *
 * No row returned means the WHERE rejected the update: stale.  To tell an
 * insert from an update without system columns (xmax cannot be returned
 * through a partitioned table), $2 is a boolean parameter that only the DO
 * UPDATE arm ever reads, after the version test: upsert_param_fetch() notes
 * that it was fetched.
 *
 * A primary key column that is GENERATED ALWAYS AS IDENTITY is inserted with
 * OVERRIDING SYSTEM VALUE: the row's key is the key, or every call would
 * insert a new row.  Other generated and identity-always columns are left to
 * the table.
 *
 * On a table with a transition guard, naming the state column in the SET
 * list makes the guard fire, and it keeps the old row whenever the state is
 * unchanged -- which would drop a newer version in the same state.  So such a
 * table gets a second plan that leaves the state column out and applies only
 * if the state is unchanged:
 *
 *	 ... DO UPDATE SET c = EXCLUDED.c, ... (not the state)
 *	 WHERE t.v < EXCLUDED.v AND $3 AND t.s = EXCLUDED.s (or both NULL) AND $2
 *
 * It runs first; if it read $3 but not $2 (newer, but the state differs), the
 * conflicting row is locked by now, and the full upsert runs, which the
 * guard judges as a state change.
 */
static void
upsert_build(UpsertKey *key, Oid rowtype, UpsertPlans *out, bool keep)
{
	Relation	rel = helper_open_table(key->relid);
	Relation	idx = helper_open_pkey(rel, "idem_upsert");
	TupleDesc	tupdesc = RelationGetDescr(rel);
	const char *vcol = NameStr(key->vcol);
	Trigger    *ttg = idem_find_guard_trigger(rel, TRANSITION_TRIGGER_NAME);
	AttrNumber	stateatt = InvalidAttrNumber;
	StringInfoData cols,
				vals,
				sets,
				sets_nostate,
				conflict;
	Bitmapset  *pkcols = NULL;
	bool		override = false;
	int			i;
	AttrNumber	vattnum;
	Oid			argtypes[3];
	char	   *head;
	char	   *vtest;

	vattnum = SPI_fnumber(tupdesc, vcol);
	if (vattnum <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_COLUMN),
				 errmsg("column \"%s\" of relation \"%s\" does not exist",
						vcol, RelationGetRelationName(rel))));
	idem_check_version_type(TupleDescAttr(tupdesc, vattnum - 1)->atttypid, vcol, key->relid);
	out->vattnum = vattnum;
	out->vtypid = getBaseType(TupleDescAttr(tupdesc, vattnum - 1)->atttypid);
	if (ttg != NULL && ttg->tgenabled != TRIGGER_DISABLED)
		stateatt = SPI_fnumber(tupdesc, ttg->tgargs[0]);

	initStringInfo(&cols);
	initStringInfo(&vals);
	initStringInfo(&sets);
	initStringInfo(&sets_nostate);
	initStringInfo(&conflict);

	for (i = 0; i < IndexRelationGetNumberOfKeyAttributes(idx); i++)
	{
		AttrNumber	attno = idx->rd_index->indkey.values[i];

		pkcols = bms_add_member(pkcols, attno);
		appendStringInfo(&conflict, "%s%s", i ? ", " : "",
						 quote_identifier(NameStr(TupleDescAttr(tupdesc, attno - 1)->attname)));
	}

	for (i = 0; i < tupdesc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(tupdesc, i);
		bool		inkey = bms_is_member(att->attnum, pkcols);
		const char *name;

		if (att->attisdropped || att->attgenerated)
			continue;
		/* identity columns the table always computes are its business, unless keys */
		if (att->attidentity == ATTRIBUTE_IDENTITY_ALWAYS)
		{
			if (!inkey)
				continue;
			override = true;
		}
		name = quote_identifier(NameStr(att->attname));
		appendStringInfo(&cols, "%s%s", cols.len ? ", " : "", name);
		appendStringInfo(&vals, "%s($1).%s", vals.len ? ", " : "", name);
		if (inkey)
			continue;
		appendStringInfo(&sets, "%s%s = EXCLUDED.%s", sets.len ? ", " : "", name, name);
		if (att->attnum != stateatt || att->attnum == vattnum)
			appendStringInfo(&sets_nostate, "%s%s = EXCLUDED.%s",
							 sets_nostate.len ? ", " : "", name, name);
	}
	/* nothing to update but the version check: a table of key columns only */
	if (sets.len == 0)
		appendStringInfo(&sets, "%s = EXCLUDED.%s", quote_identifier(vcol), quote_identifier(vcol));
	if (sets_nostate.len == 0)
		appendStringInfo(&sets_nostate, "%s = EXCLUDED.%s", quote_identifier(vcol), quote_identifier(vcol));

	head = psprintf("INSERT INTO %s AS t (%s)%s SELECT %s ON CONFLICT (%s) DO UPDATE SET ",
					idem_qualified_relname(key->relid), cols.data,
					override ? " OVERRIDING SYSTEM VALUE" : "", vals.data, conflict.data);
	/* as in the version guard, a stored NULL or NaN is no version yet */
	vtest = psprintf("(t.%s OPERATOR(pg_catalog.<) EXCLUDED.%s OR t.%s IS NULL%s%s%s)",
					 quote_identifier(vcol), quote_identifier(vcol), quote_identifier(vcol),
					 out->vtypid == NUMERICOID ? " OR t." : "",
					 out->vtypid == NUMERICOID ? quote_identifier(vcol) : "",
					 out->vtypid == NUMERICOID ?
					 " OPERATOR(pg_catalog.=) CAST('NaN' AS pg_catalog.numeric)" : "");
	argtypes[0] = rowtype;
	argtypes[1] = BOOLOID;
	argtypes[2] = BOOLOID;
	out->plan = helper_prepare(psprintf("%s%s WHERE %s AND $2 RETURNING 1",
										head, sets.data, vtest),
							   3, argtypes, keep);
	out->same_state_plan = NULL;
	if (stateatt > 0 && stateatt != vattnum && strcmp(sets.data, sets_nostate.data) != 0)
	{
		const char *s = quote_identifier(NameStr(TupleDescAttr(tupdesc, stateatt - 1)->attname));

		out->same_state_plan =
			helper_prepare(psprintf("%s%s WHERE %s AND $3 AND (t.%s %s EXCLUDED.%s"
									" OR (t.%s IS NULL AND EXCLUDED.%s IS NULL)) AND $2 RETURNING 1",
									head, sets_nostate.data, vtest,
									s, equality_sql(TupleDescAttr(tupdesc, stateatt - 1)->atttypid), s,
									s, s),
						   3, argtypes, keep);
	}

	index_close(idx, AccessShareLock);
	relation_close(rel, NoLock);
}

/*
 * Set when the running upsert reached its DO UPDATE arm past the version
 * test ($3) and past all its tests ($2).
 */
static bool upsert_newer_seen = false;
static bool upsert_update_seen = false;

/* paramFetch hook of idem_upsert: parameters 2 and 3 are read only by an update. */
static ParamExternData *
upsert_param_fetch(ParamListInfo params, int paramid, bool speculative,
				   ParamExternData *workspace)
{
	if (!speculative)
	{
		if (paramid == 2)
			upsert_update_seen = true;
		else if (paramid == 3)
			upsert_newer_seen = true;
	}
	return &params->params[paramid - 1];
}

/* idem_upsert(new_row anyelement, version_column name) RETURNS text */
Datum
idem_upsert(PG_FUNCTION_ARGS)
{
	Oid			rowtype;
	Oid			relid;
	UpsertKey	key;
	UpsertEntry *volatile e;
	UpsertPlans plans;
	bool		isnull;
	Datum		arg;
	Datum		version;
	const char *result;
	int			rc = 0;
	ParamListInfo params;
	bool		saved_seen;
	bool		saved_newer;
	bool		updated = false;
	uint64		processed = 0;

	idem_check_not_null(fcinfo, 0, "new_row");
	idem_check_not_null(fcinfo, 1, "version_column");

	rowtype = get_fn_expr_argtype(fcinfo->flinfo, 0);
	relid = OidIsValid(rowtype) ? get_typ_typrelid(rowtype) : InvalidOid;
	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idem_upsert() needs a row of a table, not a value of type %s",
						OidIsValid(rowtype) ? format_type_be(rowtype) : "unknown"),
				 errhint("Pass a row of the target table, e.g. ROW(...)::my_table.")));

	memset(&key, 0, sizeof(key));
	key.relid = relid;
	namestrcpy(&key.vcol, NameStr(*PG_GETARG_NAME(1)));
	arg = PG_GETARG_DATUM(0);

	e = plan_cache_acquire(&upsert_cache, &key);
	PG_TRY();
	{
		SPI_connect();
		if (e->link.valid && e->plans.plan != NULL)
			plans = e->plans;
		else if (e->link.refcount == 1)
		{
			upsert_free_plans(e);
			/* set first: an invalidation while building clears it again */
			e->link.valid = true;
			upsert_build(&key, rowtype, &e->plans, true);
			plans = e->plans;
		}
		else
			upsert_build(&key, rowtype, &plans, false);	/* in use further up */

		version = GetAttributeByNum(DatumGetHeapTupleHeader(arg), plans.vattnum, &isnull);
		if (isnull)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("version column \"%s\" of the new row is null", NameStr(key.vcol))));
		idem_check_version_finite(plans.vtypid, version, NameStr(key.vcol), get_rel_name(relid));

		/*
		 * $1 is the row, constant for the planner; $2 and $3 are left
		 * non-constant so that the executor fetches them through the hook
		 * each time it reads them.
		 */
		params = makeParamList(3);
		params->paramFetch = upsert_param_fetch;
		params->params[0].value = arg;
		params->params[0].isnull = false;
		params->params[0].pflags = PARAM_FLAG_CONST;
		params->params[0].ptype = rowtype;
		for (int i = 1; i < 3; i++)
		{
			params->params[i].value = BoolGetDatum(true);
			params->params[i].isnull = false;
			params->params[i].pflags = 0;
			params->params[i].ptype = BOOLOID;
		}

		/* save and restore: a trigger on the table may run an upsert of its own */
		saved_seen = upsert_update_seen;
		saved_newer = upsert_newer_seen;
		upsert_update_seen = upsert_newer_seen = false;
		PG_TRY();
		{
			rc = SPI_execute_plan_with_paramlist(plans.same_state_plan ? plans.same_state_plan : plans.plan,
												 params, false, 0);
			processed = SPI_processed;
			/* newer but in another state: the row is locked; let the guard judge the move */
			if (rc == SPI_OK_INSERT_RETURNING && processed == 0 &&
				plans.same_state_plan && upsert_newer_seen && !upsert_update_seen)
			{
				rc = SPI_execute_plan_with_paramlist(plans.plan, params, false, 0);
				processed = SPI_processed;
			}
		}
		PG_FINALLY();
		{
			updated = upsert_update_seen;
			upsert_update_seen = saved_seen;
			upsert_newer_seen = saved_newer;
		}
		PG_END_TRY();
		if (rc != SPI_OK_INSERT_RETURNING)
			elog(ERROR, "idem_upsert: unexpected SPI result %s", SPI_result_code_string(rc));
		if (processed == 0)
		{
			idem_guard_counts.upsert_stale++;
			result = "stale";
		}
		else
			result = updated ? "updated" : "inserted";
		SPI_finish();
	}
	PG_FINALLY();
	{
		plan_cache_release(&upsert_cache, e);
	}
	PG_END_TRY();
	PG_RETURN_TEXT_P(cstring_to_text(result));
}

/*
 * Build the two statements idem_transition runs on key->relid into *out:
 *
 *	 SELECT t.state = $2::statetype FROM s.t t WHERE t.pk = $1::pktype FOR UPDATE
 *	 UPDATE s.t t SET state = $2::statetype WHERE t.pk = $1::pktype
 *
 * The state column is the one the table's transition guard names; states
 * are compared by its type's equality, as the guard compares them.
 */
static void
transition_build(TransitionKey *key, TransitionPlans *out, bool keep)
{
	Relation	rel = helper_open_table(key->relid);
	Relation	idx;
	TupleDesc	tupdesc = RelationGetDescr(rel);
	Trigger    *ttg = idem_find_guard_trigger(rel, TRANSITION_TRIGGER_NAME);
	Trigger    *vtg = idem_find_guard_trigger(rel, VERSION_TRIGGER_NAME);
	const char *statecol;
	Form_pg_attribute stateattr;
	AttrNumber	stateatt;
	AttrNumber	pkatt;
	Form_pg_attribute pkattr;
	Oid			eqop;
	char	   *where;
	char	   *statetype;
	Oid			argtypes[2];

	if (ttg == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("relation \"%s\" has no transition guard", RelationGetRelationName(rel)),
				 errhint("Install one with idem_guard_transitions().")));
	/* it sets no version, so a version guard would skip every move */
	if (vtg != NULL && vtg->tgenabled != TRIGGER_DISABLED)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_transition() cannot move rows of relation \"%s\", which has a version guard",
						RelationGetRelationName(rel)),
				 errdetail("idem_transition() does not raise the version, so the version guard would skip every move."),
				 errhint("Use an UPDATE or idem_upsert() that sets the state and raises the version.")));
	statecol = ttg->tgargs[0];
	stateatt = SPI_fnumber(tupdesc, statecol);
	if (stateatt <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_COLUMN),
				 errmsg("column \"%s\" of relation \"%s\" does not exist",
						statecol, RelationGetRelationName(rel))));
	stateattr = TupleDescAttr(tupdesc, stateatt - 1);

	idx = helper_open_pkey(rel, "idem_transition");
	if (IndexRelationGetNumberOfKeyAttributes(idx) != 1 || idx->rd_index->indkey.values[0] <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem_transition() needs a single-column primary key"),
				 errdetail("Relation \"%s\" has a primary key of %d columns.",
						   RelationGetRelationName(rel),
						   IndexRelationGetNumberOfKeyAttributes(idx))));
	pkatt = idx->rd_index->indkey.values[0];
	pkattr = TupleDescAttr(tupdesc, pkatt - 1);

	/* the key's own equality operator, named by schema */
	eqop = get_opfamily_member(idx->rd_opfamily[0], idx->rd_opcintype[0],
							   idx->rd_opcintype[0], BTEqualStrategyNumber);
	where = psprintf("t.%s %s CAST($1 AS %s)",
					 quote_identifier(NameStr(pkattr->attname)), operator_sql(eqop),
					 format_type_extended(pkattr->atttypid, pkattr->atttypmod,
										  FORMAT_TYPE_TYPEMOD_GIVEN | FORMAT_TYPE_FORCE_QUALIFY));
	statetype = format_type_extended(stateattr->atttypid, stateattr->atttypmod,
									 FORMAT_TYPE_TYPEMOD_GIVEN | FORMAT_TYPE_FORCE_QUALIFY);

	argtypes[0] = key->idtype;
	argtypes[1] = TEXTOID;
	out->select_plan =
		helper_prepare(psprintf("SELECT t.%s %s CAST($2 AS %s) FROM %s t WHERE %s FOR UPDATE OF t",
								quote_identifier(statecol), equality_sql(stateattr->atttypid),
								statetype, idem_qualified_relname(key->relid), where),
					   2, argtypes, keep);
	out->update_plan =
		helper_prepare(psprintf("UPDATE %s t SET %s = CAST($2 AS %s) WHERE %s",
								idem_qualified_relname(key->relid), quote_identifier(statecol),
								statetype, where),
					   2, argtypes, keep);

	index_close(idx, AccessShareLock);
	relation_close(rel, NoLock);
}

/* idem_transition(target regclass, id anyelement, to_state text) RETURNS text */
Datum
idem_transition(PG_FUNCTION_ARGS)
{
	TransitionKey key;
	TransitionEntry *volatile e;
	TransitionPlans plans;
	Datum		args[2];
	const char *result;
	int			rc;

	idem_check_not_null(fcinfo, 0, "target");
	idem_check_not_null(fcinfo, 1, "id");
	idem_check_not_null(fcinfo, 2, "to_state");

	memset(&key, 0, sizeof(key));
	key.relid = PG_GETARG_OID(0);
	key.idtype = get_fn_expr_argtype(fcinfo->flinfo, 1);
	args[0] = PG_GETARG_DATUM(1);
	args[1] = PG_GETARG_DATUM(2);

	e = plan_cache_acquire(&transition_cache, &key);
	PG_TRY();
	{
		bool		isnull;

		SPI_connect();
		if (e->link.valid && e->plans.select_plan != NULL && e->plans.update_plan != NULL)
			plans = e->plans;
		else if (e->link.refcount == 1)
		{
			transition_free_plans(e);
			e->link.valid = true;
			transition_build(&key, &e->plans, true);
			plans = e->plans;
		}
		else
			transition_build(&key, &plans, false);	/* in use further up */

		/* lock the row and compare its state: the answer must match what we write */
		rc = SPI_execute_plan(plans.select_plan, args, "  ", false, 0);
		if (rc != SPI_OK_SELECT)
			elog(ERROR, "idem_transition: unexpected SPI result %s", SPI_result_code_string(rc));
		if (SPI_processed == 0)
			result = "not_found";
		else if (DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
											&isnull)) && !isnull)
		{
			idem_guard_counts.already_applied++;
			result = "already_applied";
		}
		else
		{
			/* the guard decides; it skips (0 rows) or raises IK005 */
			rc = SPI_execute_plan(plans.update_plan, args, "  ", false, 0);
			if (rc != SPI_OK_UPDATE)
				elog(ERROR, "idem_transition: unexpected SPI result %s", SPI_result_code_string(rc));
			result = SPI_processed > 0 ? "applied" : "rejected";
		}
		SPI_finish();
	}
	PG_FINALLY();
	{
		plan_cache_release(&transition_cache, e);
	}
	PG_END_TRY();
	PG_RETURN_TEXT_P(cstring_to_text(result));
}


/*------------------------------------------------------------------------
 * Counters and initialisation
 *------------------------------------------------------------------------
 */

/* idempotency.guard_stats(): this backend's guard counters */
Datum
idem_guard_stats(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[6];
	bool		nulls[6] = {false};

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	tupdesc = BlessTupleDesc(tupdesc);
	values[0] = Int64GetDatum(idem_guard_counts.stale_skipped);
	values[1] = Int64GetDatum(idem_guard_counts.stale_rejected);
	values[2] = Int64GetDatum(idem_guard_counts.upsert_stale);
	values[3] = Int64GetDatum(idem_guard_counts.invalid_skipped);
	values[4] = Int64GetDatum(idem_guard_counts.invalid_rejected);
	values[5] = Int64GetDatum(idem_guard_counts.already_applied);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

/* idempotency.guard_stats_reset(): zero this backend's guard counters */
Datum
idem_guard_stats_reset(PG_FUNCTION_ARGS)
{
	memset(&idem_guard_counts, 0, sizeof(idem_guard_counts));
	PG_RETURN_VOID();
}

void
idem_guards_init(void)
{
	DefineCustomEnumVariable("idempotency.guard_log_level",
							 "Message level at which guards log each skipped write.",
							 "Skips are normal under at-least-once delivery, so the default is debug1; "
							 "set log to audit them.",
							 &guard_log_level,
							 DEBUG1,
							 guard_log_level_options,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);
	CacheRegisterRelcacheCallback(guard_relcache_callback, (Datum) 0);
}
