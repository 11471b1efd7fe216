/*
 * config.c: idem-relay's configuration, from (lowest first) the defaults, a
 * file (--config FILE or IDEM_RELAY_CONFIG: "name = value" lines, # starts
 * a comment), the environment (IDEM_RELAY_<NAME>, dashes as underscores)
 * and the command line (--name value, --name=value, or a short flag).
 * Every option has the same name in all three.  Bad configuration prints
 * one line on stderr and exits 2 (EXIT_CONFIG).
 *
 * Runs once, in the main thread, before anything else starts.  The strings
 * it stores are never freed (they live as long as the process).
 */
#include "relay.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum opt_kind
{
	O_STRING, O_INT, O_SECONDS, O_FLAG
} opt_kind;

typedef struct option_def
{
	const char *name;
	char		short_flag;
	opt_kind	kind;
	size_t		offset;
	const char *arg;
	const char *help;
} option_def;

#define OFF(f) offsetof(relay_config, f)

static const option_def options[] = {
	{"dbname", 'd', O_STRING, OFF(dbname), "CONNINFO",
	"database name or libpq connection string (default: libpq's PG* variables)"},
	{"sink", 's', O_STRING, OFF(sink), "NAME", "where events go: stdout (default), sql, http, redis, nats, amqp"},
	{"url", 'u', O_STRING, OFF(url), "URL",
	"the sink's address (sql: a libpq connection string, - for --dbname; http: the webhook; redis://HOST:PORT; nats://HOST:PORT; amqp://USER:PASS@HOST:PORT/VHOST)"},
	{"target", 'T', O_STRING, OFF(target), "TEMPLATE",
	"subject (nats), stream (redis) or routing key (amqp) from {aggregate_type} {event_type} {aggregate_id}"},
	{"exchange", 0, O_STRING, OFF(exchange), "NAME", "amqp: the exchange to publish to (default: the default exchange)"},
	{"sql", 0, O_STRING, OFF(sql), "STATEMENT",
	"sql: the statement run per event on the sink's connection, $1 the event as JSON, $2 its id"},
	{"sql-commit", 0, O_STRING, OFF(sql_commit), "batch|event",
	"sql: one transaction per batch (default; a failed one goes again event by event) or per event"},
	{"http-concurrency", 0, O_INT, OFF(http_concurrency), "N",
	"http: POSTs of a batch in flight at once, never two of one aggregate (default 1: one at a time)"},
	{"types", 't', O_STRING, OFF(types), "LIST", "comma-separated aggregate types to take (default: all)"},
	{"subscription", 0, O_STRING, OFF(subscription), "NAME",
	"the outbox subscription to deliver (default: default); one relay process per subscription and sink"},
	{"batch", 'b', O_INT, OFF(batch), "N", "events per claim (default 100)"},
	{"prefetch", 0, O_INT, OFF(prefetch), "0|1",
	"1 (default): claim the next batch and ack the last while this one is published; 0: claim, publish, ack in series"},
	{"lease", 'l', O_SECONDS, OFF(lease), "SECONDS", "lease of a claim, extended while a slow sink works (default 30)"},
	{"poll", 'p', O_SECONDS, OFF(poll), "SECONDS", "claim again after this long when idle (default 1)"},
	{"listen", 'L', O_FLAG, OFF(listen), NULL, "LISTEN idempotency_outbox: claim as soon as an emit commits"},
	{"notify-window", 0, O_SECONDS, OFF(notify_window), "SECONDS",
	"with --listen, claim once more this long after each notification, or the session's idempotency.outbox_notify_window if longer (emitters' outbox_notify = coalesce; default 0.02, 0: never)"},
	{"timeout", 0, O_SECONDS, OFF(timeout), "SECONDS", "limit of one publish (default 10)"},
	{"retries", 0, O_INT, OFF(retries), "N",
	"tries of a transiently failing publish (5xx, timeout, lost connection) before a nack (default 5)"},
	{"retry-max", 0, O_SECONDS, OFF(retry_max), "SECONDS", "cap of the backoff between those tries (default 5)"},
	{"nack-retry-after", 0, O_SECONDS, OFF(nack_retry_after), "SECONDS",
	"retry_after of a nack (default: the extension's backoff, 1 s doubling to 1 h)"},
	{"metrics-listen", 'm', O_STRING, OFF(metrics_listen), "HOST:PORT", "serve Prometheus metrics on http://HOST:PORT/metrics"},
	{"log-format", 0, O_STRING, OFF(log_format), "FORMAT", "logfmt (default) or json, on stderr"},
	{"once", '1', O_FLAG, OFF(once), NULL, "exit when a claim returns nothing"},
	{"verbose", 'v', O_FLAG, OFF(verbose), NULL, "log every batch"},
	/* inbound: --in SOURCE and what only it reads */
	{"in", 'i', O_STRING, OFF(in), "SOURCE",
	"inbound: store messages of SOURCE (http, redis, nats, amqp) in the inbox instead"},
	{"source", 0, O_STRING, OFF(source), "NAME", "inbound: the inbox source name (default: the --in name); with {source} in --url of --in http, the names allowed there, comma-separated"},
	{"message-id", 0, O_STRING, OFF(message_id), "SPEC",
	"inbound: header:NAME or json:/POINTER (default per source: header:Idempotency-Key, header:id, header:Nats-Msg-Id, header:message_id)"},
	{"ordering-key", 0, O_STRING, OFF(ordering_key), "SPEC", "inbound: header:NAME or json:/POINTER (default: none)"},
	{"group", 0, O_STRING, OFF(group), "NAME", "inbound: redis consumer group, nats durable consumer (default idem-relay)"},
	{"consumer", 0, O_STRING, OFF(consumer), "NAME", "inbound: redis consumer name (default idem-relay)"},
	{"hmac-secret", 0, O_STRING, OFF(hmac_secret), "SECRET", "inbound http: check an HMAC-SHA256 signature with this key"},
	{"hmac-format", 0, O_STRING, OFF(hmac_format), "FORMAT",
	"inbound http: hex (\"[sha256=]HEX\" of the body, default) or stripe (\"t=TS,v1=HEX\" of \"TS.body\")"},
	{"hmac-header", 0, O_STRING, OFF(hmac_header), "NAME",
	"inbound http: the signature's header (default X-Hub-Signature-256, or Stripe-Signature)"},
	{"hmac-tolerance", 0, O_SECONDS, OFF(hmac_tolerance), "SECONDS",
	"inbound http, stripe: how old a signature's timestamp may be (default 300)"},
};

#define N_OPTIONS (sizeof(options) / sizeof(options[0]))

static void
usage(FILE *out)
{
	size_t		i;

	fprintf(out,
			"Usage: idem-relay [OPTION]...            outbox events to a broker (--sink)\n"
			"       idem-relay --in SOURCE [OPTION]...  broker messages into the inbox\n"
			"Out: lease a batch of outbox events, publish each aggregate's events in seq\n"
			"order, ack what the broker confirmed.  In: take a batch of messages, store\n"
			"them with idem_inbox_receive in one transaction, ack each to the broker (or\n"
			"answer the webhook 2xx) only after the commit (doc/relay.md).\n\n");
	for (i = 0; i < N_OPTIONS; i++)
	{
		char		flag[64];

		snprintf(flag, sizeof(flag), "%s%c%s--%s%s%s",
				 options[i].short_flag ? "-" : "",
				 options[i].short_flag ? options[i].short_flag : ' ',
				 options[i].short_flag ? ", " : "  ",
				 options[i].name, options[i].arg ? " " : "",
				 options[i].arg ? options[i].arg : "");
		fprintf(out, "  %-30s %s\n", flag + (options[i].short_flag ? 0 : 1), options[i].help);
	}
	fprintf(out,
			"  -c, --config FILE              read \"name = value\" lines (IDEM_RELAY_CONFIG)\n"
			"  -h, --help                     this text\n"
			"  -V, --version\n\n"
			"Every option is also a variable IDEM_RELAY_<NAME> (dashes as underscores, a\n"
			"flag is 1 or 0) and a line of the file; the command line wins, then the\n"
			"environment, then the file.\n\n"
			"Sinks compiled in: %s\n"
			"Sources compiled in: %s\n\n"
			"SIGTERM or SIGINT: finish the event in hand, ack what was published, give\n"
			"the rest back (claimable at once), exit 0\n"
			"(inbound: store the batch in hand, ack it, answer waiting webhooks 503).\n"
			"Exit status: 0 stopped (or --once found nothing more), 1 --once and the\n"
			"database failed, 2 bad configuration.\n",
			sink_names(), source_names());
}

static void
config_error(const char *fmt, const char *a, const char *b)
{
	fprintf(stderr, "idem-relay: ");
	fprintf(stderr, fmt, a, b);
	fprintf(stderr, "\nTry \"idem-relay --help\" for more information.\n");
	exit(EXIT_CONFIG);
}

static const option_def *
find_long(const char *name, size_t len)
{
	size_t		i;

	for (i = 0; i < N_OPTIONS; i++)
		if (strlen(options[i].name) == len && strncmp(options[i].name, name, len) == 0)
			return &options[i];
	return NULL;
}

static const option_def *
find_short(char c)
{
	size_t		i;

	for (i = 0; i < N_OPTIONS; i++)
		if (options[i].short_flag == c)
			return &options[i];
	return NULL;
}

/* set option o from text value, given by source (for messages) */
static void
set_option(relay_config *cfg, const option_def *o, const char *value, const char *source)
{
	char	   *base = (char *) cfg + o->offset;
	char	   *end;

	switch (o->kind)
	{
		case O_STRING:
			*(const char **) base = strdup(value);
			break;
		case O_INT:
			{
				long		v;

				errno = 0;
				v = strtol(value, &end, 10);
				if (errno || end == value || *end || v < 0 || v > 1000000)
					config_error("invalid value \"%s\" for %s: an integer from 0 to 1000000 is expected",
								 value, source);
				*(int *) base = (int) v;
				break;
			}
		case O_SECONDS:
			{
				double		v;

				errno = 0;
				v = strtod(value, &end);
				if (errno || end == value || *end || !(v >= 0) || v > 86400.0)
					config_error("invalid value \"%s\" for %s: a number of seconds from 0 to 86400 is expected",
								 value, source);
				*(double *) base = v;
				break;
			}
		case O_FLAG:
			if (strcmp(value, "1") == 0 || strcmp(value, "true") == 0 ||
				strcmp(value, "on") == 0 || strcmp(value, "yes") == 0)
				*(int *) base = 1;
			else if (strcmp(value, "0") == 0 || strcmp(value, "false") == 0 ||
					 strcmp(value, "off") == 0 || strcmp(value, "no") == 0)
				*(int *) base = 0;
			else
				config_error("invalid value \"%s\" for %s: 1 or 0 is expected", value, source);
			break;
	}
}

static char *
trim(char *s)
{
	char	   *e;

	while (isspace((unsigned char) *s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char) e[-1]))
		*--e = '\0';
	return s;
}

static void
load_file(relay_config *cfg, const char *path)
{
	FILE	   *f = fopen(path, "r");
	char		line[4096];
	int			lineno = 0;

	if (!f)
		config_error("could not open configuration file \"%s\": %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f))
	{
		char	   *s,
				   *eq,
				   *name,
				   *value;
		const option_def *o;
		char		where[300];

		lineno++;
		s = trim(line);
		if (*s == '\0' || *s == '#')
			continue;
		eq = strchr(s, '=');
		snprintf(where, sizeof(where), "%s line %d", path, lineno);
		if (!eq)
			config_error("%s: \"name = value\" expected", where, NULL);
		*eq = '\0';
		name = trim(s);
		value = trim(eq + 1);
		o = find_long(name, strlen(name));
		if (!o)
			config_error("unknown option \"%s\" in %s", name, where);
		set_option(cfg, o, value, where);
	}
	fclose(f);
}

static void
load_env(relay_config *cfg)
{
	size_t		i;

	for (i = 0; i < N_OPTIONS; i++)
	{
		char		var[64];
		const char *v;
		size_t		j;

		snprintf(var, sizeof(var), "IDEM_RELAY_%s", options[i].name);
		for (j = 0; var[j]; j++)
			var[j] = var[j] == '-' ? '_' : (char) toupper((unsigned char) var[j]);
		v = getenv(var);
		if (v)
			set_option(cfg, &options[i], v, var);
	}
}

/* the options of --in SOURCE; cfg->in is set */
static void
check_inbound(relay_config *cfg, int sink_given)
{
	const source_ops *src = source_find(cfg->in);
	const char *specs[2];
	int			i;

	if (!src)
		config_error("unknown source \"%s\" (compiled in: %s)", cfg->in, source_names());
	if (sink_given)
		config_error("--in and --sink exclude each other (one relay, one direction)%s%s", "", "");
	if (!cfg->url)
		cfg->url = src->default_url;
	if (!cfg->target)
		cfg->target = src->default_target;
	if (!cfg->source)
		cfg->source = src->name;
	if (!cfg->message_id)
		cfg->message_id = src->default_message_id;
	if (!*cfg->source)
		config_error("--source must not be empty%s%s", "", "");
	if (strstr(cfg->url, "{source}"))
	{
		const char *t = strstr(cfg->url, "{source}");

		/* the last path segment, whole: the rest of the path routes */
		if (strcmp(src->name, "http") != 0 || t == cfg->url || t[-1] != '/' || strcmp(t, "{source}") != 0)
			config_error("invalid --url \"%s\": {source} is for --in http only, as the whole last path segment%s",
						 cfg->url, "");
		if (cfg->source[0] == ',' || strstr(cfg->source, ",,") || cfg->source[strlen(cfg->source) - 1] == ',')
			config_error("invalid --source \"%s\": the names allowed for {source}, comma-separated, none empty%s",
						 cfg->source, "");
	}
	specs[0] = cfg->message_id;
	specs[1] = cfg->ordering_key;
	for (i = 0; i < 2; i++)
		if (*specs[i] && strncmp(specs[i], "header:", 7) != 0 && strncmp(specs[i], "json:/", 6) != 0)
			config_error("invalid %s \"%s\": header:NAME or json:/POINTER expected",
						 i == 0 ? "--message-id" : "--ordering-key", specs[i]);
	if (!*cfg->message_id || strcmp(cfg->message_id, "header:") == 0)
		config_error("--message-id must name a header or a JSON pointer%s%s", "", "");
	if (strcmp(cfg->hmac_format, "hex") != 0 && strcmp(cfg->hmac_format, "stripe") != 0)
		config_error("invalid --hmac-format \"%s\": hex or stripe%s", cfg->hmac_format, "");
	if (!cfg->hmac_header)
		cfg->hmac_header = strcmp(cfg->hmac_format, "stripe") == 0 ? "Stripe-Signature" : "X-Hub-Signature-256";
	if (*cfg->hmac_secret && strcmp(src->name, "http") != 0)
		config_error("--hmac-secret is for --in http only%s%s", "", "");
}

static void
check(relay_config *cfg, int sink_given)
{
	const sink_ops *sink = cfg->in ? NULL : sink_find(cfg->sink);

	if (cfg->in)
		check_inbound(cfg, sink_given);
	else if (!sink)
		config_error("unknown sink \"%s\" (compiled in: %s)", cfg->sink, sink_names());
	if (cfg->batch < 1)
		config_error("--batch must be at least 1%s%s", "", "");
	if (cfg->prefetch != 0 && cfg->prefetch != 1)
		config_error("--prefetch must be 0 or 1%s%s", "", "");
	if (cfg->lease < 1)
		config_error("--lease must be at least 1 second%s%s", "", "");
	if (cfg->notify_window < 0)
		config_error("--notify-window must not be negative%s%s", "", "");
	if (cfg->poll <= 0 || cfg->timeout <= 0)
		config_error("--poll and --timeout must be more than 0 seconds%s%s", "", "");
	if (cfg->timeout >= cfg->lease)
		config_error("--timeout must be shorter than --lease (a publish must end before the lease does)%s%s", "", "");
	if (cfg->retries < 1)
		config_error("--retries must be at least 1%s%s", "", "");
	if (strcmp(cfg->log_format, "logfmt") != 0 && strcmp(cfg->log_format, "json") != 0)
		config_error("invalid --log-format \"%s\": logfmt or json%s", cfg->log_format, "");
	if (*cfg->metrics_listen && !strrchr(cfg->metrics_listen, ':'))
		config_error("invalid --metrics-listen \"%s\": HOST:PORT expected%s", cfg->metrics_listen, "");
	if (sink && !cfg->url)
		cfg->url = sink->default_url;
	if (!cfg->url || !*cfg->url)
		config_error("%s needs --url%s", cfg->in ? cfg->in : sink->name, "");
	if (sink && !cfg->target)
		cfg->target = sink->default_target;
	if (sink && strcmp(sink->name, "sql") == 0 && !*cfg->sql)
		config_error("--sink sql needs --sql STATEMENT%s%s", "", "");
	if (*cfg->sql && (!sink || strcmp(sink->name, "sql") != 0))
		config_error("--sql is for --sink sql only%s%s", "", "");
	if (strcmp(cfg->sql_commit, "batch") != 0 && strcmp(cfg->sql_commit, "event") != 0)
		config_error("invalid --sql-commit \"%s\": batch or event%s", cfg->sql_commit, "");
	if (cfg->http_concurrency < 1 || cfg->http_concurrency > 1000)
		config_error("--http-concurrency must be from 1 to 1000%s%s", "", "");
	if (cfg->http_concurrency != 1 && (!sink || strcmp(sink->name, "http") != 0))
		config_error("--http-concurrency is for --sink http only%s%s", "", "");
}

void
config_load(relay_config *cfg, int argc, char **argv)
{
	const char *file = getenv("IDEM_RELAY_CONFIG");
	int			i,
				sink_given;

	memset(cfg, 0, sizeof(*cfg));
	cfg->dbname = "";
	cfg->sink = NULL;			/* "stdout" unless given (check: --in excludes it) */
	cfg->url = NULL;
	cfg->target = NULL;
	cfg->exchange = "";
	cfg->sql = "";
	cfg->sql_commit = "batch";
	cfg->http_concurrency = 1;
	cfg->types = "";
	cfg->subscription = "default";
	cfg->metrics_listen = "";
	cfg->log_format = "logfmt";
	cfg->batch = 100;
	cfg->prefetch = 1;
	cfg->lease = 30;
	cfg->poll = 1;
	cfg->notify_window = 0.02;
	cfg->timeout = 10;
	cfg->retries = 5;
	cfg->retry_max = 5;
	cfg->nack_retry_after = -1;
	cfg->in = NULL;
	cfg->source = NULL;
	cfg->message_id = NULL;
	cfg->ordering_key = "";
	cfg->group = "idem-relay";
	cfg->consumer = "idem-relay";
	cfg->hmac_secret = "";
	cfg->hmac_format = "hex";
	cfg->hmac_header = NULL;
	cfg->hmac_tolerance = 300;

	/* --help, --version and --config first: the file is read before the rest */
	for (i = 1; i < argc; i++)
	{
		if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0)
		{
			usage(stdout);
			exit(0);
		}
		if (strcmp(argv[i], "-V") == 0 || strcmp(argv[i], "--version") == 0)
		{
			printf("idem-relay %s (sinks: %s; sources: %s)\n", RELAY_VERSION, sink_names(), source_names());
			exit(0);
		}
		if (strcmp(argv[i], "-c") == 0 || strcmp(argv[i], "--config") == 0)
		{
			if (i + 1 >= argc)
				config_error("option %s needs a value%s", argv[i], "");
			file = argv[++i];
		}
		else if (strncmp(argv[i], "--config=", 9) == 0)
			file = argv[i] + 9;
	}
	if (file && *file)
		load_file(cfg, file);
	load_env(cfg);

	for (i = 1; i < argc; i++)
	{
		const char *a = argv[i];
		const option_def *o = NULL;
		const char *value = NULL;
		char		source[80];

		if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0)
		{
			i++;
			continue;
		}
		if (strncmp(a, "--config=", 9) == 0)
			continue;
		if (strncmp(a, "--", 2) == 0 && a[2])
		{
			const char *eq = strchr(a + 2, '=');

			o = find_long(a + 2, eq ? (size_t) (eq - a - 2) : strlen(a + 2));
			if (eq)
				value = eq + 1;
		}
		else if (a[0] == '-' && a[1] && !a[2])
			o = find_short(a[1]);
		if (!o)
			config_error("unknown option \"%s\"%s", a, "");
		snprintf(source, sizeof(source), "--%s", o->name);
		if (!value)
		{
			if (o->kind == O_FLAG)
				value = "1";
			else if (i + 1 < argc)
				value = argv[++i];
			else
				config_error("option %s needs a value%s", source, "");
		}
		set_option(cfg, o, value, source);
	}
	sink_given = cfg->sink != NULL;
	if (!sink_given)
		cfg->sink = "stdout";
	check(cfg, sink_given);
}
