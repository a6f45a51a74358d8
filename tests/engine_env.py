"""Where the engine tests keep the tiny model and which loopback ports their servers use."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("BLACKBOX_CACHE", ROOT / ".blackbox-cache"))
BASE_PORT = int(os.environ.get("BLACKBOX_TEST_PORT", "8170"))
