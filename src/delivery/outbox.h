/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  What the files of the outbox share, and they only: outbox.c (settings,
 *	  statements, a deliveries row's states), outbox_emit.c (emit, emit
 *	  locks and wake-ups), outbox_lease.c (idem_outbox_claim: parked
 *	  aggregates, the cursor, candidates), outbox_settle.c (ack, nack,
 *	  extend, redrive, discard) and outbox_subscriptions.c (subscribe,
 *	  unsubscribe, the subscription a call works for).  outbox.c's banner describes the whole.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DELIVERY_OUTBOX_H
#define IDEM_DELIVERY_OUTBOX_H

#include "access/xact.h"
#include "fmgr.h"
#include "storage/itemptr.h"
#include "utils/jsonb.h"
#include "utils/uuid.h"

/* prefix of the logical decoding messages of outbox_mode 'wal' and 'both' */
#define OUTBOX_MESSAGE_PREFIX	"idempotency.outbox"
#define OUTBOX_NOTIFY_CHANNEL	"idempotency_outbox"

/* longest names stored as they are */
#define OUTBOX_MAX_TYPE_BYTES	IDEM_MAX_SCOPE_BYTES
#define OUTBOX_MAX_EVENT_TYPE_BYTES	255

/* rows a claim reads from its cursor at a time */
#define OUTBOX_SCAN_CHUNK		256

/* aggregates a claim locks at first, before it knows how long runs are */
#define OUTBOX_LEASE_GROUP		8

/* deliveries rows a relay makes in one transaction, at most */
#define OUTBOX_MAX_NEW_ROWS		1024

/* emit locks a transaction takes, at most (then one lock for all: outbox_emit.c) */
#define OUTBOX_MAX_EMIT_LOCKS	512

/* how often a relay writes its cursor back */
#define OUTBOX_CURSOR_WRITE_USECS	USECS_PER_SEC

/*---- settings (outbox.c) ----*/

#define OUTBOX_MAX_ATTEMPTS_DEFAULT	10
#define OUTBOX_KEEP_UNDELIVERED_DEFAULT	true
#define OUTBOX_DEAD_POLICY_DEFAULT	DEAD_BLOCK
#define OUTBOX_NOTIFY_DEFAULT		NOTIFY_COMMIT
#define OUTBOX_NOTIFY_WINDOW_DEFAULT	10	/* ms */
#define OUTBOX_MODE_DEFAULT			MODE_TABLE
#define OUTBOX_MAX_LAG_DEFAULT		(14 * SECS_PER_DAY)

typedef enum
{
	DEAD_BLOCK,
	DEAD_SKIP
} OutboxDeadPolicy;

typedef enum
{
	NOTIFY_COMMIT,
	NOTIFY_COALESCE,
	NOTIFY_OFF
} OutboxNotify;

typedef enum
{
	MODE_TABLE,
	MODE_WAL,
	MODE_BOTH
} OutboxMode;

extern int	outbox_max_attempts;
extern int	outbox_dead_policy;
extern int	outbox_notify;
extern int	outbox_notify_window;	/* milliseconds, for NOTIFY_COALESCE */
extern int	outbox_mode;

/*---- statements (outbox.c) ----*/

typedef enum
{
	ST_WAL_SEQ,
	ST_NEWEST_SEQ,
	ST_CURSOR_READ,
	ST_CURSOR_MAKE,
	ST_CURSOR_WRITE,
	ST_SCAN,
	ST_ENSURE_DELIVERIES,
	ST_LOCK_CANDIDATES,
	ST_PARKED_DUE,
	ST_PARKED_DEAD,
	ST_RUN,
	ST_SET_STATE,
	ST_UNPARK,
	ST_DEAD_LETTER,
	ST_FIND_EVENTS,
	ST_LOCK_DELIVERIES,
	ST_EXTEND,
	ST_LEASE_TYPES,
	ST_FIND_DEAD,
	ST_DELETE_DEAD,
	NUM_STATEMENTS
} OutboxStatement;

extern uint64 outbox_exec(OutboxStatement st, Datum *values, const char *nulls, int expected);

/*---- events (outbox.c) ----*/

/* what an emit hands the caller and logical decoding */
typedef struct OutboxEvent
{
	pg_uuid_t	id;
	const char *aggregate_type;
	const char *aggregate_id;
	int64		seq;
	const char *event_type;
	Jsonb	   *payload;
	Jsonb	   *headers;
	TimestampTz created_at;
} OutboxEvent;

/*---- delivery state (outbox.c) ----*/

/* One outbox_deliveries row, as locked and as it will be written back. */
typedef struct Delivery
{
	char	   *aggregate_type;
	char	   *aggregate_id;
	int64		acked;
	bool		leased;			/* leased_seq, lease_token, lease_until set */
	int64		leased_seq;
	pg_uuid_t	token;
	TimestampTz until;
	int32		attempts;
	bool		parked;			/* retry_at set */
	TimestampTz retry_at;
	bool		dead;			/* dead_seq set: the head (acked + 1) is dead */
	int64		dead_seq;
	char	   *error;			/* last_error, or NULL */
	bool		redrive;		/* redrive_seq set: waiting for the lease to end */
	int64		redrive_seq;
	int64		last_seq;		/* newest seq, once read: outbox_last_seq() */
	bool		last_seq_known;
	ItemPointerData ctid;		/* of the locked row version */
	bool		changed;
	bool		unpark;			/* try to unpark after writing */
} Delivery;

extern Delivery *outbox_read_deliveries(uint64 n);
extern int64 outbox_last_seq(Delivery *d);
extern void outbox_park(Delivery *d, TimestampTz at);
extern void outbox_clear_dead(Delivery *d, TimestampTz now);
extern void outbox_rewind_to(Delivery *d, int64 seq, TimestampTz now);
extern void outbox_end_lease(Delivery *d, TimestampTz now);
extern void outbox_write_deliveries(Delivery *ds, int n, TimestampTz now);
extern void outbox_key_arrays(char **types, char **ids, int n, Datum *values);
extern bool outbox_lock_new_row(const char *type, const char *id, bool wait);
extern void outbox_ensure_deliveries(char **types, char **ids, int *n, bool admin);
extern Delivery *outbox_lock_deliveries(char **types, char **ids, int n, int *nlocked);
extern bool outbox_lease_is(const Delivery *d, const pg_uuid_t *token);
extern bool outbox_lease_live(const Delivery *d, TimestampTz now);
extern bool outbox_lease_held(const Delivery *d, const pg_uuid_t *token, TimestampTz now);
extern bool outbox_dead_letter(Delivery *d, int64 seq, const char *error, TimestampTz now);
extern void outbox_head_exhausted(Delivery *d, TimestampTz now);
extern bool outbox_apply_dead_policy(Delivery *d, TimestampTz now);
extern void outbox_event_values(const OutboxEvent *ev, int32 attempts, const pg_uuid_t *token,
								TimestampTz until, Datum *values, bool *nulls);
extern void outbox_event_stored_values(const OutboxEvent *ev, Datum *values);

/*---- subscriptions (outbox_subscriptions.c) ----*/

/* The subscription a relay or operator call works for. */
typedef struct OutboxSubscription
{
	int32		id;
	const char *name;
	int			ntypes;			/* its aggregate types, or -1: every type */
	char	  **types;
	Datum		types_array;	/* text[] of them, if ntypes >= 0 */
	int			dead_policy;	/* its own, or -1: the setting's */
} OutboxSubscription;

struct IdemCapGrants;
extern const OutboxSubscription *outbox_subscription_open(FunctionCallInfo fcinfo, int argno,
														   const char *fname, int cap,
														   const struct IdemCapGrants *g);
extern int32 outbox_subscription_id(void);
extern int	outbox_subscription_dead_policy(void);
extern bool outbox_subscription_covers(const OutboxSubscription *sub, const char *type);

/*---- wake-ups (outbox_emit.c) ----*/

extern void outbox_xact_callback(XactEvent event, void *arg);
extern bool outbox_emits_idle(const char *type, const char *id);
extern void outbox_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
									SubTransactionId parentSubid, void *arg);

#endif							/* IDEM_DELIVERY_OUTBOX_H */
