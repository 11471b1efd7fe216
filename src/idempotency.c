/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  Entry point of the idempotency extension.
 *
 * _PG_init only hands off to each subsystem's init function; the helpers
 * here are the few that every subsystem needs (finding the extension's own
 * schema and relations).  Nothing here takes locks beyond catalog lookups.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"

#include "catalog/namespace.h"
#include "fmgr.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

void
_PG_init(void)
{
	idem_partitions_init();
	idem_filters_init();
	idem_guards_init();
	idem_store_init();
	idem_outbox_init();
	idem_inbox_init();
	idem_worker_init();
}

/*
 * OID of schema "idempotency"; errors out if the extension is not installed
 * in this database.
 */
Oid
idem_schema_oid(void)
{
	Oid			nspid = get_namespace_oid(IDEM_SCHEMA, true);

	if (!OidIsValid(nspid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idempotency\" is not installed in this database")));
	return nspid;
}

/* OID of relation idempotency.<relname>, which must exist. */
Oid
idem_internal_relid(const char *relname)
{
	Oid			relid = get_relname_relid(relname, idem_schema_oid());

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"%s.%s\" does not exist", IDEM_SCHEMA, relname),
				 errhint("The idempotency extension may be damaged; reinstall it.")));
	return relid;
}

/*
 * Pin search_path to pg_catalog while preparing or running internal SQL
 * (maintenance often runs as a superuser): no operator or function a user
 * put on the path can stand in for the built-in ones.  Returns the GUC nest
 * level to undo with AtEOXact_GUC(true, level).
 */
int
idem_pin_search_path(void)
{
	int			nestlevel = NewGUCNestLevel();

	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	return nestlevel;
}
