"""Debian's chromium for the page tests (driven by Playwright with `executable_path`, never a browser
download): where it is, and why a page test is skipped when it or Playwright is missing."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else None)
if importlib.util.find_spec("playwright") is None:
    MISSING: str | None = "playwright not installed: no module named 'playwright'"
else:
    MISSING = None if CHROMIUM else "chromium not installed: no `chromium` on PATH (.ci/run installs it)"
