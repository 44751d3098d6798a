"""A plug-in module (``task.imports=[tests.slow_store_build]``) that makes rank 0's teacher-store
build announce itself and then hang, so a test can stop rank 0 in the middle of it."""

from __future__ import annotations

import os
import sys
import time

from kdrun.engine import teacher_store

_real = teacher_store.build_store


def _slow(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        print("[slow_store_build] rank 0 is building", flush=True)
        sys.stdout.flush()
        time.sleep(600)
    return _real(*args, **kwargs)


teacher_store.build_store = _slow
