/*-------------------------------------------------------------------------
 *
 * catalog.c
 *	  Finding the extension's schema and its own tables (their columns are
 *	  described once, in catalog.h).
 *
 * Locking rules: catalog lookups only; idem_open_internal() takes the lock
 * its caller names.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/catalog.h"

#include "access/table.h"
#include "catalog/namespace.h"
#include "utils/lsyscache.h"

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
 * Open one of the extension's own tables; a clear error (not "could not open
 * relation with OID") if DROP EXTENSION removed it meanwhile.
 */
Relation
idem_open_internal(Oid relid)
{
	Relation	rel = try_table_open(relid, AccessShareLock);

	if (rel == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idempotency\" is not installed in this database"),
				 errdetail("Its tables were dropped while this statement ran.")));
	return rel;
}
