# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this file
# Shared by scripts/slurm-up, scripts/slurm-down and scripts/slurm-node: where the test cluster lives,
# how its namespaced nodes are named and addressed, and how to tell whether one of its daemons is
# alive. Sourced, never run.

# Clients (sinfo, sbatch, scontrol, the Slurm launcher) find the config at Slurm's default path, so
# nothing has to export SLURM_CONF.
SLURM_CONF_FILE=/etc/slurm/slurm.conf
STATE_DIR=/var/lib/tunepod-slurm
LOG_DIR=/var/log/tunepod-slurm
RUN_DIR=/run/tunepod-slurm
PARTITION=debug

# munged keeps the Debian package's paths: Slurm's auth/munge looks for the socket there.
MUNGE_KEY=/etc/munge/munge.key
MUNGE_RUN_DIR=/run/munge
MUNGE_PID_FILE=$MUNGE_RUN_DIR/munged.pid
MUNGE_LOG_FILE=/var/log/munge/munged.log

# This host is one node of the cluster (partition debug, the default) at 127.0.0.1.
HOST_NODE=$(hostname -s)

# The namespaced nodes (slurm-up --nodes N): node nI is a slurmd in a network namespace of its own
# (tunepod-nI), with its own hostname (a UTS namespace) and address 10.231.0.(10+I) on a bridge that
# slurm-up makes, where the controller listens at 10.231.0.1. They share this host's file systems, as
# cluster nodes share FSx, but each has its own /dev/shm (NODE_SHM_SIZE below): its memory. The
# addresses exist only inside these namespaces and on the bridge.
NODE_PARTITION=nodes
BRIDGE=tpslurm0
SUBNET=10.231.0
BRIDGE_ADDR=$SUBNET.1
MAX_NODES=64
# Bind-mounted over /etc/hosts in each node's mount namespace: torchrun resolves the other nodes' names.
HOSTS_FILE=$STATE_DIR/hosts
# Each node's own memory: a tmpfs mounted on /dev/shm in its mount namespace, so what a job step puts
# there (the checkpoint memory tier, Python's semaphores, DCP's staging) is that node's alone and goes
# with it when the node is killed (the namespace, and its tmpfs, end with its last process). Sized
# like a container's --shm-size: the memory tier keeps a job's 2 newest steps on a node, its own and a
# peer's copy, so 1 GB holds a 64 MB state's four copies with room for staging and semaphores, while
# four nodes can never take more than 4 GB of the host's RAM (tmpfs pages count only once written).
# TUNEPOD_NODE_SHM_SIZE overrides it when a node starts (any tmpfs size=: 2g, 25%).
NODE_SHM_SIZE=${TUNEPOD_NODE_SHM_SIZE:-1g}

netns_of() { echo "tunepod-$1"; }
# The host's end of node $1's veth pair (the node's end is eth0 in its namespace).
veth_of() { echo "tp-$1"; }
node_addr() { echo "$SUBNET.$((10 + ${1#n}))"; }

# The namespaced nodes that exist now (by their namespaces), in order: n1 n2 ...
namespaced_nodes() {
  ip netns list 2>/dev/null | awk '{ print $1 }' | sed -n 's/^tunepod-\(n[0-9][0-9]*\)$/\1/p' | sort -V
}

# Daemons in start order; slurm-down stops them in reverse. Each node's slurmd is slurmd@NODE.
DAEMONS=(munged slurmctld "slurmd@$HOST_NODE")

# The process name of daemon $1 (slurmd@n2 runs as slurmd).
comm_of() { echo "${1%@*}"; }

# slurmd's files are per node (SlurmdPidFile=slurmd-%n.pid in slurm.conf).
pid_file_of() {
  case "$1" in
    munged) echo "$MUNGE_PID_FILE" ;;
    slurmd@*) echo "$RUN_DIR/slurmd-${1#slurmd@}.pid" ;;
    *) echo "$RUN_DIR/$1.pid" ;;
  esac
}

log_file_of() {
  case "$1" in
    munged) echo "$MUNGE_LOG_FILE" ;;
    slurmd@*) echo "$LOG_DIR/slurmd-${1#slurmd@}.log" ;;
    *) echo "$LOG_DIR/$1.log" ;;
  esac
}

# True when pid $1 is a live process named $2. A zombie counts as dead: a daemon that exited can
# linger as one for a few seconds before init reaps it. The name check guards against pid reuse.
pid_is_alive() {
  local pid=$1 name=$2 stat comm
  stat=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  [[ -n $stat && $stat != Z* ]] || return 1
  comm=$(ps -o comm= -p "$pid" 2>/dev/null) || return 1
  [[ $comm == "$name" ]]
}

# Prints the pid of daemon $1 when its pid file names a live process of that name.
daemon_pid() {
  local name=$1 pid_file pid
  pid_file=$(pid_file_of "$name")
  [[ -r $pid_file ]] || return 1
  pid=$(tr -dc '0-9' <"$pid_file")
  if [[ -z $pid ]] || ! pid_is_alive "$pid" "$(comm_of "$name")"; then
    return 1
  fi
  echo "$pid"
}

# Stops daemon $1 and waits until it is really gone: SIGTERM, SIGKILL after 20 s, and failure when
# even that has not ended it 10 s later. Returns 0 at once when it is not running.
stop_daemon() {
  local name=$1 pid tenths=0 comm
  comm=$(comm_of "$name")
  if ! pid=$(daemon_pid "$name"); then
    rm -f "$(pid_file_of "$name")"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  while pid_is_alive "$pid" "$comm"; do
    if ((tenths == 200)); then
      echo "  $name (pid $pid) ignored SIGTERM for 20 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    elif ((tenths == 300)); then
      echo "  $name (pid $pid) survived SIGKILL for 10 s; giving up" >&2
      return 1
    fi
    sleep 0.1
    tenths=$((tenths + 1))
  done
  rm -f "$(pid_file_of "$name")"
  echo "  stopped $name (pid $pid)"
}

# ------------------------------------------------------------------------------- namespaced nodes

# SIGKILLs every process in node $1's network namespace (its slurmd, job steps and their children):
# what a node's power cut does to them. Prints how many there were.
kill_node_processes() {
  local ns pids
  ns=$(netns_of "$1")
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  if [[ -n $pids ]]; then
    # shellcheck disable=SC2086  # one pid per word
    kill -KILL $pids 2>/dev/null || true
  fi
  wc -w <<<"$pids"
}

# Starts node $1's slurmd in its namespaces: the network namespace slurm-up made, and new UTS and
# mount namespaces for its hostname, /etc/hosts and its own /dev/shm (NODE_SHM_SIZE, empty: a node
# that starts again has lost what its memory held). Private propagation keeps both mounts out of the
# host's namespace. Not `ip netns exec`: it remounts /sys, and slurmd then fails to set up its cgroup
# plugin.
launch_node_slurmd() {
  local node=$1
  nsenter --net="/run/netns/$(netns_of "$node")" unshare --uts --mount --propagation private \
    sh -c 'mount --bind "$1" /etc/hosts &&
      mount -t tmpfs -o "size=$3,mode=1777,nosuid,nodev" "tunepod-$2-shm" /dev/shm &&
      hostname "$2" && exec slurmd -N "$2"' sh "$HOSTS_FILE" "$node" "$NODE_SHM_SIZE"
}

# True when node $1's running slurmd (pid $2) has a /dev/shm of its own, not the host's: a node
# started by an older slurm-up shares the host's, and slurm-up restarts it.
node_has_own_memory() {
  local pid=$2 host_dev node_dev
  host_dev=$(stat -c %d /dev/shm) || return 1
  node_dev=$(stat -c %d "/proc/$pid/root/dev/shm" 2>/dev/null) || return 1
  [[ $node_dev != "$host_dev" ]]
}
