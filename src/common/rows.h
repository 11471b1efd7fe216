/*-------------------------------------------------------------------------
 *
 * rows.h
 *	  Rows written without the executor (rows.c): claims, events, messages
 *	  and requests.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_ROWS_H
#define IDEM_COMMON_ROWS_H

#include "storage/itemptr.h"
#include "utils/relcache.h"

typedef struct IdemIndexSet
{
	Relation	heap;
	int			n;
	Relation   *indexes;
	struct IndexInfo **infos;
} IdemIndexSet;

extern void idem_open_insert_indexes(Relation heap, IdemIndexSet *set, const char *what);
extern void idem_close_insert_indexes(IdemIndexSet *set);
extern void idem_insert_index_entries(IdemIndexSet *set, Datum *values, bool *nulls,
									  ItemPointer tid, Oid unique_index);
extern void idem_insert_row(IdemIndexSet *set, Datum *values, bool *nulls, Oid unique_index);

#endif							/* IDEM_COMMON_ROWS_H */
