"""The Phalanx phone agent: standard library + numpy (torch and psutil where installed).

Never imports `api` or `scheduler`: it must install on a phone on its own.
"""

__version__ = "0.1.0"
