#!/bin/sh
# Write a Mosquitto password file for Xronos: make-passwords.sh FILE NODE_ID...
# Reads each password from the environment (XRONOS_PASSWORD_<NAME>, upper case,
# '-' as '_') or asks for it. Roles: controller, operator, and one user per node.
set -eu
file=$1; shift
: > "$file"
for user in controller operator "$@"; do
  var="XRONOS_PASSWORD_$(echo "$user" | tr 'a-z-' 'A-Z_')"
  eval "password=\${$var:-}"
  if [ -z "$password" ]; then
    printf 'password for %s: ' "$user" >&2; stty -echo 2>/dev/null || true; read -r password; stty echo 2>/dev/null || true; echo >&2
  fi
  mosquitto_passwd -b "$file" "$user" "$password"
done
chmod 0600 "$file"
echo "wrote $file for: controller operator $*" >&2
