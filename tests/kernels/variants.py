"""Running a check in a fresh interpreter with one native variant forced (the variant is chosen when the module
loads, so a process can hold only one)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def report_in_variant(script: str, **env: str) -> dict:
    """The JSON object ``script`` prints last, run from the checkout's root with ``env`` added to the environment;
    the script's own failure fails the caller with its stderr."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
