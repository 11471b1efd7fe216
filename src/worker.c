/* worker.c: placeholder, being written */
#include "idempotency.h"

void
idem_worker_init(void)
{
}
