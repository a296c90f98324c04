"""What every test that starts a process shares: the admin token its servers get, and the
environment without the developer's own PHALANX_* settings (a test sets what it needs)."""

from __future__ import annotations

import os
from collections.abc import Mapping

ADMIN_TOKEN = "phx-admin-test-" + "0" * 24


def without_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) less every PHALANX_* variable."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if not k.startswith("PHALANX_")}
