"""Phalanx command lines: `phalanx server|worker|demo|train|sim|devices|jobs|...`."""

__version__ = "0.1.0"
