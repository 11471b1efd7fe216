/*
 * source_http.c: an HTTP webhook receiver (libmicrohttpd) on --url
 * http://HOST:PORT[/PATH] (default http://127.0.0.1:8080/; with a PATH,
 * only POSTs to it).  A PATH ending in the segment {source}
 * (/webhooks/{source}) routes: a POST to /webhooks/NAME is stored under
 * inbox source NAME if --source lists it (comma-separated), else 404; one
 * receiver for several senders.  Each POST is a message: the raw body, the
 * request's headers as headers (the default message id: Idempotency-Key).
 * The answer waits for the main thread's commit:
 *
 *	200 {"stored": true}                       stored
 *	200 {"stored": false, "duplicate": true}   received before (a redelivery)
 *	400 / 409 {"error": ...}                   never storable: not JSON, no id
 *	                                           (400); another payload under
 *	                                           the same id (IK001: 409)
 *	401                                        a bad or missing signature
 *	                                           (nothing stored)
 *	503 + Retry-After                          not stored this time (the
 *	                                           database refused or is away, or
 *	                                           the relay is stopping)
 *	405, 404, 413                              not a POST, another path (or a
 *	                                           source --source does not list),
 *	                                           a body over 1 MiB
 *
 * Signatures (--hmac-secret): HMAC-SHA256 with the secret as key, compared
 * in constant time.  --hmac-format hex: header --hmac-header (default
 * X-Hub-Signature-256) is the hex HMAC of the raw body, "sha256=" before it
 * allowed (GitHub, and most providers).  stripe: header Stripe-Signature
 * "t=TS,v1=HEX[,v1=HEX...]", the HMAC of "TS.body", TS at most
 * --hmac-tolerance seconds from now (Stripe's scheme).
 * Guarantee: a 2xx only after the commit; a sender that retries until a
 * 2xx has each message stored once.
 *
 * Threads and locking: libmicrohttpd runs one thread per connection (with
 * SIGTERM/SIGINT blocked); each reads its request, checks the signature,
 * builds the message, then appends it to the queue and waits.  The queue
 * and each waiting request's state (fetched, settled, outcome) are guarded
 * by one mutex, st->lock: fetch (main thread) takes requests off the queue
 * and marks them fetched, settle (main thread) sets the outcome and wakes
 * the request's thread.  A request not fetched within --timeout (the
 * database away) leaves the queue and answers 503; a fetched one always
 * waits for its settle, so the main thread never touches a freed request.
 * close answers every queued request 503, then stops the daemon (joining
 * its threads).
 */
#include "relay.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#define MAX_BODY (1024 * 1024)

typedef struct http_req
{
	struct http_req *next;		/* in the queue */
	relay_buf	body;
	int			too_big;
	relay_message msg;			/* moved to the main thread by fetch */
	int			queued,
				fetched,
				settled;
	msg_outcome outcome;
	char		sqlstate[6];
	char		error[256];
	pthread_cond_t done;
} http_req;

typedef struct http_source
{
	const relay_config *cfg;
	struct MHD_Daemon *daemon;
	char		path[256];		/* "" = any; with {source}: the prefix before it */
	int			by_source;		/* the path ends in {source} */
	char		sources[1024];	/* then: ",NAME,NAME," of the --source list */
	pthread_mutex_t lock;
	pthread_cond_t arrived;
	http_req   *head,
			   *tail;
	int			closing;
} http_source;

static void
deadline_in(struct timespec *ts, double seconds)
{
	clock_gettime(CLOCK_REALTIME, ts);
	ts->tv_sec += (time_t) seconds;
	ts->tv_nsec += (long) ((seconds - (double) (time_t) seconds) * 1e9);
	if (ts->tv_nsec >= 1000000000L)
	{
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/* --- signatures ----------------------------------------------------------- */

/* the lowercase hex HMAC-SHA256 of a then b under key into hex[65] */
static void
hmac_hex(const char *key, const char *a, size_t alen, const char *b, size_t blen, char *hex)
{
	unsigned char md[EVP_MAX_MD_SIZE];
	unsigned int mdlen = 0;
	relay_buf	data = {0};
	unsigned int i;

	buf_put(&data, a, alen);
	buf_put(&data, b, blen);
	HMAC(EVP_sha256(), key, (int) strlen(key), (const unsigned char *) data.data, data.len, md, &mdlen);
	free(data.data);
	for (i = 0; i < mdlen && i < 32; i++)
		snprintf(hex + 2 * i, 3, "%02x", md[i]);
	hex[64] = '\0';
}

/* given (len bytes, hex, any case) equals expected (64 lowercase hex), in constant time */
static int
hex_equal(const char *given, size_t len, const char *expected)
{
	char		lower[64];
	size_t		i;

	if (len != 64)
		return 0;
	for (i = 0; i < 64; i++)
		lower[i] = (char) (given[i] >= 'A' && given[i] <= 'F' ? given[i] + 32 : given[i]);
	return CRYPTO_memcmp(lower, expected, 64) == 0;
}

/* the signature in header value sig is right for body; 0 or 1, why in *why */
static int
signature_ok(const relay_config *cfg, const char *sig, const char *body, size_t len, const char **why)
{
	char		hex[65];

	*why = "missing signature header";
	if (!sig)
		return 0;
	*why = "bad signature";
	if (strcmp(cfg->hmac_format, "hex") == 0)
	{
		if (strncasecmp(sig, "sha256=", 7) == 0)
			sig += 7;
		hmac_hex(cfg->hmac_secret, "", 0, body, len, hex);
		return hex_equal(sig, strlen(sig), hex);
	}
	else
	{
		/* stripe: t=TS,v1=HEX,... */
		const char *p = sig;
		char		ts[32] = "";
		int			ok = 0;

		while (*p)
		{
			const char *end = strchr(p, ',');
			size_t		n = end ? (size_t) (end - p) : strlen(p);

			if (n > 2 && strncmp(p, "t=", 2) == 0 && n - 2 < sizeof(ts) - 1)
				snprintf(ts, sizeof(ts), "%.*s", (int) (n - 2), p + 2);
			p += n + (end ? 1 : 0);
		}
		if (!ts[0])
			return 0;
		{
			char	   *e;
			long long	t = strtoll(ts, &e, 10);
			double		skew = (double) (time(NULL) - t);

			if (*e || skew > cfg->hmac_tolerance || -skew > cfg->hmac_tolerance)
			{
				*why = "signature timestamp outside the tolerance";
				return 0;
			}
		}
		strcat(ts, ".");
		hmac_hex(cfg->hmac_secret, ts, strlen(ts), body, len, hex);
		for (p = sig; *p;)
		{
			const char *end = strchr(p, ',');
			size_t		n = end ? (size_t) (end - p) : strlen(p);

			if (n > 3 && strncmp(p, "v1=", 3) == 0 && hex_equal(p + 3, n - 3, hex))
				ok = 1;
			p += n + (end ? 1 : 0);
		}
		return ok;
	}
}

/* --- the request threads -------------------------------------------------- */

/*
 * url is a path this receiver takes: 1, with the source it names (by
 * {source}) into source[64], "" otherwise
 */
static int
path_ok(const http_source *st, const char *url, char *source)
{
	size_t		plen = strlen(st->path);
	const char *name = url + plen;
	char		item[68];

	source[0] = '\0';
	if (!st->by_source)
		return !st->path[0] || strcmp(url, st->path) == 0;
	if (strncmp(url, st->path, plen) != 0 || !*name || strlen(name) > 63 || strchr(name, ','))
		return 0;
	snprintf(item, sizeof(item), ",%s,", name);
	if (!strstr(st->sources, item))
		return 0;
	snprintf(source, 64, "%s", name);
	return 1;
}

typedef struct header_walk
{
	relay_message *msg;
	const relay_config *cfg;
} header_walk;

static enum MHD_Result
each_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
	header_walk *w = cls;

	(void) kind;
	if (value)
		msg_header(w->msg, w->cfg, key, value, strlen(value));
	return MHD_YES;
}

static enum MHD_Result
respond(struct MHD_Connection *conn, unsigned int status, const char *body)
{
	struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), (void *) body,
																MHD_RESPMEM_MUST_COPY);
	enum MHD_Result rc;

	MHD_add_response_header(resp, "Content-Type", "application/json");
	if (status == 503)
		MHD_add_response_header(resp, "Retry-After", "1");
	rc = MHD_queue_response(conn, status, resp);
	MHD_destroy_response(resp);
	return rc;
}

/* {"error": text} */
static enum MHD_Result
respond_error(struct MHD_Connection *conn, unsigned int status, const char *text)
{
	relay_buf	b = {0};
	enum MHD_Result rc;

	buf_puts(&b, "{\"error\":");
	buf_json_string(&b, text, strlen(text));
	buf_puts(&b, "}\n");
	rc = respond(conn, status, b.data);
	free(b.data);
	return rc;
}

/* queue req and wait for its outcome; with st->lock not held */
static void
enqueue_and_wait(http_source *st, http_req *req)
{
	struct timespec deadline;

	deadline_in(&deadline, st->cfg->timeout);
	pthread_mutex_lock(&st->lock);
	if (!st->closing)
	{
		req->queued = 1;
		if (st->tail)
			st->tail->next = req;
		else
			st->head = req;
		st->tail = req;
		pthread_cond_signal(&st->arrived);
	}
	while (req->queued && !req->settled)
	{
		if (!req->fetched && st->closing)
			break;
		if (!req->fetched)
		{
			if (pthread_cond_timedwait(&req->done, &st->lock, &deadline) == ETIMEDOUT && !req->fetched)
				break;
		}
		else
			pthread_cond_wait(&req->done, &st->lock);
	}
	if (req->queued && !req->fetched)
	{
		/* not taken in time (or stopping): off the queue, answered 503 */
		http_req  **pp = &st->head,
				   *prev = NULL;

		while (*pp && *pp != req)
		{
			prev = *pp;
			pp = &(*pp)->next;
		}
		if (*pp)
		{
			*pp = req->next;
			if (st->tail == req)
				st->tail = prev;
		}
		req->outcome = MSG_FAILED;
		snprintf(req->error, sizeof(req->error), "%s", st->closing ? "the relay is stopping" :
				 "the database is not answering");
	}
	else if (!req->queued)
	{
		req->outcome = MSG_FAILED;
		snprintf(req->error, sizeof(req->error), "the relay is stopping");
	}
	pthread_mutex_unlock(&st->lock);
}

static enum MHD_Result
handle(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
	   const char *version, const char *upload_data, size_t *upload_data_size, void **con_cls)
{
	http_source *st = cls;
	http_req   *req = *con_cls;
	const char *why;
	header_walk walk;
	char		source[64];

	(void) version;
	if (!req)
	{
		req = calloc(1, sizeof(*req));
		if (!req)
			return MHD_NO;
		pthread_cond_init(&req->done, NULL);
		*con_cls = req;
		return MHD_YES;
	}
	if (*upload_data_size)
	{
		if (req->body.len + *upload_data_size > MAX_BODY)
			req->too_big = 1;
		else
			buf_put(&req->body, upload_data, *upload_data_size);
		*upload_data_size = 0;
		return MHD_YES;
	}
	if (strcmp(method, "POST") != 0)
		return respond_error(conn, 405, "POST expected");
	if (!path_ok(st, url, source))
		return respond_error(conn, 404, "not found");
	if (req->too_big)
		return respond_error(conn, 413, "body over 1 MiB");
	if (*st->cfg->hmac_secret &&
		!signature_ok(st->cfg, MHD_lookup_connection_value(conn, MHD_HEADER_KIND, st->cfg->hmac_header),
					  req->body.data ? req->body.data : "", req->body.len, &why))
	{
		metric_add(M_IN_REJECTED, 1);
		log_msg(LOG_WARN, "webhook refused: signature check failed", "error", why, NULL);
		return respond_error(conn, 401, why);
	}
	msg_set_body(&req->msg, req->body.data ? req->body.data : "", req->body.len);
	memcpy(req->msg.source, source, sizeof(req->msg.source));
	walk.msg = &req->msg;
	walk.cfg = st->cfg;
	MHD_get_connection_values(conn, MHD_HEADER_KIND, each_header, &walk);
	snprintf(req->msg.ref, sizeof(req->msg.ref), "POST %.50s", url);
	enqueue_and_wait(st, req);
	switch (req->outcome)
	{
		case MSG_STORED:
			return respond(conn, 200, "{\"stored\":true}\n");
		case MSG_DUPLICATE:
			return respond(conn, 200, "{\"stored\":false,\"duplicate\":true}\n");
		case MSG_REJECTED:
			return respond_error(conn, strcmp(req->sqlstate, "IK001") == 0 ? 409 : 400, req->error);
		case MSG_FAILED:
			break;
	}
	return respond_error(conn, 503, req->error);
}

static void
completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
	http_req   *req = *con_cls;

	(void) cls;
	(void) conn;
	(void) toe;
	if (!req)
		return;
	free(req->body.data);
	msg_free(&req->msg);
	pthread_cond_destroy(&req->done);
	free(req);
	*con_cls = NULL;
}

/* --- the source ------------------------------------------------------------ */

static void
hs_close(void *state)
{
	http_source *st = state;

	pthread_mutex_lock(&st->lock);
	st->closing = 1;
	while (st->head)
	{
		http_req   *r = st->head;

		st->head = r->next;
		r->queued = 0;
		pthread_cond_signal(&r->done);
	}
	st->tail = NULL;
	pthread_mutex_unlock(&st->lock);
	if (st->daemon)
		MHD_stop_daemon(st->daemon);
	pthread_cond_destroy(&st->arrived);
	pthread_mutex_destroy(&st->lock);
	free(st);
}

static int
hs_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	http_source *st = calloc(1, sizeof(*st));
	const char *p = cfg->url;
	const char *slash,
			   *colon;
	char		host[256],
				port[16];
	struct addrinfo hints,
			   *ai = NULL;
	sigset_t	old;
	int			rc;

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->cfg = cfg;
	pthread_mutex_init(&st->lock, NULL);
	pthread_cond_init(&st->arrived, NULL);
	if (strncmp(p, "http://", 7) == 0)
		p += 7;
	slash = strchr(p, '/');
	colon = memchr(p, ':', slash ? (size_t) (slash - p) : strlen(p));
	if (!colon)
	{
		snprintf(err, errlen, "--url must be http://HOST:PORT[/PATH] for --in http");
		hs_close(st);
		return -1;
	}
	snprintf(host, sizeof(host), "%.*s", (int) (colon - p), p);
	snprintf(port, sizeof(port), "%.*s", (int) (slash ? slash - colon - 1 : (long) strlen(colon + 1)), colon + 1);
	if (slash && strcmp(slash, "/") != 0)
		snprintf(st->path, sizeof(st->path), "%s", slash);
	if (strstr(st->path, "{source}"))
	{
		/* config.c has checked it is the last segment */
		*strstr(st->path, "{source}") = '\0';
		st->by_source = 1;
		if (strlen(cfg->source) + 3 > sizeof(st->sources))
		{
			snprintf(err, errlen, "--source is too long for {source} (at most %zu bytes)", sizeof(st->sources) - 3);
			hs_close(st);
			return -1;
		}
		snprintf(st->sources, sizeof(st->sources), ",%s,", cfg->source);
	}
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE;
	if ((rc = getaddrinfo(*host ? host : NULL, port, &hints, &ai)) != 0)
	{
		snprintf(err, errlen, "cannot resolve %s: %s", cfg->url, gai_strerror(rc));
		hs_close(st);
		return -1;
	}
	relay_block_signals(&old);
	st->daemon = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
								  (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0),
								  (uint16_t) atoi(port), NULL, NULL, handle, st,
								  MHD_OPTION_SOCK_ADDR, ai->ai_addr,
								  MHD_OPTION_NOTIFY_COMPLETED, completed, NULL,
								  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int) 30,
								  MHD_OPTION_END);
	relay_restore_signals(&old);
	freeaddrinfo(ai);
	if (!st->daemon)
	{
		snprintf(err, errlen, "cannot listen on %s: %s", cfg->url, strerror(errno));
		hs_close(st);
		return -1;
	}
	log_msg(LOG_INFO, "receiving webhooks", "url", cfg->url, "source", cfg->source,
			"signature", *cfg->hmac_secret ? cfg->hmac_format : "none", NULL);
	*state = st;
	return 0;
}

static int
hs_fetch(void *state, relay_message *msgs, int max, double wait, char *err, size_t errlen)
{
	http_source *st = state;
	struct timespec deadline;
	int			n = 0;

	(void) err;
	(void) errlen;
	deadline_in(&deadline, wait);
	pthread_mutex_lock(&st->lock);
	while (!st->head && !relay_stopping &&
		   pthread_cond_timedwait(&st->arrived, &st->lock, &deadline) != ETIMEDOUT)
		;
	while (st->head && n < max)
	{
		http_req   *r = st->head;

		st->head = r->next;
		if (!st->head)
			st->tail = NULL;
		r->fetched = 1;
		msgs[n] = r->msg;
		memset(&r->msg, 0, sizeof(r->msg));
		msgs[n++].handle = r;
	}
	pthread_mutex_unlock(&st->lock);
	return n;
}

static int
hs_settle(void *state, relay_message *msg, msg_outcome outcome, char *err, size_t errlen)
{
	http_source *st = state;
	http_req   *r = msg->handle;

	(void) err;
	(void) errlen;
	pthread_mutex_lock(&st->lock);
	r->outcome = outcome;
	memcpy(r->sqlstate, msg->sqlstate, sizeof(r->sqlstate));
	memcpy(r->error, msg->error, sizeof(r->error));
	r->settled = 1;
	pthread_cond_signal(&r->done);
	pthread_mutex_unlock(&st->lock);
	msg->handle = NULL;
	return 0;
}

SOURCE_DEFINE(source_http, "http", "http://127.0.0.1:8080/", "", "header:Idempotency-Key",
			  hs_open, hs_fetch, hs_settle, hs_close);
