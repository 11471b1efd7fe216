/*
 * main.c: idem-relay's entry point: configuration (config.c), logs
 * (log.c), the metrics thread (metrics.c), the signal handlers, then the
 * relay loop (outbox.c) with the sink --sink names.
 *
 * Signals: SIGTERM and SIGINT set relay_stopping (installed without
 * SA_RESTART, so a wait in select or nanosleep returns early); SIGPIPE is
 * ignored (a closed pipe or socket is an error return, not death).  The
 * metrics thread blocks both, so they reach the main thread.
 */
#include "relay.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void
on_stop(int sig)
{
	(void) sig;
	relay_stopping = 1;
}

int
main(int argc, char **argv)
{
	relay_config cfg;
	const sink_ops *sink;
	struct sigaction sa;
	sigset_t	block,
				old;
	int			rc;

	config_load(&cfg, argc, argv);
	log_init(cfg.log_format, cfg.verbose);
	sink = sink_find(cfg.sink);

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	if (*cfg.metrics_listen)
	{
		sigemptyset(&block);
		sigaddset(&block, SIGTERM);
		sigaddset(&block, SIGINT);
		pthread_sigmask(SIG_BLOCK, &block, &old);
		rc = metrics_start(cfg.metrics_listen);
		pthread_sigmask(SIG_SETMASK, &old, NULL);
		if (rc != 0)
			return EXIT_CONFIG;
	}
	return outbox_run(&cfg, sink);
}
