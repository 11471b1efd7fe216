/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *	  Declarations shared by the subsystems of the idempotency extension.
 *
 * Each subsystem lives in its own file with its own prefix: claims.c,
 * retention.c, guards.c, worker.c.  idempotency.c holds only _PG_init and
 * the few helpers every subsystem uses.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "utils/elog.h"

/* Name of the schema that holds the extension's tables and internals. */
#define IDEM_SCHEMA "idempotency"

/* SQLSTATEs of class IK (SPEC.md section 7). */
#define ERRCODE_IDEM_KEY_REUSED			MAKE_SQLSTATE('I','K','0','0','1')
#define ERRCODE_IDEM_REQUEST_IN_PROGRESS	MAKE_SQLSTATE('I','K','0','0','2')
#define ERRCODE_IDEM_LEASE_LOST			MAKE_SQLSTATE('I','K','0','0','3')
#define ERRCODE_IDEM_STALE_VERSION		MAKE_SQLSTATE('I','K','0','0','4')
#define ERRCODE_IDEM_INVALID_TRANSITION	MAKE_SQLSTATE('I','K','0','0','5')

/* idempotency.c: helpers shared by the subsystems */
extern Oid	idem_schema_oid(void);
extern Oid	idem_internal_relid(const char *relname);

/* claims.c */
extern uint64 idem_key_hash(text *scope, text *key);

/* Bloom filters of sealed partitions (claims.c) */
#define IDEM_BLOOM_HASHES		7
#define IDEM_BLOOM_BITS_PER_KEY	10
#define IDEM_BLOOM_ROUND_BITS	512		/* filter sizes are multiples of this */
extern void idem_bloom_add(uint8 *bloom, uint32 nbits, uint64 hash);
extern bool idem_bloom_maybe(const uint8 *bloom, uint32 nbits, uint64 hash);

/* retention.c: the partition registry and its per-backend cache */
typedef struct IdemPartition
{
	Oid			relid;			/* partition table */
	Oid			indexid;		/* its unique index on (scope, key), or
								 * InvalidOid until first opened */
	TimestampTz lower;			/* claims made at or after ... */
	TimestampTz upper;			/* ... and before this go here */
	bool		sealed;			/* no more claims will go here */
	uint32		bloom_bits;		/* size of bloom in bits; 0 = no filter */
	uint8	   *bloom;			/* Bloom filter of a sealed partition's keys */
} IdemPartition;

typedef struct IdemPartitionSet
{
	Oid			claims_relid;	/* idempotency.claims, the parent */
	int64		retention;		/* microseconds; older partitions are dead */
	uint64		generation;		/* changes whenever the set is rebuilt */
	int			nparts;
	IdemPartition *parts;		/* sorted by lower, newest first */
} IdemPartitionSet;

extern IdemPartitionSet *idem_partition_set(bool fresh);
extern void idem_retention_init(void);
extern int	idem_maintain_round(int elevel);

/* worker.c: the maintenance background worker */
extern void idem_worker_init(void);
extern PGDLLEXPORT void idem_launcher_main(Datum main_arg);
extern PGDLLEXPORT void idem_worker_main(Datum main_arg);

/* guards.c: per-backend counters of guarded writes */
typedef struct IdemGuardCounters
{
	int64		stale_skipped;		/* version guard, 'skip' */
	int64		stale_rejected;		/* version guard, 'error' (IK004) */
	int64		upsert_stale;		/* idem_upsert() returned 'stale' */
	int64		invalid_skipped;	/* transition guard, 'skip' */
	int64		invalid_rejected;	/* transition guard, 'error' (IK005) */
	int64		already_applied;	/* transition to the state a row had */
} IdemGuardCounters;

extern void idem_guards_init(void);
extern void idem_guard_counters(IdemGuardCounters *out);

#endif							/* IDEMPOTENCY_H */
