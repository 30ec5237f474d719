#!/bin/sh
# Make the TLS files for Xronos's Mosquitto: make-certs.sh DIR NODE_ID...
#
# In DIR: a CA (ca.crt, ca.key: kept if already there), the broker's certificate
# (broker.crt, broker.key) and one client certificate per role: controller,
# operator and each node (NAME.crt, NAME.key, CN = the MQTT username, which is
# what use_identity_as_username would take). The broker's certificate names the
# hosts clients connect to: XRONOS_BROKER_NAMES, space-separated host names and
# IP addresses (default: localhost 127.0.0.1 and this machine's name).
# XRONOS_CERT_DAYS sets the validity (default 825). Running it again re-issues
# every certificate under the same CA (rotation, docs/security.md); delete
# ca.crt and ca.key first to rotate the CA itself. Keys are written mode 0600.
set -eu
[ $# -ge 1 ] || { echo "usage: make-certs.sh DIR NODE_ID..." >&2; exit 2; }
dir=$1; shift
for user in "$@"; do
  case $user in
    controller|operator|broker|ca) echo "a node cannot be called $user: that name is taken" >&2; exit 2 ;;
    xronos-*) echo "a node id cannot start with xronos- (the prefix of operators' client ids)" >&2; exit 2 ;;
    *[!A-Za-z0-9_-]*|'') echo "bad node id '$user': use [A-Za-z0-9_-]" >&2; exit 2 ;;
  esac
done
days=${XRONOS_CERT_DAYS:-825}
names=${XRONOS_BROKER_NAMES:-localhost 127.0.0.1 $(hostname)}
mkdir -p "$dir"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$dir/ca.key" ] || [ ! -f "$dir/ca.crt" ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/O=Xronos/CN=Xronos MQTT CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

san=""
for n in $names; do
  case $n in
    *[!0-9.]*) case $n in *:*) entry="IP:$n" ;; *) entry="DNS:$n" ;; esac ;;
    *) entry="IP:$n" ;;
  esac
  san="${san:+$san,}$entry"
done

issue() {  # issue NAME USAGE [SAN]
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n%s' \
    "$2" "${3:+subjectAltName=$3
}" > "$tmp/ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/O=Xronos/CN=$1" \
    -keyout "$dir/$1.key" -out "$tmp/$1.csr" 2>/dev/null
  openssl x509 -req -in "$tmp/$1.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$tmp/serial" -days "$days" -extfile "$tmp/ext" -out "$dir/$1.crt" 2>/dev/null
  chmod 0600 "$dir/$1.key"
  chmod 0644 "$dir/$1.crt"
}

issue broker serverAuth,clientAuth "$san"  # clientAuth too: the compose health check presents it
for user in controller operator "$@"; do issue "$user" clientAuth; done
chmod 0644 "$dir/ca.crt"
echo "wrote $dir: ca.crt, broker.crt (for: $names), and certificates for: controller operator $*" >&2
