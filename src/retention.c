/* retention.c: placeholder, being written */
#include "idempotency.h"

void
idem_retention_init(void)
{
}
