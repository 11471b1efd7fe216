# PGXS build for the idempotency extension.
#
# The SQL scripts are built (doc/development.md, "The SQL scripts"):
#   sql/idempotency--$(EXTVERSION).sql, the install script: sql/tables/*.sql
#     (run once: schema, tables, types), then sql/functions/*.sql with
#     CREATE OR REPLACE turned into CREATE (an install never takes over an
#     object it did not make), then sql/init.sql (a first maintenance round);
#   sql/idempotency--A--$(EXTVERSION).sql, the update from A: the hand-written
#     sql/updates/idempotency--A--$(EXTVERSION).sql, the sql/tables/ files
#     wholly new in this version (NEW_TABLES), every sql/functions/ file as
#     written, then sql/init.sql.
# EXTVERSION is the default_version of idempotency.control.  Released
# scripts are frozen in sql/released/ and installed as they are; how a
# version is released and the next begun: doc/development.md, "Releasing a
# version".
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
SQL_TABLES = $(sort $(wildcard sql/tables/*.sql))
SQL_FUNCTIONS = $(sort $(wildcard sql/functions/*.sql))
SQL_INIT = sql/init.sql
# The sql/tables/ files wholly new in this version: the update to it creates
# their objects (tables of files that existed in the previous release are
# changed in sql/updates/).  Emptied when a version is released.
NEW_TABLES = sql/tables/07_capabilities.sql sql/tables/10_groups.sql sql/tables/10_late.sql sql/tables/10_scope_retention.sql sql/tables/40_outbox.sql sql/tables/50_requests.sql sql/tables/55_inbox.sql \
             sql/tables/65_stats.sql sql/tables/80_shards.sql
NEW_TABLES += sql/tables/22_store_settings.sql
SQL_INSTALL = sql/idempotency--$(EXTVERSION).sql
SQL_UPDATES = $(sort $(wildcard sql/updates/idempotency--*--$(EXTVERSION).sql))
SQL_UPDATES_BUILT = $(patsubst sql/updates/%,sql/%,$(SQL_UPDATES))
DATA_built = $(SQL_INSTALL) $(SQL_UPDATES_BUILT)
DATA = $(sort $(wildcard sql/released/idempotency--*.sql))
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

ifneq ($(wildcard sql/released/idempotency--$(EXTVERSION).sql),)
$(error sql/released/idempotency--$(EXTVERSION).sql exists: version $(EXTVERSION) is released, so it is not built again; bump default_version in $(EXTENSION).control (doc/development.md, "Releasing a version"))
endif
ifneq ($(filter-out $(SQL_UPDATES),$(wildcard sql/updates/*.sql)),)
$(error $(filter-out $(SQL_UPDATES),$(wildcard sql/updates/*.sql)): sql/updates/ holds only updates to $(EXTVERSION), the version being built (a released update is frozen in sql/released/))
endif
ifneq ($(wildcard $(patsubst sql/updates/%,sql/released/%,$(SQL_UPDATES))),)
$(error $(wildcard $(patsubst sql/updates/%,sql/released/%,$(SQL_UPDATES))) is released, but sql/updates/ builds it again)
endif
ifneq ($(filter-out $(SQL_TABLES),$(NEW_TABLES)),)
$(error NEW_TABLES names $(filter-out $(SQL_TABLES),$(NEW_TABLES)), which does not exist)
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

# built scripts of any version (a bumped default_version leaves the old ones)
EXTRA_CLEAN += sql/idempotency--*.sql sql/idempotency--*.sql.tmp

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

# Only a CREATE OR REPLACE at the start of a line is a statement's: the
# generators' DDL inside function bodies is indented or quoted.
$(SQL_INSTALL): $(SQL_TABLES) $(SQL_FUNCTIONS) $(SQL_INIT)
	{ cat $(SQL_TABLES) && \
	  sed -E 's/^CREATE OR REPLACE (FUNCTION|VIEW|TRIGGER) /CREATE \1 /' $(SQL_FUNCTIONS) && \
	  cat $(SQL_INIT); } > $@.tmp
	mv $@.tmp $@

$(SQL_UPDATES_BUILT): sql/%: sql/updates/% $(NEW_TABLES) $(SQL_FUNCTIONS) $(SQL_INIT)
	cat $^ > $@.tmp
	mv $@.tmp $@

$(OBJS): $(wildcard src/*.h src/*/*.h)

# The relay program, tools/idem-relay (doc/relay.md): built by "make",
# installed into PostgreSQL's bindir by "make install"; its sub-make
# compiles in the sinks whose libraries pkg-config finds.
RELAY_MAKE = $(MAKE) -C tools/idem-relay PG_CONFIG='$(PG_CONFIG)' bindir='$(bindir)'
all: idem-relay
idem-relay:
	$(RELAY_MAKE)
install: install-idem-relay
install-idem-relay: idem-relay
	$(RELAY_MAKE) install
uninstall: uninstall-idem-relay
uninstall-idem-relay:
	$(RELAY_MAKE) uninstall
clean: clean-idem-relay
clean-idem-relay:
	$(RELAY_MAKE) clean
.PHONY: idem-relay install-idem-relay uninstall-idem-relay clean-idem-relay
