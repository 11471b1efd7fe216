# PGXS build for the idempotency extension.
#
# The install script idempotency--1.0.sql is assembled from one fragment per
# subsystem in sql/ext/ (in name order), so each subsystem keeps its SQL next
# to nothing else's.  Tests are run by test/run-tests, which drives
# pg_regress, pg_isolation_regress, prove and pg_prove against real servers;
# "make installcheck" runs the regression and isolation tests against a
# running server (PGHOST, PGPORT, PGUSER).

EXTENSION = idempotency
MODULE_big = idempotency
OBJS = $(patsubst %.c,%.o,$(sort $(wildcard src/*.c)))
DATA_built = idempotency--1.0.sql
PG_CPPFLAGS = -Isrc
# -Wextra's unused-parameter fires in PostgreSQL's own headers (and on every
# PG_FUNCTION_ARGS), so it alone is off
PG_CFLAGS = -Wall -Wextra -Werror -Wno-unused-parameter

EXT_SQL = $(sort $(wildcard sql/ext/*.sql))

# regression tests: sql/<name>.sql with expected/<name>.out
REGRESS = $(basename $(notdir $(sort $(wildcard sql/*.sql))))
ISOLATION = $(basename $(notdir $(sort $(wildcard test/isolation/specs/*.spec))))
ISOLATION_OPTS = --inputdir=test/isolation --outputdir=test/isolation/output_iso

# no LLVM bitcode: JIT inlining of these functions buys nothing and needs clang
override with_llvm = no

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

idempotency--1.0.sql: $(EXT_SQL)
	cat $(EXT_SQL) > $@

$(OBJS): $(wildcard src/*.h)
