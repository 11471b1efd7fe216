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
 * Pipelined (send_run/recv_run): a batch goes in waves.  Wave k publishes
 * asynchronously the k-th event of every aggregate's run whose events
 * before it were all acked, then waits for all of the wave's acks (each
 * --timeout); so a batch costs about as many round trips as its longest
 * run, and one event per aggregate (the common shape) one round trip.  An
 * aggregate's event is never in flight before the one before it was acked:
 * a whole run published at once would not do, as JetStream stores event
 * k+1 even when k failed (too large, a server error), and consumers would
 * see k+1 without k.  A run stops at its first failure (mapped as the
 * one-at-a-time path maps it); a lost connection stops every run, and so do
 * SIGTERM and a third of the lease gone (what is left goes one at a time,
 * which extends the lease).  The waves run at the first recv_run; send_run
 * only builds the messages.
 *
 * One connection, the library's own reconnection off (the relay reopens);
 * main thread only, but for the ack handler of the asynchronous publishes,
 * which libnats runs on its reply subscription's thread: it touches only
 * the slots of the wave in flight, under nats_sink.mu, and the main thread
 * frees nothing it may touch before the library holds no pending publish
 * (nats_quiesce).  Each publish times out on its own after --timeout, but
 * the library settles nothing of a connection that closed: a wave's wait
 * ends at a backstop (--timeout + 1 s), and what is still pending then is
 * taken back from the library (logged), so its late acks find nothing.
 * nats_link_open is source_nats.c's too.
 */
#include "relay.h"

#include <nats/nats.h>
#include <pthread.h>
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

/*
 * send_asap: publishes written at once rather than by the library's flusher
 * thread, which waits a millisecond for more: the sink's waves wait for
 * their acks, so that millisecond would be every wave's
 */
static int
nats_link_connect(nats_link *l, const relay_config *cfg, int send_asap, char *err, size_t errlen)
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
	if (s == NATS_OK && send_asap)
		s = natsOptions_SetSendAsap(l->opts, true);
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

int
nats_link_open(nats_link *l, const relay_config *cfg, char *err, size_t errlen)
{
	return nats_link_connect(l, cfg, 0, err, errlen);
}

/* one event of the runs sent and not yet read */
typedef struct nats_slot
{
	natsMsg    *msg;			/* ours until published, then the library's */
	const void *sent;			/* msg's address once published: what the handler matches */
	int			run;			/* its run */
	int			done;			/* the handler (or a failed publish) settled it */
	natsStatus	status;
	jsErrCode	jerr;
	char		text[200];		/* the server's reason */
} nats_slot;

typedef struct nats_sink
{
	nats_link	link;			/* the one-at-a-time publishes use link.js */
	jsCtx	   *ajs;			/* the asynchronous ones: a context with the ack handler */
	pthread_mutex_t mu;			/* slots[wave[..]] and nwave, shared with the handler */
	nats_slot  *slots;
	int			nslots,
				slotcap;
	sink_run   *runs;
	int			nruns,
				runcap;
	int		   *wave;			/* the slots of the wave in flight (runcap long) */
	int			nwave;
	int			hint;			/* where the handler starts looking */
	int			nread;			/* runs recv_run returned */
	int			waved;			/* the waves of the runs queued ran */
	double		lease;
} nats_sink;

/*
 * The library's thread, for each asynchronous publish settled: an ack, an
 * error of the server, a timeout.  Acks come mostly in publish order, so
 * the search starts after the last slot found.
 */
static void
nats_ack_handler(jsCtx *js, natsMsg *msg, jsPubAck *pa, jsPubAckErr *pae, void *closure)
{
	nats_sink  *st = closure;
	int			k;

	(void) js;
	pthread_mutex_lock(&st->mu);
	for (k = 0; k < st->nwave; k++)
	{
		int			i = (st->hint + k) % st->nwave;
		nats_slot  *sl = &st->slots[st->wave[i]];

		if (sl->done || sl->sent != (const void *) msg)
			continue;
		sl->done = 1;
		sl->status = pa ? NATS_OK : pae ? pae->Err : NATS_ERR;
		sl->jerr = !pa && pae ? pae->ErrCode : 0;
		snprintf(sl->text, sizeof(sl->text), "%s", !pa && pae && pae->ErrText ? pae->ErrText : "");
		st->hint = i + 1;
		break;
	}
	pthread_mutex_unlock(&st->mu);
	natsMsg_Destroy(msg);
}

/*
 * Take back every publish still pending in the library (their acks, if
 * they come, are dropped) and wait for a handler that is running to
 * return: then the handler touches nothing more.  False if one is still
 * running after --timeout.
 */
static int
nats_quiesce(nats_sink *st)
{
	natsMsgList pending;
	jsPubOptions po;

	if (js_PublishAsyncGetPendingList(&pending, st->ajs) == NATS_OK)
		natsMsgList_Destroy(&pending);
	jsPubOptions_Init(&po);
	po.MaxWait = st->link.timeout_ms > 0 ? st->link.timeout_ms : 1000;
	return js_PublishAsyncComplete(st->ajs, &po) == NATS_OK;
}

/* drop the runs queued, the messages not published with them (void * for sink_runs_recv) */
static void
nats_reset(void *state)
{
	nats_sink  *st = state;
	int			i;

	for (i = 0; i < st->nslots; i++)
		natsMsg_Destroy(st->slots[i].msg);
	pthread_mutex_lock(&st->mu);
	st->nwave = 0;
	pthread_mutex_unlock(&st->mu);
	st->nslots = st->nruns = st->nread = st->waved = 0;
}

static void
nats_close(void *state)
{
	nats_sink  *st = state;

	/* a handler that would not return: leak the state rather than free it under it */
	if (st->ajs && !nats_quiesce(st))
	{
		log_msg(LOG_WARN, "nats: an ack handler is still running: leaving its memory", NULL);
		return;
	}
	nats_reset(st);
	if (st->ajs)
		jsCtx_Destroy(st->ajs);
	nats_link_close(&st->link);
	pthread_mutex_destroy(&st->mu);
	free(st->slots);
	free(st->runs);
	free(st->wave);
	free(st);
}

static int
nats_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	nats_sink  *st = calloc(1, sizeof(*st));
	jsOptions	jo;
	natsStatus	s;

	if (!st || pthread_mutex_init(&st->mu, NULL) != 0)
	{
		snprintf(err, errlen, "out of memory");
		free(st);
		return -1;
	}
	st->lease = cfg->lease;
	if (nats_link_connect(&st->link, cfg, 1, err, errlen) != 0)
	{
		pthread_mutex_destroy(&st->mu);
		free(st);
		return -1;
	}
	jsOptions_Init(&jo);
	jo.PublishAsync.AckHandler = nats_ack_handler;
	jo.PublishAsync.AckHandlerClosure = st;
	s = natsConnection_JetStream(&st->ajs, st->link.nc, &jo);
	if (s != NATS_OK)
	{
		snprintf(err, errlen, "%s", natsStatus_GetText(s));
		st->ajs = NULL;
		nats_close(st);
		return -1;
	}
	*state = st;
	return 0;
}

/*
 * A failed publish as a sink_result, its reason into err: an error the
 * server gave for this message (too large, ...) is its own; a lost
 * connection is the broker's; anything else (a timeout, no responders)
 * may pass.  A timeout on a connection that is no longer up is a lost one.
 */
static sink_result
nats_failure(natsConnection *nc, natsStatus s, jsErrCode jerr, const char *text,
			 char *err, size_t errlen)
{
	const char *st = natsStatus_GetText(s);
	int			say = text && *text && strcmp(text, st) != 0;

	snprintf(err, errlen, "%s%s%s%s (JetStream error %d)", st,
			 s == NATS_NO_RESPONDERS ? ": no stream captures the subject" : "",
			 say ? ": " : "", say ? text : "", (int) jerr);
	if (jerr != 0 && s != NATS_TIMEOUT)
		return SINK_REJECT;
	if (s == NATS_CONNECTION_CLOSED || s == NATS_CONNECTION_DISCONNECTED || s == NATS_NO_SERVER ||
		s == NATS_IO_ERROR || s == NATS_STALE_CONNECTION)
		return SINK_DOWN;
	if (s == NATS_TIMEOUT && nc && natsConnection_Status(nc) != NATS_CONN_STATUS_CONNECTED)
		return SINK_DOWN;
	return SINK_RETRY;
}

/* the message of one event: the JSON body, Nats-Msg-Id = the event id */
static natsStatus
nats_message(natsMsg **msg, const relay_event *ev, const char *target)
{
	natsStatus	s;

	*msg = NULL;
	s = natsMsg_Create(msg, target, NULL, ev->json, (int) strlen(ev->json));
	if (s == NATS_OK)
		s = natsMsgHeader_Set(*msg, "Nats-Msg-Id", ev->id);
	if (s == NATS_OK)
		s = natsMsgHeader_Set(*msg, "Content-Type", "application/json");
	if (s != NATS_OK)
	{
		natsMsg_Destroy(*msg);
		*msg = NULL;
	}
	return s;
}

static sink_result
nats_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	nats_sink  *st = state;
	natsMsg    *msg = NULL;
	jsPubAck   *pa = NULL;
	jsPubOptions po;
	jsErrCode	jerr = 0;
	natsStatus	s;

	s = nats_message(&msg, ev, target);
	if (s == NATS_OK)
	{
		jsPubOptions_Init(&po);
		po.MaxWait = st->link.timeout_ms;
		s = js_PublishMsg(&pa, st->link.js, msg, &po, &jerr);
	}
	natsMsg_Destroy(msg);
	if (pa)
		jsPubAck_Destroy(pa);
	if (s == NATS_OK)
		return SINK_OK;
	return nats_failure(NULL, s, jerr, NULL, err, errlen);
}

/* queue a run: its messages built, nothing sent (the waves send) */
static int
nats_send_run(void *state, const relay_event *evs, const char *const *targets, int n,
			  char *err, size_t errlen)
{
	nats_sink  *st = state;
	int			i;

	if (st->waved)
		nats_reset(st);			/* a new batch (the last one read to its end or dropped) */
	if (st->nslots + n > st->slotcap || st->nruns + 1 > st->runcap)
	{
		int			slotcap = st->slotcap,
					runcap = st->runcap;
		nats_slot  *slots;
		sink_run   *runs;
		int		   *wave;

		while (st->nslots + n > slotcap)
			slotcap = slotcap ? slotcap * 2 : 128;
		while (st->nruns + 1 > runcap)
			runcap = runcap ? runcap * 2 : 64;
		pthread_mutex_lock(&st->mu);
		slots = realloc(st->slots, (size_t) slotcap * sizeof(*slots));
		if (slots)
			st->slots = slots;
		runs = realloc(st->runs, (size_t) runcap * sizeof(*runs));
		if (runs)
			st->runs = runs;
		wave = realloc(st->wave, (size_t) runcap * sizeof(*wave));
		if (wave)
			st->wave = wave;
		if (slots && runs && wave)
		{
			st->slotcap = slotcap;
			st->runcap = runcap;
		}
		pthread_mutex_unlock(&st->mu);
		if (!slots || !runs || !wave)
		{
			snprintf(err, errlen, "out of memory");
			return -1;
		}
	}
	for (i = 0; i < n; i++)
	{
		nats_slot  *sl = &st->slots[st->nslots + i];
		natsStatus	s;

		memset(sl, 0, sizeof(*sl));
		sl->run = st->nruns;
		s = nats_message(&sl->msg, &evs[i], targets[i]);
		if (s != NATS_OK)
		{
			while (--i >= 0)
				natsMsg_Destroy(st->slots[st->nslots + i].msg);
			snprintf(err, errlen, "%s", natsStatus_GetText(s));
			return -1;
		}
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
nats_waves(void *state)
{
	nats_sink  *st = state;
	double		t0 = relay_now();
	jsPubOptions po,
				wait;
	const char *why = NULL;
	sink_result why_res = SINK_RETRY;
	int			w,
				r,
				i;

	jsPubOptions_Init(&po);
	po.MaxWait = st->link.timeout_ms;
	jsPubOptions_Init(&wait);
	/* each publish times out on its own after --timeout: this is a backstop */
	wait.MaxWait = st->link.timeout_ms + 1000;
	for (w = 0; !why; w++)
	{
		int			down = 0;

		for (r = 0; r < st->nruns; r++)
		{
			sink_run   *run = &st->runs[r];
			nats_slot  *sl;
			natsStatus	s;

			if (run->res != SINK_OK || run->confirmed != w || w >= run->n || down)
				continue;
			sl = &st->slots[run->first + w];
			pthread_mutex_lock(&st->mu);
			sl->sent = sl->msg;
			st->wave[st->nwave++] = run->first + w;
			pthread_mutex_unlock(&st->mu);
			s = js_PublishMsgAsync(st->ajs, &sl->msg, &po);
			if (s != NATS_OK)
			{
				/* not published: the message is still ours, the handler never sees it */
				pthread_mutex_lock(&st->mu);
				sl->done = 1;
				sl->status = s;
				pthread_mutex_unlock(&st->mu);
				if (nats_failure(st->link.nc, s, 0, NULL, run->err, sizeof(run->err)) == SINK_DOWN)
					down = 1;
			}
		}
		if (st->nwave == 0)
			break;
		if (js_PublishAsyncComplete(st->ajs, &wait) != NATS_OK)
		{
			log_msg(LOG_WARN, "nats: publishes still pending after the wave's wait: taken back", NULL);
			nats_quiesce(st);
		}
		pthread_mutex_lock(&st->mu);
		for (i = 0; i < st->nwave; i++)
		{
			nats_slot  *sl = &st->slots[st->wave[i]];
			sink_run   *run = &st->runs[sl->run];

			if (sl->done && sl->status == NATS_OK)
			{
				run->confirmed++;
				continue;
			}
			if (!sl->done)
				sl->status = NATS_TIMEOUT;	/* no answer, not even the library's timeout */
			run->res = nats_failure(st->link.nc, sl->status, sl->jerr, sl->text, run->err, sizeof(run->err));
			if (run->res == SINK_DOWN)
				down = 1;
		}
		st->nwave = 0;
		st->hint = 0;
		pthread_mutex_unlock(&st->mu);
		why = sink_waves_stopped(down, t0, st->lease, &why_res);
	}
	if (why)
		sink_runs_fail_rest(st->runs, st->nruns, why_res, why);
}

static sink_result
nats_recv_run(void *state, int *confirmed, char *err, size_t errlen)
{
	nats_sink *st = state;

	return sink_runs_recv(st, st->runs, st->nruns, &st->nread, &st->waved,
						  nats_waves, nats_reset, confirmed, err, errlen);
}

SINK_DEFINE_PIPELINED(sink_nats, "nats", "nats://127.0.0.1:4222", "outbox.{aggregate_type}.{event_type}",
					  nats_open, nats_publish, nats_close, nats_send_run, nats_recv_run);
