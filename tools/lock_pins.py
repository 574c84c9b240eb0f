"""The lock's versions as `name==version` lines: pylock.toml (PEP 751) is what installs read,
but uv takes constraints (`-c`) only in requirements format, and the wheel check and
benchmarks/newest_releases.py constrain other installs to the locked versions.

    python tools/lock_pins.py [pylock.toml] > constraints.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "pylock.toml"


def pins(lock: Path = LOCK) -> dict[str, str]:
    """Package name (as the lock spells it) -> its locked version."""
    with open(lock, "rb") as f:
        return {p["name"]: p["version"] for p in tomllib.load(f)["packages"]}


if __name__ == "__main__":
    lock = Path(sys.argv[1]) if len(sys.argv) > 1 else LOCK
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in pins(lock).items()))
