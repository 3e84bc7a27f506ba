#!/bin/bash
# Throwaway TLS certificates for the rig's TLS sessions (openssl, no password):
# a self-signed CA and a server certificate signed by it whose subject and
# subjectAltName fit a server on loopback (CN=localhost, SAN DNS:localhost,
# IP:127.0.0.1, IP:::1).
#
#   rig/tls-certs.sh DIR [CN]
# e.g.
#   rig/tls-certs.sh /tmp/t1/x509
#   rig/start-xspice.sh start 5905 5 --tls /tmp/t1/x509 -- --mode noise
#   rig/client.py spice://127.0.0.1?tls-port=5905 --ca-file /tmp/t1/x509/ca-cert.pem
#
# Writes into DIR (created, mode 0700), in spice-server's (and QEMU's) x509 dir
# layout, so DIR can be given to Xspice's --x509-dir / XSPICE_X509_DIR as is:
#   ca-cert.pem      the CA certificate (what clients verify against)
#   ca-key.pem       the CA's key (kept only to sign more certificates by hand)
#   server-cert.pem  the server certificate, signed by the CA
#   server-key.pem   its key (unencrypted, mode 0600)
#   server.pem       server-cert.pem + server-key.pem in one file (stunnel's `cert =`)
# and prints one line: the directory and the certificate's subject.
# Keys: EC P-256 (fast to generate: the whole script takes ~50 ms).  Validity
# 30 days.  The server certificate's subject is "/CN=CN" (default localhost);
# spice-gtk checks its host name (or IP) against the SAN entries, and a client
# can also be told the subject with `cert-subject` (client.py --cert-subject).
# An existing DIR is overwritten file by file (new keys each run).
set -euo pipefail
HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
# shellcheck source=rig/lib.sh
. "$HERE/lib.sh"
[[ $# -ge 1 && $1 != -h && $1 != --help ]] || { rig_usage; exit 2; }
dir=$1 cn=${2:-localhost}
command -v openssl >/dev/null || rig_die "openssl missing (apt-get install openssl)"
mkdir -p "$dir"; chmod 700 "$dir"
log=$dir/openssl.log
: >"$log"
ossl() { openssl "$@" >>"$log" 2>&1 || { cat "$log" >&2; rig_die "openssl $1 failed"; }; }
days=30
ossl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/ca-key.pem" -out "$dir/ca-cert.pem" -days "$days" \
    -subj "/O=spice-observer rig/CN=spice-observer rig CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
ossl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/server-key.pem" -out "$dir/server.csr" -subj "/CN=$cn"
ext=$dir/server.ext
san="DNS:localhost,IP:127.0.0.1,IP:::1"
[[ $cn == localhost ]] || san="DNS:$cn,$san"
cat >"$ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EOF
ossl x509 -req -in "$dir/server.csr" -CA "$dir/ca-cert.pem" -CAkey "$dir/ca-key.pem" \
    -CAcreateserial -out "$dir/server-cert.pem" -days "$days" -extfile "$ext"
rm -f "$dir/server.csr" "$ext" "$dir/ca-cert.srl"
chmod 600 "$dir/server-key.pem" "$dir/ca-key.pem"
cat "$dir/server-cert.pem" "$dir/server-key.pem" >"$dir/server.pem"
chmod 600 "$dir/server.pem"
ossl verify -CAfile "$dir/ca-cert.pem" "$dir/server-cert.pem"
echo "certificates in $dir: server $(openssl x509 -in "$dir/server-cert.pem" -noout -subject)"
