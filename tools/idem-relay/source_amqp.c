/*
 * source_amqp.c: a RabbitMQ queue consumer with manual acks (--url
 * amqp://USER:PASS@HOST:PORT/VHOST, queue --target, default "inbox"; the
 * queue must exist), prefetch --batch.  A message's body is the body; its
 * properties (message_id, correlation_id, type, content_type, app_id), the
 * routing key, the exchange and the string or integer entries of its
 * headers table are the headers (the default message id: message_id).
 *
 * Fetch: the first delivery waits up to --poll, the rest of the batch is
 * what already arrived.  Settle: basic.ack only after the commit; a message
 * that failed goes back to the queue (basic.nack, requeue); one that can
 * never be stored is rejected without requeue (to the queue's dead-letter
 * exchange, if it has one).  What was delivered and not acked when the
 * connection ends (the relay killed, the broker stopped) is requeued by
 * RabbitMQ.
 * Guarantee: at least once from RabbitMQ, each message stored once (a
 * redelivery is a duplicate for idem_inbox_receive); none lost: a message
 * leaves the queue only by the ack after its commit.
 *
 * One connection, channel 1 (amqp_connect_channel of sink_amqp.c); main
 * thread only.
 */
#include "relay.h"

#include <amqp.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

typedef struct amqp_source
{
	amqp_connection_state_t conn;
	const relay_config *cfg;
} amqp_source;

static void
as_close(void *state)
{
	amqp_source *st = state;

	amqp_disconnect(st->conn);
	free(st);
}

static int
as_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	amqp_source *st = calloc(1, sizeof(*st));
	amqp_rpc_reply_t r;

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->cfg = cfg;
	if (!(st->conn = amqp_connect_channel(cfg, 0, err, errlen)))
	{
		free(st);
		return -1;
	}
	amqp_basic_qos(st->conn, 1, 0, (uint16_t) (cfg->batch > 65535 ? 65535 : cfg->batch), 0);
	r = amqp_get_rpc_reply(st->conn);
	if (r.reply_type == AMQP_RESPONSE_NORMAL)
	{
		amqp_basic_consume(st->conn, 1, amqp_cstring_bytes(cfg->target), amqp_empty_bytes, 0, 0, 0,
						   amqp_empty_table);
		r = amqp_get_rpc_reply(st->conn);
	}
	if (r.reply_type != AMQP_RESPONSE_NORMAL)
	{
		snprintf(err, errlen, "basic.consume of queue \"%s\": %s", cfg->target,
				 r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION ? amqp_error_string2(r.library_error) :
				 "refused by the server (does the queue exist?)");
		as_close(st);
		return -1;
	}
	*state = st;
	return 0;
}

/* a header of msg from AMQP bytes */
static void
bytes_header(relay_message *m, const relay_config *cfg, const char *name, amqp_bytes_t v)
{
	msg_header(m, cfg, name, v.bytes ? v.bytes : "", v.len);
}

static void
envelope_message(relay_message *m, const relay_config *cfg, const amqp_envelope_t *env)
{
	const amqp_basic_properties_t *p = &env->message.properties;
	int			i;

	msg_set_body(m, env->message.body.bytes ? env->message.body.bytes : "", env->message.body.len);
	if (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG)
		bytes_header(m, cfg, "message_id", p->message_id);
	if (p->_flags & AMQP_BASIC_CORRELATION_ID_FLAG)
		bytes_header(m, cfg, "correlation_id", p->correlation_id);
	if (p->_flags & AMQP_BASIC_TYPE_FLAG)
		bytes_header(m, cfg, "type", p->type);
	if (p->_flags & AMQP_BASIC_CONTENT_TYPE_FLAG)
		bytes_header(m, cfg, "content_type", p->content_type);
	if (p->_flags & AMQP_BASIC_APP_ID_FLAG)
		bytes_header(m, cfg, "app_id", p->app_id);
	bytes_header(m, cfg, "routing_key", env->routing_key);
	bytes_header(m, cfg, "exchange", env->exchange);
	if (p->_flags & AMQP_BASIC_HEADERS_FLAG)
		for (i = 0; i < p->headers.num_entries; i++)
		{
			const amqp_table_entry_t *e = &p->headers.entries[i];
			char		name[256],
						num[32];

			snprintf(name, sizeof(name), "%.*s", (int) e->key.len, (const char *) e->key.bytes);
			switch (e->value.kind)
			{
				case AMQP_FIELD_KIND_UTF8:
				case AMQP_FIELD_KIND_BYTES:
					bytes_header(m, cfg, name, e->value.value.bytes);
					break;
				case AMQP_FIELD_KIND_I32:
					snprintf(num, sizeof(num), "%" PRId32, e->value.value.i32);
					msg_header(m, cfg, name, num, strlen(num));
					break;
				case AMQP_FIELD_KIND_I64:
				case AMQP_FIELD_KIND_TIMESTAMP:
					snprintf(num, sizeof(num), "%" PRId64, e->value.value.i64);
					msg_header(m, cfg, name, num, strlen(num));
					break;
				default:
					break;		/* tables, arrays, floats: not carried */
			}
		}
	snprintf(m->ref, sizeof(m->ref), "delivery %" PRIu64, (uint64_t) env->delivery_tag);
	m->handle = (void *) (uintptr_t) env->delivery_tag;
}

static int
as_fetch(void *state, relay_message *msgs, int max, double wait, char *err, size_t errlen)
{
	amqp_source *st = state;
	int			n = 0;

	amqp_maybe_release_buffers(st->conn);
	while (n < max)
	{
		amqp_envelope_t env;
		struct timeval tv = {0, 0};
		amqp_rpc_reply_t r;

		if (n == 0)
		{
			tv.tv_sec = (time_t) wait;
			tv.tv_usec = (suseconds_t) ((wait - (double) tv.tv_sec) * 1e6);
		}
		else if (!amqp_data_in_buffer(st->conn) && !amqp_frames_enqueued(st->conn))
			break;
		r = amqp_consume_message(st->conn, &env, &tv, 0);
		if (r.reply_type == AMQP_RESPONSE_NORMAL)
		{
			envelope_message(&msgs[n++], st->cfg, &env);
			amqp_destroy_envelope(&env);
			continue;
		}
		if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT)
			break;
		/* anything else (a closed channel or connection, a cancel): lost */
		if (n > 0)
			break;				/* settle these first; the next fetch sees it again */
		snprintf(err, errlen, "consume: %s", r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION ?
				 amqp_error_string2(r.library_error) : "the broker closed the channel");
		return -1;
	}
	return n;
}

static int
as_settle(void *state, relay_message *m, msg_outcome outcome, char *err, size_t errlen)
{
	amqp_source *st = state;
	uint64_t	tag = (uint64_t) (uintptr_t) m->handle;
	int			rc;

	if (outcome == MSG_STORED || outcome == MSG_DUPLICATE)
		rc = amqp_basic_ack(st->conn, 1, tag, 0);
	else if (outcome == MSG_REJECTED)
		rc = amqp_basic_reject(st->conn, 1, tag, 0);
	else
		rc = amqp_basic_nack(st->conn, 1, tag, 0, 1);
	m->handle = NULL;
	if (rc != AMQP_STATUS_OK)
	{
		snprintf(err, errlen, "%s", amqp_error_string2(rc));
		return -1;
	}
	return 0;
}

SOURCE_DEFINE(source_amqp, "amqp", "amqp://guest:guest@127.0.0.1:5672", "inbox", "header:message_id",
			  as_open, as_fetch, as_settle, as_close);
