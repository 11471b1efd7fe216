/*
 * sink.c: the sinks compiled in (each sink_*.c is built only when
 * pkg-config found its library; stdout and sql, which needs only libpq,
 * always), lookup by name, and the
 * target template: {aggregate_type}, {event_type} and {aggregate_id}
 * replaced by the event's values, anything else kept as written; and
 * the bookkeeping of the sinks that publish a batch's runs in waves, and
 * the queue of the sinks that publish a batch's runs after copying them.
 *
 * No state: called from the main thread.
 */
#include "relay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const sink_ops *const sinks[] = {
	&sink_stdout,
	&sink_sql,
#ifdef HAVE_CURL
	&sink_http,
#endif
#ifdef HAVE_HIREDIS
	&sink_redis,
#endif
#ifdef HAVE_NATS
	&sink_nats,
#endif
#ifdef HAVE_RABBITMQ
	&sink_amqp,
#endif
};

#define N_SINKS (sizeof(sinks) / sizeof(sinks[0]))

const sink_ops *
sink_find(const char *name)
{
	size_t		i;

	for (i = 0; i < N_SINKS; i++)
		if (strcmp(sinks[i]->name, name) == 0)
			return sinks[i];
	return NULL;
}

const char *
sink_names(void)
{
	static char names[128];
	size_t		i;

	if (!names[0])
		for (i = 0; i < N_SINKS; i++)
		{
			if (i)
				strcat(names, " ");
			strcat(names, sinks[i]->name);
		}
	return names;
}

void
sink_expand(const char *tmpl, const relay_event *ev, char *out, size_t outlen)
{
	static const char *const names[] = {"{aggregate_type}", "{event_type}", "{aggregate_id}"};
	const char *values[3];
	size_t		len = 0;

	values[0] = ev->aggregate_type;
	values[1] = ev->event_type;
	values[2] = ev->aggregate_id;
	while (*tmpl && len + 1 < outlen)
	{
		int			k,
					hit = -1;

		for (k = 0; k < 3 && *tmpl == '{'; k++)
			if (strncmp(tmpl, names[k], strlen(names[k])) == 0)
				hit = k;
		if (hit >= 0)
		{
			size_t		n = strlen(values[hit]);

			if (n > outlen - 1 - len)
				n = outlen - 1 - len;
			memcpy(out + len, values[hit], n);
			len += n;
			tmpl += strlen(names[hit]);
		}
		else
			out[len++] = *tmpl++;
	}
	out[len] = '\0';
}

void
sink_runs_fail_rest(sink_run *runs, int nruns, sink_result res, const char *why)
{
	for (int r = 0; r < nruns; r++)
		if (runs[r].res == SINK_OK && runs[r].confirmed < runs[r].n)
		{
			runs[r].res = res;
			snprintf(runs[r].err, sizeof(runs[r].err), "%s", why);
		}
}

/*
 * Why a sink's waves stop with runs left (NULL: go on): the connection was
 * lost (down; *res becomes SINK_DOWN), SIGTERM, or a third of the lease has
 * gone since t0, so the batch is acked before its lease runs out.
 */
const char *
sink_waves_stopped(int down, double t0, double lease, sink_result *res)
{
	if (down)
	{
		*res = SINK_DOWN;
		return "not sent: the connection was lost";
	}
	if (relay_stopping)
		return "not sent: stopping";
	if (relay_now() - t0 > lease / 3)
		return "not sent in waves: a third of the lease has gone";
	return NULL;
}

sink_result
sink_runs_recv(void *state, sink_run *runs, int nruns, int *nread, int *waved,
			   void (*waves) (void *), void (*reset) (void *),
			   int *confirmed, char *err, size_t errlen)
{
	sink_run   *run;
	sink_result res;

	*confirmed = 0;
	if (*nread >= nruns)
	{
		snprintf(err, errlen, "no run was sent");
		return SINK_RETRY;
	}
	if (!*waved)
	{
		waves(state);
		*waved = 1;
	}
	run = &runs[(*nread)++];
	*confirmed = run->confirmed;
	res = run->res;
	if (res != SINK_OK)
		snprintf(err, errlen, "%s", run->err);
	if (*nread == nruns)
		reset(state);
	return res;
}

int
sink_queue_run(sink_queue *q, const relay_event *evs, int n, char *err, size_t errlen)
{
	sink_run   *run;

	if (q->nruns == q->runcap)
	{
		int			cap = q->runcap ? q->runcap * 2 : 64;
		sink_run   *r = realloc(q->runs, (size_t) cap * sizeof(*r));

		if (!r)
			goto oom;
		q->runs = r;
		q->runcap = cap;
	}
	if (q->nev + n > q->evcap)
	{
		int			cap = q->evcap ? q->evcap : 128;
		sink_queued *e;

		while (cap < q->nev + n)
			cap *= 2;
		e = realloc(q->evs, (size_t) cap * sizeof(*e));
		if (!e)
			goto oom;
		q->evs = e;
		q->evcap = cap;
	}
	for (int i = 0; i < n; i++)
	{
		sink_queued *e = &q->evs[q->nev + i];

		e->run = q->nruns;
		e->json = strdup(evs[i].json);
		e->id = strdup(evs[i].id);
		if (!e->json || !e->id)
		{
			for (int j = 0; j <= i; j++)
			{
				free(q->evs[q->nev + j].json);
				free(q->evs[q->nev + j].id);
			}
			goto oom;
		}
	}
	run = &q->runs[q->nruns++];
	memset(run, 0, sizeof(*run));
	run->first = q->nev;
	run->n = n;
	run->res = SINK_OK;
	q->nev += n;
	return 0;
oom:
	snprintf(err, errlen, "out of memory");
	return -1;
}

void
sink_queue_clear(sink_queue *q)
{
	for (int i = 0; i < q->nev; i++)
	{
		free(q->evs[i].json);
		free(q->evs[i].id);
	}
	q->nev = 0;
	q->nruns = 0;
}

void
sink_queue_free(sink_queue *q)
{
	sink_queue_clear(q);
	free(q->runs);
	free(q->evs);
	memset(q, 0, sizeof(*q));
}
