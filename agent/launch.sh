#!/bin/sh
# Start the Phalanx agent from its current slot (agent/slots.py); runit runs this (install.sh).
#
#   sh $PHALANX_AGENT_HOME/launch.sh run --config CONFIG
#
# A slot installed by an upgrade is on trial until its agent has heartbeated once. Each start
# of a slot on trial is counted; past MAX_STARTS starts it is given up: `current` goes back to
# `previous` and `rolled_back` names the failed slot for the old agent to report. An upgrade
# never replaces this file, so a broken build cannot break the way back.
set -u
HOME_DIR="${PHALANX_AGENT_HOME:-$HOME/.local/share/phalanx-agent}"
PY="${PHALANX_AGENT_PYTHON:-python3}"
MAX_STARTS=3

read_file() { [ -f "$HOME_DIR/$1" ] && cat "$HOME_DIR/$1" || true; }
write_file() { printf '%s\n' "$2" > "$HOME_DIR/.$1.tmp" && mv "$HOME_DIR/.$1.tmp" "$HOME_DIR/$1"; }

slot="$(read_file current)"
if [ -n "$slot" ] && [ -f "$HOME_DIR/trial" ]; then
  starts=$(( $(read_file trial) + 1 ))
  if [ "$starts" -gt "$MAX_STARTS" ]; then
    previous="$(read_file previous)"
    echo "launch.sh: agent slot $slot did not reach the server in $MAX_STARTS starts:" \
         "back to ${previous:-the installed agent}" >&2
    write_file rolled_back "$slot"
    write_file current "$previous"
    rm -f "$HOME_DIR/trial"
    slot="$previous"
  else
    write_file trial "$starts"
  fi
fi
if [ -n "$slot" ] && [ ! -d "$HOME_DIR/slots/$slot" ]; then
  echo "launch.sh: slot $slot is missing: running the installed agent" >&2
  slot=""
fi

export PHALANX_AGENT_HOME="$HOME_DIR"
if [ -n "$slot" ]; then
  export PYTHONPATH="$HOME_DIR/slots/$slot${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$HOME_DIR" || exit 1  # `python -m` puts the working folder first on the path
exec "$PY" -m agent "$@"
