/*
 * sink_amqp.c: publish each event to RabbitMQ (librabbitmq, AMQP 0-9-1)
 * with publisher confirms: exchange --exchange (default: the default
 * exchange, where the routing key names a queue), routing key --target
 * (default "outbox.{aggregate_type}.{event_type}"), mandatory, persistent,
 * message_id and the header-free body: the event as JSON.  The broker's
 * basic.ack is the confirmation; basic.nack or a lost connection is
 * transient; an unroutable message (basic.return) is refused.
 * Guarantee: at least once; RabbitMQ does not dedupe on message_id, so a
 * lost ack means a second copy, and consumers dedupe on message_id.
 *
 * Pipelined (send_run/recv_run): a batch goes in waves, as in sink_nats.c.
 * Wave k publishes the k-th event of every aggregate's run whose events
 * before it were all confirmed, then reads frames until each of them is
 * settled by delivery tag (basic.ack or basic.nack, "multiple" covering
 * every tag up to it; a basic.return before its ack, told apart by the
 * returned message's message_id, makes it unroutable), or --timeout.  So a
 * batch costs about as many round trips as its longest run, and an
 * aggregate's event is never in flight before the one before it was
 * confirmed: a whole run at once would not do, as RabbitMQ routes k+1
 * (another routing key) when k came back unroutable.  A run stops at its
 * first failure; a lost connection stops every run, and so do SIGTERM and a
 * third of the lease gone (the rest goes one at a time, which extends the
 * lease).  The waves run at the first recv_run; send_run copies the events.
 * Delivery tags count every publish of the channel, so a confirm that comes
 * after its publish timed out is known for what it is and skipped.
 *
 * One connection, channel 1 in confirm mode; main thread only.
 * amqp_connect_channel is source_amqp.c's too.
 */
#include "relay.h"

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

/* an event to publish, and how it went */
typedef struct amqp_slot
{
	char	   *copy;			/* send_run's copy of the strings below (NULL: not ours) */
	const char *id;
	const char *type;
	const char *target;
	const char *json;
	int			run;
	uint64_t	tag;			/* its delivery tag, once published */
	int			returned;		/* a basic.return named it */
	int			done;			/* settled: res and err set */
	sink_result res;
	char		err[256];
} amqp_slot;

typedef struct amqp_state
{
	amqp_connection_state_t conn;
	const char *exchange;
	struct timeval timeout;
	uint64_t	tag;			/* the last delivery tag of channel 1 */
	double		lease;
	amqp_slot  *slots;
	int			nslots,
				slotcap;
	sink_run   *runs;
	int			nruns,
				runcap;
	amqp_slot **wave;			/* the slots of the wave in flight (runcap long) */
	int			nread;			/* runs recv_run returned */
	int			waved;			/* the waves of the runs queued ran */
} amqp_state;

void
amqp_disconnect(amqp_connection_state_t conn)
{
	amqp_channel_close(conn, 1, AMQP_REPLY_SUCCESS);
	amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(conn);
}

static void
amqp_close_state(void *state)
{
	amqp_state *st = state;
	int			i;

	amqp_disconnect(st->conn);
	for (i = 0; i < st->nslots; i++)
		free(st->slots[i].copy);
	free(st->slots);
	free(st->runs);
	free(st->wave);
	free(st);
}

static int
rpc_ok(amqp_rpc_reply_t r, const char *what, char *err, size_t errlen)
{
	if (r.reply_type == AMQP_RESPONSE_NORMAL)
		return 1;
	if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION)
		snprintf(err, errlen, "%s: %s", what, amqp_error_string2(r.library_error));
	else
		snprintf(err, errlen, "%s: refused by the server", what);
	return 0;
}

/* --timeout as a timeval */
static struct timeval
timeout_tv(const relay_config *cfg)
{
	struct timeval tv;

	tv.tv_sec = (time_t) cfg->timeout;
	tv.tv_usec = (suseconds_t) ((cfg->timeout - (double) tv.tv_sec) * 1e6);
	return tv;
}

amqp_connection_state_t
amqp_connect_channel(const relay_config *cfg, int confirm, char *err, size_t errlen)
{
	struct amqp_connection_info ci;
	char	   *url = strdup(cfg->url);
	amqp_socket_t *sock;
	amqp_connection_state_t conn;
	struct timeval tv = timeout_tv(cfg);
	int			rc;

	if (!url)
	{
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	amqp_default_connection_info(&ci);
	if ((rc = amqp_parse_url(url, &ci)) != AMQP_STATUS_OK)
	{
		snprintf(err, errlen, "bad --url: %s", amqp_error_string2(rc));
		free(url);
		return NULL;
	}
	/* "amqp://host/" names the vhost "" (the default one, "/", is %2f) */
	if (!ci.vhost || !*ci.vhost)
		ci.vhost = "/";
	conn = amqp_new_connection();
	sock = amqp_tcp_socket_new(conn);
	if (!sock || (rc = amqp_socket_open_noblock(sock, ci.host, ci.port, &tv)) != AMQP_STATUS_OK)
	{
		snprintf(err, errlen, "cannot connect to %s:%d: %s", ci.host, ci.port,
				 sock ? amqp_error_string2(rc) : "no socket");
		amqp_destroy_connection(conn);
		free(url);
		return NULL;
	}
	amqp_set_rpc_timeout(conn, &tv);
	if (!rpc_ok(amqp_login(conn, ci.vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, ci.user, ci.password),
				"login", err, errlen) ||
		(amqp_channel_open(conn, 1), !rpc_ok(amqp_get_rpc_reply(conn), "channel.open", err, errlen)) ||
		(confirm && (amqp_confirm_select(conn, 1),
					 !rpc_ok(amqp_get_rpc_reply(conn), "confirm.select", err, errlen))))
	{
		amqp_destroy_connection(conn);
		free(url);
		return NULL;
	}
	free(url);
	return conn;
}

static int
amqp_open_sink(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	amqp_state *st = calloc(1, sizeof(*st));

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->exchange = cfg->exchange;
	st->timeout = timeout_tv(cfg);
	st->lease = cfg->lease;
	if (!(st->conn = amqp_connect_channel(cfg, 1, err, errlen)))
	{
		free(st);
		return -1;
	}
	*state = st;
	return 0;
}

/* publish slot sl (mandatory, persistent); its delivery tag set; an AMQP status */
static int
amqp_send(amqp_state *st, amqp_slot *sl)
{
	amqp_basic_properties_t props;
	int			rc;

	memset(&props, 0, sizeof(props));
	props._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
		AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TYPE_FLAG;
	props.content_type = amqp_cstring_bytes("application/json");
	props.delivery_mode = 2;
	props.message_id = amqp_cstring_bytes(sl->id);
	props.type = amqp_cstring_bytes(sl->type);
	rc = amqp_basic_publish(st->conn, 1, amqp_cstring_bytes(st->exchange), amqp_cstring_bytes(sl->target),
							1, 0, &props, amqp_cstring_bytes(sl->json));
	if (rc == AMQP_STATUS_OK)
		sl->tag = ++st->tag;
	return rc;
}

static void
settle(amqp_slot *sl, sink_result res, const char *err)
{
	sl->done = 1;
	sl->res = res;
	snprintf(sl->err, sizeof(sl->err), "%s", err);
}

/*
 * Read frames until every slot of wave (published, not settled) is
 * settled, or --timeout: a basic.return first marks the slot its
 * message_id names; basic.ack and basic.nack settle the tags they cover;
 * anything about other tags (a confirm that came after its timeout) is
 * skipped.
 */
static void
amqp_await(amqp_state *st, amqp_slot **wave, int n)
{
	double		deadline = relay_now() + (double) st->timeout.tv_sec + (double) st->timeout.tv_usec / 1e6;
	int			left = n,
				header = 0,		/* a basic.return came: its header frame is next */
				i;

	while (left > 0)
	{
		amqp_frame_t frame;
		struct timeval tv;
		double		rem = deadline - relay_now();
		int			rc;

		if (rem < 0)
			rem = 0;
		tv.tv_sec = (time_t) rem;
		tv.tv_usec = (suseconds_t) ((rem - (double) tv.tv_sec) * 1e6);
		rc = amqp_simple_wait_frame_noblock(st->conn, &frame, &tv);
		if (rc != AMQP_STATUS_OK)
		{
			char		err[128];

			snprintf(err, sizeof(err), "waiting for the confirm: %s", amqp_error_string2(rc));
			for (i = 0; i < n; i++)
				if (!wave[i]->done)
					settle(wave[i], rc == AMQP_STATUS_TIMEOUT ? SINK_RETRY : SINK_DOWN, err);
			break;
		}
		if (frame.frame_type == AMQP_FRAME_HEADER && header)
		{
			amqp_basic_properties_t *p = frame.payload.properties.decoded;

			header = 0;
			if (p && (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG))
				for (i = 0; i < n; i++)
					if (!wave[i]->done && strlen(wave[i]->id) == p->message_id.len &&
						memcmp(wave[i]->id, p->message_id.bytes, p->message_id.len) == 0)
						wave[i]->returned = 1;
			continue;
		}
		if (frame.frame_type != AMQP_FRAME_METHOD)
			continue;			/* the returned message's body */
		switch (frame.payload.method.id)
		{
			case AMQP_BASIC_RETURN_METHOD:
				header = 1;
				break;
			case AMQP_BASIC_ACK_METHOD:
			case AMQP_BASIC_NACK_METHOD:
				{
					int			ack = frame.payload.method.id == AMQP_BASIC_ACK_METHOD;
					uint64_t	tag;
					int			multiple;

					if (ack)
					{
						amqp_basic_ack_t *m = frame.payload.method.decoded;

						tag = m->delivery_tag;
						multiple = m->multiple;
					}
					else
					{
						amqp_basic_nack_t *m = frame.payload.method.decoded;

						tag = m->delivery_tag;
						multiple = m->multiple;
					}
					for (i = 0; i < n; i++)
					{
						amqp_slot  *sl = wave[i];
						char		err[256];

						if (sl->done || !(sl->tag == tag || (multiple && sl->tag < tag)))
							continue;
						left--;
						if (!ack)
							settle(sl, SINK_RETRY, "the broker nacked the message");
						else if (sl->returned)
						{
							snprintf(err, sizeof(err), "unroutable: no queue is bound to routing key \"%s\"",
									 sl->target);
							settle(sl, SINK_REJECT, err);
						}
						else
							settle(sl, SINK_OK, "");
					}
					break;
				}
			case AMQP_CHANNEL_CLOSE_METHOD:
			case AMQP_CONNECTION_CLOSE_METHOD:
				for (i = 0; i < n; i++)
					if (!wave[i]->done)
						settle(wave[i], SINK_DOWN, "the broker closed the channel");
				left = 0;
				break;
			default:
				break;
		}
	}
	amqp_maybe_release_buffers(st->conn);
}

static sink_result
amqp_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	amqp_state *st = state;
	amqp_slot	sl;
	amqp_slot  *one = &sl;
	int			rc;

	memset(&sl, 0, sizeof(sl));
	sl.id = ev->id;
	sl.type = ev->event_type;
	sl.target = target;
	sl.json = ev->json;
	if ((rc = amqp_send(st, &sl)) != AMQP_STATUS_OK)
	{
		snprintf(err, errlen, "basic.publish: %s", amqp_error_string2(rc));
		return SINK_DOWN;
	}
	amqp_await(st, &one, 1);
	if (sl.res != SINK_OK)
		snprintf(err, errlen, "%s", sl.err);
	return sl.res;
}

/* drop the runs queued (void * for sink_runs_recv) */
static void
amqp_reset(void *state)
{
	amqp_state *st = state;
	int			i;

	for (i = 0; i < st->nslots; i++)
		free(st->slots[i].copy);
	st->nslots = st->nruns = st->nread = st->waved = 0;
}

/* queue a run: its events copied, nothing sent (the waves send) */
static int
amqp_send_run(void *state, const relay_event *evs, const char *const *targets, int n,
			  char *err, size_t errlen)
{
	amqp_state *st = state;
	int			i;

	if (st->waved)
		amqp_reset(st);			/* a new batch (the last one read to its end or dropped) */
	if (st->nslots + n > st->slotcap || st->nruns + 1 > st->runcap)
	{
		int			slotcap = st->slotcap,
					runcap = st->runcap;
		amqp_slot  *slots;
		sink_run   *runs;
		amqp_slot **wave;

		while (st->nslots + n > slotcap)
			slotcap = slotcap ? slotcap * 2 : 128;
		while (st->nruns + 1 > runcap)
			runcap = runcap ? runcap * 2 : 64;
		if ((slots = realloc(st->slots, (size_t) slotcap * sizeof(*slots))))
			st->slots = slots;
		if ((runs = realloc(st->runs, (size_t) runcap * sizeof(*runs))))
			st->runs = runs;
		if ((wave = realloc(st->wave, (size_t) runcap * sizeof(*wave))))
			st->wave = wave;
		if (!slots || !runs || !wave)
		{
			snprintf(err, errlen, "out of memory");
			return -1;
		}
		st->slotcap = slotcap;
		st->runcap = runcap;
	}
	for (i = 0; i < n; i++)
	{
		amqp_slot  *sl = &st->slots[st->nslots + i];
		const char *parts[4] = {evs[i].id, evs[i].event_type, targets[i], evs[i].json};
		size_t		len[4],
					total = 0,
					off = 0;
		int			k;

		for (k = 0; k < 4; k++)
			total += (len[k] = strlen(parts[k])) + 1;
		memset(sl, 0, sizeof(*sl));
		if (!(sl->copy = malloc(total)))
		{
			while (--i >= 0)
				free(st->slots[st->nslots + i].copy);
			snprintf(err, errlen, "out of memory");
			return -1;
		}
		for (k = 0; k < 4; k++)
		{
			memcpy(sl->copy + off, parts[k], len[k] + 1);
			off += len[k] + 1;
		}
		sl->id = sl->copy;
		sl->type = sl->id + len[0] + 1;
		sl->target = sl->type + len[1] + 1;
		sl->json = sl->target + len[2] + 1;
		sl->run = st->nruns;
	}
	memset(&st->runs[st->nruns], 0, sizeof(st->runs[0]));
	st->runs[st->nruns].first = st->nslots;
	st->runs[st->nruns].n = n;
	st->runs[st->nruns].res = SINK_OK;
	st->nruns++;
	st->nslots += n;
	return 0;
}

/*
 * every run queued, in waves (the banner): each run's confirmed and res set
 * (void * for sink_runs_recv)
 */
static void
amqp_waves(void *state)
{
	amqp_state *st = state;
	double		t0 = relay_now();
	const char *why = NULL;
	sink_result why_res = SINK_RETRY;
	int			w,
				r,
				i;

	for (w = 0; !why; w++)
	{
		int			nwave = 0,
					down = 0;

		for (r = 0; r < st->nruns && !down; r++)
		{
			sink_run   *run = &st->runs[r];
			amqp_slot  *sl;
			int			rc;

			if (run->res != SINK_OK || run->confirmed != w || w >= run->n)
				continue;
			sl = &st->slots[run->first + w];
			if ((rc = amqp_send(st, sl)) != AMQP_STATUS_OK)
			{
				run->res = SINK_DOWN;
				snprintf(run->err, sizeof(run->err), "basic.publish: %s", amqp_error_string2(rc));
				down = 1;
				break;
			}
			st->wave[nwave++] = sl;
		}
		if (nwave == 0 && !down)
			break;
		if (nwave > 0)
			amqp_await(st, st->wave, nwave);
		for (i = 0; i < nwave; i++)
		{
			amqp_slot  *sl = st->wave[i];
			sink_run   *run = &st->runs[sl->run];

			if (sl->res == SINK_OK)
			{
				run->confirmed++;
				continue;
			}
			run->res = sl->res;
			snprintf(run->err, sizeof(run->err), "%s", sl->err);
			if (sl->res == SINK_DOWN)
				down = 1;
		}
		why = sink_waves_stopped(down, t0, st->lease, &why_res);
	}
	if (why)
		sink_runs_fail_rest(st->runs, st->nruns, why_res, why);
}

static sink_result
amqp_recv_run(void *state, int *confirmed, char *err, size_t errlen)
{
	amqp_state *st = state;

	return sink_runs_recv(st, st->runs, st->nruns, &st->nread, &st->waved,
						  amqp_waves, amqp_reset, confirmed, err, errlen);
}

SINK_DEFINE_PIPELINED(sink_amqp, "amqp", "amqp://guest:guest@127.0.0.1:5672", "outbox.{aggregate_type}.{event_type}",
					  amqp_open_sink, amqp_publish, amqp_close_state, amqp_send_run, amqp_recv_run);
