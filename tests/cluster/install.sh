#!/bin/sh
# What tests/cluster needs, installed when missing and we are root with apt (quiet, idempotent):
# iproute2 (ip, tc), util-linux (unshare, nsenter), iptables (iptables-legacy: delay and loss where
# the kernel has no netem), slurm-wlm and munge. Otherwise nothing: the tests skip and say what is missing.
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || exit 0
need=""
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need="$need iproute2"
{ command -v unshare && command -v nsenter; } >/dev/null 2>&1 || need="$need util-linux"
command -v iptables-legacy >/dev/null 2>&1 || need="$need iptables"
{ command -v slurmctld && command -v slurmd && command -v sbatch; } >/dev/null 2>&1 || need="$need slurm-wlm"
command -v munged >/dev/null 2>&1 || need="$need munge"
[ -n "$need" ] || exit 0
export DEBIAN_FRONTEND=noninteractive
echo "tests/cluster: installing$need"
apt-get install -y -q $need >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $need >/dev/null 2>&1; } \
  || echo "tests/cluster: could not install$need; the tests that need it skip" >&2
exit 0
