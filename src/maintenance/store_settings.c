/*-------------------------------------------------------------------------
 *
 * store_settings.c
 *	  The retention of each store of its own (the outbox, the inbox, the
 *	  requests): idem_configure_store(store, retention), which stores it in
 *	  idempotency.store_settings (NULL removes it: the store follows
 *	  idem_configure's retention again) and applies it at once with a
 *	  round; idempotency.current_store_settings(), what is in force; and
 *	  the rule a store's retention must keep with the settings, which
 *	  idem_configure() checks too, so that a new partition_interval or
 *	  premake never leaves a store's retention invalid.  Reading the
 *	  overrides is common/store_retention.c's.
 *
 * Locking rules: idem_configure_store() waits for the maintenance lock (as
 * idem_configure() does) and reads the settings and validates only once
 * it holds it, so that neither a configuration nor a round runs between
 * its check and its commit: a round that already read the old retention
 * finishes first (its drops were due by the retention in force then), and
 * rounds after it see the new one.  It writes the table as the extension's
 * owner; its statement trigger invalidates the caches that watch it
 * (common/cache.c).
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "maintenance/store_settings.h"

#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "common/args.h"
#include "common/capabilities.h"
#include "common/ownership.h"
#include "common/spi.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "maintenance/actions.h"
#include "maintenance/maintenance.h"
#include "utils/builtins.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(idem_configure_store);
PG_FUNCTION_INFO_V1(idem_current_store_settings);

/*
 * Error out unless retention (seconds) suits the settings s: at least one
 * partition_interval, at most the retention bound, and no more live
 * partitions than a claims configuration may have (the stores' registries
 * and writers' caches list each live one).  by_configure: the check of
 * idem_configure, whose new settings would break the store's retention.
 */
static void
validate_store_retention(IdemStoreId store, int64 retention, const IdemSettings *s,
						 bool by_configure)
{
	const char *name = idem_store_name(store);
	int			room = IDEM_MAX_LIVE_PARTITIONS - 1 - s->premake;
	int64		live;

#define STORE_HINT(...) \
	(by_configure ? \
	 errhint("Change the retention of store \"%s\" first with idem_configure_store(), or remove it (NULL).", name) : \
	 errhint(__VA_ARGS__))

	if (retention < s->interval)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention of store \"%s\" must not be shorter than partition_interval", name),
				 errdetail("retention is %lld seconds, partition_interval %lld seconds.",
						   (long long) retention, (long long) s->interval),
				 STORE_HINT("Use a retention of at least %lld seconds, or a shorter partition_interval (idem_configure()).",
							(long long) s->interval)));
	if (retention > IDEM_MAX_RETENTION_SECS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("retention of store \"%s\" must not exceed %d years", name,
						IDEM_MAX_RETENTION_YEARS),
				 STORE_HINT("Use a retention of at most %lld seconds.",
							(long long) IDEM_MAX_RETENTION_SECS)));
	/* live partitions: the retention window, the current one, premade ones */
	live = (retention + s->interval - 1) / s->interval + 1 + s->premake;
	if (live > IDEM_MAX_LIVE_PARTITIONS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("too many live partitions for store \"%s\": %lld, at most %d",
						name, (long long) live, IDEM_MAX_LIVE_PARTITIONS),
				 errdetail("retention %lld s over partition_interval %lld s, plus premake %d, is too many.",
						   (long long) retention, (long long) s->interval, s->premake),
				 STORE_HINT("Use a retention of at most %lld seconds, or a longer partition_interval (idem_configure()).",
							(long long) room * s->interval)));
#undef STORE_HINT
}

/*
 * idem_configure()'s check of the stores' own retentions against its new
 * settings s; the caller holds the maintenance lock.
 */
void
idem_validate_store_settings(const IdemSettings *s)
{
	IdemStoreOverride o[IDEM_NSTORES];

	idem_store_overrides(GetLatestSnapshot(), o);
	for (int i = 0; i < IDEM_NSTORES; i++)
		if (o[i].set)
			validate_store_retention((IdemStoreId) i, o[i].retention, s, true);
}

/* Every store's retention in force in seconds, as snap sees the overrides. */
void
idem_store_retentions(const IdemSettings *s, Snapshot snap, int64 out[IDEM_NSTORES])
{
	IdemStoreOverride o[IDEM_NSTORES];

	idem_store_overrides(snap, o);
	for (int i = 0; i < IDEM_NSTORES; i++)
		out[i] = o[i].set ? o[i].retention : s->retention;
}

/*
 * idem_configure_store(store, retention): validate and store a store's own
 * retention (NULL removes it), then run a round, so that a lower one drops
 * what is due at once.
 */
Datum
idem_configure_store(PG_FUNCTION_ARGS)
{
	char	   *name = text_to_cstring(idem_text_arg(fcinfo, 0, "store"));
	IdemStoreId store;
	IdemSettings s;
	IdemAsOwner as;
	Oid			types[2] = {TEXTOID, INTERVALOID};
	Datum		values[2];

	if (!idem_store_by_name(name, &store))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("unknown store \"%s\"", name),
				 errhint("A store is 'outbox', 'inbox' or 'requests'.")));
	idem_capability_require_unlimited("idem_configure_store", IDEM_CAP_OPERATOR);

	/* validate against settings no configuration can change before commit */
	idem_maintenance_lock_wait();
	idem_become_owner(&as);
	SPI_connect();
	s = idem_read_settings(GetLatestSnapshot());
	values[0] = CStringGetTextDatum(name);
	if (PG_ARGISNULL(1))
		idem_spi_exec("DELETE FROM idempotency.store_settings WHERE store = $1",
					  1, types, values, SPI_OK_DELETE);
	else
	{
		Interval   *iv = PG_GETARG_INTERVAL_P(1);

		validate_store_retention(store, idem_interval_seconds(iv), &s, false);
		values[1] = IntervalPGetDatum(iv);
		idem_spi_exec("INSERT INTO idempotency.store_settings (store, retention)"
					  " VALUES ($1, $2)"
					  " ON CONFLICT (store) DO UPDATE SET retention = $2",
					  2, types, values, SPI_OK_INSERT);
	}

	/*
	 * The inbox's and the requests' dedup claims follow the store
	 * (claims/classes.c): their classes must fit, and a raised retention
	 * keeps the sealed partitions that hold them longer.
	 */
	if (store == IDEM_STORE_INBOX || store == IDEM_STORE_REQUESTS)
	{
		const char *prefix = store == IDEM_STORE_INBOX ?
			IDEM_INBOX_SCOPE_PREFIX "*" : IDEM_REQUEST_SCOPE_PREFIX "*";

		idem_validate_claim_classes();
		idem_claim_partitions_keep(prefix, PG_ARGISNULL(1), PG_ARGISNULL(1) ? 0 :
								   idem_interval_seconds(PG_GETARG_INTERVAL_P(1)) * USECS_PER_SEC);
	}
	SPI_finish();
	idem_unbecome_owner(&as);

	/* in force now: the round (which takes the lock again) drops what is due */
	(void) idem_maintain_round(DEBUG1);
	PG_RETURN_VOID();
}

/*
 * idempotency.current_store_settings(): each store's retention in force,
 * and whether it is the store's own (else idem_configure's), as this
 * transaction sees them.
 */
Datum
idem_current_store_settings(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemSettings s = idem_read_settings(GetActiveSnapshot());
	IdemStoreOverride o[IDEM_NSTORES];

	InitMaterializedSRF(fcinfo, 0);
	idem_store_overrides(GetActiveSnapshot(), o);
	for (int i = 0; i < IDEM_NSTORES; i++)
	{
		Datum		values[3];
		bool		nulls[3] = {false, false, false};
		Interval   *iv = palloc(sizeof(Interval));

		*iv = o[i].set ? o[i].retention_iv : s.retention_iv;
		values[0] = CStringGetTextDatum(idem_store_name((IdemStoreId) i));
		values[1] = IntervalPGetDatum(iv);
		values[2] = BoolGetDatum(o[i].set);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
