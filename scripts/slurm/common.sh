# shellcheck shell=bash disable=SC2034  # the variables are used by the scripts that source this file
# Shared by scripts/slurm-up and scripts/slurm-down: where the test cluster lives, and how to tell
# whether one of its daemons is alive. Sourced, never run.

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

# Daemons in start order; slurm-down stops them in reverse.
DAEMONS=(munged slurmctld slurmd)

pid_file_of() {
  case "$1" in
    munged) echo "$MUNGE_PID_FILE" ;;
    *) echo "$RUN_DIR/$1.pid" ;;
  esac
}

log_file_of() {
  case "$1" in
    munged) echo "$MUNGE_LOG_FILE" ;;
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
  if [[ -z $pid ]] || ! pid_is_alive "$pid" "$name"; then
    return 1
  fi
  echo "$pid"
}

# Stops daemon $1 and waits until it is really gone: SIGTERM, SIGKILL after 20 s, and failure when
# even that has not ended it 10 s later. Returns 0 at once when it is not running.
stop_daemon() {
  local name=$1 pid tenths=0
  if ! pid=$(daemon_pid "$name"); then
    rm -f "$(pid_file_of "$name")"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  while pid_is_alive "$pid" "$name"; do
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
