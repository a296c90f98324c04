#!/data/data/com.termux/files/usr/bin/bash
# Install the Phalanx agent on a phone (Termux) and keep it running.
#
#   curl -fsSLo install.sh <server>/install.sh && echo "<sha256>  install.sh" | sha256sum -c \
#     && bash install.sh --server <server> --token <enroll-token> --sha256 <archive sha256>
#   (the control plane serves this script and /agent.tar.gz, the agent's sources, without auth;
#   `phalanx tokens create --enroll` prints this line with both hashes filled in)
#   bash deploy/termux/install.sh --server URL --token TOKEN [--name N] [--label k=v]... \
#        [--source PIP-SPEC] [--sha256 HEX] [--release-key HEX] [--ca-file PEM] [--torch] [--no-enroll]
#
# What it does: pkg install python python-numpy termux-api termux-services (python-torch and
# python-psutil on request / when available), pip install the agent (numpy comes from pkg:
# building it with pip on a phone takes an hour), enroll, a runit service that restarts the
# agent when Android kills it, termux-wake-lock, and a Termux:Boot script.
set -euo pipefail

SERVER="" TOKEN="" NAME="" SOURCE="" SHA256="" RELEASE_KEY="" CA_FILE="" TORCH=0 ENROLL=1
LABELS=()
here="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" 2>/dev/null && pwd || echo .)"

usage() { sed -n '2,12p' "$0" 2>/dev/null | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --server) SERVER="$2"; shift 2 ;;
    --token) TOKEN="$2"; shift 2 ;;
    --name) NAME="$2"; shift 2 ;;
    --label) LABELS+=(--label "$2"); shift 2 ;;
    --source) SOURCE="$2"; shift 2 ;;
    --sha256) SHA256="$2"; shift 2 ;;
    --release-key) RELEASE_KEY="$2"; shift 2 ;;  # `phalanx agents key`: upgrades signed by it
    --ca-file) CA_FILE="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --torch) TORCH=1; shift ;;
    --no-enroll) ENROLL=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "install.sh: unknown option $1" >&2; usage 2 ;;
  esac
done

PREFIX="${PREFIX:-/data/data/com.termux/files/usr}"
if [ ! -d "$PREFIX" ] || ! command -v pkg >/dev/null 2>&1; then
  echo "install.sh: run this inside Termux (no \$PREFIX or pkg found)" >&2
  exit 1
fi
if [ -z "$SOURCE" ]; then
  if [ -f "$here/pyproject.toml" ] && grep -q '^name = "phalanx-agent"' "$here/pyproject.toml"; then
    SOURCE="$here"                      # beside the agent's sources (agent/install.sh)
  elif [ -f "$here/../../agent/pyproject.toml" ]; then
    SOURCE="$here/../../agent"          # from a checkout of the repository (deploy/termux)
  elif [ -n "$SERVER" ]; then
    SOURCE="$SERVER/agent.tar.gz"       # the agent's sources, served by the control plane
  else
    echo "install.sh: give --source (a pip spec for the agent) or --server" >&2
    exit 2
  fi
fi

echo "== packages"
pkg install -y python python-numpy termux-api termux-services
pkg install -y python-psutil || echo "python-psutil not available: the agent does without"
if [ "$TORCH" = 1 ]; then
  pkg install -y python-torch || echo "python-torch not available: numpy backend only"
fi

if [ -n "$SHA256" ]; then  # the archive as downloaded must be the one the admin was shown
  case "$SOURCE" in
    http://*|https://*) ;;
    *) echo "install.sh: --sha256 checks a downloaded archive: give --server or an http(s) --source" >&2
       exit 2 ;;
  esac
  ARCHIVE="${TMPDIR:-$PREFIX/tmp}/phalanx-agent-$$.tar.gz"
  trap 'rm -f "$ARCHIVE"' EXIT
  curl -fsSL ${CA_FILE:+--cacert "$CA_FILE"} "$SOURCE" -o "$ARCHIVE"
  if ! echo "$SHA256  $ARCHIVE" | sha256sum -c --status; then
    echo "install.sh: $SOURCE does not have sha256 $SHA256: not installed" >&2
    exit 3
  fi
  SOURCE="$ARCHIVE"
else
  case "$SOURCE" in
    http://*) echo "install.sh: warning: $SOURCE over plain http without --sha256:" \
                   "anything on the network could replace it" >&2 ;;
  esac
fi

echo "== agent from $SOURCE"
# --no-deps: numpy (the only dependency) is the pkg build; pip would compile it from source
pip install --no-deps --upgrade ${CA_FILE:+--cert "$CA_FILE"} "$SOURCE"

CONFIG="$HOME/.config/phalanx-agent/config.json"
if [ "$ENROLL" = 1 ] && [ ! -f "$CONFIG" ]; then
  if [ -z "$SERVER" ] || [ -z "$TOKEN" ]; then
    echo "install.sh: --server and --token are needed to enroll (or pass --no-enroll)" >&2
    exit 2
  fi
  echo "== enroll with $SERVER"
  args=(enroll --server "$SERVER" --token "$TOKEN" --config "$CONFIG" "${LABELS[@]}")
  [ -n "$NAME" ] && args+=(--name "$NAME")
  [ -n "$CA_FILE" ] && args+=(--ca-file "$CA_FILE")  # the lab's own certificate
  phalanx-agent "${args[@]}"
fi

echo "== runit service"
# launch.sh starts the agent's current build and rolls a failed upgrade back (agent/slots.py)
AGENT_HOME="$HOME/.local/share/phalanx-agent"
# --release-key: for an agent not from the server's archive (which carries the key itself)
phalanx-agent install-launcher --home "$AGENT_HOME" ${RELEASE_KEY:+--release-key "$RELEASE_KEY"}
SV="$PREFIX/var/service/phalanx-agent"
LOGDIR="$PREFIX/var/log/sv/phalanx-agent"
mkdir -p "$SV/log" "$LOGDIR"
cat > "$SV/run" <<RUN
#!$PREFIX/bin/sh
# Restarted by runit whenever it exits: Android's phantom process killer may end it any time,
# and the agent exits after installing an upgrade for this to start the new build.
exec 2>&1
export PHALANX_AGENT_HOME="$AGENT_HOME" PHALANX_AGENT_PYTHON="$PREFIX/bin/python"
exec sh "$AGENT_HOME/launch.sh" run --config "$CONFIG"
RUN
cat > "$SV/finish" <<'FINISH'
#!/data/data/com.termux/files/usr/bin/sh
# Exit code 3: the control plane revoked this device. Restarting cannot help: stay down.
if [ "$1" = 3 ]; then
  echo "phalanx-agent: device token revoked; enroll again, then: sv up phalanx-agent"
  exec sv down "$(pwd)"  # finish runs in the service folder
fi
sleep 2  # no tight restart loop when the agent cannot start
FINISH
sed -i "1s|.*|#!$PREFIX/bin/sh|" "$SV/finish"
cat > "$SV/log/run" <<LOG
#!$PREFIX/bin/sh
exec svlogd -tt "$LOGDIR"
LOG
chmod 0755 "$SV/run" "$SV/finish" "$SV/log/run"
sv-enable phalanx-agent || echo "sv-enable failed: restart Termux once so termux-services starts, then run: sv-enable phalanx-agent"

echo "== keep the phone awake and start on boot"
termux-wake-lock || true
BOOT="$HOME/.termux/boot"
mkdir -p "$BOOT"
cat > "$BOOT/phalanx-agent" <<BOOTSCRIPT
#!$PREFIX/bin/sh
# Termux:Boot runs this after the phone starts: keep the CPU awake, start the runit services.
termux-wake-lock
. "$PREFIX/etc/profile.d/start-services.sh"
BOOTSCRIPT
chmod 0755 "$BOOT/phalanx-agent"

echo
echo "Installed. Check it:  sv status phalanx-agent ; tail -f $LOGDIR/current"
echo "Android 12+: disable the phantom process killer (see docs/agent.md), or Android kills it."
