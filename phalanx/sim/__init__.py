"""Simulated phones: device profiles, physics, the files the agent reads, and a fleet load tool."""
