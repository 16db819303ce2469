#!/bin/sh
# Makes the certificates of a locked-down etcd for ultrascale (docs/kubernetes.md, docs/systemd.md).
#
#   deploy/etcd/make-certs.sh OUT_DIR
#
# OUT_DIR must not exist yet (a second run never replaces a CA that certificates were issued
# from). Every directory it writes is one Kubernetes Secret, its files the Secret's keys
# (tls.crt, tls.key, ca.crt): `kubectl create secret generic NAME --from-file=OUT_DIR/NAME/`.
#
#   ca/                   the client CA: signs etcd's server certificate and every client
#                         certificate. Its key signs new etcd identities: keep it offline.
#   peer-ca/              the peer CA: signs the members' peer certificates only, so no client
#                         certificate can ever join the cluster as a member.
#   etcd-server-tls/      etcd's serving certificate (its members' DNS names) + the client CA
#   etcd-peer-tls/        the members' peer certificate (client and server) + the peer CA
#   etcd-root-client/     CN=root: etcd's root user, for the bootstrap (deploy/etcd/rbac.sh) only
#   ultrad-etcd-client/   CN=ultrascale-agent: the agents (role ultrascale-agent)
#   etcd-observer-client/ CN=ultrascale-observer: read-only tools (role ultrascale-observer)
#
# With --client-cert-auth and auth enabled, etcd takes the user name from the client
# certificate's CN, so the CN is the identity: never issue another certificate with these CNs.
#
# Environment:
#   NAMESPACE       Kubernetes namespace of the etcd StatefulSet (default: ultrascale)
#   REPLICAS        members etcd-0 .. etcd-(REPLICAS-1) (default: 3)
#   CLUSTER_DOMAIN  the cluster's DNS domain (default: cluster.local)
#   MEMBER_NAMES    the members' DNS names, space separated, instead of the StatefulSet's
#                   (hosts outside Kubernetes, e.g. "etcd-0.example.internal etcd-1...")
#   EXTRA_SANS      more subjectAltName entries for the server and peer certificates,
#                   comma separated (e.g. "IP:10.0.0.5,DNS:etcd.example.internal")
#   DAYS            validity of the leaf certificates in days (default: 365; CAs: 10 years)
set -eu

out=${1:?usage: make-certs.sh OUT_DIR}
if [ -e "$out" ]; then
    echo "make-certs.sh: $out exists; choose a new directory (a CA is never replaced)" >&2
    exit 2
fi
namespace=${NAMESPACE:-ultrascale}
replicas=${REPLICAS:-3}
domain=${CLUSTER_DOMAIN:-cluster.local}
days=${DAYS:-365}

if [ -n "${MEMBER_NAMES:-}" ]; then
    names=$MEMBER_NAMES
else
    names="etcd.$namespace.svc etcd.$namespace.svc.$domain"
    i=0
    while [ "$i" -lt "$replicas" ]; do
        names="$names etcd-$i.etcd.$namespace.svc etcd-$i.etcd.$namespace.svc.$domain"
        i=$((i + 1))
    done
fi
sans=""
for name in $names; do
    sans="${sans:+$sans,}DNS:$name"
done
if [ -n "${EXTRA_SANS:-}" ]; then
    sans="$sans,$EXTRA_SANS"
fi

umask 077
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

key() {  # EC P-256: small, fast, supported by etcd and gRPC
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

ca() {  # ca DIR CN
    mkdir -p "$out/$1"
    key "$out/$1/ca.key"
    openssl req -x509 -new -key "$out/$1/ca.key" -subj "/CN=$2" -days 3650 \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$out/$1/ca.crt"
}

leaf() {  # leaf CA_DIR DIR CN EXTENDED_KEY_USAGE [SANS]
    mkdir -p "$out/$2"
    key "$out/$2/tls.key"
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$4"
        if [ -n "${5:-}" ]; then echo "subjectAltName=$5"; fi
    } > "$work/$2.ext"
    openssl req -new -key "$out/$2/tls.key" -subj "/CN=$3" -out "$work/$2.csr"
    openssl x509 -req -in "$work/$2.csr" -CA "$out/$1/ca.crt" -CAkey "$out/$1/ca.key" \
        -CAcreateserial -CAserial "$work/$1.srl" -days "$days" -extfile "$work/$2.ext" \
        -out "$out/$2/tls.crt" 2>/dev/null
    cp "$out/$1/ca.crt" "$out/$2/ca.crt"
}

ca ca "ultrascale etcd client CA"
ca peer-ca "ultrascale etcd peer CA"
# The server certificate serves only (serverAuth): it is never a client identity.
leaf ca etcd-server-tls etcd-server serverAuth "$sans"
# Members dial each other with the peer certificate, and serve it on 2380.
leaf peer-ca etcd-peer-tls etcd-peer serverAuth,clientAuth "$sans"
leaf ca etcd-root-client root clientAuth
leaf ca ultrad-etcd-client ultrascale-agent clientAuth
leaf ca etcd-observer-client ultrascale-observer clientAuth
chmod -R go-rwx "$out"
echo "make-certs.sh: wrote $out (server and peer names: $sans)" >&2
