/*
 * sink_stdout.c: each event as one JSON line on stdout, written through a
 * 64 kB buffer that is flushed before the batch is acked (the flush is the
 * confirmation: a pipe reader that died makes it fail, and nothing of the
 * batch is acked).
 * Guarantee: at least once; a line written but not acked (the relay killed
 * between the write and the ack) is written again.
 *
 * Main thread only.
 */
#include "relay.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static int
stdout_open(void **state, const relay_config *cfg, char *err, size_t errlen)
{
	(void) cfg;
	(void) err;
	(void) errlen;
	static char buf[65536];

	*state = NULL;
	setvbuf(stdout, buf, _IOFBF, sizeof(buf));
	return 0;
}

static sink_result
stdout_publish(void *state, const relay_event *ev, const char *target, char *err, size_t errlen)
{
	(void) state;
	(void) target;
	if (fputs(ev->json, stdout) < 0 || fputc('\n', stdout) < 0)
	{
		snprintf(err, errlen, "cannot write to stdout: %s", strerror(errno));
		clearerr(stdout);
		return SINK_RETRY;
	}
	return SINK_OK;
}

static int
stdout_flush(void *state, char *err, size_t errlen)
{
	(void) state;
	if (fflush(stdout) != 0)
	{
		snprintf(err, errlen, "cannot write to stdout: %s", strerror(errno));
		clearerr(stdout);
		return -1;
	}
	return 0;
}

static void
stdout_close(void *state)
{
	(void) state;
	fflush(stdout);
}

SINK_DEFINE(sink_stdout, "stdout", "-", "",
			stdout_open, stdout_publish, stdout_flush, stdout_close);
