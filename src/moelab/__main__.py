import sys

from moelab.cli import main
from moelab.progress import phase

code = main()
phase("exit")  # MOELAB_TIMING=1: the command is done; what follows is the interpreter's shutdown
sys.exit(code)
