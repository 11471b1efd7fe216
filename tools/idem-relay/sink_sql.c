/*
 * sink_sql.c: run one SQL statement per event (--sql STATEMENT) on a
 * connection of the sink's own to --url, a libpq connection string ("-",
 * the default: the relay's own --dbname, on a second connection).  $1 is
 * the event as one JSON object (jsonb), $2 its id (uuid); a statement may
 * use either, both or neither, but no $3.  The statement's result is
 * ignored: it succeeds, and the event is confirmed, or it raises.
 *
 * Each statement runs in autocommit, so it has committed before the relay
 * acks the event: at least once, exactly once in effect for a statement
 * that dedupes (on $2, or with idem_claim in a database with the
 * extension).  The connection's application_name is the relay's
 * (PGAPPNAME, or idem-relay) plus "/sink", statement_timeout is --timeout.
 *
 * Errors, by SQLSTATE: 40xxx (serialization failure, deadlock), 53xxx
 * (out of resources), 55P03 (lock not available) and 57014 (the timeout)
 * are transient: tried again in place; 08xxx, 57P0x (the server shutting
 * down) and a lost connection mean the database is unreachable: tried
 * again until it is back, spending no attempt; so does 42xxx (the
 * statement's function or table dropped or its grant revoked: an operator's
 * fix, not the event's fault).  Anything else (a RAISE of the statement, a
 * constraint) refuses the event: nacked, dead-lettered after
 * outbox_max_attempts.  A statement that cannot be prepared when the relay
 * starts (a syntax error, more than two parameters) stops it with exit 2.
 *
 * One connection, blocking; main thread only.
 */
#include "relay.h"

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SQL_STMT_NAME "idem_relay_sink"

static const Oid param_types[2] = {3802, 2950};	/* JSONBOID, UUIDOID */

typedef struct sql_sink
{
	PGconn	   *conn;
} sql_sink;

static void
sql_close(void *state)
{
	sql_sink   *st = state;

	PQfinish(st->conn);
	free(st);
}

/* copy the error of res (or of the connection) into err */
static void
sql_error_text(PGconn *conn, const PGresult *res, char *err, size_t errlen)
{
	const char *msg = res ? PQresultErrorMessage(res) : "";
	size_t		n;

	snprintf(err, errlen, "%s", *msg ? msg : PQerrorMessage(conn));
	n = strlen(err);
	while (n > 0 && (err[n - 1] == '\n' || err[n - 1] == ' '))
		err[--n] = '\0';
}

static int
sql_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	const char *app = getenv("PGAPPNAME");
	char		appname[128],
				timeout[32],
				connect_timeout[16];
	const char *keys[] = {"dbname", "application_name", "connect_timeout", NULL};
	const char *values[4];
	const char *set_params[1];
	sql_sink   *st;
	PGresult   *res;
	int			fatal = 0,
				nparams;

	snprintf(appname, sizeof(appname), "%s/sink", app && *app ? app : "idem-relay");
	snprintf(connect_timeout, sizeof(connect_timeout), "%d", cfg->timeout < 2 ? 2 : (int) cfg->timeout);
	values[0] = strcmp(cfg->url, "-") == 0 ? cfg->dbname : cfg->url;
	values[1] = appname;
	values[2] = connect_timeout;
	values[3] = NULL;
	st = calloc(1, sizeof(*st));
	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	/* expand_dbname: the later keys win over what the connection string says */
	st->conn = PQconnectdbParams(keys, values, 1);
	if (PQstatus(st->conn) != CONNECTION_OK)
	{
		sql_error_text(st->conn, NULL, err, errlen);
		sql_close(st);
		return -1;
	}
	snprintf(timeout, sizeof(timeout), "%d", (int) (cfg->timeout * 1000));
	set_params[0] = timeout;
	res = PQexecParams(st->conn,
					   "SELECT pg_catalog.set_config('statement_timeout', $1, false), "
					   "pg_catalog.set_config('client_min_messages', 'warning', false)",
					   1, NULL, set_params, NULL, NULL, 0);
	if (PQresultStatus(res) != PGRES_TUPLES_OK)
	{
		sql_error_text(st->conn, res, err, errlen);
		PQclear(res);
		sql_close(st);
		return -1;
	}
	PQclear(res);

	/* jsonb and uuid, by OID (built in, fixed): so $2 alone is fine too */
	res = PQprepare(st->conn, SQL_STMT_NAME, cfg->sql, 2, param_types);
	if (PQresultStatus(res) != PGRES_COMMAND_OK)
	{
		const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);

		/* the statement itself is wrong (syntax, an unknown name): no retry helps */
		fatal = state && strncmp(state, "42", 2) == 0;
		snprintf(err, errlen, "--sql cannot be prepared: ");
		sql_error_text(st->conn, res, err + strlen(err), errlen - strlen(err));
		PQclear(res);
		sql_close(st);
		return fatal ? SINK_OPEN_FATAL : -1;
	}
	PQclear(res);
	res = PQdescribePrepared(st->conn, SQL_STMT_NAME);
	if (PQresultStatus(res) != PGRES_COMMAND_OK)
	{
		sql_error_text(st->conn, res, err, errlen);
		PQclear(res);
		sql_close(st);
		return -1;
	}
	nparams = PQnparams(res);
	PQclear(res);
	if (nparams > 2)
	{
		snprintf(err, errlen, "--sql has %d parameters: at most 2 ($1 the event as JSON, $2 its id)",
				 nparams);
		sql_close(st);
		return SINK_OPEN_FATAL;
	}
	*state = st;
	return 0;
}

/* what a failed statement's SQLSTATE means for the event */
static sink_result
sql_result_of(const char *state)
{
	if (!state)
		return SINK_DOWN;
	if (strncmp(state, "08", 2) == 0 || strncmp(state, "57P0", 4) == 0 || strncmp(state, "42", 2) == 0)
		return SINK_DOWN;
	if (strncmp(state, "40", 2) == 0 || strncmp(state, "53", 2) == 0 ||
		strcmp(state, "55P03") == 0 || strcmp(state, "57014") == 0)
		return SINK_RETRY;
	return SINK_REJECT;
}

static sink_result
sql_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	sql_sink   *st = state;
	const char *params[2];
	PGresult   *res;
	sink_result r;
	ExecStatusType s;

	(void) target;
	params[0] = ev->json;
	params[1] = ev->id;
	res = PQexecPrepared(st->conn, SQL_STMT_NAME, 2, params, NULL, NULL, 0);
	s = PQresultStatus(res);
	if (s == PGRES_COMMAND_OK || s == PGRES_TUPLES_OK)
	{
		PQclear(res);
		return SINK_OK;
	}
	sql_error_text(st->conn, res, err, errlen);
	r = PQstatus(st->conn) != CONNECTION_OK ? SINK_DOWN :
		sql_result_of(PQresultErrorField(res, PG_DIAG_SQLSTATE));
	PQclear(res);
	return r;
}

SINK_DEFINE(sink_sql, "sql", "-", "",
			sql_open, sql_publish, NULL, sql_close);
