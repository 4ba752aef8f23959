"""Test helpers shared by several suites (tests/fake_kubelet.py) are imported by their module name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
