/*
 * metrics.c: idem-relay's counters and its Prometheus text endpoint
 * (--metrics-listen HOST:PORT; GET /metrics, anything else 404).
 *
 * Locking: the main thread adds to the counters, the histogram and the lag
 * gauge (source_http.c's request threads to the rejected counter); one thread of ours serves them, one connection at a time
 * (blocking, a 2-second receive timeout per client).  Every shared value is
 * a C11 atomic, updated and read with relaxed order: a scrape may see a
 * batch half counted, never a torn value.
 */
#include "relay.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static const char *const metric_names[M_COUNT][2] = {
	[M_PUBLISHED] = {"idem_relay_published_total", "events the sink confirmed"},
	[M_ACKED] = {"idem_relay_acked_total", "events idem_outbox_ack marked delivered"},
	[M_FAILED] = {"idem_relay_failed_total", "failed publishes (every try)"},
	[M_NACKED] = {"idem_relay_nacked_total", "events nacked (idem_outbox_nack)"},
	[M_DEAD_LETTERED] = {"idem_relay_dead_lettered_total", "events nacked at their last attempt (dead-lettered)"},
	[M_LEASES_LOST] = {"idem_relay_leases_lost_total", "batches whose lease was lost before the ack"},
	[M_DB_RECONNECTS] = {"idem_relay_db_reconnects_total", "database reconnections"},
	[M_SINK_RECONNECTS] = {"idem_relay_sink_reconnects_total", "sink reconnections"},
	[M_CLAIMS] = {"idem_relay_claims_total", "claims that returned events"},
	[M_IN_RECEIVED] = {"idem_relay_in_received_total", "inbound: messages taken from the source"},
	[M_IN_STORED] = {"idem_relay_in_stored_total", "inbound: messages idem_inbox_receive stored"},
	[M_IN_DUPLICATES] = {"idem_relay_in_duplicates_total", "inbound: messages received before (acked, not stored again)"},
	[M_IN_FAILED] = {"idem_relay_in_failed_total", "inbound: messages not stored this time (not acked: delivered again)"},
	[M_IN_REJECTED] = {"idem_relay_in_rejected_total", "inbound: messages that can never be stored (bad signature, no id, not JSON, IK001)"},
	[M_IN_SOURCE_RECONNECTS] = {"idem_relay_in_source_reconnects_total", "inbound: source reconnections"},
};

static _Atomic uint64_t counters[M_COUNT];

/* batch latency (claim to ack; inbound: fetched to settled), seconds */
static const double buckets[] = {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30};

#define N_BUCKETS (sizeof(buckets) / sizeof(buckets[0]))
static _Atomic uint64_t bucket_counts[N_BUCKETS];
static _Atomic uint64_t batch_count;
static _Atomic uint64_t batch_sum_us;
static _Atomic uint64_t lag_ms;

void
metric_add(enum metric m, uint64_t n)
{
	atomic_fetch_add_explicit(&counters[m], n, memory_order_relaxed);
}

void
metric_batch_seconds(double seconds)
{
	size_t		i;

	for (i = 0; i < N_BUCKETS; i++)
		if (seconds <= buckets[i])
			atomic_fetch_add_explicit(&bucket_counts[i], 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&batch_count, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&batch_sum_us, (uint64_t) (seconds * 1e6), memory_order_relaxed);
}

void
metric_lag_seconds(double seconds)
{
	atomic_store_explicit(&lag_ms, seconds > 0 ? (uint64_t) (seconds * 1000) : 0, memory_order_relaxed);
}

static size_t
render(char *buf, size_t cap)
{
	size_t		len = 0;
	size_t		i;

#define OUT(...) do { int n_ = snprintf(buf + len, cap - len, __VA_ARGS__); \
		if (n_ > 0 && (size_t) n_ < cap - len) len += (size_t) n_; } while (0)
	for (i = 0; i < M_COUNT; i++)
	{
		OUT("# HELP %s %s\n# TYPE %s counter\n%s %llu\n", metric_names[i][0], metric_names[i][1],
			metric_names[i][0], metric_names[i][0],
			(unsigned long long) atomic_load_explicit(&counters[i], memory_order_relaxed));
	}
	OUT("# HELP idem_relay_batch_seconds time from a claim to its ack (inbound: from the fetch to the last broker ack)\n"
		"# TYPE idem_relay_batch_seconds histogram\n");
	for (i = 0; i < N_BUCKETS; i++)
		OUT("idem_relay_batch_seconds_bucket{le=\"%g\"} %llu\n", buckets[i],
			(unsigned long long) atomic_load_explicit(&bucket_counts[i], memory_order_relaxed));
	OUT("idem_relay_batch_seconds_bucket{le=\"+Inf\"} %llu\n",
		(unsigned long long) atomic_load_explicit(&batch_count, memory_order_relaxed));
	OUT("idem_relay_batch_seconds_sum %.6f\n",
		(double) atomic_load_explicit(&batch_sum_us, memory_order_relaxed) / 1e6);
	OUT("idem_relay_batch_seconds_count %llu\n",
		(unsigned long long) atomic_load_explicit(&batch_count, memory_order_relaxed));
	OUT("# HELP idem_relay_lag_seconds age of the oldest event of the last batch when claimed\n"
		"# TYPE idem_relay_lag_seconds gauge\nidem_relay_lag_seconds %.3f\n",
		(double) atomic_load_explicit(&lag_ms, memory_order_relaxed) / 1000.0);
#undef OUT
	return len;
}

static void *
serve(void *arg)
{
	int			lfd = (int) (intptr_t) arg;

	for (;;)
	{
		int			fd = accept(lfd, NULL, NULL);
		char		req[2048];
		char		body[16384];
		char		head[256];
		ssize_t		n;
		size_t		got = 0;
		size_t		blen;
		struct timeval tv = {2, 0};

		if (fd < 0)
			continue;
		setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
		/* read the request head (up to the blank line, or what fits) */
		while (got < sizeof(req) - 1 && (n = recv(fd, req + got, sizeof(req) - 1 - got, 0)) > 0)
		{
			got += (size_t) n;
			req[got] = '\0';
			if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n"))
				break;
		}
		req[got] = '\0';
		if (strncmp(req, "GET /metrics ", 13) == 0 || strncmp(req, "GET /metrics?", 13) == 0)
		{
			blen = render(body, sizeof(body));
			snprintf(head, sizeof(head),
					 "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
					 "Content-Length: %zu\r\nConnection: close\r\n\r\n", blen);
		}
		else
		{
			blen = (size_t) snprintf(body, sizeof(body), "not found: GET /metrics\n");
			snprintf(head, sizeof(head),
					 "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n"
					 "Content-Length: %zu\r\nConnection: close\r\n\r\n", blen);
		}
		if (send(fd, head, strlen(head), MSG_NOSIGNAL) > 0)
			(void) send(fd, body, blen, MSG_NOSIGNAL);
		close(fd);
	}
	return NULL;
}

int
metrics_start(const char *listen_at)
{
	char		host[256];
	const char *colon = strrchr(listen_at, ':');
	struct addrinfo hints,
			   *ai = NULL;
	int			fd,
				one = 1,
				rc;
	pthread_t	th;

	snprintf(host, sizeof(host), "%.*s", (int) (colon - listen_at), listen_at);
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	hints.ai_flags = AI_PASSIVE;
	rc = getaddrinfo(*host ? host : NULL, colon + 1, &hints, &ai);
	if (rc != 0)
	{
		log_msg(LOG_ERROR, "cannot resolve --metrics-listen", "address", listen_at,
				"error", gai_strerror(rc), NULL);
		return -1;
	}
	fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
		bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 16) < 0)
	{
		log_msg(LOG_ERROR, "cannot listen on --metrics-listen", "address", listen_at,
				"error", strerror(errno), NULL);
		freeaddrinfo(ai);
		if (fd >= 0)
			close(fd);
		return -1;
	}
	freeaddrinfo(ai);
	if (pthread_create(&th, NULL, serve, (void *) (intptr_t) fd) != 0)
	{
		close(fd);
		return -1;
	}
	pthread_detach(th);
	log_msg(LOG_INFO, "serving metrics", "address", listen_at, NULL);
	return 0;
}
