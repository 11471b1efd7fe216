/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Everything that depends on the PostgreSQL major version, in one place.
 *	  The extension is built and tested for PostgreSQL 15 only (see
 *	  idempotency.h); a port to a later version changes this file (16
 *	  replaced pg_class_ownercheck() by object_ownercheck(), for one) and
 *	  adds a CI run for it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_COMPAT_H
#define IDEM_COMMON_COMPAT_H

#include "miscadmin.h"
#include "utils/acl.h"

/* Does the current user own relation relid (or have its owner's rights)? */
#define idem_rel_owned_by_user(relid)	pg_class_ownercheck((relid), GetUserId())

#endif							/* IDEM_COMMON_COMPAT_H */
