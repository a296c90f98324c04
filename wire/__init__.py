"""What travels between a phone and the control plane: the binary message formats of the step
protocol (`wire.messages`) and the socket options both ends set for bulk transfers
(`wire.sockopts`). Standard library + numpy, and the engine's result types: the phone install
ships it beside `agent` and `engine`.
"""
