/*-------------------------------------------------------------------------
 *
 * capabilities.h
 *	  Capabilities: who may call which API function, for which scopes,
 *	  aggregate types and sources (capabilities.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_CAPABILITIES_H
#define IDEM_COMMON_CAPABILITIES_H

typedef enum IdemCapability
{
	IDEM_CAP_HANDLER = 0,
	IDEM_CAP_RELAY,
	IDEM_CAP_OPERATOR,
	IDEM_CAP_MONITOR,
	IDEM_NUM_CAPS
} IdemCapability;

/* The axis a grant may be limited on (a column of idempotency.capabilities). */
typedef enum IdemCapAxis
{
	IDEM_AXIS_SCOPE = 0,
	IDEM_AXIS_TYPE,
	IDEM_AXIS_SOURCE,
	IDEM_AXIS_SUBSCRIPTION,
	IDEM_NUM_AXES
} IdemCapAxis;

/*
 * The caller's grants of one capability, for filtering rows by an axis.
 * Got from idem_capability_require_any(); NULL means unlimited on every
 * axis (a superuser, the extension's owner, or an unlimited grant).
 */
typedef struct IdemCapGrants IdemCapGrants;

extern void idem_capability_require(const char *fname, IdemCapability cap,
									IdemCapAxis axis, const char *value);
extern void idem_capability_require_unlimited(const char *fname, IdemCapability cap);
extern const IdemCapGrants *idem_capability_require_any(const char *fname, IdemCapability cap);
extern bool idem_capability_allows(const IdemCapGrants *g, IdemCapAxis axis, const char *value);
extern bool idem_capability_limited(const IdemCapGrants *g, IdemCapAxis axis);
extern void idem_capability_check_unlimited(const char *fname, IdemCapability cap,
											const IdemCapGrants *g);
extern void idem_capability_check_value(const char *fname, IdemCapability cap,
										const IdemCapGrants *g, IdemCapAxis axis,
										const char *value);
extern bool idem_capability_held(IdemCapability cap);
extern int	idem_capability_exact_names(const IdemCapGrants *g, IdemCapAxis axis, char ***names);

#endif							/* IDEM_COMMON_CAPABILITIES_H */
