/*-------------------------------------------------------------------------
 *
 * guard_triggers.c
 *	  The guard triggers, installing and removing them, and the counters of
 *	  guarded writes.
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
 * the life of one statement.  What counts as a newer version and which
 * moves a map allows is decided in guard_rules.c.
 *
 * Generated columns cannot be guarded (BEFORE triggers do not see their new
 * values).  On a table with both guards, an update that names the state
 * column with the row's state and raises the version is applied: the
 * version tells a newer snapshot from a redelivery.  A partition's guard
 * cloned from its partitioned table can only be changed there.
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
 *
 * Counters are kept twice: per backend (idem_guard_counts below, exposed
 * through idempotency.guard_stats(); guard_helpers.c counts its outcomes
 * there too) and per table for the whole cluster (stats.c, when preloaded;
 * idempotency.stats).  idem_guards_init() defines
 * idempotency.guard_log_level, the level at which skips are logged, and
 * sets up the helpers' plan caches.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/args.h"
#include "common/compat.h"
#include "stats/stats.h"
#include "guards/guards.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/stratnum.h"
#include "access/sysattr.h"
#include "access/table.h"
#include "catalog/objectaddress.h"
#include "catalog/pg_class.h"
#include "catalog/pg_inherits.h"
#include "catalog/pg_trigger.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "nodes/bitmapset.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"

/*---- GUC variables ----*/

#define GUARD_LOG_LEVEL_DEFAULT	DEBUG1

static int	guard_log_level = GUARD_LOG_LEVEL_DEFAULT;

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

IdemGuardCounters idem_guard_counts;

/*---- function declarations ----*/

PG_FUNCTION_INFO_V1(idem_version_guard);
PG_FUNCTION_INFO_V1(idem_transition_guard);
PG_FUNCTION_INFO_V1(idem_guard_version);
PG_FUNCTION_INFO_V1(idem_guard_transitions);
PG_FUNCTION_INFO_V1(idem_unguard);
PG_FUNCTION_INFO_V1(idem_guard_stats);
PG_FUNCTION_INFO_V1(idem_guard_stats_reset);

/* Which guard a trigger invocation or an install call is about. */
typedef enum GuardKind
{
	GUARD_VERSION,
	GUARD_TRANSITIONS
} GuardKind;

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
Trigger *
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
	idem_stats_count_relation(RelationGetRelid(rel), IDEM_STAT_STALE_SKIPS);
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

	idem_stats_count_relation(RelationGetRelid(rel), IDEM_STAT_INVALID_TRANSITIONS);
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
	/* the stored state only for a role that may read it (as for versions) */
	appendStringInfo(&detail, "The guard on column \"%s\" does not allow moving from %s to %s.",
					 NameStr(TupleDescAttr(tupdesc, st->attnum - 1)->attname),
					 column_readable(RelationGetRelid(rel), st->attnum) ?
					 quote_literal_cstr(OutputFunctionCall(&st->outfn, oldd)) :
					 "the stored state",
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
	if (!idem_rel_owned_by_user(relid))
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

char *
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
							 GUARD_LOG_LEVEL_DEFAULT,
							 guard_log_level_options,
							 PGC_SUSET,
							 0,
							 NULL, NULL, NULL);
}
