#!/usr/bin/env bash
# ARM64 emulation for CI: runs the project's numpy math on emulated ARM64 CPUs (qemu-user) inside a
# Debian bookworm arm64 root, to prove it gives the same bits as on x86.
#
#   scripts/arm64.sh build
#       Installs qemu-user-static, debootstrap and binfmt-support when missing, registers the
#       qemu-aarch64 binfmt handler with the F flag, and builds the arm64 root (python3 3.11 with
#       numpy 2.x and threadpoolctl in a venv at /opt/phalanx-py). Idempotent: a built root whose
#       recipe is unchanged is only checked (2 s). From nothing it takes about 3.5 minutes on 2
#       cores (most of it debootstrap's emulated second stage); the root (about 300 MB) stays
#       cached at $PHALANX_ARM64_ROOT across runs on one machine.
#   scripts/arm64.sh run [--cpu CPU] [--keep-openblas-env] [--bind DIR]... [-e NAME[=VALUE]]... -- CMD [ARG...]
#       Runs CMD inside the root as the caller, in the caller's directory when that is visible
#       inside (else the repository root). Visible at their own paths: the repository, /tmp (and
#       $TMPDIR), and each --bind DIR. --cpu sets QEMU_CPU (cortex-a53, cortex-a76, neoverse-n1,
#       max, ...; `qemu-aarch64-static -cpu help` lists them). The host's network is shared.
#       The exit status is CMD's.
#   scripts/arm64.sh check [CPU...]
#       For each CPU (default: cortex-a53 cortex-a76 neoverse-n1 max) prints uname -m, the python
#       and numpy versions and the OpenBLAS kernel numpy's OpenBLAS picked; fails unless at least
#       three of them (all, when fewer are named) get different kernels. With qemu 7.2 (Debian 12):
#       cortex-a53 -> cortexa53, cortex-a76 -> armv8, neoverse-n1 -> neoversen1, max -> armv9sme.
#       Beware armv9sme: entering and leaving SME streaming mode raises every FPSR flag (the
#       architecture says so), so numpy warns "invalid value/overflow/divide by zero encountered
#       in matmul" after float32 matmuls; `--cpu max,sme=off` gets armv8sve without that.
#
# Environment: PHALANX_ARM64_ROOT (default /var/cache/phalanx/arm64-root),
#   PHALANX_ARM64_MIRROR (default http://deb.debian.org/debian),
#   PHALANX_ARM64_NUMPY (default 'numpy>=2,<3'), PHALANX_ARM64_PIP_EXTRA (more requirements,
#   space-separated, for the root's venv; binary aarch64 wheels only),
#   PHALANX_ARM64_HOST_PYTHON (the host python whose pip downloads the wheels; default python3).
#   The knobs that shape the root are part of its recipe: set them alike for build and run.
# Needs root (chroot, mount, binfmt_misc); a non-root caller is re-run through sudo.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=${PHALANX_ARM64_ROOT:-/var/cache/phalanx/arm64-root}
ROOT=${ROOT%/}
MIRROR=${PHALANX_ARM64_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
DEB_INCLUDE=python3,python3-venv  # python3-venv brings ensurepip (Debian splits it off python3)
NUMPY_SPEC=${PHALANX_ARM64_NUMPY:-numpy>=2,<3}
PIP_EXTRA=${PHALANX_ARM64_PIP_EXTRA:-}
VENV=/opt/phalanx-py                # inside the root; a venv, as bookworm's python refuses pip installs (PEP 668)
INNER_PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
MARKER=$ROOT/.phalanx-arm64-recipe  # first line: the recipe the root was built with
# Bump r<N> whenever the build steps change: a root built with another recipe is rebuilt.
RECIPE="phalanx-arm64 r1 suite=$SUITE mirror=$MIRROR include=$DEB_INCLUDE pip=$NUMPY_SPEC threadpoolctl $PIP_EXTRA"
HOST_PACKAGES=(qemu-user-static debootstrap binfmt-support debian-archive-keyring)
QEMU=/usr/bin/qemu-aarch64-static
# Debian's handler: qemu under a name that tells it the kernel preserves argv[0] (binfmt flag P)
QEMU_P=/usr/libexec/qemu-binfmt/aarch64-binfmt-P
BINFMT=/proc/sys/fs/binfmt_misc
# The ELF header of an aarch64 executable, and which of its bits to compare (qemu's
# scripts/qemu-binfmt-conf.sh); the kernel decodes the \x escapes itself.
AARCH64_MAGIC='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
AARCH64_MASK='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
DEFAULT_CPUS=(cortex-a53 cortex-a76 neoverse-n1 max)

say() { printf 'arm64: %s\n' "$*" >&2; }
die() { printf 'arm64: error: %s\n' "$*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$SELF" >&2
  exit 2
}

# Variables a run passes into the root (besides the PATH, HOME and LANG it sets itself).
# Not PYTHONHOME: it would point the root's python at the host's standard library.
passes_in() {
  case $1 in
    PYTHONHOME | PYTHONEXECUTABLE) return 1 ;;
    PHALANX_* | OPENBLAS_* | NPY_* | QEMU_* | OMP_* | GOTO_NUM_THREADS | PYTHON* | TMPDIR | TZ | TERM | NO_COLOR | FORCE_COLOR) return 0 ;;
  esac
  return 1
}

# The caller's variables that passes_in keeps, as NAME=VALUE words in the array named by $1.
collect_env() {
  local -n out=$1
  local name
  out=()
  while IFS= read -r name; do
    if passes_in "$name"; then out+=("$name=${!name}"); fi
  done < <(compgen -e)
}

# chroot, mount and binfmt_misc need root. sudo would drop PYTHONPATH and friends, so the
# variables a run passes in are handed over explicitly; the command then runs as the caller.
need_root() {
  ((EUID == 0)) && return 0
  command -v sudo >/dev/null || die "needs root (chroot, mount, binfmt_misc): run it as root, or install sudo"
  local -a keep
  collect_env keep
  exec sudo -- env -i "${keep[@]}" PATH="$PATH" HOME=/root \
    PHALANX_ARM64_HOST_PYTHON="$(command -v "${PHALANX_ARM64_HOST_PYTHON:-python3}" || true)" \
    _PHALANX_ARM64_AS="$(id -u):$(id -g)" "$BASH" "$SELF" "$@"
}

# Host tools ---------------------------------------------------------------------------------

ensure_host_packages() {
  local pkg missing=()
  for pkg in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
      die "apt-get install ${missing[*]} failed"
  fi
  [ -x "$QEMU" ] || die "$QEMU missing although qemu-user-static is installed"
}

# binfmt_misc makes the kernel hand aarch64 executables to qemu. The F (fix-binary) flag makes the
# kernel open qemu when the handler is registered, not at each exec: without it an exec inside the
# root looks for qemu inside the root and fails (the first python and every subprocess alike).
ensure_binfmt() {
  if [ ! -e "$BINFMT/register" ]; then
    say "mounting binfmt_misc"
    modprobe binfmt_misc 2>/dev/null || true
    mount -t binfmt_misc binfmt_misc "$BINFMT" || die "cannot mount binfmt_misc at $BINFMT"
  fi
  [ "$(cat "$BINFMT/status")" = enabled ] || echo 1 >"$BINFMT/status" || die "cannot enable binfmt_misc"
  local h=$BINFMT/qemu-aarch64
  if [ -e "$h" ]; then
    local interp flags
    interp=$(sed -n 's/^interpreter //p' "$h")
    flags=$(sed -n 's/^flags: //p' "$h")
    if [[ $flags == *F* ]] && [ -x "$interp" ]; then
      if ! grep -qx enabled "$h"; then
        say "enabling the qemu-aarch64 binfmt handler"
        echo 1 >"$h" || die "cannot enable $h"
      fi
      return 0
    fi
    say "re-registering qemu-aarch64 (flags '$flags', interpreter $interp): it needs the F flag"
    echo -1 >"$h" 2>/dev/null || true  # a concurrent run may have done it: checked below
  fi
  # As Debian registers it when it can (P: argv[0] kept, for multi-call binaries), else plain F
  local qemu=$QEMU flags=F
  if [ -x "$QEMU_P" ]; then qemu=$QEMU_P flags=PF; fi
  say "registering the qemu-aarch64 binfmt handler: $qemu, flags $flags"
  # a concurrent run registering it first makes this write fail with EEXIST: the check decides
  printf ':qemu-aarch64:M::%s:%s:%s:%s' "$AARCH64_MAGIC" "$AARCH64_MASK" "$qemu" "$flags" \
    >"$BINFMT/register" 2>/dev/null || true
  grep -q '^flags: .*F' "$h" 2>/dev/null ||
    die "cannot register the qemu-aarch64 binfmt handler with the F flag (is $BINFMT writable?)"
}

# Entering the root -------------------------------------------------------------------------

# The command that runs CMD inside root $1, in array in_root (the caller runs or execs it):
#   in_root_cmd ROOT CWD UID:GID BIND... -- NAME=VALUE... -- CMD ARG...
# unshare gives the run a private mount namespace: its mounts never show on the host, nor in
# concurrent runs, and the kernel drops them when the run's last process exits, even when it is
# killed, so no trap has to unmount them (and an rbind of /dev cannot propagate an unmount back).
in_root_cmd() {
  in_root=(unshare --mount --propagation private -- "$BASH" "$SELF" __inside "$@")
}

# The inside of in_root_cmd, in the new mount namespace: mounts, then becomes CMD (exec, so
# signals reach it and its exit status is the run's).
inside() {
  local root=$1 cwd=$2 as=$3
  shift 3
  local -a binds=() envs=()
  while [ "$1" != -- ]; do binds+=("$1"); shift; done
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  mount --rbind /dev "$root/dev"      # /dev/null, /dev/shm (multiprocessing), /dev/pts
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"      # CPU counts (glibc, OpenBLAS threads)
  local d f
  for d in "${binds[@]}"; do          # at the same path inside, so host paths work unchanged
    mkdir -p "$root$d"
    mount --rbind "$d" "$root$d"
  done
  for f in /etc/hosts /etc/resolv.conf; do   # the host's names ("localhost", services)
    if [ -f "$f" ] && [ -f "$root$f" ] && [ ! -L "$root$f" ]; then mount --bind "$f" "$root$f"; fi
  done
  exec chroot --userspec="$as" "$root" /usr/bin/env -i -C "$cwd" "${envs[@]}" "$@"
}

# Building the root -------------------------------------------------------------------------

lock_root() {  # $1: -s (runs: shared) or -x (build: exclusive); held until the script exits
  mkdir -p "$(dirname "$ROOT")"
  exec {lock_fd}>"$ROOT.lock"
  if ! flock -n "$1" "$lock_fd"; then
    say "waiting for $ROOT.lock (a build or run holds it)"
    flock "$1" "$lock_fd"
  fi
}

built_recipe() { if [ -f "$MARKER" ]; then head -n1 "$MARKER"; fi; }

# Checks the root's python: aarch64, numpy and threadpoolctl import, and a subprocess (an exec
# inside the root, which needs the binfmt F flag) runs too. Prints the versions.
verify_root() {
  local root=$1
  local -a in_root
  in_root_cmd "$root" / 0:0 -- PATH="$INNER_PATH" HOME=/root LANG=C.UTF-8 -- python3 -c '
import platform, subprocess, sys
import numpy, threadpoolctl
assert platform.machine() == "aarch64", platform.machine()
child = subprocess.run([sys.executable, "-c", "import platform; print(platform.machine())"],
                       capture_output=True, text=True, check=True).stdout.strip()
assert child == "aarch64", child
print(f"python {platform.python_version()} numpy {numpy.__version__} threadpoolctl {threadpoolctl.__version__}")'
  "${in_root[@]}"
}

build() {
  ensure_host_packages
  ensure_binfmt
  lock_root -x
  if [ "$(built_recipe)" = "$RECIPE" ]; then
    say "root up to date at $ROOT ($(sed -n 2p "$MARKER")); checking it"
    verify_root "$ROOT" >/dev/null || die "the cached root at $ROOT fails its check; delete it and build again"
    say "ok"
    return 0
  fi
  if [ -e "$ROOT" ]; then say "root at $ROOT was built with another recipe: rebuilding"; fi

  local host_py=${PHALANX_ARM64_HOST_PYTHON:-python3}
  "$host_py" -m pip --version >/dev/null 2>&1 ||
    die "'$host_py -m pip' does not work: the host needs pip to download the aarch64 wheels (set PHALANX_ARM64_HOST_PYTHON)"

  # Built beside the root and renamed into place at the end, so an interrupted build leaves no
  # half root behind. Leftovers of killed builds go first (the exclusive lock says none runs).
  local new=$ROOT.new wheels=$ROOT.wheels
  rm -rf --one-file-system "$new" "$wheels" "$ROOT.old"
  trap 'rm -rf --one-file-system "$new" "$wheels"' EXIT

  local -a reqs=("$NUMPY_SPEC" threadpoolctl)
  # shellcheck disable=SC2206  # PIP_EXTRA is a space-separated list of requirements
  reqs+=($PIP_EXTRA)
  say "downloading aarch64 wheels on the host: ${reqs[*]}"
  mkdir -p "$wheels"
  "$host_py" -m pip download -q --disable-pip-version-check --no-cache-dir -d "$wheels" \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all: "${reqs[@]}" ||
    die "pip download of the aarch64 wheels failed"

  say "debootstrap $SUITE arm64 (minbase + $DEB_INCLUDE) from $MIRROR into $new; the second stage runs emulated"
  # In its own mount namespace: the /proc and /sys it mounts in the target vanish with it,
  # even when killed, so rm -rf of a broken build never meets a mount.
  local log=$ROOT.debootstrap.log
  if ! unshare --mount --propagation private -- debootstrap --arch=arm64 --variant=minbase \
    --include="$DEB_INCLUDE" "$SUITE" "$new" "$MIRROR" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    [ -f "$new/debootstrap/debootstrap.log" ] && tail -n 30 "$new/debootstrap/debootstrap.log" >&2
    die "debootstrap failed (log: $log)"
  fi
  rm -f "$log"
  rm -rf "$new"/var/cache/apt/archives/*.deb "$new"/var/lib/apt/lists/*  # 50 MB; apt-get update restores them
  # bind targets for the host's files (debootstrap copies resolv.conf; hosts may be absent)
  [ -f "$new/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$new/etc/hosts"
  if [ ! -f "$new/etc/resolv.conf" ] || [ -L "$new/etc/resolv.conf" ]; then
    rm -f "$new/etc/resolv.conf"
    : >"$new/etc/resolv.conf"
  fi

  say "creating the venv $VENV and installing ${reqs[*]} (emulated pip)"
  mv "$wheels" "$new/var/tmp/phalanx-wheels"
  local -a in_root
  in_root_cmd "$new" / 0:0 -- PATH="$INNER_PATH" HOME=/root LANG=C.UTF-8 -- /bin/sh -ec "
    python3 -m venv $VENV
    $VENV/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-index \
      --find-links /var/tmp/phalanx-wheels \"\$@\"" sh "${reqs[@]}"
  "${in_root[@]}" || die "installing the wheels in the root failed"
  rm -rf "$new/var/tmp/phalanx-wheels"

  say "checking the new root"
  local versions
  versions=$(verify_root "$new") || die "the new root fails its check (python, numpy, a subprocess)"
  printf '%s\n%s\nbuilt %s by scripts/arm64.sh\n' "$RECIPE" "$versions" "$(date -u +%FT%TZ)" >"$new/${MARKER##*/}"

  if [ -e "$ROOT" ]; then mv "$ROOT" "$ROOT.old"; fi
  mv "$new" "$ROOT"
  rm -rf --one-file-system "$ROOT.old"
  trap - EXIT
  say "built $ROOT: $versions, $(du -sh --one-file-system "$ROOT" | cut -f1)"
}

# Running in the root -----------------------------------------------------------------------

# Fails unless a built root is there; warns when it is not what build would make now.
require_root_built() {
  local have
  have=$(built_recipe)
  [ -n "$have" ] || die "no arm64 root at $ROOT: run 'scripts/arm64.sh build' first"
  [ "$have" = "$RECIPE" ] ||
    say "warning: the root at $ROOT was built with another recipe (run 'scripts/arm64.sh build'): $have"
}

# Fills array run_cmd: CMD run inside the root, with the caller's variables that pass in.
#   prepare_run CPU KEEP_OPENBLAS "BIND..." "NAME[=VALUE]..." -- CMD ARG...
prepare_run() {
  local cpu=$1 keep_openblas=$2
  local -n extra_binds=$3 extra_env=$4
  shift 5
  local -a envs mounts
  collect_env envs
  local e
  for e in "${extra_env[@]}"; do
    if [[ $e == *=* ]]; then envs+=("$e"); elif [ -n "${!e+x}" ]; then envs+=("$e=${!e}"); fi
  done
  # The host's OpenBLAS settings are for its x86 CPU (OPENBLAS_CORETYPE=Haswell means nothing on
  # ARM64, and on ARM64 it would force a kernel, hiding the one the emulated CPU gets).
  if [ "$keep_openblas" = no ]; then
    local -a kept=()
    for e in "${envs[@]}"; do
      case $e in OPENBLAS_CORETYPE=* | OPENBLAS_L2_SIZE=*) ;; *) kept+=("$e") ;; esac
    done
    envs=("${kept[@]}")
  fi
  if [ -n "$cpu" ]; then envs+=("QEMU_CPU=$cpu"); fi
  local as=${_PHALANX_ARM64_AS:-0:0} home=/root
  [ "${as%%:*}" = 0 ] || home=/tmp   # the caller's home is not inside; /tmp is theirs too
  envs+=(PATH="$INNER_PATH" HOME="$home" LANG=C.UTF-8)

  # Visible inside at the same paths: /tmp and $TMPDIR (pytest's tmp_path), the repository, --bind.
  mounts=(/tmp)
  if [ -n "${TMPDIR:-}" ] && [ -d "$TMPDIR" ] && [ "$TMPDIR" != /tmp ]; then mounts+=("$TMPDIR"); fi
  mounts+=("$REPO")
  local b
  for b in "${extra_binds[@]}"; do
    [ -d "$b" ] || die "--bind $b: no such directory"
    mounts+=("$(cd "$b" && pwd)")
  done
  # The caller's directory when it is visible inside, else the repository.
  local cwd=$REPO here
  here=$(pwd)
  for b in "${mounts[@]}"; do
    if [[ $here == "$b" || $here == "$b"/* ]]; then cwd=$here; fi
  done
  local -a in_root
  in_root_cmd "$ROOT" "$cwd" "$as" "${mounts[@]}" -- "${envs[@]}" -- "$@"
  run_cmd=("${in_root[@]}")
}

run() {
  local cpu="" keep_openblas=no
  local -a user_binds=() user_env=()
  while (($#)); do
    case $1 in
      --cpu) (($# >= 2)) || die "--cpu needs a value"; cpu=$2; shift 2 ;;
      --cpu=*) cpu=${1#--cpu=}; shift ;;
      --keep-openblas-env) keep_openblas=yes; shift ;;
      --bind) (($# >= 2)) || die "--bind needs a directory"; user_binds+=("$2"); shift 2 ;;
      -e | --env) (($# >= 2)) || die "$1 needs NAME[=VALUE]"; user_env+=("$2"); shift 2 ;;
      --) shift; break ;;
      -*) die "run: unknown option $1" ;;
      *) break ;;
    esac
  done
  (($#)) || die "run: no command (scripts/arm64.sh run [--cpu CPU] -- CMD ARG...)"
  require_root_built
  ensure_binfmt   # registrations do not survive a reboot; the cached root does
  lock_root -s    # a build waits until runs are done (the fd stays open in CMD, holding it)
  local -a run_cmd
  prepare_run "$cpu" "$keep_openblas" user_binds user_env -- "$@"
  exec "${run_cmd[@]}"
}

# Checking the emulated CPUs ------------------------------------------------------------------

check() {
  local -a cpus=("$@")
  ((${#cpus[@]})) || cpus=("${DEFAULT_CPUS[@]}")
  require_root_built
  ensure_binfmt
  lock_root -s
  say "$("$QEMU" --version | head -n1)"
  local cpu out kernel failed=0
  local -A kernel_of=()
  local -a run_cmd
  # shellcheck disable=SC2034  # passed by name to prepare_run
  local -a none=()
  for cpu in "${cpus[@]}"; do
    # shellcheck disable=SC2016  # $(uname -m) and $1 are for the shell inside the root
    prepare_run "$cpu" no none none -- /bin/sh -c 'echo "uname -m: $(uname -m)"; exec python3 -c "$1"' sh '
import json, platform, numpy, threadpoolctl
info = threadpoolctl.threadpool_info()
print("python:", platform.python_version())
print("numpy:", numpy.__version__)
for lib in info:
    if lib.get("internal_api") == "openblas":
        fields = [k + "=" + str(lib.get(k)) for k in ("internal_api", "architecture", "version", "num_threads")]
        print("openblas:", " ".join(fields))
print("threadpool_info:", json.dumps(info))'
    echo "== QEMU_CPU=$cpu"
    if ! out=$("${run_cmd[@]}" 2>&1); then
      printf '%s\n' "$out"
      say "QEMU_CPU=$cpu failed"
      failed=1
      continue
    fi
    printf '%s\n' "$out"
    kernel=$(sed -n 's/^openblas: .*architecture=\([^ ]*\).*/\1/p' <<<"$out" | head -n1)
    [ -n "$kernel" ] || { say "QEMU_CPU=$cpu: numpy reports no OpenBLAS"; failed=1; continue; }
    kernel_of[$cpu]=$kernel
  done
  echo "== OpenBLAS kernels"
  local -A cpus_of=()
  for cpu in "${cpus[@]}"; do
    [ -n "${kernel_of[$cpu]:-}" ] || continue
    printf '%-14s %s\n' "$cpu" "${kernel_of[$cpu]}"
    cpus_of[${kernel_of[$cpu]}]+="${cpus_of[${kernel_of[$cpu]}]:+ }$cpu"
  done
  echo "${#cpus_of[@]} different kernels:"
  for kernel in "${!cpus_of[@]}"; do echo "  $kernel: ${cpus_of[$kernel]}"; done
  ((failed == 0)) || die "some CPUs failed (above)"
  local need=$((${#cpus[@]} < 3 ? ${#cpus[@]} : 3))  # the bit-identity tests want three kernels
  ((${#cpus_of[@]} >= need)) || die "fewer than $need different OpenBLAS kernels among: ${cpus[*]}"
}

# -----------------------------------------------------------------------------------------------

(($#)) || usage
cmd=$1
shift
case $cmd in
  build) need_root build "$@"; build ;;
  run) need_root run "$@"; run "$@" ;;
  check) need_root check "$@"; check "$@" ;;
  __inside) inside "$@" ;;   # internal: see in_root_cmd
  -h | --help | help) usage ;;
  *) usage ;;
esac
