/*-------------------------------------------------------------------------
 *
 * delivery.h
 *	  The delivery wing's set-up: the settings of the outbox and the inbox
 *	  (outbox.c, inbox.c) and the stores' cache (store.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DELIVERY_DELIVERY_H
#define IDEM_DELIVERY_DELIVERY_H

extern void idem_outbox_init(void);
extern void idem_inbox_init(void);

#endif							/* IDEM_DELIVERY_DELIVERY_H */
