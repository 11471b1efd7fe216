/*
 * sink_nats.c: publish each event to NATS JetStream (libnats) on the
 * subject --target (default "outbox.{aggregate_type}.{event_type}"), header
 * Nats-Msg-Id: the event id, and wait for the stream's publish ack (the
 * confirmation).  A stream must capture the subject (the relay creates
 * none).  Guarantee: a redelivery after a lost ack (relay killed, lease
 * lost) within the stream's duplicate window (2 minutes by default) is
 * dropped by the server, so consumers see each event once; after the
 * window, at least once.
 *
 * One connection, the library's own reconnection off (the relay reopens);
 * main thread only.  nats_link_open is source_nats.c's too.
 */
#include "relay.h"

#include <nats/nats.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void
nats_link_close(nats_link *l)
{
	if (l->js)
		jsCtx_Destroy(l->js);
	if (l->nc)
		natsConnection_Destroy(l->nc);
	if (l->opts)
		natsOptions_Destroy(l->opts);
	memset(l, 0, sizeof(*l));
}

int
nats_link_open(nats_link *l, const relay_config *cfg, char *err, size_t errlen)
{
	natsStatus	s;

	memset(l, 0, sizeof(*l));
	l->timeout_ms = (int64_t) (cfg->timeout * 1000);
	s = natsOptions_Create(&l->opts);
	if (s == NATS_OK)
		s = natsOptions_SetURL(l->opts, cfg->url);
	if (s == NATS_OK)
		s = natsOptions_SetTimeout(l->opts, l->timeout_ms);
	if (s == NATS_OK)
		s = natsOptions_SetAllowReconnect(l->opts, false);
	if (s == NATS_OK)
		s = natsConnection_Connect(&l->nc, l->opts);
	if (s == NATS_OK)
		s = natsConnection_JetStream(&l->js, l->nc, NULL);
	if (s != NATS_OK)
	{
		snprintf(err, errlen, "%s", natsStatus_GetText(s));
		nats_link_close(l);
		return -1;
	}
	return 0;
}

static void
nats_close(void *state)
{
	nats_link_close(state);
	free(state);
}

static int
nats_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	nats_link  *l = calloc(1, sizeof(*l));

	if (!l)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	if (nats_link_open(l, cfg, err, errlen) != 0)
	{
		free(l);
		return -1;
	}
	*state = l;
	return 0;
}

static sink_result
nats_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	nats_link  *st = state;
	natsMsg    *msg = NULL;
	jsPubAck   *pa = NULL;
	jsPubOptions po;
	jsErrCode	jerr = 0;
	natsStatus	s;

	s = natsMsg_Create(&msg, target, NULL, ev->json, (int) strlen(ev->json));
	if (s == NATS_OK)
		s = natsMsgHeader_Set(msg, "Nats-Msg-Id", ev->id);
	if (s == NATS_OK)
		s = natsMsgHeader_Set(msg, "Content-Type", "application/json");
	if (s == NATS_OK)
	{
		jsPubOptions_Init(&po);
		po.MaxWait = st->timeout_ms;
		s = js_PublishMsg(&pa, st->js, msg, &po, &jerr);
	}
	natsMsg_Destroy(msg);
	if (pa)
		jsPubAck_Destroy(pa);
	if (s == NATS_OK)
		return SINK_OK;
	snprintf(err, errlen, "%s%s (JetStream error %d)", natsStatus_GetText(s),
			 s == NATS_NO_RESPONDERS ? ": no stream captures the subject" : "", (int) jerr);
	/* an error the server gave for this message (too large, ...) is its own */
	if (jerr != 0 && s != NATS_TIMEOUT)
		return SINK_REJECT;
	if (s == NATS_CONNECTION_CLOSED || s == NATS_CONNECTION_DISCONNECTED || s == NATS_NO_SERVER ||
		s == NATS_IO_ERROR || s == NATS_STALE_CONNECTION)
		return SINK_DOWN;
	return SINK_RETRY;
}

SINK_DEFINE(sink_nats, "nats", "nats://127.0.0.1:4222", "outbox.{aggregate_type}.{event_type}",
			nats_open, nats_publish, NULL, nats_close);
