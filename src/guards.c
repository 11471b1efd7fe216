/* guards.c: placeholder, being written */
#include "idempotency.h"

void
idem_guards_init(void)
{
}
