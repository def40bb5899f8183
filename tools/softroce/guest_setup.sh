#!/bin/sh
# Runs inside the guest, chrooted into the host root (read-only over 9p). Creates two soft-RoCE
# devices on the two ends of a veth pair, then runs the commands the host hands it, one after another.
# Output goes to /run/softroce (a writable 9p share the host reads); a failed set-up writes 120 to its 'rc'.
RUN=/run/softroce
. "$RUN/env"
exec >"$RUN/setup.log" 2>&1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
fail() { echo "softroce-setup: $*"; echo 120 >"$RUN/rc"; exit 120; }

# crc32_generic must be loaded by hand, or 'rdma link add' fails (rxe's ICRC needs crc32).
# sch_netem lets a test drop the holder's packets for a while (tc qdisc ... netem loss 100%).
for m in crc32_generic veth rdma_rxe rdma_ucm ib_uverbs sch_netem; do
  modprobe "$m" || fail "modprobe $m failed (kernel modules under /lib/modules/$(uname -r)?)"
done
ip link set lo up
ip link add sr0 type veth peer name sr1 || fail "cannot create the veth pair"
for i in 0 1; do
  ip link set "sr$i" mtu "$SOFTROCE_MTU" up
  ip addr add "192.168.77.$((i + 1))/24" dev "sr$i"
done
# Both ends live in this one namespace (rxe in 6.1 listens in the initial namespace only), so the
# kernel would deliver .1 -> .2 over 'lo' and the packets would never reach the other rxe device.
# Locally generated traffic between the two addresses is routed over the veth instead; the local
# table moves behind those rules, and the receiving side accepts a local source address.
ip route add 192.168.77.2 dev sr0 src 192.168.77.1 table 77
ip route add 192.168.77.1 dev sr1 src 192.168.77.2 table 78
ip rule add pref 100 iif lo to 192.168.77.2 table 77
ip rule add pref 101 iif lo to 192.168.77.1 table 78
ip rule add pref 1000 table local
ip rule del pref 0
for c in all default sr0 sr1; do  # /proc directly: procps (sysctl) may not be installed
  echo 0 >"/proc/sys/net/ipv4/conf/$c/rp_filter"
  echo 1 >"/proc/sys/net/ipv4/conf/$c/accept_local"
done
mac() { cat "/sys/class/net/$1/address"; }
ip neigh replace 192.168.77.2 lladdr "$(mac sr1)" dev sr0 nud permanent
ip neigh replace 192.168.77.1 lladdr "$(mac sr0)" dev sr1 nud permanent
rdma link add rxe0 type rxe netdev sr0 || fail "rdma link add rxe0 failed"
rdma link add rxe1 type rxe netdev sr1 || fail "rdma link add rxe1 failed"
n=0
until [ "$(rdma link show rxe0/1 | grep -c 'state ACTIVE')" = 1 ] && [ "$(rdma link show rxe1/1 | grep -c 'state ACTIVE')" = 1 ]; do
  n=$((n + 1)); [ $n -gt 100 ] && fail "rxe ports not ACTIVE after 10 s: $(rdma link show)"
  sleep 0.1
done
rdma link show
echo "softroce-setup: ready"

export HOME=/tmp/home PYTHONDONTWRITEBYTECODE=1 PDXFER_SOFTROCE=1
export SOFTROCE_DEV0=rxe0 SOFTROCE_DEV1=rxe1 SOFTROCE_IP0=192.168.77.1 SOFTROCE_IP1=192.168.77.2
mkdir -p "$HOME"
cd "$SOFTROCE_CWD" || fail "cannot cd to $SOFTROCE_CWD"
# Commands come one after another in one boot: the host writes cmd.N (renamed into place whole),
# the guest runs it with its output streaming to out.N (the host tails it) and its status in rc.N,
# written last. The host bounds each command and kills the guest when one outlives its bound.
n=1
while :; do
  if [ -e "$RUN/cmd.$n" ]; then
    sh "$RUN/cmd.$n" >"$RUN/out.$n" 2>&1 </dev/null
    echo $? >"$RUN/rc.$n.tmp"
    sync
    mv "$RUN/rc.$n.tmp" "$RUN/rc.$n"
    n=$((n + 1))
  else
    sleep 0.1  # no inotify across 9p: a new file is seen by looking
  fi
done
