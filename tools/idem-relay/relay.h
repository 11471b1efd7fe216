/*
 * relay.h: what the files of idem-relay share (doc/relay.md).
 *
 * idem-relay moves outbox events to a broker through the SQL API alone:
 * outbox.c leases batches (idem_outbox_claim), hands each event to one sink
 * (sink_*.c, chosen by --sink), acks what the sink confirmed and nacks what
 * it refused.  With --in it runs the other way: inbound.c takes batches of
 * messages from one source (source_*.c: a broker's consumer, or an HTTP
 * receiver), stores them with idem_inbox_receive in one transaction and
 * acks each to the broker only after the commit.  config.c reads flags,
 * IDEM_RELAY_* variables and a file; log.c writes logfmt lines on stderr;
 * metrics.c counts and serves them; db.c opens the database connection.
 *
 * Threads: the main thread does everything but serving /metrics, which a
 * thread of metrics.c does, and receiving webhooks, which the threads of
 * source_http.c do; the metrics thread shares only the counters of
 * metrics.c (atomics), the webhook threads only source_http.c's queue
 * (under its mutex, described there).  Nothing else is shared.
 *
 * Includes: every .c file includes this header and the system or library
 * headers it needs itself; no .c file includes another's header.
 */
#ifndef IDEM_RELAY_H
#define IDEM_RELAY_H

#include <libpq-fe.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#define RELAY_VERSION "0.1"

/* exit statuses */
#define EXIT_CONFIG 2			/* bad configuration */

/* --- config.c --------------------------------------------------------- */

typedef struct relay_config
{
	const char *dbname;			/* libpq connection string ("" = libpq's defaults) */
	const char *sink;			/* stdout, sql, http, redis, nats, amqp */
	const char *in;				/* inbound: the source (http, redis, nats, amqp); NULL: outbound */
	const char *url;			/* where the sink connects */
	const char *target;			/* template of subject / stream / routing key */
	const char *exchange;		/* amqp: the exchange ("" = the default one) */
	const char *sql;			/* sql: the statement run per event ("" = none) */
	const char *sql_commit;		/* sql: "batch" (a transaction per batch) or "event" */
	int			http_concurrency;	/* http: POSTs of a batch at once (1: one at a time) */
	const char *types;			/* comma-separated aggregate types, "" = all */
	const char *subscription;	/* the outbox subscription it delivers */
	const char *metrics_listen; /* host:port, "" = none */
	const char *log_format;		/* logfmt or json */
	int			batch;			/* events per claim */
	double		lease;			/* seconds */
	double		poll;			/* seconds between claims when idle */
	double		notify_window;	/* seconds: claim once more this long after a notification */
	double		timeout;		/* seconds per publish */
	int			retries;		/* in-place tries of a transient failure before a nack */
	double		retry_max;		/* seconds: the cap of the in-place backoff */
	double		nack_retry_after;	/* seconds; < 0: the extension's backoff */
	int			listen;			/* LISTEN idempotency_outbox */
	int			once;			/* exit when a claim returns nothing */
	int			prefetch;		/* 1: claim the next batch while this one is published */
	int			verbose;
	/* inbound (--in) */
	const char *source;			/* the inbox source name (default: the --in name);
								 * with {source} in an http --url, the names
								 * allowed there, comma-separated */
	const char *message_id;		/* header:NAME or json:/POINTER (default per source) */
	const char *ordering_key;	/* header:NAME or json:/POINTER, "" = none */
	const char *group;			/* redis consumer group, nats durable consumer */
	const char *consumer;		/* redis consumer name */
	const char *hmac_secret;	/* http: "" = no signature check */
	const char *hmac_header;	/* http: the signature's header (default per format) */
	const char *hmac_format;	/* http: hex or stripe */
	double		hmac_tolerance; /* http, stripe: seconds of clock skew */
	/*
	 * Subscriptions (issue 23): a "subscription" option would go here and
	 * be passed by outbox.c as the relay functions' last argument.
	 */
} relay_config;

/* parse argv, the environment and --config FILE; exits 2 on bad input */
void		config_load(relay_config *cfg, int argc, char **argv);

/* --- log.c -------------------------------------------------------------- */

enum log_level
{
	LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR
};

void		log_init(const char *format, int verbose);

/*
 * log_msg(level, msg, key, value, key, value, ..., NULL): one line on
 * stderr, fields after msg in pairs of strings
 */
void		log_msg(enum log_level level, const char *msg,...);

/* --- metrics.c ------------------------------------------------------------ */

enum metric
{
	M_PUBLISHED,				/* the sink confirmed the event */
	M_ACKED,					/* idem_outbox_ack marked it */
	M_FAILED,					/* a publish that failed (each try) */
	M_NACKED,					/* idem_outbox_nack sent */
	M_DEAD_LETTERED,			/* nacked at its last attempt */
	M_LEASES_LOST,				/* batches whose lease was lost */
	M_DB_RECONNECTS,
	M_SINK_RECONNECTS,
	M_CLAIMS,
	M_IN_RECEIVED,				/* inbound: messages taken from the source */
	M_IN_STORED,				/* idem_inbox_receive stored it (true) */
	M_IN_DUPLICATES,			/* received before (false) */
	M_IN_FAILED,				/* not stored, delivered again (database refused or lost) */
	M_IN_REJECTED,				/* never storable (bad JSON, no id, IK001, bad signature) */
	M_IN_SOURCE_RECONNECTS,
	M_COUNT
};

void		metric_add(enum metric m, uint64_t n);
void		metric_batch_seconds(double seconds);
void		metric_lag_seconds(double seconds);

/* start the /metrics thread on host:port; 0 or -1 (logged) */
int			metrics_start(const char *listen);

/* --- sinks (sink.c and sink_*.c) ------------------------------------------ */

/* an event as the claim returned it */
typedef struct relay_event
{
	const char *id;
	const char *aggregate_type;
	const char *aggregate_id;
	const char *seq;
	const char *event_type;
	const char *payload;		/* jsonb as text */
	const char *headers;		/* jsonb as text */
	const char *json;			/* the whole event as one JSON object */
	int			attempts;
} relay_event;

typedef enum sink_result
{
	SINK_OK,					/* the broker confirmed it */
	SINK_RETRY,					/* transient: try again, up to --retries (5xx, timeout) */
	SINK_REJECT,				/* the broker refused this event: nack it */
	SINK_DOWN					/* the broker is unreachable: try again until it is back */
} sink_result;

#define SINK_OPEN_FATAL (-2)

typedef struct sink_ops
{
	const char *name;
	const char *default_url;
	const char *default_target;
	/*
	 * connect; 0, or -1 with the reason in err (tried again with a
	 * backoff), or SINK_OPEN_FATAL: the configuration cannot work (the
	 * relay stops with exit 2 if the sink never opened)
	 */
	int			(*open) (void **state, const relay_config *cfg, char *err, size_t errlen);
	/* publish one event to subject/stream/key target; the reason in err */
	sink_result (*publish) (void *state, const relay_event *ev, const char *target,
							char *err, size_t errlen);
	/*
	 * NULL, or: make every event published since the last call confirmed;
	 * 0, or -1 (the reason in err: then none of them counts as confirmed)
	 */
	int			(*flush) (void *state, char *err, size_t errlen);
	void		(*close) (void *state);

	/*
	 * NULL, or a pipelined path for a whole batch (outbox.c tries it
	 * first): send_run queues one aggregate's run (n events in seq order,
	 * to targets[i]) without waiting for the broker, 0 or -1 (err);
	 * recv_run reads the reply of the oldest run sent and not read: how
	 * many of its events (a prefix) the broker confirmed into *confirmed,
	 * and SINK_OK if all, else the failure of the next one; the sink
	 * guarantees that no event after it in the run was published.
	 */
	int			(*send_run) (void *state, const relay_event *evs, const char *const *targets, int n,
							 char *err, size_t errlen);
	sink_result (*recv_run) (void *state, int *confirmed, char *err, size_t errlen);
} sink_ops;

/*
 * A sink's entry: its name, the URL and target template used when none is
 * given, and its functions (flush may be NULL); SINK_DEFINE_PIPELINED with
 * send_run and recv_run too.
 */
#define SINK_DEFINE(var, nm, url, target, open_fn, publish_fn, flush_fn, close_fn) \
	const sink_ops var = {nm, url, target, open_fn, publish_fn, flush_fn, close_fn, NULL, NULL}
#define SINK_DEFINE_PIPELINED(var, nm, url, target, open_fn, publish_fn, close_fn, send_fn, recv_fn) \
	const sink_ops var = {nm, url, target, open_fn, publish_fn, NULL, close_fn, send_fn, recv_fn}

/*
 * A sink that publishes the runs send_run queued in waves (nats, amqp, http):
 * each run's progress, and the recv_run they share.
 */
typedef struct sink_run
{
	int			first;			/* its first slot in the sink's own array */
	int			n;
	int			confirmed;		/* its events confirmed: a prefix */
	sink_result res;			/* SINK_OK while none failed */
	char		err[256];
} sink_run;

/*
 * The runs of a batch as send_run queues them, for a sink that publishes
 * them later (sql, http): each event's json and id copied, with the run it
 * is of; runs[] as sink_runs_recv reads them.
 */
typedef struct sink_queued
{
	char	   *json;
	char	   *id;
	int			run;			/* its run, an index into runs */
} sink_queued;

typedef struct sink_queue
{
	sink_run   *runs;
	int			nruns,
				runcap;
	sink_queued *evs;
	int			nev,
				evcap;
} sink_queue;

/* queue one aggregate's run of n events: 0, or -1 (out of memory, in err) */
int			sink_queue_run(sink_queue *q, const relay_event *evs, int n, char *err, size_t errlen);
/* forget what is queued (the arrays stay), or free it all */
void		sink_queue_clear(sink_queue *q);
void		sink_queue_free(sink_queue *q);

/* every run not wholly confirmed and not failed fails with res and why */
void		sink_runs_fail_rest(sink_run *runs, int nruns, sink_result res, const char *why);
const char *sink_waves_stopped(int down, double t0, double lease, sink_result *res);

/*
 * recv_run of such a sink: waves(state) at the first call after the runs
 * were queued (*waved set), then the runs in order (*nread counting them),
 * reset(state) after the last
 */
sink_result sink_runs_recv(void *state, sink_run *runs, int nruns, int *nread, int *waved,
						   void (*waves) (void *), void (*reset) (void *),
						   int *confirmed, char *err, size_t errlen);

/* the sink named name, NULL if not compiled in */
const sink_ops *sink_find(const char *name);

/* the names of the sinks compiled in, space-separated */
const char *sink_names(void);

/* expand {aggregate_type} {event_type} {aggregate_id} of tmpl into out */
void		sink_expand(const char *tmpl, const relay_event *ev, char *out, size_t outlen);

/* every sink compiled in */
extern const sink_ops sink_stdout;
extern const sink_ops sink_sql;
#ifdef HAVE_CURL
extern const sink_ops sink_http;
#endif
#ifdef HAVE_HIREDIS
extern const sink_ops sink_redis;
#endif
#ifdef HAVE_NATS
extern const sink_ops sink_nats;
#endif
#ifdef HAVE_RABBITMQ
extern const sink_ops sink_amqp;
#endif

/* --- sources (source.c and source_*.c) ------------------------------------ */

/* a growing text buffer (source.c); zeroed = empty; data NUL-terminated */
typedef struct relay_buf
{
	char	   *data;
	size_t		len;
	size_t		cap;
} relay_buf;

void		buf_put(relay_buf *b, const char *s, size_t len);
void		buf_puts(relay_buf *b, const char *s);
/* s as a JSON string: quotes, backslashes and control characters escaped */
void		buf_json_string(relay_buf *b, const char *s, size_t len);

/* what became of a message: the source acks, rejects or hands it out again */
typedef enum msg_outcome
{
	MSG_STORED,					/* idem_inbox_receive returned true: ack */
	MSG_DUPLICATE,				/* it returned false: ack */
	MSG_REJECTED,				/* never storable: reject (reason in error) */
	MSG_FAILED					/* not stored this time: deliver it again */
} msg_outcome;

/* a message as a source took it; source.c's msg_* functions fill it */
typedef struct relay_message
{
	char	   *body;			/* the raw body (NUL-terminated) */
	size_t		body_len;
	relay_buf	meta;			/* the broker's headers/fields/properties: a JSON object */
	int			meta_closed;	/* msg_meta was called */
	char	   *message_id;		/* from --message-id header:NAME, else NULL */
	char	   *ordering_key;	/* from --ordering-key header:NAME, else NULL */
	char		source[64];		/* the inbox source if the message names it (an
								 * http path's {source}), "" = --source */
	void	   *handle;			/* the source's, for settle */
	char		ref[64];		/* for logs: entry id, delivery tag */
	char		sqlstate[6];	/* set before settle when not stored */
	char		error[256];
} relay_message;

typedef struct source_ops
{
	const char *name;
	const char *default_url;
	const char *default_target;
	const char *default_message_id;
	/* connect (listen); 0, or -1 with the reason in err */
	int			(*open) (void **state, const relay_config *cfg, char *err, size_t errlen);
	/*
	 * up to max messages into msgs (zeroed), waiting up to wait seconds for
	 * the first; how many, or -1: the broker is lost (reason in err)
	 */
	int			(*fetch) (void *state, relay_message *msgs, int max, double wait,
						  char *err, size_t errlen);
	/*
	 * after the transaction: ack, reject or hand back msg; called once for
	 * every message fetch returned, even when it fails; 0 or -1 (err)
	 */
	int			(*settle) (void *state, relay_message *msg, msg_outcome outcome,
						   char *err, size_t errlen);
	void		(*close) (void *state);
} source_ops;

/* a source's entry, as SINK_DEFINE */
#define SOURCE_DEFINE(var, nm, url, target, msgid, open_fn, fetch_fn, settle_fn, close_fn) \
	const source_ops var = {nm, url, target, msgid, open_fn, fetch_fn, settle_fn, close_fn}

const source_ops *source_find(const char *name);
const char *source_names(void);

/* the message's body (copied); header name = value (appended to meta, and
 * taken as message id / ordering key when --message-id / --ordering-key
 * name it); msg_free frees what these allocated */
void		msg_set_body(relay_message *msg, const char *body, size_t len);
void		msg_header(relay_message *msg, const relay_config *cfg, const char *name,
					   const char *value, size_t value_len);
void		msg_free(relay_message *msg);
/* the metadata object, closed (no msg_header after this) */
const char *msg_meta(relay_message *msg);

#ifdef HAVE_MHD
extern const source_ops source_http;
#endif
#ifdef HAVE_HIREDIS
extern const source_ops source_redis;
#endif
#ifdef HAVE_NATS
extern const source_ops source_nats;
#endif
#ifdef HAVE_RABBITMQ
extern const source_ops source_amqp;
#endif

/* --- broker connections shared by a sink and a source of one broker ------ */

#ifdef HAVE_HIREDIS
#include <hiredis/hiredis.h>
/* connect to redis://HOST:PORT with --timeout; NULL (reason in err) */
redisContext *redis_connect(const relay_config *cfg, char *err, size_t errlen);
#endif
#ifdef HAVE_NATS
#include <nats/nats.h>
typedef struct nats_link
{
	natsOptions *opts;
	natsConnection *nc;
	jsCtx	   *js;
	int64_t		timeout_ms;
} nats_link;

/* connect to --url (the library's reconnection off) with a JetStream
 * context; 0, or -1 (reason in err, l closed) */
int			nats_link_open(nats_link *l, const relay_config *cfg, char *err, size_t errlen);
void		nats_link_close(nats_link *l);
#endif
#ifdef HAVE_RABBITMQ
#include <amqp.h>
/* connect to --url, log in and open channel 1 (in confirm mode if
 * confirm); NULL (reason in err) */
amqp_connection_state_t amqp_connect_channel(const relay_config *cfg, int confirm,
											 char *err, size_t errlen);
/* close channel 1 and the connection, free it */
void		amqp_disconnect(amqp_connection_state_t conn);
#endif

/* --- db.c ----------------------------------------------------------------- */

/*
 * connect to --dbname, session in READ COMMITTED, client_min_messages =
 * warning; the extension's schema (quoted) into schema; NULL (logged)
 */
PGconn	   *db_connect(const relay_config *cfg, char *schema, size_t schemalen);
/* run sql; true if it succeeded (logged if not) */
int			db_exec_ok(PGconn *conn, const char *sql);

/* --- outbox.c, inbound.c -------------------------------------------------- */

/* the relay loop until SIGTERM/SIGINT (or --once); the exit status */
int			outbox_run(const relay_config *cfg, const sink_ops *sink);

/* the inbound loop until SIGTERM/SIGINT; the exit status */
int			inbound_run(const relay_config *cfg, const source_ops *source);

/* --- main.c --------------------------------------------------------------- */

/* set by the signal handler of main.c */
extern volatile int relay_stopping;

/* now, in seconds (CLOCK_MONOTONIC) */
double		relay_now(void);

/* sleep up to seconds, returning early once relay_stopping is set */
void		relay_sleep(double seconds);

/* the next backoff after b: doubled, at most cap */
double		relay_backoff(double b, double cap);

/* a connection kept open by a loop: its backoff, and whether it ever opened */
typedef struct relay_retry
{
	double		backoff;
	int			opened;
} relay_retry;

/*
 * after an attempt to open r's connection: if it failed (!ok), sleep the
 * backoff (0.1 s doubling to 10 s) and return 0; else reset the backoff,
 * count metric m if it opened before (a reconnection), and return 1
 */
int			relay_retry_done(relay_retry *r, int ok, enum metric m);

/* block SIGTERM and SIGINT in the calling thread (before starting a thread
 * that must not take them: it inherits the mask); restore with old */
void		relay_block_signals(sigset_t *old);
void		relay_restore_signals(const sigset_t *old);

#endif							/* IDEM_RELAY_H */
