/*
 * amqp_dump.c: a RabbitMQ client for TAP 094_relay_rabbitmq (built by the
 * test with the system's librabbitmq).
 *   amqp_dump PORT declare QUEUE   declare a durable queue on 127.0.0.1:PORT
 *   amqp_dump PORT take QUEUE      take (basic.get, acked) every message
 *                                  waiting, print "message_id body" lines
 *   amqp_dump PORT publish QUEUE   publish each "message_id body" line of
 *                                  stdin to QUEUE (persistent, with
 *                                  publisher confirms: exit 0 only when the
 *                                  broker confirmed every one)
 * (TAP 098_relay_in_rabbitmq too.)
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
		fprintf(stderr, "usage: amqp_dump PORT declare|take|publish QUEUE\n");
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
	else if (strcmp(argv[2], "publish") == 0)
	{
		char		line[65536];
		int			sent = 0,
					acked = 0;

		amqp_confirm_select(conn, 1);
		check(amqp_get_rpc_reply(conn), "confirm.select");
		while (fgets(line, sizeof(line), stdin))
		{
			char	   *sp = strchr(line, ' ');
			amqp_basic_properties_t props;

			if (!sp)
				continue;
			*sp = '\0';
			sp[strcspn(sp + 1, "\n") + 1] = '\0';
			memset(&props, 0, sizeof(props));
			props._flags = AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG;
			props.message_id = amqp_cstring_bytes(line);
			props.delivery_mode = 2;
			if (amqp_basic_publish(conn, 1, amqp_empty_bytes, queue, 1, 0, &props,
								   amqp_cstring_bytes(sp + 1)) != AMQP_STATUS_OK)
			{
				fprintf(stderr, "amqp_dump: basic.publish failed\n");
				return 1;
			}
			sent++;
		}
		/* a confirm may cover several (multiple): count up to the delivery tag */
		while (acked < sent)
		{
			amqp_frame_t frame;

			if (amqp_simple_wait_frame(conn, &frame) != AMQP_STATUS_OK)
			{
				fprintf(stderr, "amqp_dump: waiting for confirms failed\n");
				return 1;
			}
			if (frame.frame_type != AMQP_FRAME_METHOD)
				continue;
			if (frame.payload.method.id == AMQP_BASIC_ACK_METHOD)
			{
				amqp_basic_ack_t *ack = frame.payload.method.decoded;

				acked = ack->multiple ? (int) ack->delivery_tag : acked + 1;
			}
			else
			{
				fprintf(stderr, "amqp_dump: the broker did not confirm a publish\n");
				return 1;
			}
		}
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
