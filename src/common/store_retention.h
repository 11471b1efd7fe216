/*-------------------------------------------------------------------------
 *
 * store_retention.h
 *	  The stores that keep rows by time beside the claims (the outbox, the
 *	  requests, the inbox), named, and the retention each has in force:
 *	  its own from idempotency.store_settings, else idem_configure's
 *	  (store_retention.c).  In common so that every wing may ask: the
 *	  dedup claims of the inbox and of requests follow their store's
 *	  retention.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_STORE_RETENTION_H
#define IDEM_COMMON_STORE_RETENTION_H

#include "datatype/timestamp.h"
#include "utils/snapshot.h"

typedef enum IdemStoreId
{
	IDEM_STORE_OUTBOX,
	IDEM_STORE_REQUESTS,
	IDEM_STORE_INBOX,
	IDEM_NSTORES
} IdemStoreId;

/*
 * The claim scopes of the inbox's and the requests' dedup claims start so;
 * those claims follow their store's retention (claims/classes.c).
 */
#define IDEM_INBOX_SCOPE_PREFIX		"inbox:"
#define IDEM_REQUEST_SCOPE_PREFIX	"request:"

/* A store's own retention, if idempotency.store_settings has one. */
typedef struct IdemStoreOverride
{
	bool		set;
	Interval	retention_iv;	/* as stored */
	int64		retention;		/* in seconds */
} IdemStoreOverride;

/* columns of idempotency.store_settings */
enum
{
	Anum_store_settings_store = 1,
	Anum_store_settings_retention,
	_Anum_store_settings_max,
};

/* The name of a store in SQL ('outbox', 'requests', 'inbox'). */
extern const char *idem_store_name(IdemStoreId store);
extern bool idem_store_by_name(const char *name, IdemStoreId *store);

/* Every store's override as snap sees it; none where the table is missing. */
extern void idem_store_overrides(Snapshot snap, IdemStoreOverride out[IDEM_NSTORES]);

/*
 * A store's retention in force in seconds, under the active snapshot: its
 * override, else default_secs (idem_configure's retention, which the
 * caller has: common cannot read the claims' settings).
 */
extern int64 idem_store_retention(IdemStoreId store, int64 default_secs);

#endif							/* IDEM_COMMON_STORE_RETENTION_H */
