/*
 * sink_http.c: POST each event (the JSON object) to --url with libcurl,
 * header Idempotency-Key: the event id, so the receiver can drop a
 * redelivery.  2xx: confirmed.  408, 429, 5xx, a timeout (--timeout) or a
 * transport error: transient, tried again (a refused connection: tried
 * until the server is back).  Any other status (4xx, 3xx):
 * refused, nacked at once (dead-lettered after outbox_max_attempts).
 * Guarantee: at least once; exactly once in effect for a receiver that
 * dedupes on Idempotency-Key.
 *
 * One at a time (publish): one easy handle, reused (keep-alive).  With
 * --http-concurrency N > 1 a batch is pipelined (send_run/recv_run) in
 * waves, as the nats sink's: wave k POSTs the k-th event of every
 * aggregate's run whose events before it were all confirmed, at most N at
 * once on libcurl's multi interface, and ends when all of them answered
 * (each within --timeout).  So an aggregate never has two POSTs in flight
 * and its events arrive in seq order, as one at a time.  Each answer maps
 * as above; a run stops at its first failure; a refused connection stops
 * every run (the relay reopens the sink), and so do SIGTERM and a third of
 * the lease gone, checked before each POST starts (what is left goes one at
 * a time, which extends the lease): the waves end by then plus --timeout,
 * each POST's own limit.  The multi handle's connection cache
 * (at most N connections to the host) keeps connections across waves and
 * batches.  With N = 1 send_run declines: the batch goes one at a time.
 *
 * Main thread only.
 */
#include "relay.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* an easy handle and what its POST needs */
typedef struct http_conn
{
	CURL	   *curl;
	struct curl_slist *headers;
	char		body[512];		/* the start of the response, for errors */
	size_t		body_len;
	int			slot;			/* the event it is POSTing (pipelined), -1 = idle */
} http_conn;

typedef struct http_state
{
	http_conn	one;			/* the one-at-a-time path */
	const relay_config *cfg;
	int			concurrency;	/* --http-concurrency */
	/* pipelined: the multi handle and its easy handles (concurrency of them) */
	CURLM	   *multi;
	http_conn  *conns;
	sink_queue	q;				/* the runs queued, their events copied */
	int		   *wave;			/* the events of the wave being sent */
	int			wavecap;
	int			nread;			/* runs recv_run returned */
	int			waved;			/* the waves of the runs queued ran */
} http_state;

static size_t
http_write(char *data, size_t size, size_t nmemb, void *arg)
{
	http_conn  *c = arg;
	size_t		n = size * nmemb;
	size_t		room = sizeof(c->body) - 1 - c->body_len;

	memcpy(c->body + c->body_len, data, n < room ? n : room);
	c->body_len += n < room ? n : room;
	c->body[c->body_len] = '\0';
	return n;
}

/* an easy handle with what every POST shares; 0 or -1 */
static int
http_conn_init(http_conn *c, const relay_config *cfg)
{
	memset(c, 0, sizeof(*c));
	c->slot = -1;
	if (!(c->curl = curl_easy_init()))
		return -1;
	curl_easy_setopt(c->curl, CURLOPT_URL, cfg->url);
	curl_easy_setopt(c->curl, CURLOPT_POST, 1L);
	curl_easy_setopt(c->curl, CURLOPT_TIMEOUT_MS, (long) (cfg->timeout * 1000));
	curl_easy_setopt(c->curl, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(c->curl, CURLOPT_WRITEFUNCTION, http_write);
	curl_easy_setopt(c->curl, CURLOPT_WRITEDATA, c);
	/* a finished transfer of the multi handle names its http_conn */
	curl_easy_setopt(c->curl, CURLOPT_PRIVATE, c);
	curl_easy_setopt(c->curl, CURLOPT_USERAGENT, "idem-relay/" RELAY_VERSION);
	return 0;
}

/* set c up to POST json with Idempotency-Key id; 0 or -1 */
static int
http_conn_prepare(http_conn *c, const char *json, const char *id)
{
	char		key[128];

	curl_slist_free_all(c->headers);
	c->headers = NULL;
	snprintf(key, sizeof(key), "Idempotency-Key: %s", id);
	c->headers = curl_slist_append(c->headers, "Content-Type: application/json");
	if (c->headers)
		c->headers = curl_slist_append(c->headers, key);
	if (c->headers)
		c->headers = curl_slist_append(c->headers, "Expect:");
	if (!c->headers)
		return -1;
	c->body_len = 0;
	c->body[0] = '\0';
	curl_easy_setopt(c->curl, CURLOPT_HTTPHEADER, c->headers);
	curl_easy_setopt(c->curl, CURLOPT_POSTFIELDS, json);
	curl_easy_setopt(c->curl, CURLOPT_POSTFIELDSIZE, (long) strlen(json));
	return 0;
}

/* the outcome of c's POST that ended with rc (the banner's mapping) */
static sink_result
http_result(http_conn *c, CURLcode rc, char *err, size_t errlen)
{
	long		status = 0;

	curl_slist_free_all(c->headers);
	c->headers = NULL;
	if (rc != CURLE_OK)
	{
		snprintf(err, errlen, "%s", curl_easy_strerror(rc));
		/* nothing reached the server: no try is spent */
		if (rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST)
			return SINK_DOWN;
		return SINK_RETRY;
	}
	curl_easy_getinfo(c->curl, CURLINFO_RESPONSE_CODE, &status);
	if (status >= 200 && status < 300)
		return SINK_OK;
	snprintf(err, errlen, "HTTP %ld: %s", status, c->body);
	if (status == 408 || status == 429 || status >= 500)
		return SINK_RETRY;
	return SINK_REJECT;
}

/* forget the runs queued */
static void
http_reset(http_state *st)
{
	sink_queue_clear(&st->q);
	st->nread = st->waved = 0;
}

static void
http_close(void *state)
{
	http_state *st = state;

	http_reset(st);
	for (int i = 0; st->conns && i < st->concurrency; i++)
	{
		if (st->multi && st->conns[i].curl)
			curl_multi_remove_handle(st->multi, st->conns[i].curl);
		if (st->conns[i].curl)
			curl_easy_cleanup(st->conns[i].curl);
		curl_slist_free_all(st->conns[i].headers);
	}
	if (st->multi)
		curl_multi_cleanup(st->multi);
	if (st->one.curl)
		curl_easy_cleanup(st->one.curl);
	curl_slist_free_all(st->one.headers);
	free(st->conns);
	sink_queue_free(&st->q);
	free(st->wave);
	free(st);
}

static int
http_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	static int	global_done;
	http_state *st;

	if (!global_done)
	{
		if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0)
		{
			snprintf(err, errlen, "curl_global_init failed");
			return -1;
		}
		global_done = 1;
	}
	st = calloc(1, sizeof(*st));
	if (!st)
	{
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	st->cfg = cfg;
	st->concurrency = cfg->http_concurrency;
	if (http_conn_init(&st->one, cfg) != 0)
		goto fail;
	if (st->concurrency > 1)
	{
		st->conns = calloc((size_t) st->concurrency, sizeof(*st->conns));
		if (!st->conns || !(st->multi = curl_multi_init()))
			goto fail;
		curl_multi_setopt(st->multi, CURLMOPT_MAX_HOST_CONNECTIONS, (long) st->concurrency);
		curl_multi_setopt(st->multi, CURLMOPT_MAXCONNECTS, (long) st->concurrency);
		for (int i = 0; i < st->concurrency; i++)
			if (http_conn_init(&st->conns[i], cfg) != 0)
				goto fail;
	}
	*state = st;
	return 0;
fail:
	snprintf(err, errlen, "curl_easy_init or curl_multi_init failed");
	http_close(st);
	return -1;
}

static sink_result
http_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	http_state *st = state;

	(void) target;
	if (http_conn_prepare(&st->one, ev->json, ev->id) != 0)
	{
		snprintf(err, errlen, "out of memory");
		return SINK_RETRY;
	}
	return http_result(&st->one, curl_easy_perform(st->one.curl), err, errlen);
}

/* queue a run: its events copied, nothing sent (the waves send) */
static int
http_send_run(void *state, const relay_event *evs, const char *const *targets, int n,
			  char *err, size_t errlen)
{
	http_state *st = state;

	(void) targets;
	if (st->concurrency <= 1)
	{
		snprintf(err, errlen, "--http-concurrency 1: one POST at a time");
		return -1;
	}
	if (st->waved)
		http_reset(st);			/* a new batch (the last one read to its end or dropped) */
	return sink_queue_run(&st->q, evs, n, err, errlen);
}

/*
 * One wave: POST the nwave slots of st->wave, at most concurrency at once;
 * each answer settles its run (confirmed++, or res and err).  Stops
 * starting POSTs once *why is set (a refused connection sets it here, with
 * *why_res SINK_DOWN; SIGTERM or the deadline too); those not started fail
 * with the reason at the end of the waves.
 */
static void
http_wave(http_state *st, int nwave, double deadline, const char **why, sink_result *why_res)
{
	int			next = 0,
				active = 0;

	while (active > 0 || (next < nwave && !*why))
	{
		CURLMsg    *m;
		CURLMcode	mc;
		int			left,
					running;

		for (int c = 0; c < st->concurrency && next < nwave && !*why; c++)
		{
			http_conn  *hc = &st->conns[c];
			sink_queued *sl;

			if (hc->slot >= 0)
				continue;
			if (relay_stopping)
			{
				*why = "not sent: stopping";
				break;
			}
			if (relay_now() > deadline)
			{
				*why = "not sent in waves: a third of the lease has gone";
				break;
			}
			sl = &st->q.evs[st->wave[next]];
			if (http_conn_prepare(hc, sl->json, sl->id) != 0 ||
				curl_multi_add_handle(st->multi, hc->curl) != CURLM_OK)
			{
				sink_run   *run = &st->q.runs[sl->run];

				run->res = SINK_RETRY;
				snprintf(run->err, sizeof(run->err), "out of memory");
				next++;
				continue;
			}
			hc->slot = st->wave[next++];
			active++;
		}
		if (active == 0)
			break;
		mc = curl_multi_perform(st->multi, &running);
		if (mc != CURLM_OK)
		{
			/* the multi handle is unusable: what is in flight fails, nothing more starts */
			for (int c = 0; c < st->concurrency; c++)
			{
				http_conn  *hc = &st->conns[c];
				sink_run   *run;

				if (hc->slot < 0)
					continue;
				run = &st->q.runs[st->q.evs[hc->slot].run];
				run->res = SINK_RETRY;
				snprintf(run->err, sizeof(run->err), "%s", curl_multi_strerror(mc));
				curl_multi_remove_handle(st->multi, hc->curl);
				hc->slot = -1;
			}
			if (!*why)
				*why = "not sent: the multi handle failed";
			break;
		}
		while ((m = curl_multi_info_read(st->multi, &left)) != NULL)
		{
			char	   *priv = NULL;
			http_conn  *hc;
			sink_run   *run;

			if (m->msg != CURLMSG_DONE ||
				curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &priv) != CURLE_OK || !priv)
				continue;
			hc = (http_conn *) priv;
			if (hc->slot < 0)
				continue;
			run = &st->q.runs[st->q.evs[hc->slot].run];
			run->res = http_result(hc, m->data.result, run->err, sizeof(run->err));
			if (run->res == SINK_OK)
				run->confirmed++;
			else if (run->res == SINK_DOWN && !*why)
			{
				*why = "not sent: the receiver is unreachable";
				*why_res = SINK_DOWN;
			}
			curl_multi_remove_handle(st->multi, hc->curl);
			hc->slot = -1;
			active--;
		}
		if (active > 0 && running > 0)
			curl_multi_poll(st->multi, NULL, 0, 100, NULL);
	}
}

/* every run queued, in waves (the banner): each run's confirmed and res set */
static void
http_waves(void *state)
{
	http_state *st = state;
	double		deadline = relay_now() + st->cfg->lease / 3;
	const char *why = NULL;
	sink_result why_res = SINK_RETRY;

	/* a wave holds at most one event of each run */
	if (st->wavecap < st->q.nruns)
	{
		int		   *w = realloc(st->wave, (size_t) st->q.runcap * sizeof(*w));

		if (!w)
		{
			sink_runs_fail_rest(st->q.runs, st->q.nruns, SINK_RETRY, "out of memory");
			return;
		}
		st->wave = w;
		st->wavecap = st->q.runcap;
	}
	for (int w = 0; !why; w++)
	{
		int			nwave = 0;

		for (int r = 0; r < st->q.nruns; r++)
		{
			sink_run   *run = &st->q.runs[r];

			if (run->res == SINK_OK && run->confirmed == w && w < run->n)
				st->wave[nwave++] = run->first + w;
		}
		if (nwave == 0)
			break;
		http_wave(st, nwave, deadline, &why, &why_res);
	}
	if (why)
		sink_runs_fail_rest(st->q.runs, st->q.nruns, why_res, why);
}

static void
http_reset_of(void *state)
{
	http_reset(state);
}

static sink_result
http_recv_run(void *state, int *confirmed, char *err, size_t errlen)
{
	http_state *st = state;

	return sink_runs_recv(st, st->q.runs, st->q.nruns, &st->nread, &st->waved,
						  http_waves, http_reset_of, confirmed, err, errlen);
}

SINK_DEFINE_PIPELINED(sink_http, "http", NULL, "",
					  http_open, http_publish, http_close, http_send_run, http_recv_run);
