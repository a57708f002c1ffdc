"""Helpers of this folder (``regex_strategies``) are imported as top-level modules."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
