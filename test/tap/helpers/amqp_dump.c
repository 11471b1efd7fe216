/*
 * amqp_dump.c: a RabbitMQ client for TAP 094_relay_rabbitmq (built by the
 * test with the system's librabbitmq).
 *   amqp_dump PORT declare QUEUE   declare a durable queue on 127.0.0.1:PORT
 *   amqp_dump PORT take QUEUE      take (basic.get, acked) every message
 *                                  waiting, print "message_id body" lines
 * Exit status 1 with a message on any failure.
 */
#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void
check(amqp_rpc_reply_t r, const char *what)
{
	if (r.reply_type != AMQP_RESPONSE_NORMAL)
	{
		fprintf(stderr, "amqp_dump: %s failed (%d)\n", what, (int) r.reply_type);
		exit(1);
	}
}

int
main(int argc, char **argv)
{
	amqp_connection_state_t conn;
	amqp_socket_t *sock;
	amqp_bytes_t queue;

	if (argc != 4)
	{
		fprintf(stderr, "usage: amqp_dump PORT declare|take QUEUE\n");
		return 1;
	}
	conn = amqp_new_connection();
	sock = amqp_tcp_socket_new(conn);
	if (!sock || amqp_socket_open(sock, "127.0.0.1", atoi(argv[1])) != AMQP_STATUS_OK)
	{
		fprintf(stderr, "amqp_dump: cannot connect\n");
		return 1;
	}
	check(amqp_login(conn, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest"), "login");
	amqp_channel_open(conn, 1);
	check(amqp_get_rpc_reply(conn), "channel.open");
	queue = amqp_cstring_bytes(argv[3]);
	if (strcmp(argv[2], "declare") == 0)
	{
		amqp_queue_declare(conn, 1, queue, 0, 1, 0, 0, amqp_empty_table);
		check(amqp_get_rpc_reply(conn), "queue.declare");
	}
	else
		for (;;)
		{
			amqp_rpc_reply_t r = amqp_basic_get(conn, 1, queue, 1);
			amqp_message_t msg;

			check(r, "basic.get");
			if (r.reply.id != AMQP_BASIC_GET_OK_METHOD)
				break;
			check(amqp_read_message(conn, 1, &msg, 0), "read message");
			printf("%.*s %.*s\n",
				   (msg.properties._flags & AMQP_BASIC_MESSAGE_ID_FLAG) ? (int) msg.properties.message_id.len : 0,
				   (char *) msg.properties.message_id.bytes, (int) msg.body.len, (char *) msg.body.bytes);
			amqp_destroy_message(&msg);
		}
	amqp_channel_close(conn, 1, AMQP_REPLY_SUCCESS);
	amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
	amqp_destroy_connection(conn);
	return 0;
}
