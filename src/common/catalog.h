/*-------------------------------------------------------------------------
 *
 * catalog.h
 *	  The extension's schema and the columns of its own tables that C reads
 *	  or writes by number: one description, which must match the CREATE
 *	  TABLE statements in sql/tables/ (and the updates in sql/updates/, which
 *	  append).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_CATALOG_H
#define IDEM_COMMON_CATALOG_H

#include "utils/rel.h"

/* Name of the schema that holds the extension's tables and internals. */
#define IDEM_SCHEMA "idempotency"

/* idempotency.claims and its partitions */
enum Anum_claims
{
	Anum_claims_scope = 1,
	Anum_claims_key,
	Anum_claims_claimed_at,
	Anum_claims_fingerprint,	/* 1.0's payload hash; read, no longer written */
	Anum_claims_digest,			/* SHA-256 of the canonical payload */
	_Anum_claims_max
};
#define Natts_claims (_Anum_claims_max - 1)

/* idempotency.partition_registry */
enum Anum_registry
{
	Anum_registry_relid = 1,
	Anum_registry_lower,
	Anum_registry_upper,
	Anum_registry_sealed,
	Anum_registry_bloom,
	Anum_registry_nkeys,
	Anum_registry_max_claimed_at,
	Anum_registry_closed,
	Anum_registry_held_by,
	Anum_registry_retention,
	Anum_registry_keep_retention,
	Anum_registry_keep_default,
	_Anum_registry_max
};
#define Natts_registry (_Anum_registry_max - 1)

/* idempotency.settings */
enum Anum_settings
{
	Anum_settings_singleton = 1,
	Anum_settings_retention,
	Anum_settings_interval,
	Anum_settings_premake,
	_Anum_settings_max
};
#define Natts_settings (_Anum_settings_max - 1)

/* idempotency.late_summaries */
enum Anum_late
{
	Anum_late_id = 1,
	Anum_late_expired_from,
	Anum_late_expired_to,
	Anum_late_last_drop,
	Anum_late_nkeys,
	Anum_late_capacity,
	Anum_late_bloom,
	_Anum_late_max
};
#define Natts_late (_Anum_late_max - 1)

/* idempotency.filter_groups */
enum Anum_group
{
	Anum_group_id = 1,
	Anum_group_members,
	Anum_group_nkeys,
	Anum_group_capacity,
	Anum_group_bloom,
	_Anum_group_max
};
#define Natts_group (_Anum_group_max - 1)

extern Oid	idem_schema_oid(void);
extern Oid	idem_internal_relid(const char *relname);
extern Relation idem_open_internal(Oid relid);

#endif							/* IDEM_COMMON_CATALOG_H */
