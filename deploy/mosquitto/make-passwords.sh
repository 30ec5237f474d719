#!/bin/sh
# Write a Mosquitto password file for Xronos: make-passwords.sh FILE NODE_ID...
# Reads each password from the environment (XRONOS_PASSWORD_<NAME>, upper case,
# '-' as '_') or asks for it. Roles: controller, operator, and one user per node.
# The passwords reach mosquitto_passwd on its standard input (printf is a shell
# builtin), never on a command line that `ps` would show.
set -eu
file=$1; shift
for user in "$@"; do
  case $user in
    controller|operator) echo "a node cannot be called $user: that is a role's user" >&2; exit 2 ;;
    xronos-*) echo "a node id cannot start with xronos- (the prefix of operators' client ids)" >&2; exit 2 ;;
  esac
done
umask 077
: > "$file"
for user in controller operator "$@"; do
  var="XRONOS_PASSWORD_$(echo "$user" | tr 'a-z-' 'A-Z_')"
  eval "password=\${$var:-}"
  if [ -z "$password" ]; then
    printf 'password for %s: ' "$user" >&2; stty -echo 2>/dev/null || true; read -r password; stty echo 2>/dev/null || true; echo >&2
  fi
  printf '%s\n%s\n' "$password" "$password" | mosquitto_passwd "$file" "$user" >/dev/null
done
chmod 0600 "$file"
echo "wrote $file for: controller operator $*" >&2
