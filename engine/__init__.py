"""The training engine: numpy layers (torch optional), models, sampler, optimizer, step.

See docs/engine.md; the seams other parts use are listed in docs/contracts.md.
"""
