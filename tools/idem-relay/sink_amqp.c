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

typedef struct amqp_state
{
	amqp_connection_state_t conn;
	const char *exchange;
	struct timeval timeout;
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

	amqp_disconnect(st->conn);
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
	if (!(st->conn = amqp_connect_channel(cfg, 1, err, errlen)))
	{
		free(st);
		return -1;
	}
	*state = st;
	return 0;
}

static sink_result
amqp_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	amqp_state *st = state;
	amqp_basic_properties_t props;
	int			rc,
				returned = 0;

	memset(&props, 0, sizeof(props));
	props._flags = AMQP_BASIC_CONTENT_TYPE_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
		AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_TYPE_FLAG;
	props.content_type = amqp_cstring_bytes("application/json");
	props.delivery_mode = 2;
	props.message_id = amqp_cstring_bytes(ev->id);
	props.type = amqp_cstring_bytes(ev->event_type);
	rc = amqp_basic_publish(st->conn, 1, amqp_cstring_bytes(st->exchange), amqp_cstring_bytes(target),
							1, 0, &props, amqp_cstring_bytes(ev->json));
	if (rc != AMQP_STATUS_OK)
	{
		snprintf(err, errlen, "basic.publish: %s", amqp_error_string2(rc));
		return SINK_DOWN;
	}
	/* frames until the confirm: a basic.return (unroutable) comes first */
	for (;;)
	{
		amqp_frame_t frame;
		struct timeval tv = st->timeout;

		rc = amqp_simple_wait_frame_noblock(st->conn, &frame, &tv);
		if (rc != AMQP_STATUS_OK)
		{
			snprintf(err, errlen, "waiting for the confirm: %s", amqp_error_string2(rc));
			return rc == AMQP_STATUS_TIMEOUT ? SINK_RETRY : SINK_DOWN;
		}
		if (frame.frame_type != AMQP_FRAME_METHOD)
			continue;			/* the returned message's header and body */
		switch (frame.payload.method.id)
		{
			case AMQP_BASIC_RETURN_METHOD:
				returned = 1;
				break;
			case AMQP_BASIC_ACK_METHOD:
				if (returned)
				{
					snprintf(err, errlen, "unroutable: no queue is bound to routing key \"%s\"", target);
					return SINK_REJECT;
				}
				return SINK_OK;
			case AMQP_BASIC_NACK_METHOD:
				snprintf(err, errlen, "the broker nacked the message");
				return SINK_RETRY;
			case AMQP_CHANNEL_CLOSE_METHOD:
			case AMQP_CONNECTION_CLOSE_METHOD:
				snprintf(err, errlen, "the broker closed the channel");
				return SINK_DOWN;
			default:
				break;
		}
	}
}

SINK_DEFINE(sink_amqp, "amqp", "amqp://guest:guest@127.0.0.1:5672", "outbox.{aggregate_type}.{event_type}",
			amqp_open_sink, amqp_publish, NULL, amqp_close_state);
