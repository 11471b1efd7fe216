/*
 * sink_redis.c: XADD to a Redis stream (--target, default
 * "outbox:{aggregate_type}"; --url redis://HOST:PORT), fields id,
 * aggregate_type, aggregate_id, seq, event_type, payload, headers.  The
 * XADD's reply is the confirmation.  A batch goes pipelined: each
 * aggregate's run is one EVALSHA of a script that XADDs its events in
 * order and stops at the first failure (returning how many went in and the
 * error), all runs of the batch written before the first reply is read; so
 * a batch costs about one round trip, and an aggregate's events still land
 * in seq order with nothing after a failed one.  Without scripting (SCRIPT
 * LOAD refused) the sink publishes one XADD at a time.
 * Guarantee: at least once.  Redis gives no dedup: an event published but
 * not acked (relay killed, lost ack) is a second stream entry with the same
 * id field; consumers dedupe on it.
 *
 * One connection (hiredis, blocking, --timeout); main thread only.
 * redis_connect is source_redis.c's too.
 */
#include "relay.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

redisContext *
redis_connect(const relay_config *cfg, char *err, size_t errlen)
{
	char		host[256] = "127.0.0.1";
	int			port = 6379;
	const char *p = cfg->url;
	const char *colon;
	struct timeval tv;
	redisContext *c;

	if (strncmp(p, "redis://", 8) == 0)
		p += 8;
	colon = strrchr(p, ':');
	if (colon)
	{
		snprintf(host, sizeof(host), "%.*s", (int) (colon - p), p);
		port = atoi(colon + 1);
	}
	else if (*p)
		snprintf(host, sizeof(host), "%s", p);
	tv.tv_sec = (time_t) cfg->timeout;
	tv.tv_usec = (suseconds_t) ((cfg->timeout - (double) tv.tv_sec) * 1e6);
	c = redisConnectWithTimeout(host, port, tv);
	if (!c || c->err)
	{
		snprintf(err, errlen, "%s", c ? c->errstr : "out of memory");
		if (c)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, tv);
	return c;
}

/* KEYS: the targets; ARGV: 7 fields per event; returns {events added, error or ""} */
static const char run_script[] =
"local n = 0\n"
"for i = 1, #KEYS do\n"
"  local b = (i - 1) * 7\n"
"  local r = redis.pcall('XADD', KEYS[i], '*', 'id', ARGV[b + 1], 'aggregate_type', ARGV[b + 2],\n"
"    'aggregate_id', ARGV[b + 3], 'seq', ARGV[b + 4], 'event_type', ARGV[b + 5],\n"
"    'payload', ARGV[b + 6], 'headers', ARGV[b + 7])\n"
"  if type(r) == 'table' and r.err then return {n, r.err} end\n"
"  n = n + 1\n"
"end\n"
"return {n, ''}\n";

typedef struct redis_sink
{
	redisContext *c;
	char		sha[41];		/* of run_script, "" if scripting is refused */
} redis_sink;

static int
redis_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	redis_sink *st = calloc(1, sizeof(*st));
	redisReply *r;

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	if (!(st->c = redis_connect(cfg, err, errlen)))
	{
		free(st);
		return -1;
	}
	r = redisCommand(st->c, "SCRIPT LOAD %s", run_script);
	if (!r)
	{
		snprintf(err, errlen, "%s", st->c->errstr[0] ? st->c->errstr : "lost the connection");
		redisFree(st->c);
		free(st);
		return -1;
	}
	if (r->type == REDIS_REPLY_STRING && r->len == 40)
		memcpy(st->sha, r->str, 40);
	freeReplyObject(r);
	*state = st;
	return 0;
}

/* a Redis error: the server is loading or read-only, it may pass; anything else is the event's */
static sink_result
redis_error(const char *msg)
{
	return (strncmp(msg, "LOADING", 7) == 0 || strncmp(msg, "READONLY", 8) == 0 ||
			strncmp(msg, "BUSY", 4) == 0 || strncmp(msg, "NOSCRIPT", 8) == 0) ? SINK_RETRY : SINK_REJECT;
}

static int
redis_send_run(void *state, const relay_event *evs, const char *const *targets, int n,
			   char *err, size_t errlen)
{
	redis_sink *st = state;
	int			argc = 3 + 8 * n,
				i,
				k = 0,
				rc;
	const char **argv = malloc((size_t) argc * sizeof(*argv));
	char		nkeys[16];

	if (!st->sha[0] || !argv)
	{
		snprintf(err, errlen, "%s", argv ? "no script" : "out of memory");
		free(argv);
		return -1;
	}
	snprintf(nkeys, sizeof(nkeys), "%d", n);
	argv[k++] = "EVALSHA";
	argv[k++] = st->sha;
	argv[k++] = nkeys;
	for (i = 0; i < n; i++)
		argv[k++] = targets[i];
	for (i = 0; i < n; i++)
	{
		argv[k++] = evs[i].id;
		argv[k++] = evs[i].aggregate_type;
		argv[k++] = evs[i].aggregate_id;
		argv[k++] = evs[i].seq;
		argv[k++] = evs[i].event_type;
		argv[k++] = evs[i].payload;
		argv[k++] = evs[i].headers;
	}
	rc = redisAppendCommandArgv(st->c, argc, argv, NULL);
	free(argv);
	if (rc != REDIS_OK)
	{
		snprintf(err, errlen, "%s", st->c->errstr);
		return -1;
	}
	return 0;
}

static sink_result
redis_recv_run(void *state, int *confirmed, char *err, size_t errlen)
{
	redis_sink *st = state;
	redisReply *r = NULL;
	sink_result res = SINK_OK;

	*confirmed = 0;
	if (redisGetReply(st->c, (void **) &r) != REDIS_OK || !r)
	{
		snprintf(err, errlen, "%s", st->c->errstr[0] ? st->c->errstr : "lost the connection");
		return SINK_DOWN;
	}
	if (r->type == REDIS_REPLY_ERROR)
	{
		snprintf(err, errlen, "%s", r->str);
		res = redis_error(r->str);
	}
	else if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r->element[0]->type == REDIS_REPLY_INTEGER)
	{
		*confirmed = (int) r->element[0]->integer;
		if (r->element[1]->type == REDIS_REPLY_STRING && r->element[1]->len > 0)
		{
			snprintf(err, errlen, "%s", r->element[1]->str);
			res = redis_error(r->element[1]->str);
		}
	}
	else
	{
		snprintf(err, errlen, "unexpected reply to the script");
		res = SINK_RETRY;
	}
	freeReplyObject(r);
	return res;
}

static sink_result
redis_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	redisContext *c = ((redis_sink *) state)->c;
	redisReply *r;
	sink_result res = SINK_OK;

	r = redisCommand(c, "XADD %s * id %s aggregate_type %s aggregate_id %s seq %s event_type %s payload %s headers %s",
					 target, ev->id, ev->aggregate_type, ev->aggregate_id, ev->seq, ev->event_type,
					 ev->payload, ev->headers);
	if (!r)
	{
		snprintf(err, errlen, "%s", c->errstr[0] ? c->errstr : "lost the connection");
		return SINK_DOWN;
	}
	if (r->type == REDIS_REPLY_ERROR)
	{
		snprintf(err, errlen, "%s", r->str);
		res = redis_error(r->str);
	}
	freeReplyObject(r);
	return res;
}

static void
redis_close(void *state)
{
	redis_sink *st = state;

	redisFree(st->c);
	free(st);
}

SINK_DEFINE_PIPELINED(sink_redis, "redis", "redis://127.0.0.1:6379", "outbox:{aggregate_type}",
					  redis_open, redis_publish, redis_close, redis_send_run, redis_recv_run);
