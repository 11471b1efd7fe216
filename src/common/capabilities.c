/*-------------------------------------------------------------------------
 *
 * capabilities.c
 *	  Capabilities, the permission surface of the API: which role may call
 *	  which function, for which scopes, aggregate types and sources;
 *	  idem_grant() and idem_revoke().
 *
 * A row of idempotency.capabilities (role, capability, scopes,
 * aggregate_types, sources) gives one role one capability (handler,
 * relay, operator, monitor).  A NULL limit is unlimited on that axis; an
 * entry is an exact name or a prefix ending in '*'; an empty array allows
 * nothing on that axis.  A grant to a role covers every role that has its
 * privileges (has_privs_of_role(), as for table privileges), so a group
 * role's grant covers its members; superusers and roles with the
 * extension owner's privileges hold every capability unlimited.  Rows of a
 * role that no longer exists are never used (each build checks
 * pg_authid), and idem_grant()/idem_revoke() delete them.  The role column
 * is a regrole, so a dump carries role names and a restore into another
 * cluster maps them to that cluster's roles.
 *
 * The API functions call idem_capability_require*() first, after the
 * argument checks that need no privilege, and then touch our tables as
 * the extension's owner (common/ownership.c) or directly in the heap: no
 * application role needs a privilege on an internal table.
 *
 * Each backend caches the table's rows (read once with a heap scan) and,
 * for the current user, the rows that apply to it.  The rows are dropped
 * by a relcache invalidation of the table, which the one invalidation
 * trigger (common/cache.c) sends at the writer's commit (and at once to
 * the writer itself); REASSIGN OWNED, which may change the extension's
 * owner, changes the table's owner too and so invalidates it as well.  The
 * per-user part is also dropped when GetUserId() changes and by syscache
 * invalidations of pg_authid and pg_auth_members (membership, superuser).
 *
 * Locking rules: a build takes AccessShareLock on the table (which
 * processes pending invalidations) before its snapshot; an invalidation
 * that arrives during the build makes the next check build again.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/capabilities.h"
#include "common/catalog.h"
#include "common/keys.h"
#include "common/ownership.h"
#include "common/spi.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

PG_FUNCTION_INFO_V1(idem_grant);
PG_FUNCTION_INFO_V1(idem_revoke);

static const char *const cap_names[IDEM_NUM_CAPS] = {"handler", "relay", "operator", "monitor"};
static const char *const axis_names[IDEM_NUM_AXES] = {"scope", "aggregate type", "source",
"outbox subscription"};
static const char *const axis_params[IDEM_NUM_AXES] = {"scopes", "aggregate_types", "sources",
"subscriptions"};

/* columns of idempotency.capabilities */
enum
{
	Anum_caps_role = 1,
	Anum_caps_capability,
	Anum_caps_scopes,
	Anum_caps_aggregate_types,
	Anum_caps_sources,
	Anum_caps_subscriptions
};

/* one row of the table */
typedef struct CapRow
{
	Oid			role;
	int			cap;
	bool		limited[IDEM_NUM_AXES];
	int			npat[IDEM_NUM_AXES];
	char	  **pat[IDEM_NUM_AXES];
} CapRow;

/* the rows of one capability that apply to the current user */
struct IdemCapGrants
{
	bool		all;			/* superuser, owner, or an unlimited row */
	int			nrows;
	CapRow	  **rows;
};

static MemoryContext caps_cxt = NULL;
static bool rows_valid = false;
static Oid	caps_relid = InvalidOid;
static CapRow *caps_rows = NULL;
static int	caps_nrows = 0;

static bool user_valid = false;
static bool legacy = false;		/* the last check found 1.0's objects */
static Oid	user_id = InvalidOid;
static IdemCapGrants user_grants[IDEM_NUM_CAPS];

static void
caps_relcache_cb(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == caps_relid)
	{
		rows_valid = false;
		user_valid = false;
	}
}

static void
caps_syscache_cb(Datum arg, int cacheid, uint32 hashvalue)
{
	user_valid = false;
}

static void
caps_register(void)
{
	static bool registered = false;

	if (registered)
		return;
	CacheRegisterRelcacheCallback(caps_relcache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(AUTHOID, caps_syscache_cb, (Datum) 0);
	CacheRegisterSyscacheCallback(AUTHMEMROLEMEM, caps_syscache_cb, (Datum) 0);
	/* the extension's owner changed (see idem_extension_owner()) */
	CacheRegisterSyscacheCallback(NAMESPACEOID, caps_syscache_cb, (Datum) 0);
	caps_cxt = AllocSetContextCreate(CacheMemoryContext, "idempotency capabilities",
									 ALLOCSET_SMALL_SIZES);
	registered = true;
}

/* A text[] column as C strings in caps_cxt; false if NULL. */
static bool
read_patterns(HeapTuple tup, TupleDesc desc, int attno, int *n, char ***out)
{
	bool		isnull;
	Datum		d = heap_getattr(tup, attno, desc, &isnull);
	Datum	   *elems;
	bool	   *nulls;
	int			nelems;

	*n = 0;
	*out = NULL;
	if (isnull)
		return false;
	deconstruct_array(DatumGetArrayTypeP(d), TEXTOID, -1, false, TYPALIGN_INT,
					  &elems, &nulls, &nelems);
	*out = MemoryContextAlloc(caps_cxt, sizeof(char *) * Max(nelems, 1));
	for (int i = 0; i < nelems; i++)
		if (!nulls[i])
			(*out)[(*n)++] = MemoryContextStrdup(caps_cxt, TextDatumGetCString(elems[i]));
	return true;
}

static int
cap_index(const char *name)
{
	for (int c = 0; c < IDEM_NUM_CAPS; c++)
		if (strcmp(name, cap_names[c]) == 0)
			return c;
	return -1;
}

/* Read the table into caps_rows. */
static void
build_rows(void)
{
	Relation	rel;
	Snapshot	snap;
	TableScanDesc scan;
	HeapTuple	tup;
	int			cap = 16;

	caps_register();
	rows_valid = true;			/* an invalidation during the build clears it */
	user_valid = false;
	MemoryContextReset(caps_cxt);
	caps_rows = NULL;
	caps_nrows = 0;
	caps_relid = idem_internal_relid("capabilities");
	rel = table_open(caps_relid, AccessShareLock);
	caps_rows = MemoryContextAlloc(caps_cxt, sizeof(CapRow) * cap);
	snap = RegisterSnapshot(GetLatestSnapshot());
	scan = table_beginscan(rel, snap, 0, NULL);
	while ((tup = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		TupleDesc	desc = RelationGetDescr(rel);
		bool		isnull;
		CapRow	   *r;
		Oid			role = DatumGetObjectId(heap_getattr(tup, Anum_caps_role, desc, &isnull));
		int			c = cap_index(TextDatumGetCString(heap_getattr(tup, Anum_caps_capability,
																   desc, &isnull)));

		if (c < 0 || !SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(role)))
			continue;			/* a dropped role's row is never used */
		if (caps_nrows == cap)
		{
			cap *= 2;
			caps_rows = repalloc(caps_rows, sizeof(CapRow) * cap);
		}
		r = &caps_rows[caps_nrows++];
		r->role = role;
		r->cap = c;
		for (int a = 0; a < IDEM_NUM_AXES; a++)
			r->limited[a] = read_patterns(tup, desc, Anum_caps_scopes + a, &r->npat[a], &r->pat[a]);
	}
	table_endscan(scan);
	UnregisterSnapshot(snap);
	table_close(rel, AccessShareLock);
}

/* The rows that apply to the current user, per capability. */
static void
build_user(void)
{
	Oid			uid = GetUserId();
	bool		all;

	if (!rows_valid)
		build_rows();
	all = superuser_arg(uid) || has_privs_of_role(uid, idem_extension_owner());
	for (int c = 0; c < IDEM_NUM_CAPS; c++)
	{
		IdemCapGrants *g = &user_grants[c];

		g->all = all;
		g->nrows = 0;
		if (g->rows == NULL)
			g->rows = MemoryContextAlloc(TopMemoryContext, sizeof(CapRow *) * 8);
		if (all)
			continue;
		for (int i = 0; i < caps_nrows; i++)
		{
			CapRow	   *r = &caps_rows[i];

			if (r->cap != c || !has_privs_of_role(uid, r->role))
				continue;
			g->all = true;		/* an unlimited row: limited on no axis */
			for (int a = 0; a < IDEM_NUM_AXES; a++)
				g->all = g->all && !r->limited[a];
			if (g->nrows > 0 && (g->nrows & 7) == 0)
				g->rows = repalloc(g->rows, sizeof(CapRow *) * (g->nrows + 8));
			g->rows[g->nrows++] = r;
		}
	}
	user_id = uid;
	user_valid = true;
}

/*
 * Version 1.0's functions running on this library, before ALTER EXTENSION
 * UPDATE made the table: 1.0's rules, the caller's privileges on
 * idempotency.claims (INSERT to claim, DELETE to release); maintenance was
 * PUBLIC's.  Not cached: the update may come any moment.
 */
static const IdemCapGrants *
legacy_grants(IdemCapability cap, Oid claims)
{
	static IdemCapGrants g;
	AclMode		mode = cap == IDEM_CAP_OPERATOR ? ACL_DELETE : ACL_INSERT;

	g.nrows = 0;
	g.all = superuser() || pg_class_aclcheck(claims, GetUserId(), mode) == ACLCHECK_OK;
	return &g;
}

static const IdemCapGrants *
grants_of(IdemCapability cap)
{
	legacy = false;
	if (!user_valid || !rows_valid || user_id != GetUserId())
	{
		Oid			claims;

		if (!rows_valid &&
			!OidIsValid(get_relname_relid("capabilities", idem_schema_oid())) &&
			OidIsValid(claims = get_relname_relid("claims", idem_schema_oid())))
		{
			legacy = true;
			return legacy_grants(cap, claims);
		}
		build_user();
	}
	return &user_grants[cap];
}

static bool
pattern_matches(const char *pat, const char *value)
{
	size_t		len = strlen(pat);

	if (len > 0 && pat[len - 1] == '*')
		return strncmp(pat, value, len - 1) == 0;
	return strcmp(pat, value) == 0;
}

bool
idem_capability_allows(const IdemCapGrants *g, IdemCapAxis axis, const char *value)
{
	if (g == NULL || g->all)
		return true;
	for (int i = 0; i < g->nrows; i++)
	{
		CapRow	   *r = g->rows[i];

		if (!r->limited[axis])
			return true;
		for (int p = 0; p < r->npat[axis]; p++)
			if (pattern_matches(r->pat[axis][p], value))
				return true;
	}
	return false;
}

/* Is the caller limited on this axis (so rows must be filtered)? */
bool
idem_capability_limited(const IdemCapGrants *g, IdemCapAxis axis)
{
	if (g == NULL || g->all)
		return false;
	for (int i = 0; i < g->nrows; i++)
		if (!g->rows[i]->limited[axis])
			return false;
	return true;
}

/*
 * The names g allows on axis, if they are all exact names (no prefix):
 * their number, the names in *names; -1 if unlimited there or a prefix.
 */
int
idem_capability_exact_names(const IdemCapGrants *g, IdemCapAxis axis, char ***names)
{
	int			n = 0;

	if (!idem_capability_limited(g, axis))
		return -1;
	for (int i = 0; i < g->nrows; i++)
		n += g->rows[i]->npat[axis];
	*names = palloc(sizeof(char *) * Max(n, 1));
	n = 0;
	for (int i = 0; i < g->nrows; i++)
		for (int p = 0; p < g->rows[i]->npat[axis]; p++)
		{
			char	   *pat = g->rows[i]->pat[axis][p];

			if (pat[strlen(pat) - 1] == '*')
				return -1;
			(*names)[n++] = pat;
		}
	return n;
}

/* Does the current user hold cap at all (any limits)? */
bool
idem_capability_held(IdemCapability cap)
{
	const IdemCapGrants *g = grants_of(cap);

	return g->all || g->nrows > 0;
}

/* The current user's own (direct) row of cap, or NULL. */
static CapRow *
own_row(IdemCapability cap)
{
	Oid			uid = GetUserId();

	for (int i = 0; i < caps_nrows; i++)
		if (caps_rows[i].role == uid && caps_rows[i].cap == (int) cap)
			return &caps_rows[i];
	return NULL;
}

/* ARRAY['a', 'b'] of patterns, plus extra if not NULL */
static void
append_array(StringInfo buf, char **pat, int n, const char *extra)
{
	appendStringInfoString(buf, "ARRAY[");
	for (int i = 0; i < n; i++)
		appendStringInfo(buf, "%s%s", i > 0 ? ", " : "", quote_literal_cstr(pat[i]));
	if (extra != NULL)
		appendStringInfo(buf, "%s%s", n > 0 ? ", " : "", quote_literal_cstr(extra));
	appendStringInfoString(buf, "]");
	if (n == 0 && extra == NULL)
		appendStringInfoString(buf, "::text[]");
}

/*
 * The 42501 error: fname names the function, axis < 0 asks for an
 * unlimited grant, else value is the name on that axis that was refused.
 */
static void
refuse(const char *fname, IdemCapability cap, int axis, const char *value)
{
	char	   *user = GetUserNameFromId(GetUserId(), false);
	char	   *role_lit = quote_literal_cstr(quote_identifier(user));
	CapRow	   *own = own_row(cap);
	StringInfoData hint;
	char	   *detail;

	initStringInfo(&hint);
	appendStringInfo(&hint, "An owner of the extension can grant it: SELECT idem_grant(%s, '%s'",
					 role_lit, cap_names[cap]);
	if (axis >= 0 && value != NULL)
	{
		detail = psprintf("Role \"%s\" has no idempotency capability \"%s\" for %s \"%s\".",
						  user, cap_names[cap], axis_names[axis], value);
		/* keep the limits of the role's own grant, and add the value */
		for (int a = 0; a < IDEM_NUM_AXES; a++)
		{
			if (a == axis)
			{
				appendStringInfo(&hint, ", %s => ", axis_params[a]);
				append_array(&hint, own ? own->pat[a] : NULL, own && own->limited[a] ? own->npat[a] : 0,
							 value);
			}
			else if (own != NULL && own->limited[a])
			{
				appendStringInfo(&hint, ", %s => ", axis_params[a]);
				append_array(&hint, own->pat[a], own->npat[a], NULL);
			}
		}
	}
	else if (axis < 0 && idem_capability_held(cap))
		detail = psprintf("Role \"%s\" has idempotency capability \"%s\" only with limits; %s needs it unlimited.",
						  user, cap_names[cap], fname);
	else
		detail = psprintf("Role \"%s\" has no idempotency capability \"%s\".", user, cap_names[cap]);
	appendStringInfoString(&hint, ");");
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("permission denied for function %s", fname),
			 errdetail_internal("%s", detail),
			 errhint("%s", hint.data)));
}

/* Error unless the caller holds cap for value on axis. */
void
idem_capability_require(const char *fname, IdemCapability cap, IdemCapAxis axis, const char *value)
{
	const IdemCapGrants *g = grants_of(cap);

	if (g->all)
		return;
	if (g->nrows == 0)
		refuse(fname, cap, -2, NULL);
	if (!idem_capability_allows(g, axis, value))
		refuse(fname, cap, axis, value);
}

/* Error unless the caller holds cap with no limit. */
void
idem_capability_require_unlimited(const char *fname, IdemCapability cap)
{
	const IdemCapGrants *g = grants_of(cap);

	if (g->all || legacy)
		return;					/* all, or 1.0's maintenance: PUBLIC's */
	refuse(fname, cap, -1, NULL);
}

/*
 * Error unless the caller holds cap with any limits; the grants, to filter
 * rows with idem_capability_allows(), or NULL if unlimited.  Valid until
 * the next check.
 */
const IdemCapGrants *
idem_capability_require_any(const char *fname, IdemCapability cap)
{
	const IdemCapGrants *g = grants_of(cap);

	if (g->all)
		return NULL;
	if (g->nrows == 0)
		refuse(fname, cap, -2, NULL);
	return g;
}

/*
 * Error unless g (from idem_capability_require_any, checked for the same
 * cap) is unlimited: for a decision taken later, when the caller may be
 * acting as the extension's owner.
 */
void
idem_capability_check_unlimited(const char *fname, IdemCapability cap, const IdemCapGrants *g)
{
	if (g != NULL && !g->all)
		refuse(fname, cap, -1, NULL);
}

/* Error unless g (from idem_capability_require_any) allows value on axis. */
void
idem_capability_check_value(const char *fname, IdemCapability cap, const IdemCapGrants *g,
							IdemCapAxis axis, const char *value)
{
	if (!idem_capability_allows(g, axis, value))
		refuse(fname, cap, axis, value);
}

/*---- idem_grant(), idem_revoke() ----*/

static void
require_owner(const char *fname)
{
	if (!superuser() && !has_privs_of_role(GetUserId(), idem_extension_owner()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for function %s", fname),
				 errdetail("Only superusers and roles with the privileges of the owner of extension \"idempotency\" grant and revoke capabilities.")));
}

static Oid
role_arg(FunctionCallInfo fcinfo)
{
	Oid			role;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("role must not be null")));
	role = PG_GETARG_OID(0);
	if (!SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(role)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role with OID %u does not exist", role)));
	return role;
}

static const char *
cap_arg(FunctionCallInfo fcinfo, int argno)
{
	char	   *name;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("capability must not be null")));
	name = TextDatumGetCString(PG_GETARG_DATUM(argno));
	if (cap_index(name) < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("unknown idempotency capability \"%s\"", name),
				 errhint("The capabilities are handler, relay, operator and monitor.")));
	return name;
}

/* Check a limit: one-dimensional, no NULL, each an exact name or a prefix and '*'. */
static void
check_patterns(FunctionCallInfo fcinfo, int argno, int axis)
{
	ArrayType  *arr;
	Datum	   *elems;
	bool	   *nulls;
	int			n;

	if (PG_ARGISNULL(argno))
		return;
	arr = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(arr) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a one-dimensional array", axis_params[axis])));
	deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &elems, &nulls, &n);
	for (int i = 0; i < n; i++)
	{
		text	   *t;
		char	   *s;
		char	   *star;

		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%s must not contain nulls", axis_params[axis]),
					 errdetail("Element %d is null.", i + 1)));
		t = DatumGetTextPP(elems[i]);
		s = text_to_cstring(t);
		if (*s == '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("%s must not contain empty names", axis_params[axis]),
					 errdetail("Element %d is empty.", i + 1)));
		star = strchr(s, '*');
		if (star != NULL && star[1] != '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid %s pattern \"%s\"", axis_names[axis], s),
					 errdetail("A pattern is an exact name, or a prefix followed by one \"*\" at its end.")));
		if (axis == IDEM_AXIS_SCOPE)
			idem_check_scope(t, IDEM_MAX_SCOPE_BYTES);
	}
}

/* Rows of roles that no longer exist go whenever grants change. */
static const char *const forget_dropped_sql =
"DELETE FROM idempotency.capabilities c WHERE NOT EXISTS"
" (SELECT FROM pg_catalog.pg_authid a WHERE a.oid OPERATOR(pg_catalog.=) c.role::pg_catalog.oid)";

/* Give or take the view access of the monitor capability (07_capabilities.sql). */
static void
monitor_privileges(Oid role, bool give)
{
	Oid			types[2] = {OIDOID, BOOLOID};
	Datum		values[2] = {ObjectIdGetDatum(role), BoolGetDatum(give)};

	idem_spi_exec("SELECT idempotency.monitor_privileges($1::pg_catalog.regrole, $2)",
				  2, types, values, SPI_OK_SELECT);
}

/*
 * idem_grant(role regrole, capability text, scopes text[] = NULL,
 *            aggregate_types text[] = NULL, sources text[] = NULL,
 *            subscriptions text[] = NULL)
 */
Datum
idem_grant(PG_FUNCTION_ARGS)
{
	Oid			role = role_arg(fcinfo);
	const char *cap = cap_arg(fcinfo, 1);
	Oid			types[2 + IDEM_NUM_AXES] = {OIDOID, TEXTOID, TEXTARRAYOID, TEXTARRAYOID,
	TEXTARRAYOID, TEXTARRAYOID};
	Datum		values[2 + IDEM_NUM_AXES];
	char		nulls[2 + IDEM_NUM_AXES] = {' ', ' ', ' ', ' ', ' ', ' '};
	IdemAsOwner as;

	bool		limited = false;

	for (int a = 0; a < IDEM_NUM_AXES; a++)
	{
		check_patterns(fcinfo, 2 + a, a);
		if (PG_ARGISNULL(2 + a))
			nulls[2 + a] = 'n';
		else
			values[2 + a] = PG_GETARG_DATUM(2 + a);
		limited = limited || !PG_ARGISNULL(2 + a);
	}
	if (strcmp(cap, "monitor") == 0 && limited)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("capability \"monitor\" cannot be limited"),
				 errdetail("It gives access to the monitoring views, which show every scope, aggregate type and source.")));
	require_owner("idem_grant");
	PreventCommandIfReadOnly("idem_grant()");
	values[0] = ObjectIdGetDatum(role);
	values[1] = CStringGetTextDatum(cap);

	idem_become_owner(&as);
	SPI_connect();
	idem_spi_exec(forget_dropped_sql, 0, NULL, NULL, SPI_OK_DELETE);
	if (SPI_execute_with_args("INSERT INTO idempotency.capabilities AS c"
							  " (role, capability, scopes, aggregate_types, sources, subscriptions)"
							  " VALUES ($1::pg_catalog.regrole, $2, $3, $4, $5, $6)"
							  " ON CONFLICT (role, capability) DO UPDATE"
							  " SET scopes = excluded.scopes, aggregate_types = excluded.aggregate_types,"
							  " sources = excluded.sources, subscriptions = excluded.subscriptions",
							  2 + IDEM_NUM_AXES, types, values, nulls, false, 0) != SPI_OK_INSERT)
		elog(ERROR, "could not store the capability");
	if (strcmp(cap, "monitor") == 0)
		monitor_privileges(role, true);
	SPI_finish();
	idem_unbecome_owner(&as);
	PG_RETURN_VOID();
}

/* idem_revoke(role regrole, capability text = NULL) returns integer */
Datum
idem_revoke(PG_FUNCTION_ARGS)
{
	Oid			role = role_arg(fcinfo);
	Oid			types[2] = {OIDOID, TEXTOID};
	Datum		values[2];
	char		nulls[2] = {' ', ' '};
	uint64		n;
	IdemAsOwner as;

	values[0] = ObjectIdGetDatum(role);
	if (PG_ARGISNULL(1))
		nulls[1] = 'n';
	else
		values[1] = CStringGetTextDatum(cap_arg(fcinfo, 1));
	require_owner("idem_revoke");
	PreventCommandIfReadOnly("idem_revoke()");

	idem_become_owner(&as);
	SPI_connect();
	idem_spi_exec(forget_dropped_sql, 0, NULL, NULL, SPI_OK_DELETE);
	if (SPI_execute_with_args("DELETE FROM idempotency.capabilities"
							  " WHERE role OPERATOR(pg_catalog.=) $1::pg_catalog.regrole"
							  " AND ($2::pg_catalog.text IS NULL OR capability OPERATOR(pg_catalog.=) $2)",
							  2, types, values, nulls, false, 0) != SPI_OK_DELETE)
		elog(ERROR, "could not remove the capability");
	n = SPI_processed;
	if (PG_ARGISNULL(1) || strcmp(TextDatumGetCString(values[1]), "monitor") == 0)
		monitor_privileges(role, false);
	SPI_finish();
	idem_unbecome_owner(&as);
	PG_RETURN_INT32((int32) n);
}
