# PGXS build for the idempotency extension.
#
# The install script of the current version, idempotency--$(EXTVERSION).sql,
# is assembled from one fragment per subsystem in sql/ext/ (in name order),
# so each subsystem keeps its SQL next to nothing else's.  EXTVERSION is the
# default_version of idempotency.control.
#
# Released versions are frozen in sql/versions/: the install script of each
# earlier release (idempotency--1.0.sql) and the upgrade scripts
# (idempotency--1.0--1.1.sql).  Every object added to or changed in sql/ext/
# goes into the upgrade script to the current version too (a fragment that
# is new as a whole is listed in NEW_IN_VERSION and appended when the script
# is built); the TAP test
# test/tap/040_upgrade.pl checks that every earlier version, updated, has
# the objects of a fresh install.  To release
# version X and start X+1: copy the built idempotency--X.sql into
# sql/versions/, add sql/versions/idempotency--X--X+1.sql, bump
# default_version.
#
# Tests are run by test/run-tests, which drives pg_regress,
# pg_isolation_regress, prove and pg_prove against real servers;
# "make installcheck" runs the regression and isolation tests against a
# running server (PGHOST, PGPORT, PGUSER).
#
# Warnings are errors only when asked: "make WERROR=1", or with CI=true in
# the environment (as CI services set it, and .ci/run does).

EXTENSION = idempotency
EXTVERSION := $(shell sed -n "s/^[[:space:]]*default_version[[:space:]]*=[[:space:]]*'\([^']*\)'.*/\1/p" $(EXTENSION).control)
ifeq ($(EXTVERSION),)
$(error cannot read default_version from $(EXTENSION).control)
endif

MODULE_big = idempotency
OBJS = $(patsubst %.c,%.o,$(sort $(wildcard src/*.c src/*/*.c)))
# Upgrade scripts to the version being built: the hand-written script in
# sql/versions/ (changes to objects of the earlier release), followed by the
# sql/ext/ fragments that are wholly new in this version, so that no CREATE
# statement is written twice.
NEW_IN_VERSION = sql/ext/05_ownership.sql sql/ext/07_capabilities.sql sql/ext/40_outbox.sql sql/ext/50_requests.sql sql/ext/55_inbox.sql sql/ext/60_partitions.sql sql/ext/65_stats.sql \
                 sql/ext/70_replay.sql sql/ext/80_shards.sql
# ... and then, like the install script, a first maintenance round (the new
# stores get their first partitions at once)
EXT_INIT = sql/ext/99_init.sql
UPGRADE_TO_CURRENT = $(sort $(wildcard sql/versions/idempotency--*--$(EXTVERSION).sql))
DATA_built = idempotency--$(EXTVERSION).sql $(notdir $(UPGRADE_TO_CURRENT))
DATA = $(filter-out $(UPGRADE_TO_CURRENT),$(sort $(wildcard sql/versions/idempotency--*.sql)))
PG_CPPFLAGS = -Isrc
# -Wextra's unused-parameter fires in PostgreSQL's own headers (and on every
# PG_FUNCTION_ARGS), so it alone is off
PG_CFLAGS = -Wall -Wextra -Wno-unused-parameter
ifeq ($(CI),true)
WERROR ?= 1
endif
ifneq ($(filter 1 yes true,$(WERROR)),)
PG_CFLAGS += -Werror
endif

EXT_SQL = $(sort $(wildcard sql/ext/*.sql))

ifneq ($(wildcard sql/versions/idempotency--$(EXTVERSION).sql),)
$(error sql/versions/idempotency--$(EXTVERSION).sql exists, but version $(EXTVERSION) is built from sql/ext: bump default_version in $(EXTENSION).control)
endif

# regression tests: test/regress/sql/<name>.sql with
# test/regress/expected/<name>.out
REGRESS = $(basename $(notdir $(sort $(wildcard test/regress/sql/*.sql))))
REGRESS_OPTS = --inputdir=test/regress --outputdir=test/regress
ISOLATION = $(basename $(notdir $(sort $(wildcard test/isolation/specs/*.spec))))
ISOLATION_OPTS = --inputdir=test/isolation --outputdir=test/isolation/output_iso

# every test output, wherever a test run leaves it
EXTRA_CLEAN = test/regress/results/ test/regress/regression.diffs \
	test/regress/regression.out test/regress/log/ test/regress/tmp_check/ \
	test/isolation/output_iso/ test/isolation/results/ test/isolation/log/ \
	test/isolation/tmp_check/ test/tap/tmp_check/ test/tap/log/

# no LLVM bitcode: JIT inlining of these functions buys nothing and needs clang
override with_llvm = no

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# Supported PostgreSQL major versions (README "Installation"): 15 only, the
# one built and tested.  The C code keeps version-specific parts behind
# PG_VERSION_NUM guards so that 13-17 stay possible; to try one of those, at
# your own risk: make PG_SUPPORTED_MAJORS=16
PG_SUPPORTED_MAJORS = 15
ifeq ($(filter clean distclean maintainer-clean,$(MAKECMDGOALS)),)
ifeq ($(filter $(MAJORVERSION),$(PG_SUPPORTED_MAJORS)),)
$(error idempotency supports PostgreSQL $(PG_SUPPORTED_MAJORS), but $(PG_CONFIG) is PostgreSQL $(VERSION); set PG_CONFIG to the pg_config of a supported version)
endif
endif

idempotency--$(EXTVERSION).sql: $(EXT_SQL)
	cat $(EXT_SQL) > $@

$(notdir $(UPGRADE_TO_CURRENT)): %: sql/versions/% $(NEW_IN_VERSION) $(EXT_INIT)
	cat $^ > $@

$(OBJS): $(wildcard src/*.h src/*/*.h)
