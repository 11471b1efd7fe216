/*
 * relay.h: what the files of idem-relay share (doc/relay.md).
 *
 * idem-relay moves outbox events to a broker through the SQL API alone:
 * outbox.c leases batches (idem_outbox_claim), hands each event to one sink
 * (sink_*.c, chosen by --sink), acks what the sink confirmed and nacks what
 * it refused.  config.c reads flags, IDEM_RELAY_* variables and a file;
 * log.c writes logfmt lines on stderr; metrics.c counts and serves them.
 *
 * Threads: the main thread does everything but serving /metrics, which a
 * thread of metrics.c does; the two share only the counters of metrics.c
 * (atomics).  Nothing else is shared, so no locks.
 *
 * Includes: every .c file includes this header and the system or library
 * headers it needs itself; no .c file includes another's header.
 */
#ifndef IDEM_RELAY_H
#define IDEM_RELAY_H

#include <stddef.h>
#include <stdint.h>

#define RELAY_VERSION "0.1"

/* exit statuses */
#define EXIT_CONFIG 2			/* bad configuration */

/* --- config.c --------------------------------------------------------- */

typedef struct relay_config
{
	const char *dbname;			/* libpq connection string ("" = libpq's defaults) */
	const char *sink;			/* stdout, http, redis, nats, amqp */
	const char *url;			/* where the sink connects */
	const char *target;			/* template of subject / stream / routing key */
	const char *exchange;		/* amqp: the exchange ("" = the default one) */
	const char *types;			/* comma-separated aggregate types, "" = all */
	const char *metrics_listen; /* host:port, "" = none */
	const char *log_format;		/* logfmt or json */
	int			batch;			/* events per claim */
	double		lease;			/* seconds */
	double		poll;			/* seconds between claims when idle */
	double		timeout;		/* seconds per publish */
	int			retries;		/* in-place tries of a transient failure before a nack */
	double		retry_max;		/* seconds: the cap of the in-place backoff */
	double		nack_retry_after;	/* seconds; < 0: the extension's backoff */
	int			listen;			/* LISTEN idempotency_outbox */
	int			once;			/* exit when a claim returns nothing */
	int			verbose;
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

typedef struct sink_ops
{
	const char *name;
	const char *default_url;
	const char *default_target;
	/* connect; 0, or -1 with the reason in err */
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
} sink_ops;

/*
 * A sink's entry: its name, the URL and target template used when none is
 * given, and its functions (flush may be NULL).
 */
#define SINK_DEFINE(var, nm, url, target, open_fn, publish_fn, flush_fn, close_fn) \
	const sink_ops var = {nm, url, target, open_fn, publish_fn, flush_fn, close_fn}

/* the sink named name, NULL if not compiled in */
const sink_ops *sink_find(const char *name);

/* the names of the sinks compiled in, space-separated */
const char *sink_names(void);

/* expand {aggregate_type} {event_type} {aggregate_id} of tmpl into out */
void		sink_expand(const char *tmpl, const relay_event *ev, char *out, size_t outlen);

/* every sink compiled in */
extern const sink_ops sink_stdout;
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

/* --- outbox.c ------------------------------------------------------------- */

/* the relay loop until SIGTERM/SIGINT (or --once); the exit status */
int			outbox_run(const relay_config *cfg, const sink_ops *sink);

/* set by the signal handler of main.c */
extern volatile int relay_stopping;

/* now, in seconds (CLOCK_MONOTONIC) */
double		relay_now(void);

/* sleep up to seconds, returning early once relay_stopping is set */
void		relay_sleep(double seconds);

#endif							/* IDEM_RELAY_H */
