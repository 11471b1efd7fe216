/*
 * sink_sql.c: run one SQL statement per event (--sql STATEMENT) on a
 * connection of the sink's own to --url, a libpq connection string ("-",
 * the default: the relay's own --dbname, on a second connection).  $1 is
 * the event as one JSON object (jsonb), $2 its id (uuid); a statement may
 * use either, both or neither, but no $3.  The statement's result is
 * ignored: it succeeds, and the event is confirmed, or it raises.
 *
 * Commits (--sql-commit): "batch" (the default) runs the statements of a
 * whole batch in one transaction, sent in libpq's pipeline mode, one round
 * trip for all; if any statement fails, or the COMMIT does, the transaction
 * rolls back, nothing of it counts, and the batch goes one event at a time
 * (outbox.c), each statement in autocommit, as "event" always does -- so
 * one poison event costs its batch a second, slower pass, never its order
 * or an effect.  Either way a statement has committed before the relay acks
 * its event: at least once, exactly once in effect for a statement that
 * dedupes (on $2, or with idem_claim in a database with the extension).  In
 * a batch every statement sees the same now() and holds its locks to the
 * batch's commit.  The connection's application_name is the relay's
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
 * One connection, blocking; main thread only.  A batch's runs are copied
 * by send_run and run at the first recv_run (sink.c's sink_runs_recv).
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
	int			per_event;		/* --sql-commit event: no batch transactions */
	double		lease;			/* --lease: a batch's transaction ends by a third of it */
	sink_queue	q;				/* the runs of the batch in hand (send_run) */
	int			nread;			/* runs recv_run returned */
	int			waved;			/* the batch's transaction ran */
} sql_sink;

/* forget the runs queued (after the last recv_run, or on close) */
static void
sql_reset(void *state)
{
	sql_sink   *st = state;

	sink_queue_clear(&st->q);
	st->nread = 0;
	st->waved = 0;
}

static void
sql_close(void *state)
{
	sql_sink   *st = state;

	sink_queue_free(&st->q);
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
	st->per_event = strcmp(cfg->sql_commit, "event") == 0;
	st->lease = cfg->lease;
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

/*
 * send_run: copy one aggregate's run; nothing is sent before the first
 * recv_run.  With --sql-commit event it declines, so every event goes one
 * at a time.
 */
static int
sql_send_run(void *state, const relay_event *evs, const char *const *targets, int n,
			 char *err, size_t errlen)
{
	sql_sink   *st = state;

	(void) targets;
	if (st->per_event)
	{
		snprintf(err, errlen, "--sql-commit event: one transaction per event");
		return -1;
	}
	return sink_queue_run(&st->q, evs, n, err, errlen);
}

/*
 * Send BEGIN (first) and the statements of events [from, to), then a sync,
 * and read their results: the first error into err (and *down if it means
 * the database is unreachable).  Returns 1 if every statement succeeded.
 */
static int
sql_chunk(sql_sink *st, int begin, int from, int to, char *err, size_t errlen, int *down)
{
	PGconn	   *conn = st->conn;
	int			ok,
				nq = to - from + begin;

	ok = !begin || PQsendQueryParams(conn, "BEGIN", 0, NULL, NULL, NULL, NULL, 0);
	for (int i = from; ok && i < to; i++)
	{
		const char *params[2] = {st->q.evs[i].json, st->q.evs[i].id};

		ok = PQsendQueryPrepared(conn, SQL_STMT_NAME, 2, params, NULL, NULL, 0);
	}
	if (!ok || !PQpipelineSync(conn))
	{
		sql_error_text(conn, NULL, err, errlen);
		*down = 1;
		return 0;
	}
	/* a result each (then NULL), then the sync's */
	for (int q = 0; q < nq; q++)
	{
		PGresult   *res = PQgetResult(conn);
		ExecStatusType rs;

		if (res == NULL)
		{
			if (ok)
				sql_error_text(conn, NULL, err, errlen);
			*down = 1;			/* no result: the connection is broken */
			return 0;
		}
		rs = PQresultStatus(res);
		if (rs == PGRES_FATAL_ERROR && ok)
		{
			sql_error_text(conn, res, err, errlen);
			if (PQstatus(conn) != CONNECTION_OK ||
				sql_result_of(PQresultErrorField(res, PG_DIAG_SQLSTATE)) == SINK_DOWN)
				*down = 1;
		}
		if (rs != PGRES_COMMAND_OK && rs != PGRES_TUPLES_OK)
			ok = 0;
		PQclear(res);
		while ((res = PQgetResult(conn)) != NULL)
			PQclear(res);
	}
	{
		PGresult   *res = PQgetResult(conn);

		if (res == NULL || PQresultStatus(res) != PGRES_PIPELINE_SYNC)
			*down = 1;
		PQclear(res);
	}
	return ok && !*down;
}

/*
 * The batch's transaction: BEGIN and every queued event's statement, sent
 * in pipeline mode in chunks (a round trip each: SQL_FIRST_CHUNK, then as
 * many as should end by the deadline at the pace so far), then COMMIT.
 * Past a third of the lease, or on SIGTERM, it commits what ran so far --
 * a prefix of each run, as the runs went in order -- and leaves the rest
 * to the one-at-a-time path, which extends the lease.  If a statement or
 * the COMMIT fails, it rolls back and nothing is confirmed: each run fails
 * with the first error, SINK_RETRY so that the batch goes one event at a
 * time, or SINK_DOWN if the database is unreachable.
 */
#define SQL_FIRST_CHUNK 8
#define SQL_MAX_CHUNK 128

static void
sql_batch(void *state)
{
	sql_sink   *st = state;
	PGconn	   *conn = st->conn;
	char		first_err[256] = "";
	double		started = relay_now();
	double		deadline = started + st->lease / 3;
	int			done = 0,
				ok = 1,
				down = 0;

	if (!PQenterPipelineMode(conn))
	{
		sql_error_text(conn, NULL, first_err, sizeof(first_err));
		sink_runs_fail_rest(st->q.runs, st->q.nruns, SINK_DOWN, first_err);
		return;
	}
	while (ok && done < st->q.nev)
	{
		int			chunk = SQL_FIRST_CHUNK,
					to;
		double		now = relay_now();

		/* as many as should end by the deadline, at the pace so far */
		if (done > 0)
		{
			double		each = (now - started) / done;

			chunk = each > 0 ? (int) ((deadline - now) / each) : SQL_MAX_CHUNK;
			chunk = chunk < 1 ? 1 : (chunk > SQL_MAX_CHUNK ? SQL_MAX_CHUNK : chunk);
		}
		to = done + chunk < st->q.nev ? done + chunk : st->q.nev;
		ok = sql_chunk(st, done == 0, done, to, first_err, sizeof(first_err), &down);
		if (ok)
			done = to;
		if (relay_stopping || relay_now() > deadline)
			break;
	}
	if (ok)
	{
		ok = PQsendQueryParams(conn, "COMMIT", 0, NULL, NULL, NULL, NULL, 0) &&
			PQpipelineSync(conn);
		if (!ok)
			down = 1;
		else
		{
			PGresult   *res = PQgetResult(conn);

			if (res == NULL || PQresultStatus(res) != PGRES_COMMAND_OK)
			{
				ok = 0;
				sql_error_text(conn, res, first_err, sizeof(first_err));
				if (PQstatus(conn) != CONNECTION_OK || res == NULL)
					down = 1;	/* the outcome is unknown: nothing counts */
			}
			PQclear(res);
			while ((res = PQgetResult(conn)) != NULL)
				PQclear(res);
			res = PQgetResult(conn);
			if (res == NULL || PQresultStatus(res) != PGRES_PIPELINE_SYNC)
				down = 1;
			PQclear(res);
		}
	}
	if (PQstatus(conn) != CONNECTION_OK || (!down && !PQexitPipelineMode(conn)))
		down = 1;
	if (!down && PQtransactionStatus(conn) != PQTRANS_IDLE)
	{
		/* an error inside the block leaves it aborted: end it */
		PGresult   *res = PQexec(conn, "ROLLBACK");

		if (PQresultStatus(res) != PGRES_COMMAND_OK)
			down = 1;
		PQclear(res);
		ok = 0;
	}
	if (!ok || down)
	{
		if (!first_err[0])
			sql_error_text(conn, NULL, first_err, sizeof(first_err));
		sink_runs_fail_rest(st->q.runs, st->q.nruns, down ? SINK_DOWN : SINK_RETRY, first_err);
		return;
	}
	/* committed: the events that ran, a prefix of each run */
	for (int r = 0; r < st->q.nruns; r++)
	{
		sink_run   *run = &st->q.runs[r];
		int			ran = done - run->first;

		run->confirmed = ran < 0 ? 0 : (ran > run->n ? run->n : ran);
	}
	sink_runs_fail_rest(st->q.runs, st->q.nruns, SINK_RETRY,
						relay_stopping ? "stopping" : "a third of the batch's time gone: one event at a time");
}

static sink_result
sql_recv_run(void *state, int *confirmed, char *err, size_t errlen)
{
	sql_sink   *st = state;

	return sink_runs_recv(st, st->q.runs, st->q.nruns, &st->nread, &st->waved,
						  sql_batch, sql_reset, confirmed, err, errlen);
}

SINK_DEFINE_PIPELINED(sink_sql, "sql", "-", "",
					  sql_open, sql_publish, sql_close, sql_send_run, sql_recv_run);
