/*-------------------------------------------------------------------------
 *
 * rows.c
 *	  Writing a row straight into a table and its indexes, without the
 *	  executor: what claims (claims.c) and outbox events (outbox.c) do on
 *	  their hot paths, where setting up an executor per row would cost more
 *	  than the write.
 *
 * Only plain column indexes are maintained (one with expressions or a
 * predicate is refused with an error); triggers, rules, row-level security
 * and CHECK constraints are not applied, so the tables written this way
 * must not rely on them (the callers' parents refuse or do not need them).
 * The caller holds RowExclusiveLock on the table; the indexes are opened
 * with the same lock and kept open until the caller closes them.
 *
 *-------------------------------------------------------------------------
 */
#include "idempotency.h"
#include "common/rows.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "catalog/index.h"
#include "pgstat.h"
#include "utils/rel.h"

/* Open every index of heap for inserts; what names the table in errors. */
void
idem_open_insert_indexes(Relation heap, IdemIndexSet *set, const char *what)
{
	List	   *oids = RelationGetIndexList(heap);
	ListCell   *lc;

	set->heap = heap;
	set->indexes = palloc(sizeof(Relation) * Max(list_length(oids), 1));
	set->infos = palloc(sizeof(IndexInfo *) * Max(list_length(oids), 1));
	set->n = 0;
	foreach(lc, oids)
	{
		Relation	index = index_open(lfirst_oid(lc), RowExclusiveLock);
		IndexInfo  *info;

		/*
		 * Refused before BuildIndexInfo(), which folds the expressions:
		 * that would run code the index's owner chose, as the caller.
		 */
		if (!heap_attisnull(index->rd_indextuple, Anum_pg_index_indexprs, NULL) ||
			!heap_attisnull(index->rd_indextuple, Anum_pg_index_indpred, NULL))
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("%s \"%s\" has index \"%s\" with expressions or a predicate",
							what, RelationGetRelationName(heap), RelationGetRelationName(index)),
					 errdetail("The idempotency extension maintains only indexes on plain columns there."),
					 errhint("Drop the index, or index the columns themselves.")));
		info = BuildIndexInfo(index);
		if (!info->ii_ReadyForInserts)
		{
			index_close(index, NoLock);
			continue;
		}
		set->indexes[set->n] = index;
		set->infos[set->n++] = info;
	}
	list_free(oids);
}

void
idem_close_insert_indexes(IdemIndexSet *set)
{
	for (int i = 0; i < set->n; i++)
		index_close(set->indexes[i], NoLock);
	set->n = 0;
}

/*
 * Insert the entries of the row at tid into every index.  The uniqueness of
 * a unique index, and of the index unique_index if given, is checked.
 */
void
idem_insert_index_entries(IdemIndexSet *set, Datum *values, bool *nulls, ItemPointer tid,
						  Oid unique_index)
{
	for (int i = 0; i < set->n; i++)
	{
		Relation	index = set->indexes[i];
		IndexInfo  *info = set->infos[i];
		Datum		ivalues[INDEX_MAX_KEYS];
		bool		inulls[INDEX_MAX_KEYS];

		for (int j = 0; j < info->ii_NumIndexAttrs; j++)
		{
			AttrNumber	att = info->ii_IndexAttrNumbers[j];

			if (att <= 0 || att > RelationGetDescr(set->heap)->natts)
				elog(ERROR, "unexpected column %d in index \"%s\"", att,
					 RelationGetRelationName(index));
			ivalues[j] = values[att - 1];
			inulls[j] = nulls[att - 1];
		}
		index_insert(index, ivalues, inulls, tid, set->heap,
					 (RelationGetRelid(index) == unique_index || info->ii_Unique) ?
					 UNIQUE_CHECK_YES : UNIQUE_CHECK_NO,
					 false, info);
	}
}

/* Insert a row (values in the table's column order) and its index entries. */
void
idem_insert_row(IdemIndexSet *set, Datum *values, bool *nulls, Oid unique_index)
{
	HeapTuple	tup = heap_form_tuple(RelationGetDescr(set->heap), values, nulls);

	heap_insert(set->heap, tup, GetCurrentCommandId(true), 0, NULL);
	pgstat_count_heap_insert(set->heap, 1);
	idem_insert_index_entries(set, values, nulls, &tup->t_self, unique_index);
	heap_freetuple(tup);
}
