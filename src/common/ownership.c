/*-------------------------------------------------------------------------
 *
 * ownership.c
 *	  Which relations are ours, and acting as the extension's owner.
 *
 * Maintenance (the worker, idem_maintain(), idem_configure()) and the
 * SECURITY DEFINER functions behind the monitoring views run with more
 * rights than the roles whose relations sit next to ours.  Planning a
 * query over a relation, or building an index entry for it, can run code
 * its owner chose (index expressions and predicates are folded when the
 * relcache builds them; rules turn a table into a view; policies and
 * triggers are code).  So nothing with more rights touches a relation
 * unless idem_relation_distrust() found it to be what we made: a plain
 * table in schema idempotency, the child of the parent we expect, owned
 * by the extension's owner, with no rules, triggers or row security, and
 * indexes on plain columns only.  Anything else is refused and reported,
 * never acted on.
 *
 * A maintenance round runs as the extension's owner, whoever called it,
 * in a security-restricted operation with a GUC nest level of its own
 * (idem_become_owner()): partitions it makes are the owner's, so no lesser
 * role can later add code to them, and a caller's settings (search_path,
 * default_tablespace, ...) do not reach the DDL it runs.
 *
 * Locking rules: none taken here beyond catalog reads; callers hold
 * whatever lock makes the answer stay true while they act on it (a seal
 * its ShareLock, a drop its AccessExclusiveLock).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/ownership.h"
#include "common/catalog.h"
#include "common/spi.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "catalog/indexing.h"
#include "catalog/dependency.h"
#include "catalog/pg_class.h"
#include "catalog/pg_depend.h"
#include "catalog/pg_extension.h"
#include "catalog/pg_index.h"
#include "catalog/pg_inherits.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/syscache.h"
#include "executor/spi.h"

PG_FUNCTION_INFO_V1(idem_relation_distrust_sql);

/* A scan of one catalog for the rows whose OID column attno is key. */
typedef struct CatalogScan
{
	Relation	rel;
	SysScanDesc scan;
} CatalogScan;

static void
catalog_scan_begin(CatalogScan *cs, Oid catalog, Oid index, AttrNumber attno, Oid key)
{
	ScanKeyData skey;

	cs->rel = table_open(catalog, AccessShareLock);
	ScanKeyInit(&skey, attno, BTEqualStrategyNumber, F_OIDEQ, ObjectIdGetDatum(key));
	cs->scan = systable_beginscan(cs->rel, index, true, NULL, 1, &skey);
}

static void
catalog_scan_end(CatalogScan *cs)
{
	systable_endscan(cs->scan);
	table_close(cs->rel, AccessShareLock);
}

/*
 * The extension's owner, kept for the backend: every API call acts as it,
 * and reading it is two catalog index scans (pg_extension has no syscache).
 * Its schema's pg_namespace row stands in for it: whatever changes the
 * extension's owner (REASSIGN OWNED, DROP and CREATE EXTENSION) changes or
 * replaces the schema too, and that syscache has invalidations.
 */
static Oid	owner_cached = InvalidOid;
static uint64 owner_generation = 0;

static void
owner_invalidate(Datum arg, int cacheid, uint32 hashvalue)
{
	owner_cached = InvalidOid;
	owner_generation++;
}

/* The role that owns extension "idempotency" (pg_extension.extowner). */
Oid
idem_extension_owner(void)
{
	static bool registered = false;
	CatalogScan cs;
	HeapTuple	tup;
	Oid			owner = InvalidOid;
	uint64		generation = owner_generation;

	if (OidIsValid(owner_cached))
		return owner_cached;
	if (!registered)
	{
		CacheRegisterSyscacheCallback(NAMESPACEOID, owner_invalidate, (Datum) 0);
		registered = true;
	}
	catalog_scan_begin(&cs, ExtensionRelationId, ExtensionOidIndexId, Anum_pg_extension_oid,
					   get_extension_oid("idempotency", false));
	tup = systable_getnext(cs.scan);
	if (HeapTupleIsValid(tup))
		owner = ((Form_pg_extension) GETSTRUCT(tup))->extowner;
	catalog_scan_end(&cs);
	if (!OidIsValid(owner))
		elog(ERROR, "extension \"idempotency\" has no owner");
	/* an invalidation that came while reading: do not keep what was read */
	if (generation == owner_generation)
		owner_cached = owner;
	return owner;
}

/* Is relid a direct child (inheritance or partition) of parent? */
static bool
is_child_of(Oid relid, Oid parent)
{
	CatalogScan cs;
	HeapTuple	tup;
	bool		found = false;

	catalog_scan_begin(&cs, InheritsRelationId, InheritsRelidSeqnoIndexId,
					   Anum_pg_inherits_inhrelid, relid);
	while (!found && HeapTupleIsValid(tup = systable_getnext(cs.scan)))
		found = ((Form_pg_inherits) GETSTRUCT(tup))->inhparent == parent;
	catalog_scan_end(&cs);
	return found;
}

/* The first index of relid on an expression or with a predicate, or InvalidOid. */
static Oid
code_bearing_index(Oid relid)
{
	CatalogScan cs;
	HeapTuple	tup;
	Oid			found = InvalidOid;

	catalog_scan_begin(&cs, IndexRelationId, IndexIndrelidIndexId, Anum_pg_index_indrelid, relid);
	while (!OidIsValid(found) && HeapTupleIsValid(tup = systable_getnext(cs.scan)))
	{
		if (!heap_attisnull(tup, Anum_pg_index_indexprs, NULL) ||
			!heap_attisnull(tup, Anum_pg_index_indpred, NULL))
			found = ((Form_pg_index) GETSTRUCT(tup))->indexrelid;
	}
	catalog_scan_end(&cs);
	return found;
}

/*
 * NULL if relid is a partition we made of parent (see the banner); else
 * why not, as a phrase for a report ("owned by role x", ...).  Reads only
 * the catalogs: nothing of the relation itself is built or run.
 */
const char *
idem_relation_distrust(Oid relid, Oid parent)
{
	HeapTuple	tup = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	Form_pg_class form;
	const char *why = NULL;
	Oid			index;

	if (!HeapTupleIsValid(tup))
		return "does not exist";
	form = (Form_pg_class) GETSTRUCT(tup);
	if (form->relkind != RELKIND_RELATION)
		why = "not a plain table";
	else if (form->relnamespace != idem_schema_oid())
		why = psprintf("not in schema %s", IDEM_SCHEMA);
	else if (form->relowner != idem_extension_owner())
	{
		char	   *owner = GetUserNameFromId(form->relowner, true);

		why = psprintf("owned by role %s, not by the extension's owner",
					   owner != NULL ? quote_identifier(owner) : "?");
	}
	else if (form->relhasrules)
		why = "has rules";
	else if (form->relhastriggers)
		why = "has triggers";
	else if (form->relrowsecurity)
		why = "has row security";
	ReleaseSysCache(tup);
	if (why != NULL)
		return why;
	if (!is_child_of(relid, parent))
		return psprintf("not a partition of %s.%s", IDEM_SCHEMA,
						quote_identifier(get_rel_name(parent) ? get_rel_name(parent) : "?"));
	index = code_bearing_index(relid);
	if (OidIsValid(index))
		return psprintf("index %s is on an expression or partial",
						quote_identifier(get_rel_name(index) ? get_rel_name(index) : "?"));
	return NULL;
}

/*
 * idempotency.relation_distrust(rel regclass, parent regclass) returns
 * text: idem_relation_distrust() for the SECURITY DEFINER functions in
 * SQL, which must not read a relation that is not ours.
 */
Datum
idem_relation_distrust_sql(PG_FUNCTION_ARGS)
{
	const char *why;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		PG_RETURN_TEXT_P(cstring_to_text("is NULL"));
	why = idem_relation_distrust(PG_GETARG_OID(0), PG_GETARG_OID(1));
	if (why == NULL)
		PG_RETURN_NULL();
	PG_RETURN_TEXT_P(cstring_to_text(why));
}

/*
 * Error out unless every table and view of the extension is owned by the
 * extension's owner: a round acting as that owner writes them, and a
 * trigger or rule on one of them would run as the owner too.
 */
void
idem_check_members_owned(void)
{
	Oid			extid = get_extension_oid("idempotency", false);
	Oid			owner = idem_extension_owner();
	Relation	rel = table_open(DependRelationId, AccessShareLock);
	ScanKeyData key[2];
	SysScanDesc scan;
	HeapTuple	tup;

	ScanKeyInit(&key[0], Anum_pg_depend_refclassid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(ExtensionRelationId));
	ScanKeyInit(&key[1], Anum_pg_depend_refobjid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(extid));
	scan = systable_beginscan(rel, DependReferenceIndexId, true, NULL, 2, key);
	while (HeapTupleIsValid(tup = systable_getnext(scan)))
	{
		Form_pg_depend dep = (Form_pg_depend) GETSTRUCT(tup);
		HeapTuple	ctup;
		Oid			relowner;

		if (dep->deptype != DEPENDENCY_EXTENSION || dep->classid != RelationRelationId)
			continue;
		ctup = SearchSysCache1(RELOID, ObjectIdGetDatum(dep->objid));
		if (!HeapTupleIsValid(ctup))
			continue;
		relowner = ((Form_pg_class) GETSTRUCT(ctup))->relowner;
		ReleaseSysCache(ctup);
		if (relowner != owner)
		{
			char	   *relname = get_rel_name(dep->objid);
			char	   *who = GetUserNameFromId(relowner, true);

			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("relation %s.%s is not owned by the owner of extension \"idempotency\"",
							IDEM_SCHEMA, quote_identifier(relname ? relname : "?")),
					 errdetail("It is owned by role %s; maintenance acts as the extension's owner and does not write relations another role controls.",
							   who ? quote_identifier(who) : "?"),
					 errhint("Give it back with ALTER TABLE ... OWNER TO the extension's owner, and grant the role that maintains the operator capability instead: SELECT idem_grant('role', 'operator').")));
		}
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
}

/*
 * Act as the extension's owner, in a security-restricted operation, with
 * search_path pinned and the settings that shape DDL at their defaults, in
 * a GUC nest level of its own.  idem_unbecome_owner(&as) undoes it; an
 * error undoes it too (transaction and subtransaction abort restore the
 * user and the GUCs).
 */
void
idem_become_owner(IdemAsOwner *as)
{
	GetUserIdAndSecContext(&as->save_userid, &as->save_sec_context);
	SetUserIdAndSecContext(idem_extension_owner(),
						   as->save_sec_context | SECURITY_RESTRICTED_OPERATION);
	as->nestlevel = idem_pin_search_path();
	(void) set_config_option("default_tablespace", "", PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
	(void) set_config_option("default_table_access_method", "heap", PGC_USERSET,
							 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
}

void
idem_unbecome_owner(IdemAsOwner *as)
{
	AtEOXact_GUC(true, as->nestlevel);
	SetUserIdAndSecContext(as->save_userid, as->save_sec_context);
}

/*
 * Connect to SPI as the extension's owner, for an API function that has
 * checked the caller's capability and now works on our tables (see
 * common/capabilities.c); idem_spi_finish_as_owner() undoes both, an
 * error undoes both too.
 */
void
idem_spi_connect_as_owner(IdemAsOwner *as)
{
	idem_become_owner(as);
	SPI_connect();
}

void
idem_spi_finish_as_owner(IdemAsOwner *as)
{
	SPI_finish();
	idem_unbecome_owner(as);
}
