#!/usr/bin/env bash
# A single-node Slurm (slurmctld + slurmd + munge) for tests and trying the scripts out,
# from the distribution's packages, as root without systemd. Stopped by the PIDs it started.
#
#     slurm/local-cluster.sh install     # the packages, when missing (.ci/run does this)
#     slurm/local-cluster.sh up DIR      # prints: export SLURM_CONF=DIR/slurm.conf
#     slurm/local-cluster.sh down DIR
#
# Installs slurmctld, slurmd, slurm-client and munge with apt-get when they are missing.
# The node declares CPUS (default 8) CPUs whatever the machine has, so 8 ranks fit on 2 cores.
# Exit status 77 (the test suites' "skipped"): this machine cannot have a local Slurm (not
# root, or the packages cannot be installed); the message says which. 1: it failed to start.
set -euo pipefail

cmd=${1:?usage: local-cluster.sh install|up|down DIR}
dir=$(realpath -m "${2:-${TMPDIR:-/tmp}/hpcpar-slurm}")
cpus=${CPUS:-8}

cannot() {                            # this machine cannot have one: status 77, "skipped"
  echo "local-cluster: $*" >&2
  exit 77
}

need_root() {
  [ "$(id -u)" = 0 ] || cannot "needs root (it installs packages, writes /etc/munge/munge.key and starts munged, slurmctld and slurmd), and runs as $(id -un)"
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  need_root
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it (install slurmctld, slurmd, slurm-client and munge)"
  mkdir -p "$dir"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         --no-install-recommends slurmctld slurmd slurm-client munge; } >"$dir/apt.log" 2>&1; then
    cannot "cannot install Slurm (apt-get install slurmctld slurmd slurm-client munge failed; see $dir/apt.log)"
  fi
}

up() {
  need_root
  mkdir -p "$dir"/{state,spool,munge}
  chmod 711 "$dir"                    # munged, running as munge, reaches its socket folder
  install
  host=$(hostname)
  chown munge:munge "$dir/munge" && chmod 711 "$dir/munge"
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
                                   chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  runuser -u munge -- munged --socket="$dir/munge/munge.socket.2" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" --force
  cat >"$dir/slurm.conf" <<CONF
ClusterName=hpcpartest
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it starts again (default 120 s)
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld
  slurmd
  for _ in $(seq 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$dir/slurm.conf"
      return
    fi
    sleep 0.1
  done
  echo "local-cluster: the node did not become idle; see $dir/slurmctld.log and $dir/slurmd.log" >&2
  exit 1
}

down() {
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    if [ -s "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
}

case "$cmd" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: local-cluster.sh install|up|down DIR" >&2; exit 2 ;;
esac
