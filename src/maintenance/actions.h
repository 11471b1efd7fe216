/*-------------------------------------------------------------------------
 *
 * actions.h
 *	  What every step of a maintenance round uses (actions.c), and the
 *	  steps themselves (claim_partitions.c, store_partitions.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_MAINTENANCE_ACTIONS_H
#define IDEM_MAINTENANCE_ACTIONS_H

#include "claims/settings.h"
#include "datatype/timestamp.h"

/*
 * lock_timeout of a maintenance round: its DDL waits at most this long for
 * a lock (any role that may LOCK a parent can hold one), then the action is
 * reported as "skip ... (in use)" and the round goes on.
 */
#define IDEM_MAINTENANCE_LOCK_TIMEOUT_MS	1000

/*
 * Where a round reports its actions: rows of idem_maintain() (store set),
 * or the log at elevel (the worker's LOG, idem_configure()'s DEBUG1).
 */
typedef struct MaintainReport
{
	struct Tuplestorestate *store;
	struct TupleDescData *desc;
	int			elevel;
	int			nactions;
} MaintainReport;

typedef bool (*IdemGuardedAction) (void *arg);

/* A partition to create, for [lower, upper), as one guarded action of a step */
typedef struct IdemCreateCall
{
	void	   *step;			/* the step's own state */
	TimestampTz lower;
	TimestampTz upper;
	const char *name;			/* qualified, quoted */
} IdemCreateCall;

/* actions.c */
extern void idem_report_action(MaintainReport *rep, const char *action, const char *object);
extern bool idem_run_guarded(MaintainReport *rep, const char *verb, const char *object,
							 IdemGuardedAction fn, void *arg);
extern bool idem_partition_trusted(MaintainReport *rep, const char *verb, Oid relid, Oid parent,
								   const char *name);
extern void idem_exec_ddl_as_data(const char *sql);
extern void idem_forget_missing(MaintainReport *rep, const char *registry);
extern char *idem_partition_name(const char *prefix, TimestampTz lower);
extern TimestampTz idem_next_boundary(TimestampTz now, int64 interval_secs);

/* maintenance.c */
extern bool idem_round_caller_trusted(void);

/* the steps */
extern void idem_claim_partitions_keep(const char *pattern, bool removed, int64 retention);
extern void idem_claim_partitions_maintain(MaintainReport *rep, const IdemSettings *s,
										   TimestampTz now, bool reshape);
extern void idem_stores_maintain(MaintainReport *rep, const IdemSettings *s, TimestampTz now);

#endif							/* IDEM_MAINTENANCE_ACTIONS_H */
