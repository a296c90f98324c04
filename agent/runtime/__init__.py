"""The agent's runtime: `agent.AgentRuntime` wires the heartbeat loop (`heartbeat`, `buffer`),
the work loop (`work`, `cache`, `ledger`), the phone-first guard (`guard`, `monitor`) and the
execution choice (`choice`, `execution`, `executor`, and the `worker` subprocess)."""
