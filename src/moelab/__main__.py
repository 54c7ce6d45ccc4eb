import atexit
import os
import sys
import threading

from moelab.cli import main
from moelab.progress import phase

code = main()
phase("exit")  # MOELAB_TIMING=1: the command is done; what follows is the interpreter's shutdown
if threading.active_count() == 1:
    # nothing left running: the exit handlers (JAX's, a distributed job's shutdown, multiprocessing's,
    # logging's), then out, without tearing down every module and XLA's client one object at a time
    # (a second or more after a training run on 2 cores, for nothing)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(code or 0))
sys.exit(code)
