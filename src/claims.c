/* claims.c: placeholder, being written */
#include "idempotency.h"

void
idem_claims_init(void)
{
}
