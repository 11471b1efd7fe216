/*
 * inbound.c: the inbound loop (--in SOURCE), through the SQL API alone
 * (doc/inbox.md):
 *
 *	1. fetch up to --batch messages from the source (waiting up to --poll
 *	   seconds for the first), only while the database is connected;
 *	2. store them in one statement, so one transaction, autocommit:
 *	   idem_inbox_receive(source, message id, body, headers) per message
 *	   in the order fetched (the order an ordering key's seq follows).  The
 *	   source is --source, or the one the message names (an http path's
 *	   {source}: source_http.c has checked it is one --source allows).  The
 *	   message id is the header --message-id names, or the JSON pointer it
 *	   gives resolved in the body; the ordering key likewise, added to the
 *	   headers as ordering_key (doc/inbox.md, "Order"); the headers are the
 *	   broker's metadata as a JSON object;
 *	3. only after that statement returned (committed): settle each message
 *	   with the source: ack (stored, or a duplicate: receive returned
 *	   false), reject (it can never be stored), or hand it back (failed);
 *	4. if the statement failed, the batch is tried again one message per
 *	   statement, so one bad message (not JSON, no id, IK001: a class 22 or
 *	   IK error) is rejected alone and the others are stored; any other
 *	   error (a missing capability, a lock or statement timeout, a lost
 *	   connection) fails the message: it is not acked, the source delivers
 *	   it again, and the loop backs off (0.1 s doubling to 10 s).
 *
 * Failures: a lost database connection is reopened with that backoff and no
 * message is fetched meanwhile; a lost source is reopened likewise.  A
 * message is acked only after its commit, so a relay killed anywhere loses
 * nothing: what was stored but not acked comes again and is a duplicate
 * (receive returns false, acked then).  SIGTERM/SIGINT: the batch in hand is
 * stored and settled, then exit 0.
 *
 * Main thread only.
 */
#include "relay.h"

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct inbound_db
{
	PGconn	   *conn;
	char		receive_sql[2048];
} inbound_db;

/* a JSON pointer ("/a/b~1c") as a text[] literal ({"a","b/c"}) into b */
static void
pointer_path(relay_buf *b, const char *pointer)
{
	const char *p = pointer;

	buf_puts(b, "{");
	while (*p == '/')
	{
		const char *end = strchr(p + 1, '/');
		size_t		len = end ? (size_t) (end - p - 1) : strlen(p + 1);
		size_t		i;

		if (p != pointer)
			buf_puts(b, ",");
		buf_puts(b, "\"");
		for (i = 0; i < len; i++)
		{
			char		c = p[1 + i];

			if (c == '~' && i + 1 < len && (p[2 + i] == '0' || p[2 + i] == '1'))
				c = p[2 + i++] == '0' ? '~' : '/';
			if (c == '"' || c == '\\')
				buf_puts(b, "\\");
			buf_put(b, &c, 1);
		}
		buf_puts(b, "\"");
		p += 1 + len;
	}
	buf_puts(b, "}");
}

static int
db_open_inbound(inbound_db *db, const relay_config *cfg)
{
	char		schema[136];		/* quote_ident of a name: at most 63 * 2 + 2 */

	db->conn = db_connect(cfg, schema, sizeof(schema));
	if (!db->conn)
		return -1;
	/*
	 * $1 source, $2 the messages as a JSON array of {"s": source, "i": id,
	 * "b": body as a string, "h": headers, "k": ordering key} ("i", "k"
	 * absent unless taken from a header, "s" unless the message names its
	 * source: $1 then), $3 / $4 the JSON pointers of the id / ordering key
	 * as paths (NULL: none)
	 */
	snprintf(db->receive_sql, sizeof(db->receive_sql),
			 "SELECT m.ord, %s.idem_inbox_receive(COALESCE(m.source, $1), m.id, m.payload, m.headers)::text "
			 "FROM (SELECT e.ord, e.v->>'s' AS source, "
			 "             COALESCE(e.v->>'i', (e.v->>'b')::jsonb #>> $3::text[]) AS id, "
			 "             (e.v->>'b')::jsonb AS payload, "
			 "             CASE WHEN k.k IS NULL THEN e.v->'h' "
			 "                  ELSE (e.v->'h') || pg_catalog.jsonb_build_object('ordering_key', k.k) END AS headers "
			 "      FROM pg_catalog.jsonb_array_elements($2::jsonb) WITH ORDINALITY e(v, ord), "
			 "           LATERAL (SELECT COALESCE(e.v->'k', (e.v->>'b')::jsonb #> $4::text[]) AS k) k) m",
			 schema);
	log_msg(LOG_INFO, "connected to the database", "source", cfg->source, NULL);
	return 0;
}

/* the messages msgs[0..n) as the JSON array $2 */
static void
batch_json(relay_buf *b, relay_message *msgs, int n)
{
	int			i;

	b->len = 0;
	buf_puts(b, "[");
	for (i = 0; i < n; i++)
	{
		relay_message *m = &msgs[i];

		buf_puts(b, i ? ",{" : "{");
		if (m->source[0])
		{
			buf_puts(b, "\"s\":");
			buf_json_string(b, m->source, strlen(m->source));
			buf_puts(b, ",");
		}
		if (m->message_id)
		{
			buf_puts(b, "\"i\":");
			buf_json_string(b, m->message_id, strlen(m->message_id));
			buf_puts(b, ",");
		}
		if (m->ordering_key)
		{
			buf_puts(b, "\"k\":");
			buf_json_string(b, m->ordering_key, strlen(m->ordering_key));
			buf_puts(b, ",");
		}
		buf_puts(b, "\"b\":");
		buf_json_string(b, m->body ? m->body : "", m->body_len);
		buf_puts(b, ",\"h\":");
		buf_puts(b, msg_meta(m));
		buf_puts(b, "}");
	}
	buf_puts(b, "]");
}

/* an error no retry can cure: the message's own (class 22: bad JSON, no id; IK: IK001) */
static int
permanent(const char *sqlstate)
{
	return sqlstate && (strncmp(sqlstate, "22", 2) == 0 || strncmp(sqlstate, "IK", 2) == 0);
}

/*
 * store msgs[0..n) in one statement; outcomes into out; 0, or -1 if the
 * statement failed (then out[] is MSG_REJECTED for all if the error is
 * permanent, else MSG_FAILED, and the SQLSTATE and error are on each)
 */
static int
store(inbound_db *db, const relay_config *cfg, relay_message *msgs, int n, msg_outcome *out,
	  const char *id_path, const char *key_path)
{
	relay_buf	json = {0};
	const char *params[4];
	PGresult   *res;
	int			i,
				rc = 0;

	batch_json(&json, msgs, n);
	params[0] = cfg->source;
	params[1] = json.data;
	params[2] = id_path;
	params[3] = key_path;
	res = PQexecParams(db->conn, db->receive_sql, 4, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == n)
	{
		for (i = 0; i < n; i++)
		{
			int			ord = atoi(PQgetvalue(res, i, 0)) - 1;

			if (ord >= 0 && ord < n)
				out[ord] = strcmp(PQgetvalue(res, i, 1), "true") == 0 ? MSG_STORED : MSG_DUPLICATE;
		}
	}
	else
	{
		const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
		const char *text = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);

		for (i = 0; i < n; i++)
		{
			out[i] = permanent(state) ? MSG_REJECTED : MSG_FAILED;
			snprintf(msgs[i].sqlstate, sizeof(msgs[i].sqlstate), "%s", state ? state : "");
			snprintf(msgs[i].error, sizeof(msgs[i].error), "%s",
					 text ? text : PQerrorMessage(db->conn));
		}
		rc = -1;
	}
	PQclear(res);
	free(json.data);
	return rc;
}

static const char *const outcome_names[] = {"stored", "duplicate", "rejected", "failed"};

int
inbound_run(const relay_config *cfg, const source_ops *ops)
{
	inbound_db	db = {0};
	void	   *state = NULL;
	int			source_open = 0;
	relay_retry db_retry = {0},
				source_retry = {0};
	double		fail_backoff = 0.1;
	relay_buf	id_path = {0},
				key_path = {0};
	relay_message *msgs = calloc((size_t) cfg->batch, sizeof(*msgs));
	msg_outcome *out = calloc((size_t) cfg->batch, sizeof(*out));

	if (!msgs || !out)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		return 1;
	}
	if (strncmp(cfg->message_id, "json:", 5) == 0)
		pointer_path(&id_path, cfg->message_id + 5);
	if (strncmp(cfg->ordering_key, "json:", 5) == 0)
		pointer_path(&key_path, cfg->ordering_key + 5);
	log_msg(LOG_INFO, "starting inbound", "in", ops->name, "url", cfg->url, "target", cfg->target,
			"source", cfg->source, "message_id", cfg->message_id,
			"ordering_key", *cfg->ordering_key ? cfg->ordering_key : "none", NULL);
	while (!relay_stopping)
	{
		char		err[512] = "";
		int			n,
					i,
					nfailed = 0,
					lost = 0;
		double		t0;
		uint64_t	counts[4] = {0};

		if (!db.conn && !relay_retry_done(&db_retry, db_open_inbound(&db, cfg) == 0, M_DB_RECONNECTS))
			continue;
		if (!source_open)
		{
			int			ok = ops->open(&state, cfg, err, sizeof(err)) == 0,
						again = source_retry.opened;

			if (!ok)
				log_msg(LOG_WARN, "cannot open the source", "in", ops->name, "url", cfg->url,
						"error", err, NULL);
			if (!relay_retry_done(&source_retry, ok, M_IN_SOURCE_RECONNECTS))
				continue;
			log_msg(again ? LOG_INFO : LOG_DEBUG, "source open", "in", ops->name, "url", cfg->url, NULL);
			source_open = 1;
		}
		memset(msgs, 0, sizeof(*msgs) * (size_t) cfg->batch);
		n = ops->fetch(state, msgs, cfg->batch, cfg->poll, err, sizeof(err));
		if (n < 0)
		{
			log_msg(LOG_WARN, "lost the source: reopening", "in", ops->name, "error", err, NULL);
			ops->close(state);
			source_open = 0;
			continue;
		}
		if (n == 0)
			continue;
		t0 = relay_now();
		metric_add(M_IN_RECEIVED, (uint64_t) n);
		/* one transaction for the batch; on an error, one per message */
		if (store(&db, cfg, msgs, n, out, id_path.data, key_path.data) != 0 && n > 1 &&
			PQstatus(db.conn) == CONNECTION_OK)
			for (i = 0; i < n; i++)
			{
				msgs[i].sqlstate[0] = msgs[i].error[0] = '\0';
				store(&db, cfg, &msgs[i], 1, &out[i], id_path.data, key_path.data);
			}
		for (i = 0; i < n; i++)
		{
			char		serr[512] = "";

			counts[out[i]]++;
			if (out[i] >= MSG_REJECTED)
				log_msg(out[i] == MSG_REJECTED ? LOG_WARN : LOG_ERROR,
						out[i] == MSG_REJECTED ? "message rejected: it cannot be stored" :
						"message not stored: the source delivers it again",
						"ref", msgs[i].ref, "source", msgs[i].source[0] ? msgs[i].source : cfg->source,
						"message_id", msgs[i].message_id ? msgs[i].message_id : "",
						"sqlstate", msgs[i].sqlstate, "error", msgs[i].error, NULL);
			if (ops->settle(state, &msgs[i], out[i], serr, sizeof(serr)) != 0 && !lost)
			{
				lost = 1;
				log_msg(LOG_WARN, "cannot settle with the source (it delivers again what it did not get)",
						"in", ops->name, "ref", msgs[i].ref, "error", serr, NULL);
			}
			msg_free(&msgs[i]);
		}
		nfailed = (int) counts[MSG_FAILED];
		metric_add(M_IN_STORED, counts[MSG_STORED]);
		metric_add(M_IN_DUPLICATES, counts[MSG_DUPLICATE]);
		metric_add(M_IN_REJECTED, counts[MSG_REJECTED]);
		metric_add(M_IN_FAILED, counts[MSG_FAILED]);
		metric_batch_seconds(relay_now() - t0);
		{
			char		c[4][16];

			for (i = 0; i < 4; i++)
				snprintf(c[i], sizeof(c[i]), "%llu", (unsigned long long) counts[i]);
			log_msg(LOG_DEBUG, "batch done", outcome_names[0], c[0], outcome_names[1], c[1],
					outcome_names[2], c[2], outcome_names[3], c[3], NULL);
		}
		if (lost)
		{
			ops->close(state);
			source_open = 0;
		}
		if (PQstatus(db.conn) != CONNECTION_OK)
		{
			log_msg(LOG_ERROR, "lost the database connection: reconnecting (nothing unstored was acked)", NULL);
			PQfinish(db.conn);
			db.conn = NULL;
		}
		if (nfailed)
		{
			relay_sleep(fail_backoff);
			fail_backoff = relay_backoff(fail_backoff, 10);
		}
		else
			fail_backoff = 0.1;
	}
	if (source_open)
		ops->close(state);
	if (db.conn)
		PQfinish(db.conn);
	free(msgs);
	free(out);
	free(id_path.data);
	free(key_path.data);
	log_msg(LOG_INFO, "stopped", NULL);
	return 0;
}
