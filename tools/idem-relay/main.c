/*
 * main.c: idem-relay's entry point: configuration (config.c), logs
 * (log.c), the metrics thread (metrics.c), the signal handlers, then the
 * outbound relay loop (outbox.c) with the sink --sink names, or with --in
 * the inbound loop (inbound.c) with that source; and the clock, sleep and
 * backoff the loops share.
 *
 * Signals: SIGTERM and SIGINT set relay_stopping (installed without
 * SA_RESTART, so a wait in select or nanosleep returns early); SIGPIPE is
 * ignored (a closed pipe or socket is an error return, not death).  Threads
 * of ours (metrics, webhooks) are started with both blocked
 * (relay_block_signals), so they reach the main thread.
 */
#include "relay.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

volatile int relay_stopping;

static void
on_stop(int sig)
{
	(void) sig;
	relay_stopping = 1;
}

double
relay_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
}

void
relay_sleep(double seconds)
{
	double		until = relay_now() + seconds;

	while (!relay_stopping)
	{
		double		left = until - relay_now();
		struct timespec ts;

		if (left <= 0)
			break;
		if (left > 0.1)
			left = 0.1;
		ts.tv_sec = (time_t) left;
		ts.tv_nsec = (long) ((left - (double) ts.tv_sec) * 1e9);
		nanosleep(&ts, NULL);
	}
}

double
relay_backoff(double b, double cap)
{
	return b * 2 > cap ? cap : b * 2;
}

int
relay_retry_done(relay_retry *r, int ok, enum metric m)
{
	if (r->backoff < 0.1)
		r->backoff = 0.1;
	if (!ok)
	{
		relay_sleep(r->backoff);
		r->backoff = relay_backoff(r->backoff, 10);
		return 0;
	}
	if (r->opened)
		metric_add(m, 1);
	r->opened = 1;
	r->backoff = 0.1;
	return 1;
}

void
relay_block_signals(sigset_t *old)
{
	sigset_t	block;

	sigemptyset(&block);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	pthread_sigmask(SIG_BLOCK, &block, old);
}

void
relay_restore_signals(const sigset_t *old)
{
	pthread_sigmask(SIG_SETMASK, old, NULL);
}

int
main(int argc, char **argv)
{
	relay_config cfg;
	struct sigaction sa;
	sigset_t	old;
	int			rc;

	config_load(&cfg, argc, argv);
	log_init(cfg.log_format, cfg.verbose);

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	if (*cfg.metrics_listen)
	{
		relay_block_signals(&old);
		rc = metrics_start(cfg.metrics_listen);
		relay_restore_signals(&old);
		if (rc != 0)
			return EXIT_CONFIG;
	}
	if (cfg.in)
		return inbound_run(&cfg, source_find(cfg.in));
	return outbox_run(&cfg, sink_find(cfg.sink));
}
