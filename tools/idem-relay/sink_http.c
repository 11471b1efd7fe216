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
 * One easy handle, reused (keep-alive); main thread only.
 */
#include "relay.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct http_state
{
	CURL	   *curl;
	char		body[512];		/* the start of the response, for errors */
	size_t		body_len;
} http_state;

static size_t
http_write(char *data, size_t size, size_t nmemb, void *arg)
{
	http_state *st = arg;
	size_t		n = size * nmemb;
	size_t		room = sizeof(st->body) - 1 - st->body_len;

	memcpy(st->body + st->body_len, data, n < room ? n : room);
	st->body_len += n < room ? n : room;
	st->body[st->body_len] = '\0';
	return n;
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
	if (!st || !(st->curl = curl_easy_init()))
	{
		free(st);
		snprintf(err, errlen, "curl_easy_init failed");
		return -1;
	}
	curl_easy_setopt(st->curl, CURLOPT_URL, cfg->url);
	curl_easy_setopt(st->curl, CURLOPT_POST, 1L);
	curl_easy_setopt(st->curl, CURLOPT_TIMEOUT_MS, (long) (cfg->timeout * 1000));
	curl_easy_setopt(st->curl, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(st->curl, CURLOPT_WRITEFUNCTION, http_write);
	curl_easy_setopt(st->curl, CURLOPT_WRITEDATA, st);
	curl_easy_setopt(st->curl, CURLOPT_USERAGENT, "idem-relay/" RELAY_VERSION);
	*state = st;
	return 0;
}

static sink_result
http_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	http_state *st = state;
	struct curl_slist *h = NULL;
	char		key[128];
	CURLcode	rc;
	long		status = 0;

	(void) target;
	snprintf(key, sizeof(key), "Idempotency-Key: %s", ev->id);
	h = curl_slist_append(h, "Content-Type: application/json");
	h = curl_slist_append(h, key);
	h = curl_slist_append(h, "Expect:");
	st->body_len = 0;
	st->body[0] = '\0';
	curl_easy_setopt(st->curl, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(st->curl, CURLOPT_POSTFIELDS, ev->json);
	curl_easy_setopt(st->curl, CURLOPT_POSTFIELDSIZE, (long) strlen(ev->json));
	rc = curl_easy_perform(st->curl);
	curl_slist_free_all(h);
	if (rc != CURLE_OK)
	{
		snprintf(err, errlen, "%s", curl_easy_strerror(rc));
		/* nothing reached the server: no try is spent */
		if (rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST)
			return SINK_DOWN;
		return SINK_RETRY;
	}
	curl_easy_getinfo(st->curl, CURLINFO_RESPONSE_CODE, &status);
	if (status >= 200 && status < 300)
		return SINK_OK;
	snprintf(err, errlen, "HTTP %ld: %s", status, st->body);
	if (status == 408 || status == 429 || status >= 500)
		return SINK_RETRY;
	return SINK_REJECT;
}

static void
http_close(void *state)
{
	http_state *st = state;

	curl_easy_cleanup(st->curl);
	free(st);
}

SINK_DEFINE(sink_http, "http", NULL, "",
			http_open, http_publish, NULL, http_close);
