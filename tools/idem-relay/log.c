/*
 * log.c: structured log lines on stderr, one per event worth telling:
 * logfmt (ts=... level=... msg="..." key=value) or JSON lines
 * (--log-format json).  Debug lines only with --verbose.
 *
 * Called from the main thread and from source_http.c's request threads
 * (the metrics thread logs nothing after it started): each line is built
 * in a local buffer and written with one fputs on a line-buffered stream,
 * which stdio locks for the call, so lines never interleave; the settings
 * are written once, by log_init, before any thread starts.
 */
#include "relay.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static int	log_json;
static int	log_verbose;

void
log_init(const char *format, int verbose)
{
	log_json = strcmp(format, "json") == 0;
	log_verbose = verbose;
	setvbuf(stderr, NULL, _IOLBF, 0);
}

/* append s to buf (at *len, of size cap) quoted for logfmt or JSON */
static void
append_quoted(char *buf, size_t *len, size_t cap, const char *s)
{
	size_t		l = *len;

	if (l + 1 < cap)
		buf[l++] = '"';
	for (; *s && l + 7 < cap; s++)
	{
		unsigned char c = (unsigned char) *s;

		if (c == '"' || c == '\\')
		{
			buf[l++] = '\\';
			buf[l++] = (char) c;
		}
		else if (c == '\n')
		{
			buf[l++] = '\\';
			buf[l++] = 'n';
		}
		else if (c < 0x20)
			l += (size_t) snprintf(buf + l, cap - l, "\\u%04x", c);
		else
			buf[l++] = (char) c;
	}
	if (l + 1 < cap)
		buf[l++] = '"';
	buf[l] = '\0';
	*len = l;
}

static int
needs_quotes(const char *s)
{
	if (!*s)
		return 1;
	for (; *s; s++)
		if (*s == ' ' || *s == '"' || *s == '=' || *s == '\\' || (unsigned char) *s < 0x21)
			return 1;
	return 0;
}

static void
append_raw(char *buf, size_t *len, size_t cap, const char *s)
{
	size_t		n = strlen(s);

	if (*len + n >= cap)
		n = cap - *len - 1;
	memcpy(buf + *len, s, n);
	*len += n;
	buf[*len] = '\0';
}

/* one field: key=value (logfmt) or ,"key":"value" (JSON) */
static void
append_field(char *buf, size_t *len, size_t cap, const char *key, const char *value)
{
	if (log_json)
	{
		append_raw(buf, len, cap, ",");
		append_quoted(buf, len, cap, key);
		append_raw(buf, len, cap, ":");
		append_quoted(buf, len, cap, value);
	}
	else
	{
		append_raw(buf, len, cap, " ");
		append_raw(buf, len, cap, key);
		append_raw(buf, len, cap, "=");
		if (needs_quotes(value))
			append_quoted(buf, len, cap, value);
		else
			append_raw(buf, len, cap, value);
	}
}

void
log_msg(enum log_level level, const char *msg,...)
{
	static const char *names[] = {"debug", "info", "warn", "error"};
	char		buf[8192];
	char		ts[40];
	size_t		len = 0;
	struct timespec now;
	struct tm	tm;
	va_list		ap;
	const char *key;

	if (level == LOG_DEBUG && !log_verbose)
		return;
	clock_gettime(CLOCK_REALTIME, &now);
	gmtime_r(&now.tv_sec, &tm);
	len = strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
	snprintf(ts + len, sizeof(ts) - len, ".%03ldZ", now.tv_nsec / 1000000);
	len = 0;
	buf[0] = '\0';
	if (log_json)
	{
		append_raw(buf, &len, sizeof(buf), "{\"ts\":");
		append_quoted(buf, &len, sizeof(buf), ts);
		append_field(buf, &len, sizeof(buf), "level", names[level]);
		append_field(buf, &len, sizeof(buf), "msg", msg);
	}
	else
	{
		append_raw(buf, &len, sizeof(buf), "ts=");
		append_raw(buf, &len, sizeof(buf), ts);
		append_field(buf, &len, sizeof(buf), "level", names[level]);
		append_field(buf, &len, sizeof(buf), "msg", msg);
	}
	va_start(ap, msg);
	while ((key = va_arg(ap, const char *)) != NULL)
	{
		const char *value = va_arg(ap, const char *);

		append_field(buf, &len, sizeof(buf), key, value ? value : "");
	}
	va_end(ap);
	append_raw(buf, &len, sizeof(buf), log_json ? "}\n" : "\n");
	fputs(buf, stderr);
}
