/*
 * outbox.c: the relay loop, through the SQL API alone (doc/outbox.md, "The
 * relay protocol"):
 *
 *	1. claim: idem_outbox_claim(batch, lease, types, subscription) in
 *	   autocommit (READ COMMITTED), one lease token for the batch, each
 *	   aggregate's run in seq order;
 *	2. publish the events in the order returned, one at a time, each only
 *	   after the one before it was confirmed by the sink (a sink with a
 *	   pipelined path, redis, nats, amqp, first gets every aggregate's run
 *	   at once and confirms a prefix of each; the one-at-a-time path below
 *	   then takes each aggregate on from its first unconfirmed event).  A
 *	   transient failure (5xx, timeout) is tried again in place, the sink
 *	   reopened, with a backoff (0.1 s doubling up to --retry-max) up to
 *	   --retries tries; a refusal (4xx) or the last try makes it the
 *	   aggregate's failure: nothing more of that aggregate in this batch,
 *	   the other aggregates go on.  A broker that cannot be reached
 *	   (connection refused or lost) is no event's fault: the publish is
 *	   tried again with the same backoff until the broker is back (or
 *	   SIGTERM), the lease extended meanwhile, so an outage burns no
 *	   attempts.  Past half the lease, idem_outbox_extend (of both batches
 *	   in hand, below); fewer events than were handed out means the lease
 *	   is lost: stop publishing (another relay has those aggregates now);
 *	3. flush the sink (if it buffers), then idem_outbox_ack of every event
 *	   it confirmed, with the token: an ack never covers an event the
 *	   broker did not confirm;
 *	4. after the ack, idem_outbox_nack of each failed aggregate's event
 *	   (with the error text; the extension's backoff unless
 *	   --nack-retry-after, dead letters after outbox_max_attempts);
 *	5. nothing claimed: wait --poll seconds, or with --listen until a
 *	   NOTIFY idempotency_outbox arrives (a hint only: the claim decides),
 *	   and claim once more --notify-window after each notification (for
 *	   emitters whose outbox_notify = 'coalesce' skipped theirs), or twice
 *	   the idempotency.outbox_notify_window this session sees if longer.
 *
 * Overlap (--prefetch 1, the default): the connection is in libpq's
 * pipeline mode, every statement its own sync point (so its own implicit
 * transaction, as in autocommit), and the database works while the sink
 * does: the claim of batch n+1 is sent before batch n is published, and
 * the ack and nacks of batch n are sent without waiting for their results,
 * which are read when batch n+1's claim is (results come in the order
 * sent).  So the database runs ack(n-1), the nacks, then claim(n+1) while
 * the sink publishes batch n.  Two batches in hand never break an
 * aggregate's order: idem_outbox_claim never hands out an aggregate's
 * event k+1 while k is leased and unacked, so claim(n+1) skips every
 * aggregate of batch n.  For the same reason a claim that came back empty
 * while a batch of ours was leased proves nothing: the next claim is made
 * after that batch's ack, and only an empty claim made with nothing in
 * hand is "nothing to do" (idle, or --once's exit).  Extending a lease
 * extends both batches' (the prefetched one ages while batch n is
 * published); a prefetched batch whose lease was lost is dropped
 * unpublished.  --prefetch 0: the claim is sent after the previous ack and
 * every result is read before the sink is called (the serial relay).
 *
 * Failures: a lost database connection is reopened with a backoff (0.1 s
 * doubling to 10 s); what was published but not acked is delivered again
 * once its lease expires (the only source of duplicates: up to two batches
 * with the overlap, the one being published and the one whose ack was in
 * flight).  The sink is opened before any claim, and a claim is not made
 * while it cannot be opened, so a broker that is down costs no attempts.
 * SIGTERM/SIGINT: the event in hand is finished, the confirmed ones acked,
 * the rest of the batch and the prefetched batch given back (their leases
 * shortened to 1 µs by idem_outbox_extend: claimable again at once), then
 * exit 0.
 *
 * The functions are called schema-qualified (the extension's schema, read
 * at connect), as statements prepared at connect; the session pins
 * default_transaction_isolation to READ COMMITTED, as claims want.  Every
 * call names the subscription the relay delivers (--subscription): one
 * process per subscription and sink.
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

typedef enum batch_status
{
	BATCH_CLAIMED, BATCH_EMPTY, BATCH_DB_LOST, BATCH_ERROR,
	BATCH_FATAL					/* the subscription is gone or detached: no retry helps */
} batch_status;

/* a batch slot: idle, its claim in the pipeline, or its claim's result read */
typedef enum slot_state
{
	SLOT_IDLE, SLOT_CLAIMING, SLOT_READY
} slot_state;

typedef struct batch
{
	slot_state	state;
	char	   *json;			/* every event's JSON object, one after the other */
	batch_status status;		/* SLOT_READY: what its claim gave */
	int			alone;			/* its claim ran with no batch of ours leased */
	PGresult   *res;			/* the claim's rows (BATCH_CLAIMED) */
	int			n;
	relay_event *ev;
	const char *token;
	double		claimed;		/* when its claim was sent */
	double		leased;			/* when its lease was last set (claim, extend) */
	int			covered;		/* the last extend's result, -1 failed */
} batch;

/* a statement in the pipeline, for reading its result */
typedef enum op_kind
{
	OP_CLAIM, OP_ACK, OP_NACK, OP_EXTEND, OP_RELEASE
} op_kind;

typedef struct pending_op
{
	op_kind		kind;
	batch	   *b;				/* claim: the slot it fills; extend: the batch */
	int			npub;			/* ack: how many events it covers */
	int			attempts;		/* nack: the event's attempts */
	char	   *event;			/* nack: "id\0type\0aggregate id\0seq" (malloc'd), for the log */
} pending_op;

typedef struct relay_db
{
	PGconn	   *conn;
	int			lost;			/* the connection failed: close and reopen it */
	int			max_attempts;
	double		notify_window;	/* seconds: --notify-window, or twice the database's window if longer */
	pending_op *ops;			/* sent, results not read yet: oldest first */
	int			nops;
	int			opcap;
} relay_db;

#define STMT_CLAIM "idem_relay_claim"
#define STMT_ACK "idem_relay_ack"
#define STMT_NACK "idem_relay_nack"
#define STMT_EXTEND "idem_relay_extend"

static void
batch_clear(batch *b)
{
	if (b->res)
		PQclear(b->res);
	free(b->ev);
	free(b->json);
	memset(b, 0, sizeof(*b));
}

/* forget every statement in flight; a claim's slot reads as lost */
static void
ops_abandon(relay_db *db)
{
	int			i;

	for (i = 0; i < db->nops; i++)
	{
		if (db->ops[i].kind == OP_CLAIM)
		{
			db->ops[i].b->state = SLOT_READY;
			db->ops[i].b->status = BATCH_DB_LOST;
		}
		if (db->ops[i].kind == OP_EXTEND)
			db->ops[i].b->covered = -1;
		free(db->ops[i].event);
	}
	db->nops = 0;
}

static void
db_close(relay_db *db)
{
	ops_abandon(db);
	if (db->conn)
		PQfinish(db->conn);
	db->conn = NULL;
	db->lost = 0;
}

static int
prepare(relay_db *db, const char *name, const char *sql, int nparams)
{
	PGresult   *res = PQprepare(db->conn, name, sql, nparams, NULL);
	int			ok = PQresultStatus(res) == PGRES_COMMAND_OK;

	if (!ok)
		log_msg(LOG_ERROR, "cannot prepare the relay's statements", "statement", name,
				"error", PQerrorMessage(db->conn), NULL);
	PQclear(res);
	return ok;
}

/*
 * The session's value of setting name into buf ("" if it has none); -1 if
 * it cannot be read (logged).
 */
static int
read_setting(PGconn *conn, const char *name, char *buf, size_t len)
{
	const char *params[1] = {name};
	PGresult   *res = PQexecParams(conn, "SELECT pg_catalog.current_setting($1, true)",
								   1, NULL, params, NULL, NULL, 0);

	if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
	{
		log_msg(LOG_ERROR, "cannot read a setting", "setting", name,
				"error", PQerrorMessage(conn), NULL);
		PQclear(res);
		return -1;
	}
	snprintf(buf, len, "%s", PQgetisnull(res, 0, 0) ? "" : PQgetvalue(res, 0, 0));
	PQclear(res);
	return 0;
}

/*
 * idempotency.outbox_notify_window as current_setting() shows it, in
 * seconds: with its unit ("500ms", "1s"), or as ALTER DATABASE stored it
 * for a session that has not loaded the library (no unit: ms); -1 if it is
 * neither.
 */
static double
window_seconds(const char *v)
{
	static const struct
	{
		const char *unit;
		double		seconds;
	}			units[] = {
		{"", 1e-3}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}, {"min", 60}, {"h", 3600}, {"d", 86400}
	};
	char	   *end;
	double		n = strtod(v, &end);
	size_t		i;

	if (end == v || !(n >= 0 && n <= 1e9))
		return -1;
	while (*end == ' ')
		end++;
	for (i = 0; i < sizeof(units) / sizeof(units[0]); i++)
		if (strcmp(end, units[i].unit) == 0)
			return n * units[i].seconds;
	return -1;
}

/* one connection attempt; 0 or -1 (logged) */
static int
db_open(relay_db *db, const relay_config *cfg)
{
	char		schema[136];		/* quote_ident of a name: at most 63 * 2 + 2 */
	char		sql[1024];
	char		value[256];
	char		window[32];

	db->conn = db_connect(cfg, schema, sizeof(schema));
	if (!db->conn)
		return -1;
	db->lost = 0;
	if (cfg->listen && !db_exec_ok(db->conn, "LISTEN idempotency_outbox"))
	{
		db_close(db);
		return -1;
	}
	if (read_setting(db->conn, "idempotency.outbox_max_attempts", value, sizeof(value)) < 0)
	{
		db_close(db);
		return -1;
	}
	db->max_attempts = *value ? atoi(value) : 10;

	/*
	 * Emitters under outbox_notify = 'coalesce' leave events unannounced for
	 * their window: the claim after a notification waits at least twice the
	 * window that this session sees (the server's, the database's or this
	 * role's), so a --notify-window left shorter misses none of theirs.
	 * Twice, as the default --notify-window is twice the default window: an
	 * emitter decides before its commit's WAL flush, so a commit it decided
	 * at the end of the window becomes visible up to a flush later.
	 */
	db->notify_window = cfg->notify_window;
	if (cfg->listen && cfg->notify_window > 0)
	{
		double		w;

		if (read_setting(db->conn, "idempotency.outbox_notify_window", value, sizeof(value)) < 0)
		{
			db_close(db);
			return -1;
		}
		w = *value ? window_seconds(value) : 0;
		if (w < 0)
			log_msg(LOG_WARN, "cannot read idempotency.outbox_notify_window: using --notify-window",
					"value", value, NULL);
		else if (2 * w > db->notify_window)
			db->notify_window = 2 * w;
	}
	snprintf(sql, sizeof(sql),
			 "SELECT e.id, e.lease_token, e.aggregate_type, e.aggregate_id, e.seq, e.event_type, "
			 "       e.payload::text, e.headers::text, e.attempts, pg_catalog.to_json(e.created_at)::text, "
			 "       pg_catalog.date_part('epoch', pg_catalog.now() - e.created_at) "
			 "FROM %s.idem_outbox_claim($1::int, pg_catalog.make_interval(secs => $2::float8), "
			 "                          pg_catalog.string_to_array(NULLIF($3::text, ''), ','), $4::text) "
			 "     WITH ORDINALITY e ORDER BY e.ordinality", schema);
	if (!prepare(db, STMT_CLAIM, sql, 4))
		goto fail;
	snprintf(sql, sizeof(sql), "SELECT %s.idem_outbox_ack($1::uuid[], $2::uuid, $3::text)", schema);
	if (!prepare(db, STMT_ACK, sql, 3))
		goto fail;
	snprintf(sql, sizeof(sql),
			 "SELECT %s.idem_outbox_nack($1::uuid, $2, "
			 "CASE WHEN $3::float8 >= 0 THEN pg_catalog.make_interval(secs => $3::float8) END, $4::uuid, $5::text)",
			 schema);
	if (!prepare(db, STMT_NACK, sql, 5))
		goto fail;
	snprintf(sql, sizeof(sql),
			 "SELECT %s.idem_outbox_extend($1::uuid, pg_catalog.make_interval(secs => $2::float8), $3::text)",
			 schema);
	if (!prepare(db, STMT_EXTEND, sql, 3))
		goto fail;
	if (!PQenterPipelineMode(db->conn))
	{
		log_msg(LOG_ERROR, "cannot enter pipeline mode", "error", PQerrorMessage(db->conn), NULL);
		goto fail;
	}
	snprintf(window, sizeof(window), "%g", db->notify_window);
	log_msg(LOG_INFO, "connected to the database", "listen", cfg->listen ? "on" : "off",
			"notify_window", window, NULL);
	return 0;
fail:
	db_close(db);
	return -1;
}

/*
 * Queue a prepared statement and its sync point; op (its event taken over)
 * says how to read its result.  0, or -1: the connection is lost.
 */
static int
db_send(relay_db *db, const char *stmt, int n, const char *const *params, const pending_op *op)
{
	if (db->lost)
	{
		free(op->event);
		return -1;
	}
	if (db->nops == db->opcap)
	{
		int			cap = db->opcap ? db->opcap * 2 : 16;
		pending_op *ops = realloc(db->ops, (size_t) cap * sizeof(*ops));

		if (!ops)
		{
			log_msg(LOG_ERROR, "out of memory", NULL);
			exit(1);
		}
		db->ops = ops;
		db->opcap = cap;
	}
	if (!PQsendQueryPrepared(db->conn, stmt, n, params, NULL, NULL, 0) || !PQpipelineSync(db->conn))
	{
		log_msg(LOG_ERROR, "cannot send to the database", "statement", stmt,
				"error", PQerrorMessage(db->conn), NULL);
		free(op->event);
		ops_abandon(db);
		db->lost = 1;
		return -1;
	}
	db->ops[db->nops++] = *op;
	if (op->kind == OP_CLAIM)
		op->b->state = SLOT_CLAIMING;
	return 0;
}

/*
 * s as a JSON string at out, escaped as jsonb's output escapes it (so the
 * object below is byte for byte what jsonb_build_object(...)::text gave);
 * out has room for 6 bytes per byte of s plus 2.  Returns the end.
 */
static char *
json_string(char *out, const char *s)
{
	*out++ = '"';
	for (; *s; s++)
	{
		unsigned char c = (unsigned char) *s;
		const char *esc = NULL;

		switch (c)
		{
			case '\b':
				esc = "\\b";
				break;
			case '\f':
				esc = "\\f";
				break;
			case '\n':
				esc = "\\n";
				break;
			case '\r':
				esc = "\\r";
				break;
			case '\t':
				esc = "\\t";
				break;
			case '"':
				esc = "\\\"";
				break;
			case '\\':
				esc = "\\\\";
				break;
			default:
				if (c < 0x20)
				{
					out += sprintf(out, "\\u%04x", c);
					continue;
				}
				*out++ = (char) c;
				continue;
		}
		*out++ = esc[0];
		*out++ = esc[1];
	}
	*out++ = '"';
	return out;
}

static char *
put(char *out, const char *s)
{
	size_t		len = strlen(s);

	memcpy(out, s, len);
	return out + len;
}

/*
 * The event as one JSON object, built here rather than by the server
 * (jsonb_build_object(...)::text wrote the payload out a second time: the
 * server's work per event is what bounds a fast sink), with the keys in
 * jsonb's order (shorter first, then bytewise).  Returns the end (NUL).
 */
static char *
event_json(char *out, const relay_event *e, const char *created_at)
{
	out = put(out, "{\"id\": \"");
	out = put(out, e->id);
	out = put(out, "\", \"seq\": ");
	out = put(out, e->seq);
	out = put(out, ", \"headers\": ");
	out = put(out, e->headers);
	out = put(out, ", \"payload\": ");
	out = put(out, e->payload);
	out += sprintf(out, ", \"attempts\": %d, \"created_at\": ", e->attempts);
	out = put(out, created_at);
	out = put(out, ", \"event_type\": ");
	out = json_string(out, e->event_type);
	out = put(out, ", \"aggregate_id\": ");
	out = json_string(out, e->aggregate_id);
	out = put(out, ", \"aggregate_type\": ");
	out = json_string(out, e->aggregate_type);
	*out++ = '}';
	*out++ = '\0';
	return out;
}

/* a claim's rows into slot b (the result taken over) */
static void
batch_fill(batch *b, PGresult *res)
{
	int			i;
	double		lag = 0;
	size_t		room = 0;
	char	   *out;

	b->res = res;
	b->n = PQntuples(res);
	b->token = PQgetvalue(res, 0, 1);
	b->ev = calloc((size_t) b->n, sizeof(*b->ev));
	/* the JSON objects' room: the fields, the strings escaped at worst */
	for (i = 0; i < b->n; i++)
		room += 160 + (size_t) PQgetlength(res, i, 0) + PQgetlength(res, i, 4) +
			PQgetlength(res, i, 6) + PQgetlength(res, i, 7) + PQgetlength(res, i, 9) +
			6 * ((size_t) PQgetlength(res, i, 2) + PQgetlength(res, i, 3) + PQgetlength(res, i, 5));
	b->json = malloc(room);
	if (!b->ev || !b->json)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		exit(1);
	}
	out = b->json;
	for (i = 0; i < b->n; i++)
	{
		double		age = atof(PQgetvalue(res, i, 10));
		relay_event *e = &b->ev[i];

		e->id = PQgetvalue(res, i, 0);
		e->aggregate_type = PQgetvalue(res, i, 2);
		e->aggregate_id = PQgetvalue(res, i, 3);
		e->seq = PQgetvalue(res, i, 4);
		e->event_type = PQgetvalue(res, i, 5);
		e->payload = PQgetvalue(res, i, 6);
		e->headers = PQgetvalue(res, i, 7);
		e->attempts = atoi(PQgetvalue(res, i, 8));
		e->json = out;
		out = event_json(out, e, PQgetvalue(res, i, 9));
		if (age > lag)
			lag = age;
	}
	metric_lag_seconds(lag);
	metric_add(M_CLAIMS, 1);
	{
		char		nb[16];

		snprintf(nb, sizeof(nb), "%d", b->n);
		log_msg(LOG_DEBUG, "claimed", "events", nb, NULL);
	}
}

/* what the oldest statement sent returned; res is taken over */
static void
op_done(relay_db *db, const pending_op *op, PGresult *res)
{
	int			ok = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1;

	/* the function each statement calls (a release is an extend of 1 µs) */
	static const char *const calls[] = {
		[OP_CLAIM] = "idem_outbox_claim", [OP_ACK] = "idem_outbox_ack",
		[OP_NACK] = "idem_outbox_nack", [OP_EXTEND] = "idem_outbox_extend",
		[OP_RELEASE] = "idem_outbox_extend"
	};

	if (!ok && op->kind != OP_CLAIM)
		log_msg(LOG_ERROR, "relay call failed", "call", calls[op->kind],
				"error", PQresultErrorMessage(res), NULL);
	switch (op->kind)
	{
		case OP_CLAIM:
			{
				batch	   *b = op->b;

				b->state = SLOT_READY;
				if (PQresultStatus(res) != PGRES_TUPLES_OK)
				{
					const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
					int			fatal = state && (strcmp(state, "42704") == 0 || strcmp(state, "55000") == 0);

					log_msg(LOG_ERROR, fatal ? "cannot deliver this subscription: stopping" : "claim failed",
							"error", PQresultErrorMessage(res), NULL);
					b->status = fatal ? BATCH_FATAL : BATCH_ERROR;
				}
				else if (PQntuples(res) == 0)
					b->status = BATCH_EMPTY;
				else
				{
					b->status = BATCH_CLAIMED;
					batch_fill(b, res);
					return;
				}
				break;
			}
		case OP_ACK:
			if (ok)
			{
				int			marked = atoi(PQgetvalue(res, 0, 0));

				metric_add(M_ACKED, (uint64_t) marked);
				if (marked < op->npub)
				{
					char		a[16],
								b[16];

					snprintf(a, sizeof(a), "%d", marked);
					snprintf(b, sizeof(b), "%d", op->npub);
					log_msg(LOG_WARN, "the ack marked fewer events than were published: the lease was lost, they will be delivered again",
							"marked", a, "published", b, NULL);
				}
			}
			break;
		case OP_NACK:
			if (ok)
			{
				const char *id = op->event,
						   *type = id + strlen(id) + 1,
						   *agg = type + strlen(type) + 1,
						   *seq = agg + strlen(agg) + 1;

				metric_add(M_NACKED, 1);
				if (op->attempts >= db->max_attempts)
				{
					metric_add(M_DEAD_LETTERED, 1);
					log_msg(LOG_WARN, "event dead-lettered (its last attempt failed)", "id", id,
							"aggregate_type", type, "aggregate_id", agg, "seq", seq, NULL);
				}
			}
			break;
		case OP_EXTEND:
		case OP_RELEASE:
			if (op->kind == OP_EXTEND)
				op->b->covered = ok ? atoi(PQgetvalue(res, 0, 0)) : -1;
			break;
	}
	PQclear(res);
}

/*
 * Read results, oldest first, until the claim of slot until was read (NULL:
 * until nothing is in flight).  0, or -1: the connection is lost (every
 * statement in flight forgotten, db->lost set).
 */
static int
db_collect(relay_db *db, const batch *until)
{
	while (db->nops > 0)
	{
		pending_op	op = db->ops[0];
		PGresult   *res,
				   *tail;

		/* its result, the NULL that ends it, then its sync point */
		res = PQgetResult(db->conn);
		tail = res ? PQgetResult(db->conn) : NULL;
		if (!res || tail || (tail = PQgetResult(db->conn)) == NULL ||
			PQresultStatus(tail) != PGRES_PIPELINE_SYNC)
		{
			log_msg(LOG_ERROR, "lost the database connection", "error",
					res ? PQresultErrorMessage(res) : PQerrorMessage(db->conn), NULL);
			if (res)
				PQclear(res);
			if (tail)
				PQclear(tail);
			ops_abandon(db);
			db->lost = 1;
			return -1;
		}
		PQclear(tail);
		memmove(db->ops, db->ops + 1, (size_t) (db->nops - 1) * sizeof(*db->ops));
		db->nops--;
		op_done(db, &op, res);
		free(op.event);
		if (until && op.kind == OP_CLAIM && op.b == until)
			return 0;
	}
	return 0;
}

/* send the claim filling slot b; alone: no batch of ours is leased when it runs */
static int
claim_send(relay_db *db, const relay_config *cfg, batch *b, int alone)
{
	char		nb[16],
				lease[32];
	const char *params[4];
	pending_op	op = {OP_CLAIM, b, 0, 0, NULL};

	batch_clear(b);
	snprintf(nb, sizeof(nb), "%d", cfg->batch);
	snprintf(lease, sizeof(lease), "%g", cfg->lease);
	params[0] = nb;
	params[1] = lease;
	params[2] = cfg->types;
	params[3] = cfg->subscription;
	b->alone = alone;
	b->claimed = b->leased = relay_now();
	return db_send(db, STMT_CLAIM, 4, params, &op);
}

/* send idem_outbox_extend of b's lease for seconds (release: its result ignored) */
static int
extend_send(relay_db *db, const relay_config *cfg, batch *b, double seconds, int release)
{
	char		lease[32];
	const char *params[3];
	pending_op	op = {release ? OP_RELEASE : OP_EXTEND, b, 0, 0, NULL};

	snprintf(lease, sizeof(lease), "%.6f", seconds);
	params[0] = b->token;
	params[1] = lease;
	params[2] = cfg->subscription;
	b->covered = -1;
	return db_send(db, STMT_EXTEND, 3, params, &op);
}

/* the shortest lease idem_outbox_extend takes: gives a lease back */
#define RELEASE_SECONDS 0.000001

/* log and count that an extend covered fewer of b's events than were claimed */
static void
lease_lost(const batch *b, const char *msg)
{
	char		covered[16],
				claimed[16];

	snprintf(covered, sizeof(covered), "%d", b->covered);
	snprintf(claimed, sizeof(claimed), "%d", b->n);
	log_msg(LOG_WARN, msg, "covered", covered, "claimed", claimed, NULL);
	metric_add(M_LEASES_LOST, 1);
}

/*
 * Extend the lease of cur (being published) and of the prefetched batch
 * next, if it holds one.  0; 1: cur's lease is lost (or the extend
 * failed); -1: the database is lost.  next's lease lost: it is dropped.
 */
static int
extend_leases(relay_db *db, const relay_config *cfg, batch *cur, batch *next)
{
	int			with_next;

	/* next's claim first: its token, and the pipeline emptied */
	if (db_collect(db, NULL) < 0)
		return -1;
	with_next = next->state == SLOT_READY && next->status == BATCH_CLAIMED;
	if (extend_send(db, cfg, cur, cfg->lease, 0) < 0 ||
		(with_next && extend_send(db, cfg, next, cfg->lease, 0) < 0) ||
		db_collect(db, NULL) < 0)
		return -1;
	cur->leased = relay_now();
	if (with_next)
	{
		next->leased = cur->leased;
		if (next->covered < next->n)
		{
			lease_lost(next, "lease of the prefetched batch lost: dropping it unpublished");
			batch_clear(next);
		}
	}
	if (cur->covered < cur->n)
	{
		if (cur->covered >= 0)
			lease_lost(cur, "lease lost: stopping this batch (its events go to another relay)");
		return 1;
	}
	return 0;
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

/*
 * One batch: the prefetched slot (or a new claim) becomes the batch in
 * hand, the next claim is sent (--prefetch), the batch is published, its
 * ack and nacks sent.  *cur and *next are the two slots, swapped here.
 */
static batch_status
run_batch(relay_db *db, const relay_config *cfg, sink_handle *sink, batch **curp, batch **nextp)
{
	batch	   *cur = *nextp,
			   *next = *curp;
	char		target[1024],
				err[1024];
	int			n,
				i,
				npub = 0,
				nfail = 0,
				lost = 0,
				db_gone = 0,
				flush_failed = 0,
				skip_from = -1;
	int		   *failed,
			   *published;
	char	  **fail_err;
	char	   *ids;
	size_t		idlen = 0;
	double		t0;
	relay_event *ev;

	*curp = cur;
	*nextp = next;
	batch_clear(next);
	for (;;)
	{
		if (cur->state == SLOT_IDLE && claim_send(db, cfg, cur, 1) < 0)
			return BATCH_DB_LOST;
		if (cur->state == SLOT_CLAIMING && db_collect(db, cur) < 0)
			return BATCH_DB_LOST;
		/* claimed beside a batch of ours: empty proves nothing, claim again */
		if (cur->status == BATCH_EMPTY && !cur->alone)
		{
			batch_clear(cur);
			continue;
		}
		break;
	}
	if (cur->status != BATCH_CLAIMED)
	{
		batch_status st = cur->status;

		batch_clear(cur);
		/* the acks' results read before idling or stopping */
		if (st != BATCH_DB_LOST && db_collect(db, NULL) < 0)
			return BATCH_DB_LOST;
		return st;
	}
	if (cfg->prefetch && claim_send(db, cfg, next, 0) < 0)
		db_gone = 1;

	n = cur->n;
	ev = cur->ev;
	t0 = cur->claimed;
	failed = calloc((size_t) n, sizeof(*failed));
	fail_err = calloc((size_t) n, sizeof(*fail_err));
	published = calloc((size_t) n, sizeof(*published));
	ids = malloc((size_t) n * 37 + 3);
	if (!failed || !fail_err || !published || !ids)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		exit(1);
	}
	ids[idlen++] = '{';

	if (sink->ops->send_run && sink->open && !db_gone)
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
		{
			published[i] = 2;
			continue;
		}
		skip_from = -1;
		sink_expand(cfg->target, &ev[i], target, sizeof(target));
		for (;;)
		{
			sink_result r;

			if (relay_now() - cur->leased > cfg->lease / 2)
			{
				int			rc = extend_leases(db, cfg, cur, next);

				if (rc != 0)
				{
					db_gone = rc < 0;
					lost = rc > 0;
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
				published[i] = 1;
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
				published[i] = 2;
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
			flush_failed = 1;
		}
	}
	if (npub > 0 && !db_gone)
	{
		const char *ap[3];
		pending_op	op = {OP_ACK, NULL, npub, 0, NULL};

		ids[idlen - 1] = '}';
		ids[idlen] = '\0';
		ap[0] = ids;
		ap[1] = cur->token;
		ap[2] = cfg->subscription;
		if (db_send(db, STMT_ACK, 3, ap, &op) < 0)
			db_gone = 1;
	}
	for (i = 0; i < nfail && !db_gone; i++)
	{
		const relay_event *e = &ev[failed[i]];
		const char *np[5];
		char		retry[32];
		size_t		l1 = strlen(e->id) + 1,
					l2 = strlen(e->aggregate_type) + 1,
					l3 = strlen(e->aggregate_id) + 1,
					l4 = strlen(e->seq) + 1;
		pending_op	op = {OP_NACK, NULL, 0, e->attempts, malloc(l1 + l2 + l3 + l4)};

		if (!op.event)
		{
			log_msg(LOG_ERROR, "out of memory", NULL);
			exit(1);
		}
		memcpy(op.event, e->id, l1);
		memcpy(op.event + l1, e->aggregate_type, l2);
		memcpy(op.event + l1 + l2, e->aggregate_id, l3);
		memcpy(op.event + l1 + l2 + l3, e->seq, l4);
		snprintf(retry, sizeof(retry), "%g", cfg->nack_retry_after);
		np[0] = e->id;
		np[1] = fail_err[i][0] ? fail_err[i] : "publish failed";
		np[2] = retry;
		np[3] = cur->token;
		np[4] = cfg->subscription;
		if (db_send(db, STMT_NACK, 5, np, &op) < 0)
			db_gone = 1;
	}
	/*
	 * stopping: what was not published is given back, claimable at once
	 * (published[i]: 1 published, 2 failed or after a failure, 0 neither)
	 */
	for (i = 0; i < n && published[i]; i++)
		;
	if (relay_stopping && !lost && !db_gone && (i < n || flush_failed) &&
		extend_send(db, cfg, cur, RELEASE_SECONDS, 1) < 0)
		db_gone = 1;
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
	batch_clear(cur);
	/* serial: every result read before the sink is called again */
	if (!db_gone && !cfg->prefetch && db_collect(db, NULL) < 0)
		db_gone = 1;
	return db_gone || db->lost ? BATCH_DB_LOST : BATCH_CLAIMED;
}

/*
 * Stopping: the prefetched batch, never published, given back; every
 * result read.
 */
static void
give_back(relay_db *db, const relay_config *cfg, batch *next)
{
	if (!db->conn || db->lost)
		return;
	if (next->state == SLOT_CLAIMING && db_collect(db, next) < 0)
		return;
	if (next->state == SLOT_READY && next->status == BATCH_CLAIMED)
	{
		char		nb[16];

		snprintf(nb, sizeof(nb), "%d", next->n);
		log_msg(LOG_DEBUG, "giving back the prefetched batch", "events", nb, NULL);
		if (extend_send(db, cfg, next, RELEASE_SECONDS, 1) < 0)
			return;
	}
	(void) db_collect(db, NULL);
	batch_clear(next);
}

/*
 * When to claim once more after the last notification (0: no such claim
 * due): emitters under outbox_notify = 'coalesce' commit events without a
 * NOTIFY for a window after theirs, which the claims that the notification
 * woke may have missed.
 */
static double reclaim_at = 0;

/*
 * wait for a notification, --poll seconds, or the claim due the notify
 * window (db_open) after the last notification; -1 if the connection is
 * gone
 */
static int
idle(relay_db *db, const relay_config *cfg)
{
	double		until = relay_now() + cfg->poll;

	if (reclaim_at > 0)
	{
		if (reclaim_at < until)
			until = reclaim_at;
		reclaim_at = 0;
	}

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

		/*
		 * first what libpq has read already (with the results of the batch
		 * just done): select() would not wake for it
		 */
		while ((note = PQnotifies(db->conn)) != NULL)
		{
			got = 1;
			PQfreemem(note);
		}
		if (got)
		{
			if (db->notify_window > 0)
				reclaim_at = relay_now() + db->notify_window;
			return 0;
		}
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
	}
	return 0;
}

int
outbox_run(const relay_config *cfg, const sink_ops *ops)
{
	relay_db	db;
	batch		slots[2];
	batch	   *cur = &slots[0],
			   *next = &slots[1];
	sink_handle sink = {ops, NULL, 0};
	relay_retry db_retry = {0};
	double		sink_backoff = 0.1;
	int			connected_once = 0,
				rc = 0;

	memset(&db, 0, sizeof(db));
	memset(slots, 0, sizeof(slots));
	log_msg(LOG_INFO, "starting", "sink", ops->name, "url", cfg->url, "target", cfg->target,
			"types", *cfg->types ? cfg->types : "all", "subscription", cfg->subscription,
			"prefetch", cfg->prefetch ? "1" : "0", NULL);
	while (!relay_stopping)
	{
		batch_status st;

		if (!db.conn)
		{
			int			ok = db_open(&db, cfg) == 0;

			if (!ok && cfg->once)
			{
				rc = 1;
				goto out;
			}
			if (!relay_retry_done(&db_retry, ok, M_DB_RECONNECTS))
				continue;
			/* 1: the database was reached; 2: the sink too (kept across reconnections) */
			if (!connected_once)
				connected_once = 1;
		}
		if (!sink.open)
		{
			int			src = sink_reopen(&sink, cfg, connected_once > 1);

			/* a configuration that never worked: stop (once it did, wait for a fix) */
			if (src == SINK_OPEN_FATAL && connected_once < 2)
			{
				rc = EXIT_CONFIG;
				goto out;
			}
			if (src != 0)
			{
				/* nothing prefetched waits for a sink that is down */
				give_back(&db, cfg, next);
				relay_sleep(sink_backoff);
				sink_backoff = relay_backoff(sink_backoff, 10);
				continue;
			}
			connected_once = 2;
			sink_backoff = 0.1;
		}
		st = run_batch(&db, cfg, &sink, &cur, &next);
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
				rc = 1;
				goto out;
			case BATCH_ERROR:
				if (cfg->once)
				{
					rc = 1;
					goto out;
				}
				relay_sleep(cfg->poll);
				break;
			case BATCH_DB_LOST:
				log_msg(LOG_ERROR, "lost the database connection: reconnecting (what was published but not acked is delivered again when its lease expires)", NULL);
				db_close(&db);
				batch_clear(cur);
				batch_clear(next);
				if (cfg->once)
				{
					rc = 1;
					goto out;
				}
				break;
		}
	}
done:
	give_back(&db, cfg, next);
	log_msg(LOG_INFO, "stopped", NULL);
out:
	if (sink.open)
		ops->close(sink.state);
	/* the acks in flight settled before the connection closes */
	if (db.conn && !db.lost)
		(void) db_collect(&db, NULL);
	db_close(&db);
	batch_clear(cur);
	batch_clear(next);
	free(db.ops);
	return rc;
}
