/*
 * source_nats.c: a NATS JetStream durable pull consumer (--url
 * nats://HOST:PORT, stream --target, default "INBOX"; consumer --group,
 * default "idem-relay").  The consumer is created if it does not exist
 * (explicit acks, AckWait --lease), then bound to: it outlives the relay,
 * so a restart goes on where the last one acked.  A message's body is the
 * body, its headers the headers (the default message id: Nats-Msg-Id).
 *
 * Fetch: up to --batch messages, waiting up to --poll.  Settle: an ack
 * (natsMsg_Ack) only after the commit; a message that failed is nak'ed
 * with a 1-second delay; one that can never be stored is terminated
 * (natsMsg_Term: the server stops delivering it).  A message fetched and
 * not acked (the relay killed) is delivered again after AckWait.
 * Guarantee: at least once from JetStream, each message stored once (a
 * redelivery, or a lost ack, is a duplicate for idem_inbox_receive); none
 * lost: the server keeps a message until the ack that follows its commit.
 *
 * One connection (nats_link_open of sink_nats.c); main thread only.
 */
#include "relay.h"

#include <nats/nats.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct nats_source
{
	nats_link	link;
	natsSubscription *sub;
	const relay_config *cfg;
} nats_source;

static void
ns_close(void *state)
{
	nats_source *st = state;

	if (st->sub)
		natsSubscription_Destroy(st->sub);
	nats_link_close(&st->link);
	free(st);
}

static int
ns_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	nats_source *st = calloc(1, sizeof(*st));
	jsConsumerConfig cc;
	jsConsumerInfo *ci = NULL;
	jsSubOptions so;
	jsErrCode	jerr = 0;
	natsStatus	s;

	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->cfg = cfg;
	if (nats_link_open(&st->link, cfg, err, errlen) != 0)
	{
		free(st);
		return -1;
	}
	/* the durable consumer: looked up, created if missing */
	s = js_GetConsumerInfo(&ci, st->link.js, cfg->target, cfg->group, NULL, &jerr);
	if (s == NATS_NOT_FOUND)
	{
		jsConsumerConfig_Init(&cc);
		cc.Durable = cfg->group;
		cc.AckPolicy = js_AckExplicit;
		cc.AckWait = (int64_t) (cfg->lease * 1e9);
		cc.MaxAckPending = cfg->batch * 10;
		s = js_AddConsumer(&ci, st->link.js, cfg->target, &cc, NULL, &jerr);
	}
	if (ci)
		jsConsumerInfo_Destroy(ci);
	if (s == NATS_OK)
	{
		jsSubOptions_Init(&so);
		so.Stream = cfg->target;
		so.Consumer = cfg->group;
		s = js_PullSubscribe(&st->sub, st->link.js, NULL, cfg->group, NULL, &so, &jerr);
	}
	if (s != NATS_OK)
	{
		snprintf(err, errlen, "consumer %s of stream %s: %s (JetStream error %d)", cfg->group,
				 cfg->target, natsStatus_GetText(s), (int) jerr);
		ns_close(st);
		return -1;
	}
	*state = st;
	return 0;
}

static int
ns_fetch(void *state, relay_message *msgs, int max, double wait, char *err, size_t errlen)
{
	nats_source *st = state;
	natsMsgList list = {0};
	jsErrCode	jerr = 0;
	natsStatus	s;
	int			i,
				n = 0;

	s = natsSubscription_Fetch(&list, st->sub, max, (int64_t) (wait * 1000) + 1, &jerr);
	if (s == NATS_TIMEOUT && list.Count == 0)
		return 0;
	if (s != NATS_OK && list.Count == 0)
	{
		snprintf(err, errlen, "fetch: %s (JetStream error %d)", natsStatus_GetText(s), (int) jerr);
		return -1;
	}
	for (i = 0; i < list.Count && n < max; i++)
	{
		natsMsg    *msg = list.Msgs[i];
		relay_message *m = &msgs[n++];
		const char **keys = NULL;
		jsMsgMetaData *md = NULL;
		int			nkeys = 0,
					k;

		msg_set_body(m, natsMsg_GetData(msg), (size_t) natsMsg_GetDataLength(msg));
		if (natsMsgHeader_Keys(msg, &keys, &nkeys) == NATS_OK)
		{
			for (k = 0; k < nkeys; k++)
			{
				const char *v = NULL;

				if (natsMsgHeader_Get(msg, keys[k], &v) == NATS_OK && v)
					msg_header(m, st->cfg, keys[k], v, strlen(v));
			}
			free((void *) keys);
		}
		msg_header(m, st->cfg, "subject", natsMsg_GetSubject(msg), strlen(natsMsg_GetSubject(msg)));
		if (natsMsg_GetMetaData(&md, msg) == NATS_OK)
		{
			snprintf(m->ref, sizeof(m->ref), "stream seq %llu", (unsigned long long) md->Sequence.Stream);
			jsMsgMetaData_Destroy(md);
		}
		m->handle = msg;
		list.Msgs[i] = NULL;	/* ours now: settle destroys it */
	}
	natsMsgList_Destroy(&list);
	return n;
}

static int
ns_settle(void *state, relay_message *m, msg_outcome outcome, char *err, size_t errlen)
{
	natsMsg    *msg = m->handle;
	natsStatus	s;

	(void) state;
	if (outcome == MSG_STORED || outcome == MSG_DUPLICATE)
		s = natsMsg_Ack(msg, NULL);
	else if (outcome == MSG_REJECTED)
		s = natsMsg_Term(msg, NULL);
	else
		s = natsMsg_NakWithDelay(msg, 1000, NULL);
	natsMsg_Destroy(msg);
	m->handle = NULL;
	if (s != NATS_OK)
	{
		snprintf(err, errlen, "%s", natsStatus_GetText(s));
		return -1;
	}
	return 0;
}

SOURCE_DEFINE(source_nats, "nats", "nats://127.0.0.1:4222", "INBOX", "header:Nats-Msg-Id",
			  ns_open, ns_fetch, ns_settle, ns_close);
