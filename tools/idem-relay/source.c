/*
 * source.c: the inbound sources compiled in (each source_*.c is built only
 * when pkg-config found its library), lookup by name, and the message a
 * source fills: its body, its metadata as one JSON object (what becomes
 * the inbox row's headers, with ordering_key added by inbound.c), and the
 * message id and ordering key taken from a header when --message-id /
 * --ordering-key say header:NAME (names compared without regard to case,
 * as HTTP and NATS headers are).  A JSON pointer (json:/...) is resolved by
 * inbound.c's SQL, not here.
 *
 * No shared state: each message is filled by one thread (source_http.c's
 * receiving thread, or the main thread) before it is handed on.
 */
#include "relay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const source_ops *const sources[] = {
#ifdef HAVE_MHD
	&source_http,
#endif
#ifdef HAVE_HIREDIS
	&source_redis,
#endif
#ifdef HAVE_NATS
	&source_nats,
#endif
#ifdef HAVE_RABBITMQ
	&source_amqp,
#endif
	NULL
};

#define N_SOURCES (sizeof(sources) / sizeof(sources[0]) - 1)

const source_ops *
source_find(const char *name)
{
	size_t		i;

	for (i = 0; i < N_SOURCES; i++)
		if (strcmp(sources[i]->name, name) == 0)
			return sources[i];
	return NULL;
}

const char *
source_names(void)
{
	static char names[128];
	size_t		i;

	if (!names[0])
	{
		for (i = 0; i < N_SOURCES; i++)
		{
			if (i)
				strcat(names, " ");
			strcat(names, sources[i]->name);
		}
		if (!N_SOURCES)
			strcat(names, "(none)");
	}
	return names;
}

static void *
xmalloc(size_t n)
{
	void	   *p = malloc(n);

	if (!p)
	{
		log_msg(LOG_ERROR, "out of memory", NULL);
		exit(1);
	}
	return p;
}

static char *
copy(const char *s, size_t len)
{
	char	   *p = xmalloc(len + 1);

	memcpy(p, s, len);
	p[len] = '\0';
	return p;
}

void
msg_set_body(relay_message *msg, const char *body, size_t len)
{
	free(msg->body);
	msg->body = copy(body, len);
	msg->body_len = len;
}

void
buf_put(relay_buf *b, const char *s, size_t len)
{
	if (b->len + len + 1 > b->cap)
	{
		size_t		cap = (b->len + len + 1) * 2;
		char	   *p = realloc(b->data, cap);

		if (!p)
		{
			log_msg(LOG_ERROR, "out of memory", NULL);
			exit(1);
		}
		b->data = p;
		b->cap = cap;
	}
	memcpy(b->data + b->len, s, len);
	b->len += len;
	b->data[b->len] = '\0';
}

void
buf_puts(relay_buf *b, const char *s)
{
	buf_put(b, s, strlen(s));
}

void
buf_json_string(relay_buf *b, const char *s, size_t len)
{
	size_t		i,
				from = 0;

	buf_put(b, "\"", 1);
	for (i = 0; i < len; i++)
	{
		unsigned char c = (unsigned char) s[i];
		char		esc[8];

		if (c != '"' && c != '\\' && c >= 0x20)
			continue;
		buf_put(b, s + from, i - from);
		from = i + 1;
		if (c < 0x20)
			snprintf(esc, sizeof(esc), "\\u%04x", c);
		else
			snprintf(esc, sizeof(esc), "\\%c", c);
		buf_puts(b, esc);
	}
	buf_put(b, s + from, len - from);
	buf_put(b, "\"", 1);
}

/* spec names header name (header:NAME, any case) */
static int
spec_is(const char *spec, const char *name)
{
	return spec && strncmp(spec, "header:", 7) == 0 && strcasecmp(spec + 7, name) == 0;
}

void
msg_header(relay_message *msg, const relay_config *cfg, const char *name,
		   const char *value, size_t value_len)
{
	buf_puts(&msg->meta, msg->meta.len ? "," : "{");
	buf_json_string(&msg->meta, name, strlen(name));
	buf_puts(&msg->meta, ":");
	buf_json_string(&msg->meta, value, value_len);
	if (!msg->message_id && spec_is(cfg->message_id, name))
		msg->message_id = copy(value, value_len);
	if (!msg->ordering_key && spec_is(cfg->ordering_key, name))
		msg->ordering_key = copy(value, value_len);
}

const char *
msg_meta(relay_message *msg)
{
	if (!msg->meta_closed)
		buf_puts(&msg->meta, msg->meta.len ? "}" : "{}");
	msg->meta_closed = 1;
	return msg->meta.data;
}

void
msg_free(relay_message *msg)
{
	free(msg->body);
	free(msg->meta.data);
	free(msg->message_id);
	free(msg->ordering_key);
	memset(msg, 0, sizeof(*msg));
}
