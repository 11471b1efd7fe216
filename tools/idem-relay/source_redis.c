/*
 * source_redis.c: a Redis Streams consumer group (--url redis://HOST:PORT,
 * stream --target, default "inbox"; group --group, consumer --consumer,
 * both default "idem-relay").  The group is created at the stream's start
 * (XGROUP CREATE ... 0 MKSTREAM) if it does not exist.  A message is an
 * entry: its field "payload" the body (without one, the entry's fields as
 * a JSON object), every other field a header (the default message id:
 * field "id", as the redis sink writes it).
 *
 * Reading: XREADGROUP ... > (BLOCK up to --poll) for new entries; XACK only
 * after the entry's commit.  What this consumer read and did not ack (the
 * relay killed, the database refused) is its pending list: read again
 * first, with XREADGROUP from id 0, after opening (a restart) and after a
 * failed store; entries another consumer of the group has held unacked for
 * longer than --lease (a dead relay under another --consumer name) are
 * taken over with XAUTOCLAIM, at open and every --lease seconds.  A
 * rejected entry (never storable) is not acked: it stays in XPENDING for an
 * operator, read again only at the next start.
 * Guarantee: at least once from Redis, each entry stored once (a redelivery
 * is a duplicate for idem_inbox_receive); none lost: an entry leaves the
 * pending list only by the XACK after its commit.
 *
 * One connection (redis_connect of sink_redis.c); main thread only.
 */
#include "relay.h"

#include <hiredis/hiredis.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct redis_source
{
	redisContext *c;
	const relay_config *cfg;
	int			pending;		/* read this consumer's pending list first */
	char		from[64];		/* ... after this id */
	double		next_autoclaim;
} redis_source;

static void
rs_close(void *state)
{
	redis_source *st = state;

	redisFree(st->c);
	free(st);
}

/* a command's reply, or NULL (the connection is lost) with the reason in err */
static redisReply *
rs_command(redis_source *st, int argc, const char **argv, char *err, size_t errlen)
{
	redisReply *r = redisCommandArgv(st->c, argc, argv, NULL);

	if (!r)
		snprintf(err, errlen, "%s", st->c->errstr[0] ? st->c->errstr : "lost the connection");
	return r;
}

/* XAUTOCLAIM what other consumers held longer than --lease; 0 or -1 */
static int
rs_autoclaim(redis_source *st, char *err, size_t errlen)
{
	char		idle[32],
				cursor[64] = "0-0";
	int			rounds = 0;

	snprintf(idle, sizeof(idle), "%lld", (long long) (st->cfg->lease * 1000));
	do
	{
		const char *argv[] = {"XAUTOCLAIM", st->cfg->target, st->cfg->group, st->cfg->consumer,
		idle, cursor, "COUNT", "1000", "JUSTID"};
		redisReply *r = rs_command(st, 9, argv, err, errlen);

		if (!r)
			return -1;
		if (r->type == REDIS_REPLY_ARRAY && r->elements >= 2 && r->element[0]->type == REDIS_REPLY_STRING)
		{
			snprintf(cursor, sizeof(cursor), "%s", r->element[0]->str);
			if (r->element[1]->type == REDIS_REPLY_ARRAY && r->element[1]->elements > 0)
			{
				st->pending = 1;
				strcpy(st->from, "0");
			}
		}
		else
			strcpy(cursor, "0-0");
		freeReplyObject(r);
	} while (strcmp(cursor, "0-0") != 0 && ++rounds < 100);
	st->next_autoclaim = relay_now() + st->cfg->lease;
	return 0;
}

static int
rs_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	redis_source *st = calloc(1, sizeof(*st));
	const char *argv[] = {"XGROUP", "CREATE", cfg->target, cfg->group, "0", "MKSTREAM"};
	redisReply *r;

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->cfg = cfg;
	st->pending = 1;
	strcpy(st->from, "0");
	if (!(st->c = redis_connect(cfg, err, errlen)))
	{
		free(st);
		return -1;
	}
	r = rs_command(st, 6, argv, err, errlen);
	if (!r || (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "BUSYGROUP", 9) != 0))
	{
		if (r)
			snprintf(err, errlen, "XGROUP CREATE: %s", r->str);
		freeReplyObject(r);
		rs_close(st);
		return -1;
	}
	freeReplyObject(r);
	if (rs_autoclaim(st, err, errlen) != 0)
	{
		rs_close(st);
		return -1;
	}
	*state = st;
	return 0;
}

/* the entry list of an XREADGROUP reply of one stream, NULL if none */
static redisReply *
rs_entry_list(redisReply *r)
{
	if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || r->element[0]->type != REDIS_REPLY_ARRAY ||
		r->element[0]->elements < 2 || r->element[0]->element[1]->type != REDIS_REPLY_ARRAY)
		return NULL;
	return r->element[0]->element[1];
}

/* the entries of an XREADGROUP reply into msgs; how many (deleted ones acked and skipped) */
static int
rs_entries(redis_source *st, redisReply *r, relay_message *msgs, int max)
{
	redisReply *entries = rs_entry_list(r);
	size_t		i;
	int			n = 0;

	if (!entries)
		return 0;
	for (i = 0; i < entries->elements && n < max; i++)
	{
		redisReply *e = entries->element[i];
		redisReply *fields = e->elements >= 2 ? e->element[1] : NULL;
		relay_message *m = &msgs[n];
		size_t		j;

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 1)
			continue;
		if (st->pending)
			snprintf(st->from, sizeof(st->from), "%s", e->element[0]->str);
		if (!fields || fields->type != REDIS_REPLY_ARRAY)
		{
			/* trimmed away while pending: nothing to store, clear it */
			freeReplyObject(redisCommand(st->c, "XACK %s %s %s", st->cfg->target, st->cfg->group,
										 e->element[0]->str));
			continue;
		}
		for (j = 0; j + 1 < fields->elements; j += 2)
		{
			redisReply *k = fields->element[j],
					   *v = fields->element[j + 1];

			if (strcmp(k->str, "payload") == 0 && !m->body)
				msg_set_body(m, v->str, v->len);
			else
				msg_header(m, st->cfg, k->str, v->str, v->len);
		}
		if (!m->body)
		{
			const char *all = msg_meta(m);

			msg_set_body(m, all, strlen(all));
		}
		snprintf(m->ref, sizeof(m->ref), "%s", e->element[0]->str);
		m->handle = strdup(e->element[0]->str);
		n++;
	}
	return n;
}

/*
 * XREADGROUP ... [BLOCK block] STREAMS stream id into msgs: how many, or
 * -1 (lost, or an error such as NOGROUP: the stream or group was deleted,
 * reopening recreates it); *listed: the entries the reply had
 */
static int
rs_read(redis_source *st, const char *id, const char *block, relay_message *msgs, int max,
		size_t *listed, char *err, size_t errlen)
{
	const char *argv[11];
	char		count[16];
	int			argc = 0,
				n;
	redisReply *r;

	snprintf(count, sizeof(count), "%d", max);
	argv[argc++] = "XREADGROUP";
	argv[argc++] = "GROUP";
	argv[argc++] = st->cfg->group;
	argv[argc++] = st->cfg->consumer;
	argv[argc++] = "COUNT";
	argv[argc++] = count;
	if (block)
	{
		argv[argc++] = "BLOCK";
		argv[argc++] = block;
	}
	argv[argc++] = "STREAMS";
	argv[argc++] = st->cfg->target;
	argv[argc++] = id;
	if (!(r = rs_command(st, argc, argv, err, errlen)))
		return -1;
	if (r->type == REDIS_REPLY_ERROR)
	{
		snprintf(err, errlen, "XREADGROUP: %s", r->str);
		freeReplyObject(r);
		return -1;
	}
	n = rs_entries(st, r, msgs, max);
	*listed = rs_entry_list(r) ? rs_entry_list(r)->elements : 0;
	freeReplyObject(r);
	return n;
}

static int
rs_fetch(void *state, relay_message *msgs, int max, double wait, char *err, size_t errlen)
{
	redis_source *st = state;
	char		block[32];
	size_t		listed;
	int			n;

	if (relay_now() >= st->next_autoclaim && rs_autoclaim(st, err, errlen) != 0)
		return -1;
	if (st->pending)
	{
		n = rs_read(st, st->from, NULL, msgs, max, &listed, err, errlen);
		if (n < 0)
			return -1;
		if (listed == 0)
			st->pending = 0;	/* the pending list is read through */
		if (n > 0 || st->pending)
			return n;
	}
	/* block less than the socket timeout */
	if (wait > st->cfg->timeout / 2)
		wait = st->cfg->timeout / 2;
	snprintf(block, sizeof(block), "%lld", (long long) (wait * 1000) + 1);
	return rs_read(st, ">", block, msgs, max, &listed, err, errlen);
}

static int
rs_settle(void *state, relay_message *msg, msg_outcome outcome, char *err, size_t errlen)
{
	redis_source *st = state;
	char	   *id = msg->handle;
	int			rc = 0;

	if (outcome == MSG_STORED || outcome == MSG_DUPLICATE)
	{
		const char *argv[] = {"XACK", st->cfg->target, st->cfg->group, id};
		redisReply *r = rs_command(st, 4, argv, err, errlen);

		if (!r || r->type == REDIS_REPLY_ERROR)
		{
			if (r)
				snprintf(err, errlen, "XACK: %s", r->str);
			rc = -1;
		}
		freeReplyObject(r);
	}
	else if (outcome == MSG_FAILED)
	{
		/* it stays pending: read it again (after the loop's backoff) */
		st->pending = 1;
		strcpy(st->from, "0");
	}
	free(id);
	msg->handle = NULL;
	return rc;
}

SOURCE_DEFINE(source_redis, "redis", "redis://127.0.0.1:6379", "inbox", "header:id",
			  rs_open, rs_fetch, rs_settle, rs_close);
