/*-------------------------------------------------------------------------
 *
 * guards.h
 *	  Declarations shared by the files of guarded writes, and by them only.
 *
 * Guarded writes are the version and state-transition guards that live on
 * the table, plus the idem_upsert() and idem_transition() helpers.  They
 * take three files, one job each:
 *
 *	guard_rules.c		the rules of guarded columns: the types a version
 *						column may have, how versions compare and which are
 *						finite; transition maps, parsed into values of the
 *						state column and compared with its type's equality
 *	guard_triggers.c	the trigger functions; installing and removing guards
 *						(idem_guard_version, idem_guard_transitions,
 *						idem_unguard); the counters, guard_stats() and
 *						idem_guards_init()
 *	guard_helpers.c		idem_upsert() and idem_transition(), with their
 *						bounded plan caches
 *
 * The rules are shared so that a guard and the helpers judge versions and
 * states alike.  _PG_init calls idem_guards_init() (the only name of
 * guards another wing uses).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_GUARDS_H
#define IDEM_GUARDS_H

#include "common/catalog.h"
#include "fmgr.h"
#include "utils/jsonb.h"
#include "utils/reltrigger.h"

/* per-backend counters of guarded writes (guard_stats()) */
typedef struct IdemGuardCounters
{
	int64		stale_skipped;		/* version guard, 'skip' */
	int64		stale_rejected;		/* version guard, 'error' (IK004) */
	int64		upsert_stale;		/* idem_upsert() returned 'stale' */
	int64		invalid_skipped;	/* transition guard, 'skip' */
	int64		invalid_rejected;	/* transition guard, 'error' (IK005) */
	int64		already_applied;	/* transition to the state a row had */
} IdemGuardCounters;

extern void idem_guards_init(void);

/*---- names ----*/

#define VERSION_TRIGGER_NAME	"idem_guard_version"
#define TRANSITION_TRIGGER_NAME	"idem_guard_transitions"
#define VERSION_TRIGGER_FUNC	IDEM_SCHEMA ".version_guard"
#define TRANSITION_TRIGGER_FUNC	IDEM_SCHEMA ".transition_guard"

/*---- guard_rules.c: versions ----*/

extern bool idem_version_type_ok(Oid typid);
extern void idem_check_version_type(Oid atttypid, const char *colname, Oid relid);
extern bool idem_version_finite(Oid typid, Datum v);
extern void idem_check_version_finite(Oid typid, Datum v, const char *colname,
									  const char *relname);
extern bool idem_version_raised(Oid typid, Datum newv, Datum oldv, bool oldnull);
extern char *idem_version_gap(Oid typid, Datum stored, Datum incoming);

/*---- guard_rules.c: states and transition maps ----*/

/*
 * How the states of one state column are parsed and compared: with the
 * column type's input function (so a domain's checks and a char(n)'s
 * padding apply) and the default equality operator of its base type, under
 * the column's collation.  Never by output text: 'pending' and 'pending   '
 * are one char(10) state, 't' and 'true' one boolean.
 */
typedef struct StateType
{
	Oid			typid;			/* column type, possibly a domain */
	int32		typmod;
	Oid			collation;
	Oid			typinput;
	Oid			typioparam;
	FmgrInfo	eqfn;			/* equality of the base type */
} StateType;

/* A transition map, its states parsed into values of the state column. */
typedef struct StateMap
{
	int			nstates;		/* number of source states */
	Datum	   *from;			/* each source state */
	int		   *ntargets;
	Datum	  **targets;		/* the states each source may move to */
} StateMap;

extern void idem_state_type_init(StateType *stt, Oid typid, int32 typmod, Oid collation,
								 const char *colname, MemoryContext cxt);
extern bool idem_state_eq(StateType *stt, Datum a, Datum b);
extern StateMap *idem_statemap_build(Jsonb *jb, StateType *stt);
extern bool idem_statemap_allows(StateMap *m, StateType *stt, Datum from, Datum to);

/*---- guard_triggers.c ----*/

/* this backend's counters; the helpers count their own outcomes too */
extern IdemGuardCounters idem_guard_counts;

extern Trigger *idem_find_guard_trigger(Relation rel, const char *name);
extern void idem_check_not_null(FunctionCallInfo fcinfo, int argno, const char *argname);
extern char *idem_qualified_relname(Oid relid);

/*---- guard_helpers.c ----*/

extern void idem_guard_helpers_init(void);

#endif							/* IDEM_GUARDS_H */
