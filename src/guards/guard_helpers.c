/*-------------------------------------------------------------------------
 *
 * guard_helpers.c
 *	  idem_upsert() and idem_transition(), with their bounded plan caches.
 *
 * idem_upsert() and idem_transition() run ordinary SQL through SPI as the
 * calling role: no SECURITY DEFINER anywhere, so privileges, RLS and the
 * guards themselves apply exactly as for hand-written statements.  They
 * read the guards' configuration from the table's triggers
 * (idem_find_guard_trigger) and judge versions and states by the same
 * rules as the guards (guard_rules.c).  Their plans are prepared once per
 * table and kept in backend-local caches of at most GUARD_PLAN_CACHE_SIZE
 * tables each, least recently used evicted, that a relcache callback
 * (registered by idem_guard_helpers_init) invalidates when a table changes;
 * an entry in use by a running call is never freed.
 *
 * Locking rules:
 *	- idem_upsert() / idem_transition() take AccessShareLock on the table
 *	  while (re)building a plan; executing takes what the statements take
 *	  (RowExclusiveLock; idem_transition locks the row FOR UPDATE before it
 *	  updates it, so its read and its write see the same row version; on a
 *	  table with a transition guard, idem_upsert's first statement leaves
 *	  the conflicting row locked when it declines to update it, so the
 *	  second statement sees the same row version).
 *	- The plan caches are backend-local: no locks.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/args.h"
#include "stats/stats.h"
#include "guards/guards.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/stratnum.h"
#include "catalog/pg_class.h"
#include "catalog/pg_operator.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/ilist.h"
#include "nodes/bitmapset.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "utils/typcache.h"

PG_FUNCTION_INFO_V1(idem_upsert);
PG_FUNCTION_INFO_V1(idem_transition);


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
			PG_TRY();
			{
				upsert_build(&key, rowtype, &e->plans, true);
			}
			PG_CATCH();
			{
				/* half-built plans (a cancel between the two) must not be used */
				e->link.valid = false;
				PG_RE_THROW();
			}
			PG_END_TRY();
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
			idem_stats_count_relation(relid, IDEM_STAT_STALE_SKIPS);
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
 * Initialisation
 *------------------------------------------------------------------------
 */

/* Called by idem_guards_init(): plans of a table that changes are rebuilt. */
void
idem_guard_helpers_init(void)
{
	CacheRegisterRelcacheCallback(guard_relcache_callback, (Datum) 0);
}
