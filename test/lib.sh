# test/lib.sh: shared bash functions for test/run-tests, examples/demo/run and
# test/bench/run.  Source it; do not run it.
#
#   idem_init                   globals, traps (cleanup on exit, ^C, TERM)
#   idem_ensure_packages [PKG...]
#                               install missing Debian packages (root) or say how;
#                               default: IDEM_PACKAGES (the demo: IDEM_DEMO_PACKAGES)
#   idem_apt_install PKG...     apt-get install that starts no service and
#                               leaves none enabled, and creates no cluster
#   idem_build_install          copy the tree to a temp dir, make, make install
#   idem_cluster_start DB [conf lines...]
#                               throwaway cluster with database DB, as $IDEM_PG_USER
#   idem_cluster_stop
#   idem_as_pg CMD...           run CMD as the unprivileged PostgreSQL user
#   idem_psql [psql args...]    psql -X on the throwaway cluster, as that user
#   idem_bg PID                 register a background process to kill on exit
#
# Environment (all optional):
#   IDEM_PG_ROOT  private relocatable copy of PostgreSQL (e.g. /tmp/pg-harness):
#                 install with DESTDIR=$IDEM_PG_ROOT and use the binaries
#                 under it.  Default: the system PostgreSQL 15.
#   PG_CONFIG     pg_config used to build (default /usr/lib/postgresql/15/bin/pg_config)
#   IDEM_PORT     port of the throwaway cluster (default 54329).  It listens
#                 on a unix socket in a private temp dir only, no TCP.
#   IDEM_NO_INSTALL=1   skip make install (extension already installed)
#   IDEM_NO_PACKAGES=1  skip the Debian package check
#   IDEM_KEEP=1   keep the temp dir (work copy, data dir, logs) on exit
#   CI=true       build with -Werror (make WERROR=1), as .ci/run does

IDEM_PACKAGES=(postgresql-15 postgresql-server-dev-15 postgresql-15-cron postgresql-15-wal2json
               postgresql-15-pgtap pgtap libipc-run-perl python3-psycopg2 prometheus-postgres-exporter curl
               postgresql-15-plproxy
               libpq-dev libcurl4-openssl-dev libhiredis-dev libnats-dev librabbitmq-dev libmicrohttpd-dev libssl-dev
               redis-server redis-tools nats-server rabbitmq-server python3)
# (the last two lines: idem-relay's client libraries, libssl-dev for the
# webhook receiver's HMAC, and the brokers its TAP tests start,
# test/tap/09x_relay_*.pl)
# what examples/demo/run uses: the server, the build, pg_cron (preloaded)
IDEM_DEMO_PACKAGES=(postgresql-15 postgresql-server-dev-15 postgresql-15-cron)

idem_log()  { printf '==> %s\n' "$*"; }
idem_warn() { printf 'WARNING: %s\n' "$*" >&2; }
idem_die()  { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# idem_init: set the globals every entry script uses and install the traps.
idem_init() {
    IDEM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    IDEM_PORT=${IDEM_PORT:-54329}
    PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
    IDEM_PG_ROOT=${IDEM_PG_ROOT:-}
    if [[ $EUID -eq 0 ]]; then
        IDEM_PG_USER=postgres
    else
        IDEM_PG_USER=$(id -un)
    fi
    IDEM_TMP=''
    IDEM_DATA=''
    IDEM_BINDIR=''
    IDEM_BG_PIDS=()
    trap idem_cleanup EXIT
    trap 'echo "interrupted" >&2; exit 130' INT
    trap 'echo "terminated" >&2; exit 143' TERM
}

# idem_pg_paths: derive binary and pgxs locations (needs pg_config, so it
# runs after the packages are ensured).
idem_pg_paths() {
    [[ -x $PG_CONFIG ]] || idem_die "pg_config not found at $PG_CONFIG (set PG_CONFIG)"
    IDEM_BINDIR=$IDEM_PG_ROOT$("$PG_CONFIG" --bindir)
    IDEM_PGXS_DIR=$IDEM_PG_ROOT$(dirname "$("$PG_CONFIG" --pgxs)")/../..
    IDEM_PGXS_DIR=$(cd "$IDEM_PGXS_DIR" && pwd)
    IDEM_PG_REGRESS=$IDEM_PGXS_DIR/src/test/regress/pg_regress
    IDEM_PG_ISOLATION_REGRESS=$IDEM_PGXS_DIR/src/test/isolation/pg_isolation_regress
    IDEM_PERL_LIB=$IDEM_PGXS_DIR/src/test/perl
    [[ -x $IDEM_BINDIR/postgres ]] || idem_die "no postgres binary in $IDEM_BINDIR"
    export PATH="$IDEM_BINDIR:$PATH"
}

# idem_cleanup: stop every server started under our temp dir (the throwaway
# cluster and any left behind by TAP tests), kill registered background
# processes, remove the temp dir.  Runs on every exit.
idem_cleanup() {
    local rc=$? pid pidfile
    set +e
    for pid in "${IDEM_BG_PIDS[@]}"; do
        { kill -KILL "$pid" && wait "$pid"; } 2>/dev/null
    done
    if [[ -n $IDEM_TMP && -d $IDEM_TMP ]]; then
        [[ -n $IDEM_BINDIR ]] && while IFS= read -r pidfile; do
            (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/pg_ctl" -D "$(dirname "$pidfile")" \
                -m immediate -w stop >/dev/null 2>&1)
        done < <(find "$IDEM_TMP" -name postmaster.pid 2>/dev/null)
        if [[ -n ${IDEM_KEEP:-} ]]; then
            echo "kept temp dir $IDEM_TMP (IDEM_KEEP is set)" >&2
        else
            rm -rf "$IDEM_TMP"
        fi
    fi
    return "$rc"
}

# idem_bg PID: kill this process (SIGKILL) when the script exits.
idem_bg() { IDEM_BG_PIDS+=("$1"); }

# idem_as_pg CMD...: run CMD as the PostgreSQL user (runuser when root),
# keeping the environment.
idem_as_pg() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u "$IDEM_PG_USER" -- "$@"
    else
        "$@"
    fi
}

# idem_apt_install PKG...: apt-get install PKG... (as root, after apt-get
# update) so that the machine is left as it was but for the packages:
#  - no service starts: a /usr/sbin/policy-rc.d that exits 101 (Debian's
#    "action forbidden" for invoke-rc.d) during the install, removed after
#    it (one already there is left alone);
#  - none stays enabled: the systemd units and init scripts of the packages
#    it installed are disabled (deb-systemd-helper and update-rc.d work
#    without a running systemd, as in containers);
#  - no cluster: if postgresql-15 is installed, create_main_cluster = false
#    in /etc/postgresql-common/createcluster.conf while its postinst runs
#    (postgresql-common, which ships that file, is installed first), then
#    the file is put back byte for byte.
# (IDEM_APT_ROOT, for trying this out: a directory that stands for / for
# those two files.)
idem_apt_install() {
    local pkgs=("$@") rc=0 root=${IDEM_APT_ROOT:-} made_policy='' p unit
    local policy=$root/usr/sbin/policy-rc.d cc=$root/etc/postgresql-common/createcluster.conf cc_saved='' before
    export DEBIAN_FRONTEND=noninteractive
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# test/lib.sh: no service starts during its apt-get install\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    before=$(dpkg-query -W -f='${Package} ${Status}\n' 2>/dev/null | awk '$4 == "installed" { print $1 }')
    if printf '%s\n' "${pkgs[@]}" | grep -qx 'postgresql-[0-9]*'; then
        if [[ ! -e $cc ]]; then
            apt-get install -y -q --no-install-recommends postgresql-common || rc=$?
        fi
        if [[ $rc -eq 0 && -e $cc ]]; then
            cc_saved=$(mktemp)
            cp -p "$cc" "$cc_saved"
            sed -i -E 's/^#?[[:space:]]*create_main_cluster[[:space:]]*=.*/create_main_cluster = false/' "$cc"
            grep -q '^create_main_cluster = false' "$cc" || echo 'create_main_cluster = false' >>"$cc"
        fi
    fi
    [[ $rc -eq 0 ]] && { apt-get install -y -q --no-install-recommends "${pkgs[@]}" || rc=$?; }
    if [[ -n $cc_saved ]]; then
        cp -p "$cc_saved" "$cc"
        rm -f "$cc_saved"
    fi
    # disable what the new packages would start at boot
    for p in $(dpkg-query -W -f='${Package} ${Status}\n' 2>/dev/null | awk '$4 == "installed" { print $1 }' \
               | grep -vxF -f <(printf '%s\n' "$before")); do
        while IFS= read -r unit; do
            case $unit in
                */systemd/system/*.service|*/systemd/system/*.socket|*/systemd/system/*.timer)
                    [[ $unit == *@.* ]] && continue
                    # (deb-systemd-helper refuses to run outside a maintainer
                    # script unless told which package it acts for)
                    command -v deb-systemd-helper >/dev/null 2>&1 \
                        && DPKG_MAINTSCRIPT_PACKAGE=$p DPKG_MAINTSCRIPT_NAME=postinst \
                           deb-systemd-helper disable "$(basename "$unit")" >/dev/null 2>&1
                    command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]] \
                        && systemctl disable --now "$(basename "$unit")" >/dev/null 2>&1 ;;
                /etc/init.d/*)
                    command -v update-rc.d >/dev/null 2>&1 \
                        && update-rc.d "$(basename "$unit")" disable >/dev/null 2>&1 ;;
            esac
        done < <(dpkg -L "$p" 2>/dev/null)
    done
    [[ -n $made_policy ]] && rm -f "$policy"
    return "$rc"
}

# idem_ensure_packages [PKG...]: the Debian packages the build, the tests and
# the demo need (default: IDEM_PACKAGES).  As root, installs what is missing
# (one apt-get update first, then idem_apt_install); otherwise prints the
# command to run and exits 1.
idem_ensure_packages() {
    if [[ -n ${IDEM_NO_PACKAGES:-} ]]; then
        idem_pg_paths
        return 0
    fi
    local want=("$@") missing=() p
    [[ ${#want[@]} -gt 0 ]] || want=("${IDEM_PACKAGES[@]}")
    if ! command -v dpkg-query >/dev/null 2>&1; then
        idem_warn "dpkg-query not found: not a Debian system? Skipping the package check."
        idem_pg_paths
        return 0
    fi
    for p in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    if ! command -v make >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1; then
        missing+=(build-essential)
    fi
    command -v prove >/dev/null 2>&1 || missing+=(perl)
    if [[ ${#missing[@]} -gt 0 ]]; then
        if [[ $EUID -ne 0 ]]; then
            echo "Missing Debian packages. Install them as root, then run this again:" >&2
            echo "  apt-get install -y --no-install-recommends ${missing[*]}" >&2
            exit 1
        fi
        idem_log "installing missing packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q || idem_die "apt-get update failed"
        idem_apt_install "${missing[@]}" || idem_die "apt-get install ${missing[*]} failed"
    fi
    command -v runuser >/dev/null 2>&1 || [[ $EUID -ne 0 ]] \
        || idem_die "runuser (util-linux) is needed to run PostgreSQL as $IDEM_PG_USER"
    if [[ $EUID -eq 0 ]] && ! id "$IDEM_PG_USER" >/dev/null 2>&1; then
        idem_die "user $IDEM_PG_USER does not exist (it comes with postgresql-15)"
    fi
    idem_pg_paths
}

# idem_build_install: copy the source tree to a fresh temp dir (the work
# copy, $IDEM_WORK; pg_regress writes results/ there), build and install the
# extension from it, then hand the temp dir to the PostgreSQL user.
idem_build_install() {
    IDEM_TMP=$(mktemp -d "${TMPDIR:-/tmp}/idem.XXXXXX")
    chmod 755 "$IDEM_TMP"
    IDEM_WORK=$IDEM_TMP/src
    mkdir "$IDEM_WORK"
    tar -C "$IDEM_ROOT" -cf - \
        --exclude=./.git --exclude='*.o' --exclude='*.so' --exclude='*.bc' \
        --exclude='./idempotency--*.sql' --exclude='./sql/idempotency--*.sql' --exclude=results --exclude=output_iso \
        --exclude=tmp_check --exclude='regression.diffs' --exclude='regression.out' . \
        | tar -C "$IDEM_WORK" -xf -
    local log=$IDEM_TMP/build.log destdir=() werror=() how=''
    [[ -n $IDEM_PG_ROOT ]] && destdir=(DESTDIR="$IDEM_PG_ROOT")
    if [[ ${CI:-} == true ]]; then
        werror=(WERROR=1)
        how=' with -Werror (CI=true)'
    fi
    idem_log "building the extension$how (log: make output shown only on failure)"
    if ! make -C "$IDEM_WORK" -j"$(nproc 2>/dev/null || echo 2)" PG_CONFIG="$PG_CONFIG" "${werror[@]}" >"$log" 2>&1; then
        cat "$log" >&2
        idem_die "build failed"
    fi
    if [[ -z ${IDEM_NO_INSTALL:-} ]]; then
        if [[ $EUID -ne 0 && -z $IDEM_PG_ROOT && ! -w $("$PG_CONFIG" --pkglibdir) ]]; then
            idem_die "cannot install into $("$PG_CONFIG" --pkglibdir): run as root, or set IDEM_PG_ROOT to a private copy of PostgreSQL"
        fi
        idem_log "installing into ${IDEM_PG_ROOT:-the system PostgreSQL} ($("$PG_CONFIG" --version))"
        if ! make -C "$IDEM_WORK" PG_CONFIG="$PG_CONFIG" install "${destdir[@]}" >>"$log" 2>&1; then
            cat "$log" >&2
            idem_die "make install failed"
        fi
    fi
    [[ $EUID -eq 0 ]] && chown -R "$IDEM_PG_USER:" "$IDEM_TMP"
    return 0
}

# idem_cluster_start DB [conf lines...]: initdb a throwaway cluster in the
# temp dir, create database DB (also pg_cron's database), start it on
# $IDEM_PORT with its socket in the temp dir, and export PGHOST, PGPORT,
# PGDATABASE, PGUSER for it.
idem_cluster_start() {
    local db=$1 line
    shift
    IDEM_DATA=$IDEM_TMP/data
    IDEM_SOCK=$IDEM_TMP
    IDEM_LOG=$IDEM_TMP/server.log
    idem_log "initdb (user $IDEM_PG_USER, port $IDEM_PORT, socket dir $IDEM_SOCK)"
    (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/initdb" -D "$IDEM_DATA" -A trust \
        -E UTF8 --no-locale --no-sync -U "$IDEM_PG_USER" >"$IDEM_TMP/initdb.log" 2>&1) \
        || { cat "$IDEM_TMP/initdb.log" >&2; idem_die "initdb failed"; }
    {
        echo "# added by test/lib.sh"
        echo "port = $IDEM_PORT"
        echo "listen_addresses = ''"
        echo "unix_socket_directories = '$IDEM_SOCK'"
        echo "shared_preload_libraries = 'pg_cron'"
        echo "cron.database_name = '$db'"
        echo "cron.host = '$IDEM_SOCK'"
        echo "max_connections = 60"
        echo "max_prepared_transactions = 10"
        echo "fsync = off"
        echo "log_line_prefix = '%m [%p] %q%a '"
        for line in "$@"; do echo "$line"; done
    } | idem_as_pg tee -a "$IDEM_DATA/postgresql.conf" >/dev/null
    # create the database before the server starts, so pg_cron's launcher
    # finds it at once
    (cd "$IDEM_TMP" && echo "CREATE DATABASE \"$db\"" \
        | idem_as_pg "$IDEM_BINDIR/postgres" --single -D "$IDEM_DATA" postgres >"$IDEM_TMP/single.log" 2>&1) \
        || { cat "$IDEM_TMP/single.log" >&2; idem_die "could not create database $db"; }
    (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/pg_ctl" -D "$IDEM_DATA" -l "$IDEM_LOG" -w -t 60 start >/dev/null) \
        || { tail -n 30 "$IDEM_LOG" >&2; idem_die "server did not start (port $IDEM_PORT; set IDEM_PORT to use another)"; }
    export PGHOST=$IDEM_SOCK PGPORT=$IDEM_PORT PGDATABASE=$db PGUSER=$IDEM_PG_USER
}

# idem_cluster_stop: stop the throwaway cluster (its files go at exit).
idem_cluster_stop() {
    [[ -n $IDEM_DATA && -f $IDEM_DATA/postmaster.pid ]] || return 0
    (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/pg_ctl" -D "$IDEM_DATA" -m fast -w -t 60 stop >/dev/null) \
        || (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/pg_ctl" -D "$IDEM_DATA" -m immediate -w stop >/dev/null)
}

# idem_psql [args...]: psql on the throwaway cluster, stop at the first error.
idem_psql() {
    (cd "$IDEM_TMP" && idem_as_pg "$IDEM_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 "$@")
}
