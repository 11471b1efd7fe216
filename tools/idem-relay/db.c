/*
 * db.c: the database connection both loops use: --dbname through libpq
 * (fallback application name idem-relay), the session pinned to READ
 * COMMITTED (claims want it; inbound receives are single statements) and
 * client_min_messages = warning, and the extension's schema, read at
 * connect, so every call is schema-qualified.
 *
 * Main thread only.
 */
#include "relay.h"

#include <libpq-fe.h>
#include <stdio.h>

int
db_exec_ok(PGconn *conn, const char *sql)
{
	PGresult   *res = PQexec(conn, sql);
	int			ok = PQresultStatus(res) == PGRES_COMMAND_OK || PQresultStatus(res) == PGRES_TUPLES_OK;

	if (!ok)
		log_msg(LOG_ERROR, "statement failed", "error", PQerrorMessage(conn), NULL);
	PQclear(res);
	return ok;
}

PGconn *
db_connect(const relay_config *cfg, char *schema, size_t schemalen)
{
	const char *keys[] = {"dbname", "fallback_application_name", NULL};
	const char *values[] = {cfg->dbname, "idem-relay", NULL};
	PGconn	   *conn = PQconnectdbParams(keys, values, 1);
	PGresult   *res;

	if (PQstatus(conn) != CONNECTION_OK)
	{
		log_msg(LOG_ERROR, "cannot connect to the database", "error", PQerrorMessage(conn), NULL);
		PQfinish(conn);
		return NULL;
	}
	if (!db_exec_ok(conn, "SET default_transaction_isolation = 'read committed'; "
					"SET client_min_messages = warning"))
	{
		PQfinish(conn);
		return NULL;
	}
	res = PQexec(conn,
				 "SELECT pg_catalog.quote_ident(n.nspname) "
				 "FROM pg_catalog.pg_extension e "
				 "JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace "
				 "WHERE e.extname = 'idempotency'");
	if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
	{
		log_msg(LOG_ERROR, "the database has no extension idempotency",
				"error", PQerrorMessage(conn), NULL);
		PQclear(res);
		PQfinish(conn);
		return NULL;
	}
	snprintf(schema, schemalen, "%s", PQgetvalue(res, 0, 0));
	PQclear(res);
	return conn;
}
