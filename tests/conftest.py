"""Every test runs with the adaptive policy's memory off (``FLASHTREE_POLICY_CACHE=off``; command-line
tests' subprocesses inherit it): no test reads what an earlier run learned or writes to the user's
cache directory. Tests of the memory point it at a temporary directory themselves."""

import os

os.environ["FLASHTREE_POLICY_CACHE"] = "off"
