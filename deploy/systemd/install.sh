#!/bin/sh
# Install pdxfer's systemd units, user, directories, token helper and example settings.
#   sudo sh deploy/systemd/install.sh            # then edit /etc/pdxfer/*.env, enable units
#   DESTDIR=/tmp/root sh deploy/systemd/install.sh   # into a staging root (no systemctl)
# pdxfer itself goes into /opt/pdxfer/venv first (docs/deploy.md). Existing settings files are
# kept.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=${DESTDIR:-}
install -d "$root/etc/systemd/system" "$root/usr/lib/sysusers.d" "$root/usr/lib/tmpfiles.d" \
  "$root/opt/pdxfer/bin" "$root/opt/pdxfer/docs" "$root/etc/pdxfer"
for unit in pdxfer-master.service pdxfer-vllm@.service pdxfer-proxy.service; do
  install -m 0644 "$here/$unit" "$root/etc/systemd/system/$unit"
done
install -m 0644 "$here/pdxfer.sysusers.conf" "$root/usr/lib/sysusers.d/pdxfer.conf"
install -m 0644 "$here/pdxfer.tmpfiles.conf" "$root/usr/lib/tmpfiles.d/pdxfer.conf"
install -m 0755 "$here/pdxfer-token" "$root/opt/pdxfer/bin/pdxfer-token"
install -m 0644 "$here/../../docs/deploy.md" "$root/opt/pdxfer/docs/deploy.md"
for f in "$here"/env/*.env; do
  dest="$root/etc/pdxfer/$(basename "$f")"
  [ -e "$dest" ] || install -m 0640 "$f" "$dest"
done
if [ -z "$root" ]; then
  systemd-sysusers pdxfer.conf
  systemd-tmpfiles --create pdxfer.conf
  chgrp pdxfer /etc/pdxfer/*.env
  systemctl daemon-reload
fi
echo "installed; edit /etc/pdxfer/*.env, then: systemctl enable --now pdxfer-master (or pdxfer-vllm@prefill, pdxfer-vllm@decode, pdxfer-proxy)"
