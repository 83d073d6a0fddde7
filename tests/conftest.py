import os
import sys

# worlds.py and the test modules are imported by name in spawned children.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
