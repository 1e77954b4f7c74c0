#!/usr/bin/env bash
# A private certificate authority and a certificate for the verifier, signed by it.
#
#   ./scripts/make_certs.sh HOST [HOST ...]
#   ./scripts/make_certs.sh dgx.local 192.168.1.20     (for example)
#
# HOST: each name or IP address the drafter's machine will use to reach the verifier (the
# first is the certificate's common name). Files go to CERT_DIR (default: certs/):
#   cert.pem, key.pem  the verifier's: uvicorn --ssl-certfile cert.pem --ssl-keyfile key.pem
#   ca.pem             the drafter's: draft_token_generator --ca-cert ca.pem (not secret)
#   ca-key.pem         the authority's key: keep it off both machines' shared folders
# An existing CA in CERT_DIR is kept (a new verifier certificate, the same ca.pem).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[certs] $*"; }

if [ $# -eq 0 ]; then
    echo "usage: $0 HOST [HOST ...]   (the verifier's names or IP addresses)" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "[certs] openssl is needed" >&2; exit 1; }
dir=${CERT_DIR:-certs}
mkdir -p "$dir"
umask 077  # the keys are readable by their owner only

sans=""
for host in "$@"; do
    if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then
        sans+="${sans:+,}IP:$host"
    else
        sans+="${sans:+,}DNS:$host"
    fi
done

if [ ! -f "$dir/ca.pem" ] || [ ! -f "$dir/ca-key.pem" ]; then
    say "a new certificate authority: $dir/ca.pem"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" -days 825 \
        -subj "/CN=hetero-specdecode private CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$dir/key.pem" -out "$dir/verifier.csr" -subj "/CN=$1" 2>/dev/null
extensions="$dir/verifier.ext"
printf '%s\n' "subjectAltName=$sans" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" \
    "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid,issuer" > "$extensions"
openssl x509 -req -in "$dir/verifier.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
    -CAcreateserial -out "$dir/cert.pem" -days 825 -extfile "$extensions" 2>/dev/null
rm -f "$dir/verifier.csr" "$extensions"
chmod 644 "$dir/ca.pem" "$dir/cert.pem"
say "the verifier's certificate for $sans: $dir/cert.pem, $dir/key.pem"
say "give the drafter's machine $dir/ca.pem (--ca-cert); keep $dir/ca-key.pem to itself"
