/*
 * sink_redis.c: XADD to a Redis stream (--target, default
 * "outbox:{aggregate_type}"; --url redis://HOST:PORT), fields id,
 * aggregate_type, aggregate_id, seq, event_type, payload, headers.  The
 * XADD's reply is the confirmation.
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

static int
redis_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	*state = redis_connect(cfg, err, errlen);
	return *state ? 0 : -1;
}

static sink_result
redis_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	redisContext *c = state;
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
		/* the server is loading or read-only: it may pass; anything else is this event's */
		res = (strncmp(r->str, "LOADING", 7) == 0 || strncmp(r->str, "READONLY", 8) == 0 ||
			   strncmp(r->str, "BUSY", 4) == 0) ? SINK_RETRY : SINK_REJECT;
	}
	freeReplyObject(r);
	return res;
}

static void
redis_close(void *state)
{
	redisFree(state);
}

SINK_DEFINE(sink_redis, "redis", "redis://127.0.0.1:6379", "outbox:{aggregate_type}",
			redis_open, redis_publish, NULL, redis_close);
