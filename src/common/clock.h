/*-------------------------------------------------------------------------
 *
 * clock.h
 *	  The extension's clock and the test-only injection point (clock.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_CLOCK_H
#define IDEM_COMMON_CLOCK_H

#include "datatype/timestamp.h"

extern TimestampTz idem_now(void);
extern void idem_debug_wait(const char *point);
extern void idem_clock_init(void);

#endif							/* IDEM_COMMON_CLOCK_H */
