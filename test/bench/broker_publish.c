/*
 * broker_publish.c: the brokers' own publish rate for test/bench/relay.sh,
 * which builds it into its temporary directory (cc, the libraries'
 * pkg-config flags, -DHAVE_NATS / -DHAVE_RABBITMQ / -DHAVE_CURL /
 * -DHAVE_MHD for each library it found; a part whose library is missing
 * says so and exits 3).
 *
 *   broker_publish nats URL SUBJECT N [WINDOW]
 *       N JetStream publishes of stdin's bytes to SUBJECT, header
 *       Nats-Msg-Id unique (as the relay's nats sink sends), each ack
 *       awaited before the next; WINDOW > 1: WINDOW asynchronous publishes,
 *       then all their acks awaited, and so on (WINDOW = N: acks at the end)
 *   broker_publish nats-stream URL STREAM SUBJECT
 *       create STREAM (file storage) capturing SUBJECT if absent, print how
 *       many messages it holds, then purge it
 *   broker_publish amqp URL QUEUE N [WINDOW]
 *       N persistent, mandatory publishes to QUEUE by the default exchange
 *       in confirm mode, message_id unique, each confirm awaited (as the
 *       relay's amqp sink); WINDOW > 1: WINDOW publishes, then all their
 *       confirms
 *   broker_publish amqp-queue URL QUEUE
 *       declare QUEUE (durable), print how many messages it holds, purge it
 *   broker_publish http URL N
 *       N POSTs of stdin's bytes to URL, one libcurl handle (keep-alive),
 *       header Idempotency-Key unique, each answer awaited, 2xx required
 *   broker_publish serve PORT
 *       an HTTP receiver on 127.0.0.1:PORT: every POST gets 200 and is
 *       counted; GET /count answers the count since the last GET /count
 *       (and zeroes it); runs until SIGTERM or SIGINT
 *
 * The publishing commands print one line, events/s over the publish loop
 * alone (connection set-up excluded), and exit 1 if any publish was not
 * confirmed.  Threads: the main thread does everything, but libnats's own
 * threads call the async ack handler (counters under a mutex) and
 * libmicrohttpd's one polling thread serves (the counter is only touched
 * there).
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef HAVE_NATS
#include <nats/nats.h>
#endif
#ifdef HAVE_RABBITMQ
#include <amqp.h>
#include <amqp_tcp_socket.h>
#endif
#ifdef HAVE_CURL
#include <curl/curl.h>
#endif
#ifdef HAVE_MHD
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#endif

/* a build without some library leaves some of these helpers unused */
#define MAYBE_UNUSED __attribute__((unused))

static void
die(const char *fmt, const char *arg)
{
	fprintf(stderr, "broker_publish: ");
	fprintf(stderr, fmt, arg);
	fputc('\n', stderr);
	exit(1);
}

static MAYBE_UNUSED void
not_built(const char *what)
{
	fprintf(stderr, "broker_publish: built without %s\n", what);
	exit(3);
}

static MAYBE_UNUSED double
now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double) ts.tv_sec + (double) ts.tv_nsec / 1e9;
}

static MAYBE_UNUSED void
print_rate(long n, double t0, double t1)
{
	printf("%.0f\n", (double) n / (t1 - t0));
}

/* stdin, whole: the message body */
static MAYBE_UNUSED char *
read_body(size_t *len)
{
	size_t		cap = 4096,
				n = 0,
				got;
	char	   *buf = malloc(cap);

	while (buf && (got = fread(buf + n, 1, cap - n - 1, stdin)) > 0)
	{
		n += got;
		if (cap - n - 1 == 0)
			buf = realloc(buf, cap *= 2);
	}
	if (!buf)
		die("%s", "out of memory");
	/* a trailing newline (of echo, of the relay's stdout sink) is no part of it */
	while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
		n--;
	buf[n] = '\0';
	*len = n;
	return buf;
}

/*
 * a message id no earlier run used: the brokers' duplicate windows (NATS's
 * 2 minutes) would otherwise drop a later round's messages
 */
static MAYBE_UNUSED void
message_id(char *out, size_t outlen, long i)
{
	static char prefix[64];

	if (!prefix[0])
		snprintf(prefix, sizeof(prefix), "bp-%ld-%ld", (long) getpid(), (long) time(NULL));
	snprintf(out, outlen, "%s-%ld", prefix, i);
}

static long
count_arg(const char *s)
{
	char	   *end;
	long		n = strtol(s, &end, 10);

	if (*end || n < 1)
		die("not a positive count: %s", s);
	return n;
}

/* --- NATS JetStream ------------------------------------------------------ */

#ifdef HAVE_NATS
static pthread_mutex_t js_lock = PTHREAD_MUTEX_INITIALIZER;
static long js_acked,
			js_failed;

/* libnats's thread, once per async publish */
static void
js_ack_handler(jsCtx *js, natsMsg *msg, jsPubAck *pa, jsPubAckErr *pae, void *closure)
{
	(void) js;
	(void) closure;
	pthread_mutex_lock(&js_lock);
	if (pa && !pae)
		js_acked++;
	else
		js_failed++;
	pthread_mutex_unlock(&js_lock);
	natsMsg_Destroy(msg);
}

static void
nats_check(natsStatus s, const char *what)
{
	if (s != NATS_OK)
	{
		fprintf(stderr, "broker_publish: %s: %s\n", what, natsStatus_GetText(s));
		exit(1);
	}
}

static void
nats_connect(const char *url, long window, natsConnection **nc, jsCtx **js)
{
	jsOptions	jo;

	nats_check(natsConnection_ConnectTo(nc, url), "connect");
	jsOptions_Init(&jo);
	if (window > 1)
	{
		jo.PublishAsync.MaxPending = window;
		jo.PublishAsync.AckHandler = js_ack_handler;
	}
	nats_check(natsConnection_JetStream(js, *nc, &jo), "jetstream");
}

static void
nats_publish(const char *url, const char *subject, long n, long window)
{
	natsConnection *nc;
	jsCtx	   *js;
	size_t		len;
	char	   *body = read_body(&len);
	char		id[96];
	double		t0,
				t1;

	nats_connect(url, window, &nc, &js);
	t0 = now();
	for (long i = 0; i < n; i += window)
	{
		long		end = i + window < n ? i + window : n;

		for (long j = i; j < end; j++)
		{
			natsMsg    *msg;
			jsErrCode	jerr = 0;

			message_id(id, sizeof(id), j);
			nats_check(natsMsg_Create(&msg, subject, NULL, body, (int) len), "message");
			nats_check(natsMsgHeader_Set(msg, "Nats-Msg-Id", id), "header");
			nats_check(natsMsgHeader_Set(msg, "Content-Type", "application/json"), "header");
			if (window > 1)
			{
				/* the library owns msg from here (the ack handler frees it) */
				nats_check(js_PublishMsgAsync(js, &msg, NULL), "async publish");
			}
			else
			{
				jsPubAck   *pa = NULL;

				if (js_PublishMsg(&pa, js, msg, NULL, &jerr) != NATS_OK)
				{
					fprintf(stderr, "broker_publish: publish not acked (JetStream error %d)\n", (int) jerr);
					exit(1);
				}
				jsPubAck_Destroy(pa);
				natsMsg_Destroy(msg);
			}
		}
		if (window > 1)
		{
			jsPubOptions po;

			jsPubOptions_Init(&po);
			po.MaxWait = 30000;
			nats_check(js_PublishAsyncComplete(js, &po), "awaiting the acks");
		}
	}
	t1 = now();
	if (window > 1 && (js_failed > 0 || js_acked != n))
	{
		fprintf(stderr, "broker_publish: %ld acked, %ld failed of %ld\n", js_acked, js_failed, n);
		exit(1);
	}
	print_rate(n, t0, t1);
	jsCtx_Destroy(js);
	natsConnection_Destroy(nc);
	free(body);
}

static void
nats_stream(const char *url, const char *stream, const char *subject)
{
	natsConnection *nc;
	jsCtx	   *js;
	jsStreamInfo *si = NULL;
	jsErrCode	jerr = 0;

	nats_connect(url, 1, &nc, &js);
	if (js_GetStreamInfo(&si, js, stream, NULL, &jerr) != NATS_OK || !si)
	{
		jsStreamConfig sc;
		const char *subjects[1] = {subject};

		jsStreamConfig_Init(&sc);
		sc.Name = stream;
		sc.Subjects = subjects;
		sc.SubjectsLen = 1;
		sc.Storage = js_FileStorage;
		nats_check(js_AddStream(&si, js, &sc, NULL, &jerr), "add stream");
	}
	printf("%llu\n", (unsigned long long) si->State.Msgs);
	jsStreamInfo_Destroy(si);
	nats_check(js_PurgeStream(js, stream, NULL, &jerr), "purge stream");
	jsCtx_Destroy(js);
	natsConnection_Destroy(nc);
}
#endif

/* --- RabbitMQ ------------------------------------------------------------- */

#ifdef HAVE_RABBITMQ
static void
rpc_check(amqp_rpc_reply_t r, const char *what)
{
	if (r.reply_type != AMQP_RESPONSE_NORMAL)
	{
		fprintf(stderr, "broker_publish: %s failed (%s)\n", what,
				r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION ?
				amqp_error_string2(r.library_error) : "refused by the server");
		exit(1);
	}
}

static amqp_connection_state_t
amqp_open(const char *url, int confirm)
{
	struct amqp_connection_info ci;
	char	   *u = strdup(url);
	amqp_connection_state_t conn = amqp_new_connection();
	amqp_socket_t *sock = amqp_tcp_socket_new(conn);

	amqp_default_connection_info(&ci);
	if (!u || amqp_parse_url(u, &ci) != AMQP_STATUS_OK)
		die("bad URL %s", url);
	if (!ci.vhost || !*ci.vhost)
		ci.vhost = "/";
	if (!sock || amqp_socket_open(sock, ci.host, ci.port) != AMQP_STATUS_OK)
		die("cannot connect to %s", url);
	rpc_check(amqp_login(conn, ci.vhost, 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, ci.user, ci.password),
			  "login");
	amqp_channel_open(conn, 1);
	rpc_check(amqp_get_rpc_reply(conn), "channel.open");
	if (confirm)
	{
		amqp_confirm_select(conn, 1);
		rpc_check(amqp_get_rpc_reply(conn), "confirm.select");
	}
	free(u);
	return conn;
}

/*
 * wait for frames until every delivery tag up to last is confirmed; the
 * confirms of one channel come in order, so "confirmed" is the highest
 * tag acked (each ack for one tag, or with multiple for all up to it)
 */
static void
amqp_await(amqp_connection_state_t conn, uint64_t *confirmed, uint64_t last)
{
	struct timeval tv = {30, 0};

	while (*confirmed < last)
	{
		amqp_frame_t frame;
		int			rc = amqp_simple_wait_frame_noblock(conn, &frame, &tv);

		if (rc != AMQP_STATUS_OK)
			die("waiting for confirms: %s", amqp_error_string2(rc));
		if (frame.frame_type != AMQP_FRAME_METHOD)
			continue;
		if (frame.payload.method.id == AMQP_BASIC_ACK_METHOD)
		{
			amqp_basic_ack_t *ack = frame.payload.method.decoded;

			if (ack->delivery_tag > *confirmed)
				*confirmed = ack->delivery_tag;
		}
		else if (frame.payload.method.id == AMQP_BASIC_NACK_METHOD)
			die("%s", "the broker nacked a publish");
		else if (frame.payload.method.id == AMQP_BASIC_RETURN_METHOD)
			die("%s", "a publish was unroutable (no such queue?)");
		amqp_maybe_release_buffers(conn);
	}
}

static void
amqp_publish_n(const char *url, const char *queue, long n, long window)
{
	amqp_connection_state_t conn = amqp_open(url, 1);
	size_t		len;
	char	   *body = read_body(&len);
	amqp_bytes_t bytes = {len, body};
	char		id[96];
	uint64_t	confirmed = 0;
	double		t0,
				t1;

	t0 = now();
	for (long i = 0; i < n; i += window)
	{
		long		end = i + window < n ? i + window : n;

		for (long j = i; j < end; j++)
		{
			amqp_basic_properties_t props;

			message_id(id, sizeof(id), j);
			memset(&props, 0, sizeof(props));
			props._flags = AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG |
				AMQP_BASIC_CONTENT_TYPE_FLAG;
			props.message_id = amqp_cstring_bytes(id);
			props.delivery_mode = 2;
			props.content_type = amqp_cstring_bytes("application/json");
			if (amqp_basic_publish(conn, 1, amqp_empty_bytes, amqp_cstring_bytes(queue), 1, 0,
								   &props, bytes) != AMQP_STATUS_OK)
				die("%s", "basic.publish failed");
		}
		/* delivery tags count publishes from 1 on the channel */
		amqp_await(conn, &confirmed, (uint64_t) end);
	}
	t1 = now();
	print_rate(n, t0, t1);
	amqp_channel_close(conn, 1, AMQP_REPLY_SUCCESS);
	amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(conn);
	free(body);
}

static void
amqp_queue(const char *url, const char *queue)
{
	amqp_connection_state_t conn = amqp_open(url, 0);
	amqp_queue_declare_ok_t *ok;

	ok = amqp_queue_declare(conn, 1, amqp_cstring_bytes(queue), 0, 1, 0, 0, amqp_empty_table);
	rpc_check(amqp_get_rpc_reply(conn), "queue.declare");
	printf("%u\n", ok->message_count);
	amqp_queue_purge(conn, 1, amqp_cstring_bytes(queue));
	rpc_check(amqp_get_rpc_reply(conn), "queue.purge");
	amqp_channel_close(conn, 1, AMQP_REPLY_SUCCESS);
	amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(conn);
}
#endif

/* --- HTTP ----------------------------------------------------------------- */

#ifdef HAVE_CURL
static size_t
discard(char *data, size_t size, size_t nmemb, void *arg)
{
	(void) data;
	(void) arg;
	return size * nmemb;
}

static void
http_publish(const char *url, long n)
{
	CURL	   *curl;
	size_t		len;
	char	   *body = read_body(&len);
	char		id[96],
				header[128];
	double		t0,
				t1;

	if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0 || !(curl = curl_easy_init()))
		die("%s", "curl init failed");
	curl_easy_setopt(curl, CURLOPT_URL, url);
	curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body);
	curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, (long) len);
	curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, discard);
	curl_easy_setopt(curl, CURLOPT_TIMEOUT, 30L);
	t0 = now();
	for (long i = 0; i < n; i++)
	{
		struct curl_slist *h = NULL;
		long		status = 0;
		CURLcode	rc;

		message_id(id, sizeof(id), i);
		snprintf(header, sizeof(header), "Idempotency-Key: %s", id);
		h = curl_slist_append(h, "Content-Type: application/json");
		h = curl_slist_append(h, header);
		curl_easy_setopt(curl, CURLOPT_HTTPHEADER, h);
		rc = curl_easy_perform(curl);
		curl_slist_free_all(h);
		if (rc != CURLE_OK)
			die("POST failed: %s", curl_easy_strerror(rc));
		curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
		if (status < 200 || status > 299)
			die("%s", "POST answered other than 2xx");
	}
	t1 = now();
	print_rate(n, t0, t1);
	curl_easy_cleanup(curl);
	free(body);
}
#endif

#ifdef HAVE_MHD
/* POSTs since the last GET /count; the polling thread's alone */
static long posts;

static enum MHD_Result
serve_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
			  const char *version, const char *upload_data, size_t *upload_data_size,
			  void **con_cls)
{
	static int	started;
	struct MHD_Response *resp;
	enum MHD_Result ret;
	char		text[32] = "";

	(void) cls;
	(void) version;
	(void) upload_data;
	/* the first call of a request sees only its headers */
	if (*con_cls == NULL)
	{
		*con_cls = &started;
		return MHD_YES;
	}
	/* the body, in pieces: read and dropped */
	if (*upload_data_size > 0)
	{
		*upload_data_size = 0;
		return MHD_YES;
	}
	if (strcmp(method, "POST") == 0)
		posts++;
	else if (strcmp(url, "/count") == 0)
	{
		snprintf(text, sizeof(text), "%ld\n", posts);
		posts = 0;
	}
	resp = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_COPY);
	ret = MHD_queue_response(conn, MHD_HTTP_OK, resp);
	MHD_destroy_response(resp);
	return ret;
}

static void
serve(const char *port)
{
	struct sockaddr_in addr;
	struct MHD_Daemon *d;
	sigset_t	set;
	int			sig;

	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_port = htons((uint16_t) atoi(port));
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	/* the signals are waited for here, not delivered to any thread */
	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, (uint16_t) atoi(port), NULL, NULL,
						 serve_request, NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr *) &addr,
						 MHD_OPTION_END);
	if (!d)
		die("cannot listen on 127.0.0.1:%s", port);
	sigwait(&set, &sig);
	MHD_stop_daemon(d);
}
#endif

int
main(int argc, char **argv)
{
	const char *cmd = argc > 1 ? argv[1] : "";

	if ((strcmp(cmd, "nats") == 0 || strcmp(cmd, "amqp") == 0) && (argc == 5 || argc == 6))
	{
		long		n = count_arg(argv[4]);
		long		window = argc == 6 ? count_arg(argv[5]) : 1;

		(void) n;
		(void) window;
		if (cmd[0] == 'n')
		{
#ifdef HAVE_NATS
			nats_publish(argv[2], argv[3], n, window);
#else
			not_built("libnats");
#endif
		}
		else
		{
#ifdef HAVE_RABBITMQ
			amqp_publish_n(argv[2], argv[3], n, window);
#else
			not_built("librabbitmq");
#endif
		}
	}
	else if (strcmp(cmd, "nats-stream") == 0 && argc == 5)
#ifdef HAVE_NATS
		nats_stream(argv[2], argv[3], argv[4]);
#else
		not_built("libnats");
#endif
	else if (strcmp(cmd, "amqp-queue") == 0 && argc == 4)
#ifdef HAVE_RABBITMQ
		amqp_queue(argv[2], argv[3]);
#else
		not_built("librabbitmq");
#endif
	else if (strcmp(cmd, "http") == 0 && argc == 4)
#ifdef HAVE_CURL
		http_publish(argv[2], count_arg(argv[3]));
#else
		not_built("libcurl");
#endif
	else if (strcmp(cmd, "serve") == 0 && argc == 3)
#ifdef HAVE_MHD
		serve(argv[2]);
#else
		not_built("libmicrohttpd");
#endif
	else
	{
		fprintf(stderr, "usage: broker_publish nats URL SUBJECT N [WINDOW] | nats-stream URL STREAM SUBJECT\n"
				"       | amqp URL QUEUE N [WINDOW] | amqp-queue URL QUEUE | http URL N | serve PORT\n");
		return 2;
	}
	return 0;
}
