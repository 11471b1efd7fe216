/*
 * outbox.c: the relay loop, through the SQL API alone (doc/outbox.md, "The
 * relay protocol"):
 *
 *	1. claim: idem_outbox_claim(batch, lease, types, subscription) in
 *	   autocommit (READ COMMITTED), one lease token for the batch, each
 *	   aggregate's run in seq order;
 *	2. publish the events in the order returned, one at a time, each only
 *	   after the one before it was confirmed by the sink (a sink with a
 *	   pipelined path, redis, first gets every aggregate's run at once and
 *	   confirms a prefix of each; the one-at-a-time path below then takes
 *	   each aggregate on from its first unconfirmed event).  A transient
 *	   failure (5xx, timeout) is tried again in place, the sink reopened,
 *	   with a backoff (0.1 s doubling up to --retry-max) up to --retries
 *	   tries; a refusal (4xx) or the last try makes it the aggregate's
 *	   failure: nothing more of that aggregate in this batch, the other
 *	   aggregates go on.  A broker that cannot be reached (connection
 *	   refused or lost) is no event's fault: the publish is tried again
 *	   with the same backoff until the broker is back (or SIGTERM), the
 *	   lease extended meanwhile, so an outage burns no attempts.  Past half the lease,
 *	   idem_outbox_extend; fewer events than were handed out means the lease
 *	   is lost: stop publishing (another relay has those aggregates now);
 *	3. flush the sink (if it buffers), then idem_outbox_ack of every event
 *	   it confirmed, with the token: an ack never covers an event the
 *	   broker did not confirm;
 *	4. after the ack, idem_outbox_nack of each failed aggregate's event
 *	   (with the error text; the extension's backoff unless
 *	   --nack-retry-after, dead letters after outbox_max_attempts);
 *	5. nothing claimed: wait --poll seconds, or with --listen until a
 *	   NOTIFY idempotency_outbox arrives (a hint only: the claim decides).
 *
 * Failures: a lost database connection is reopened with a backoff (0.1 s
 * doubling to 10 s); what was published but not acked is delivered again
 * once its lease expires (the only source of duplicates).  The sink is
 * opened before any claim, and a claim is not made while it cannot be
 * opened, so a broker that is down costs no attempts.  SIGTERM/SIGINT:
 * the event in hand is finished, the confirmed ones acked, then exit 0;
 * the rest of the batch is claimable again when its lease expires.
 *
 * The functions are called schema-qualified (the extension's schema, read
 * at connect); the session pins default_transaction_isolation to READ
 * COMMITTED, as claims want.  Every call names the subscription the relay
 * delivers (--subscription): one process per subscription and sink.
 *
 * Main thread only.
 */
#include "relay.h"

#include <errno.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>

typedef struct relay_db
{
	PGconn	   *conn;
	int			max_attempts;
	char		claim_sql[1024];
	char		ack_sql[384];
	char		nack_sql[384];
	char		extend_sql[384];
} relay_db;

typedef enum batch_status
{
	BATCH_CLAIMED, BATCH_EMPTY, BATCH_DB_LOST, BATCH_ERROR,
	BATCH_FATAL					/* the subscription is gone or detached: no retry helps */
} batch_status;

static void
db_close(relay_db *db)
{
	if (db->conn)
		PQfinish(db->conn);
	db->conn = NULL;
}

/* one connection attempt; 0 or -1 (logged) */
static int
db_open(relay_db *db, const relay_config *cfg)
{
	PGresult   *res;
	char		schema[136];		/* quote_ident of a name: at most 63 * 2 + 2 */

	db->conn = db_connect(cfg, schema, sizeof(schema));
	if (!db->conn)
		return -1;
	if (cfg->listen && !db_exec_ok(db->conn, "LISTEN idempotency_outbox"))
	{
		db_close(db);
		return -1;
	}
	res = PQexec(db->conn, "SELECT pg_catalog.current_setting('idempotency.outbox_max_attempts', true)");
	if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
	{
		log_msg(LOG_ERROR, "cannot read idempotency.outbox_max_attempts",
				"error", PQerrorMessage(db->conn), NULL);
		PQclear(res);
		db_close(db);
		return -1;
	}
	db->max_attempts = PQgetisnull(res, 0, 0) || !*PQgetvalue(res, 0, 0) ? 10 : atoi(PQgetvalue(res, 0, 0));
	snprintf(db->claim_sql, sizeof(db->claim_sql),
			 "SELECT e.id, e.lease_token, e.aggregate_type, e.aggregate_id, e.seq, e.event_type, "
			 "       e.payload::text, e.headers::text, e.attempts, "
			 "       pg_catalog.jsonb_build_object('id', e.id, 'aggregate_type', e.aggregate_type, "
			 "         'aggregate_id', e.aggregate_id, 'seq', e.seq, 'event_type', e.event_type, "
			 "         'payload', e.payload, 'headers', e.headers, 'created_at', e.created_at, "
			 "         'attempts', e.attempts)::text, "
			 "       pg_catalog.date_part('epoch', pg_catalog.now() - e.created_at) "
			 "FROM %s.idem_outbox_claim($1::int, pg_catalog.make_interval(secs => $2::float8), "
			 "                          pg_catalog.string_to_array(NULLIF($3::text, ''), ','), $4::text) "
			 "     WITH ORDINALITY e ORDER BY e.ordinality", schema);
	snprintf(db->ack_sql, sizeof(db->ack_sql),
			 "SELECT %s.idem_outbox_ack($1::uuid[], $2::uuid, $3::text)", schema);
	snprintf(db->nack_sql, sizeof(db->nack_sql),
			 "SELECT %s.idem_outbox_nack($1::uuid, $2, "
			 "CASE WHEN $3::float8 >= 0 THEN pg_catalog.make_interval(secs => $3::float8) END, $4::uuid, $5::text)",
			 schema);
	snprintf(db->extend_sql, sizeof(db->extend_sql),
			 "SELECT %s.idem_outbox_extend($1::uuid, pg_catalog.make_interval(secs => $2::float8), $3::text)",
			 schema);
	PQclear(res);
	log_msg(LOG_INFO, "connected to the database", "listen", cfg->listen ? "on" : "off", NULL);
	return 0;
}

/* run a statement with text parameters; the result, or NULL (logged) */
static PGresult *
db_query(relay_db *db, const char *sql, int n, const char *const *params)
{
	PGresult   *res = PQexecParams(db->conn, sql, n, NULL, params, NULL, NULL, 0);

	if (PQresultStatus(res) != PGRES_TUPLES_OK)
	{
		log_msg(LOG_ERROR, "relay call failed", "error", PQerrorMessage(db->conn), NULL);
		PQclear(res);
		return NULL;
	}
	return res;
}

static int
db_lost(relay_db *db)
{
	return PQstatus(db->conn) != CONNECTION_OK;
}

/* idem_outbox_extend; the events the lease still covers, -1 on error */
static int
extend_lease(relay_db *db, const relay_config *cfg, const char *token)
{
	char		lease[32];
	const char *params[3];
	PGresult   *res;
	int			covered;

	snprintf(lease, sizeof(lease), "%g", cfg->lease);
	params[0] = token;
	params[1] = lease;
	params[2] = cfg->subscription;
	res = db_query(db, db->extend_sql, 3, params);
	if (!res)
		return -1;
	covered = atoi(PQgetvalue(res, 0, 0));
	PQclear(res);
	return covered;
}

typedef struct sink_handle
{
	const sink_ops *ops;
	void	   *state;
	int			open;
} sink_handle;

/* open the sink (closing it first if open); 0, -1 or SINK_OPEN_FATAL (logged) */
static int
sink_reopen(sink_handle *s, const relay_config *cfg, int reconnect)
{
	char		err[1024] = "";
	int			rc;

	if (s->open)
		s->ops->close(s->state);
	s->open = 0;
	rc = s->ops->open(&s->state, cfg, err, sizeof(err));
	if (rc != 0)
	{
		log_msg(rc == SINK_OPEN_FATAL && !reconnect ? LOG_ERROR : LOG_WARN, "cannot open the sink",
				"sink", s->ops->name, "url", cfg->url, "error", err, NULL);
		return rc == SINK_OPEN_FATAL ? rc : -1;
	}
	s->open = 1;
	if (reconnect)
		metric_add(M_SINK_RECONNECTS, 1);
	log_msg(reconnect ? LOG_INFO : LOG_DEBUG, "sink open", "sink", s->ops->name, "url", cfg->url, NULL);
	return 0;
}

static int
same_aggregate(const relay_event *a, const relay_event *b)
{
	return strcmp(a->aggregate_type, b->aggregate_type) == 0 &&
		strcmp(a->aggregate_id, b->aggregate_id) == 0;
}

/* append id to the uuid[] literal being built in ids */
static void
add_id(char *ids, size_t *idlen, const char *id)
{
	memcpy(ids + *idlen, id, strlen(id));
	*idlen += strlen(id);
	ids[(*idlen)++] = ',';
}

/*
 * The pipelined path (a sink with send_run): every aggregate's run of the
 * batch sent at once, then the replies read in order; published[i] set for
 * each event the broker confirmed, and their count returned.  What it did
 * not confirm (a failure, a lost connection) is left to the one-at-a-time
 * path, which starts each aggregate at its first unconfirmed event: per
 * aggregate, order holds, since the sink publishes nothing of a run after
 * a failed event.  Replies left unread (the connection lost) close the
 * sink, so the one-at-a-time path reopens it.
 */
static int
publish_pipelined(const relay_config *cfg, sink_handle *sink, const relay_event *ev, int n, int *published)
{
	char	   *targets = malloc((size_t) n * 1024);
	const char **tp = malloc((size_t) n * sizeof(*tp));
	int		   *run = malloc((size_t) (n + 1) * sizeof(*run));
	int			nruns = 0,
				sent = 0,
				r,
				i,
				npub = 0;
	char		err[512] = "";

	if (!targets || !tp || !run)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		exit(1);
	}
	for (i = 0; i < n; i++)
	{
		sink_expand(cfg->target, &ev[i], targets + (size_t) i * 1024, 1024);
		tp[i] = targets + (size_t) i * 1024;
		if (i == 0 || !same_aggregate(&ev[i], &ev[i - 1]))
			run[nruns++] = i;
	}
	run[nruns] = n;
	for (r = 0; r < nruns; r++, sent++)
		if (sink->ops->send_run(sink->state, &ev[run[r]], &tp[run[r]], run[r + 1] - run[r],
								err, sizeof(err)) != 0)
			break;
	for (r = 0; r < sent; r++)
	{
		int			confirmed = 0;
		sink_result res = sink->ops->recv_run(sink->state, &confirmed, err, sizeof(err));

		for (i = 0; i < confirmed && run[r] + i < run[r + 1]; i++)
		{
			published[run[r] + i] = 1;
			npub++;
		}
		if (res != SINK_OK)
			log_msg(LOG_DEBUG, "pipelined publish stopped in a run: going on one event at a time",
					"id", ev[run[r] + confirmed < run[r + 1] ? run[r] + confirmed : run[r]].id,
					"error", err, NULL);
		if (res == SINK_DOWN)
			break;
	}
	if (r < sent)
	{
		sink->ops->close(sink->state);
		sink->open = 0;
	}
	free(targets);
	free(tp);
	free(run);
	return npub;
}

static batch_status
run_batch(relay_db *db, const relay_config *cfg, sink_handle *sink)
{
	char		batch[16],
				lease[32],
				target[1024],
				err[1024];
	const char *params[4];
	PGresult   *res;
	int			n,
				i,
				npub = 0,
				nfail = 0,
				lost = 0,
				db_gone = 0,
				skip_from = -1;
	relay_event *ev;
	int		   *failed,
			   *published;
	char	  **fail_err;
	char	   *ids;
	size_t		idlen = 0;
	double		t0 = relay_now(),
				last_extend,
				lag = 0;
	const char *token;

	snprintf(batch, sizeof(batch), "%d", cfg->batch);
	snprintf(lease, sizeof(lease), "%g", cfg->lease);
	params[0] = batch;
	params[1] = lease;
	params[2] = cfg->types;
	params[3] = cfg->subscription;
	res = PQexecParams(db->conn, db->claim_sql, 4, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(res) != PGRES_TUPLES_OK)
	{
		const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
		int			fatal = state && (strcmp(state, "42704") == 0 || strcmp(state, "55000") == 0);

		log_msg(LOG_ERROR, fatal ? "cannot deliver this subscription: stopping" : "claim failed",
				"error", PQerrorMessage(db->conn), "subscription", cfg->subscription, NULL);
		PQclear(res);
		if (fatal)
			return BATCH_FATAL;
		return db_lost(db) ? BATCH_DB_LOST : BATCH_ERROR;
	}
	n = PQntuples(res);
	if (n == 0)
	{
		PQclear(res);
		return BATCH_EMPTY;
	}
	metric_add(M_CLAIMS, 1);
	last_extend = t0;
	token = PQgetvalue(res, 0, 1);
	ev = calloc((size_t) n, sizeof(*ev));
	failed = calloc((size_t) n, sizeof(*failed));
	fail_err = calloc((size_t) n, sizeof(*fail_err));
	published = calloc((size_t) n, sizeof(*published));
	ids = malloc((size_t) n * 37 + 3);
	if (!ev || !failed || !fail_err || !published || !ids)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		exit(1);
	}
	for (i = 0; i < n; i++)
	{
		double		age = atof(PQgetvalue(res, i, 10));

		ev[i].id = PQgetvalue(res, i, 0);
		ev[i].aggregate_type = PQgetvalue(res, i, 2);
		ev[i].aggregate_id = PQgetvalue(res, i, 3);
		ev[i].seq = PQgetvalue(res, i, 4);
		ev[i].event_type = PQgetvalue(res, i, 5);
		ev[i].payload = PQgetvalue(res, i, 6);
		ev[i].headers = PQgetvalue(res, i, 7);
		ev[i].attempts = atoi(PQgetvalue(res, i, 8));
		ev[i].json = PQgetvalue(res, i, 9);
		if (age > lag)
			lag = age;
	}
	metric_lag_seconds(lag);
	{
		char		nb[16];

		snprintf(nb, sizeof(nb), "%d", n);
		log_msg(LOG_DEBUG, "claimed", "events", nb, NULL);
	}
	ids[idlen++] = '{';

	if (sink->ops->send_run && sink->open)
	{
		npub = publish_pipelined(cfg, sink, ev, n, published);
		metric_add(M_PUBLISHED, (uint64_t) npub);
		for (i = 0; i < n; i++)
			if (published[i])
				add_id(ids, &idlen, ev[i].id);
	}

	for (i = 0; i < n && !relay_stopping && !lost && !db_gone; i++)
	{
		int			tries = 0;
		double		backoff = 0.1;

		if (published[i])
			continue;
		/* the rest of an aggregate that failed waits for its retry */
		if (skip_from >= 0 && same_aggregate(&ev[i], &ev[skip_from]))
			continue;
		skip_from = -1;
		sink_expand(cfg->target, &ev[i], target, sizeof(target));
		for (;;)
		{
			sink_result r;

			if (relay_now() - last_extend > cfg->lease / 2)
			{
				int			covered = extend_lease(db, cfg, token);

				last_extend = relay_now();
				if (covered < 0)
				{
					db_gone = db_lost(db);
					lost = !db_gone;
					break;
				}
				if (covered < n)
				{
					char		a[16],
								b[16];

					snprintf(a, sizeof(a), "%d", covered);
					snprintf(b, sizeof(b), "%d", n);
					log_msg(LOG_WARN, "lease lost: stopping this batch (its events go to another relay)",
							"covered", a, "claimed", b, NULL);
					metric_add(M_LEASES_LOST, 1);
					lost = 1;
					break;
				}
			}
			err[0] = '\0';
			if (!sink->open && sink_reopen(sink, cfg, 1) != 0)
			{
				r = SINK_DOWN;
				snprintf(err, sizeof(err), "the sink cannot be opened");
			}
			else
				r = sink->ops->publish(sink->state, &ev[i], target, err, sizeof(err));
			if (r == SINK_OK)
			{
				add_id(ids, &idlen, ev[i].id);
				npub++;
				metric_add(M_PUBLISHED, 1);
				break;
			}
			metric_add(M_FAILED, 1);
			if (r != SINK_DOWN)
				tries++;
			if (r == SINK_REJECT || tries >= cfg->retries)
			{
				log_msg(LOG_WARN, "publish failed: nacking the event", "id", ev[i].id,
						"aggregate_type", ev[i].aggregate_type, "aggregate_id", ev[i].aggregate_id,
						"seq", ev[i].seq, "error", err, NULL);
				failed[nfail] = i;
				fail_err[nfail++] = strdup(err);
				skip_from = i;
				break;
			}
			log_msg(LOG_WARN, r == SINK_DOWN ? "the broker is unreachable: trying again" :
					"publish failed: trying again", "id", ev[i].id, "error", err, NULL);
			/* a transient failure: reopen the sink after the backoff */
			if (sink->open)
			{
				sink->ops->close(sink->state);
				sink->open = 0;
			}
			relay_sleep(backoff);
			if (relay_stopping)
				break;
			backoff = relay_backoff(backoff, cfg->retry_max);
		}
	}

	/* the sink's buffer: nothing counts as confirmed until it is flushed */
	if (npub > 0 && sink->open && sink->ops->flush)
	{
		err[0] = '\0';
		if (sink->ops->flush(sink->state, err, sizeof(err)) != 0)
		{
			log_msg(LOG_ERROR, "sink flush failed: acking nothing of this batch", "error", err, NULL);
			npub = 0;
		}
	}
	if (npub > 0 && !db_gone)
	{
		PGresult   *ack;
		const char *ap[3];

		ids[idlen - 1] = '}';
		ids[idlen] = '\0';
		ap[0] = ids;
		ap[1] = token;
		ap[2] = cfg->subscription;
		ack = db_query(db, db->ack_sql, 3, ap);
		if (!ack)
			db_gone = db_lost(db);
		else
		{
			int			marked = atoi(PQgetvalue(ack, 0, 0));

			metric_add(M_ACKED, (uint64_t) marked);
			if (marked < npub)
			{
				char		a[16],
							b[16];

				snprintf(a, sizeof(a), "%d", marked);
				snprintf(b, sizeof(b), "%d", npub);
				log_msg(LOG_WARN, "the ack marked fewer events than were published: the lease was lost, they will be delivered again",
						"marked", a, "published", b, NULL);
			}
			PQclear(ack);
		}
	}
	for (i = 0; i < nfail && !db_gone; i++)
	{
		PGresult   *nack;
		const char *np[5];
		char		retry[32];

		snprintf(retry, sizeof(retry), "%g", cfg->nack_retry_after);
		np[0] = ev[failed[i]].id;
		np[1] = fail_err[i][0] ? fail_err[i] : "publish failed";
		np[2] = retry;
		np[3] = token;
		np[4] = cfg->subscription;
		nack = db_query(db, db->nack_sql, 5, np);
		if (!nack)
		{
			db_gone = db_lost(db);
			continue;
		}
		PQclear(nack);
		metric_add(M_NACKED, 1);
		if (ev[failed[i]].attempts >= db->max_attempts)
		{
			metric_add(M_DEAD_LETTERED, 1);
			log_msg(LOG_WARN, "event dead-lettered (its last attempt failed)", "id", ev[failed[i]].id,
					"aggregate_type", ev[failed[i]].aggregate_type,
					"aggregate_id", ev[failed[i]].aggregate_id, "seq", ev[failed[i]].seq, NULL);
		}
	}
	metric_batch_seconds(relay_now() - t0);
	{
		char		a[16],
					b[16],
					c[16];

		snprintf(a, sizeof(a), "%d", n);
		snprintf(b, sizeof(b), "%d", npub);
		snprintf(c, sizeof(c), "%d", nfail);
		log_msg(LOG_DEBUG, "batch done", "claimed", a, "published", b, "failed", c, NULL);
	}
	for (i = 0; i < nfail; i++)
		free(fail_err[i]);
	free(fail_err);
	free(failed);
	free(published);
	free(ids);
	free(ev);
	PQclear(res);
	return db_gone ? BATCH_DB_LOST : BATCH_CLAIMED;
}

/* wait for a notification or --poll seconds; -1 if the connection is gone */
static int
idle(relay_db *db, const relay_config *cfg)
{
	double		until = relay_now() + cfg->poll;

	if (!cfg->listen)
	{
		relay_sleep(cfg->poll);
		return 0;
	}
	while (!relay_stopping)
	{
		int			sock = PQsocket(db->conn);
		double		left = until - relay_now();
		fd_set		rd;
		struct timeval tv;
		PGnotify   *note;
		int			got = 0;

		if (left <= 0)
			return 0;
		if (left > 0.2)
			left = 0.2;
		FD_ZERO(&rd);
		FD_SET(sock, &rd);
		tv.tv_sec = (time_t) left;
		tv.tv_usec = (suseconds_t) ((left - (double) tv.tv_sec) * 1e6);
		if (select(sock + 1, &rd, NULL, NULL, &tv) < 0 && errno != EINTR)
			return -1;
		if (!PQconsumeInput(db->conn))
			return -1;
		while ((note = PQnotifies(db->conn)) != NULL)
		{
			got = 1;
			PQfreemem(note);
		}
		if (got)
			return 0;
	}
	return 0;
}

int
outbox_run(const relay_config *cfg, const sink_ops *ops)
{
	relay_db	db;
	sink_handle sink = {ops, NULL, 0};
	relay_retry db_retry = {0};
	double		sink_backoff = 0.1;
	int			connected_once = 0;

	memset(&db, 0, sizeof(db));
	log_msg(LOG_INFO, "starting", "sink", ops->name, "url", cfg->url, "target", cfg->target,
			"types", *cfg->types ? cfg->types : "all", "subscription", cfg->subscription, NULL);
	while (!relay_stopping)
	{
		batch_status st;

		if (!db.conn)
		{
			int			ok = db_open(&db, cfg) == 0;

			if (!ok && cfg->once)
				return 1;
			if (!relay_retry_done(&db_retry, ok, M_DB_RECONNECTS))
				continue;
			/* 1: the database was reached; 2: the sink too (kept across reconnections) */
			if (!connected_once)
				connected_once = 1;
		}
		if (!sink.open)
		{
			int			rc = sink_reopen(&sink, cfg, connected_once > 1);

			/* a configuration that never worked: stop (once it did, wait for a fix) */
			if (rc == SINK_OPEN_FATAL && connected_once < 2)
			{
				db_close(&db);
				return EXIT_CONFIG;
			}
			if (rc != 0)
			{
				relay_sleep(sink_backoff);
				sink_backoff = relay_backoff(sink_backoff, 10);
				continue;
			}
			connected_once = 2;
			sink_backoff = 0.1;
		}
		st = run_batch(&db, cfg, &sink);
		switch (st)
		{
			case BATCH_CLAIMED:
				break;
			case BATCH_EMPTY:
				if (cfg->once)
					goto done;
				if (idle(&db, cfg) < 0)
				{
					log_msg(LOG_ERROR, "lost the database connection while idle",
							"error", PQerrorMessage(db.conn), NULL);
					db_close(&db);
				}
				break;
			case BATCH_FATAL:
				db_close(&db);
				if (sink.open)
					ops->close(sink.state);
				return 1;
			case BATCH_ERROR:
				if (cfg->once)
				{
					db_close(&db);
					if (sink.open)
						ops->close(sink.state);
					return 1;
				}
				relay_sleep(cfg->poll);
				break;
			case BATCH_DB_LOST:
				log_msg(LOG_ERROR, "lost the database connection: reconnecting (what was published but not acked is delivered again when its lease expires)", NULL);
				db_close(&db);
				if (cfg->once)
				{
					if (sink.open)
						ops->close(sink.state);
					return 1;
				}
				break;
		}
	}
done:
	if (sink.open)
		ops->close(sink.state);
	db_close(&db);
	log_msg(LOG_INFO, "stopped", NULL);
	return 0;
}
