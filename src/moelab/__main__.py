import sys

from moelab.cli import main

sys.exit(main())  # (the command leaves by itself when it is done: moelab._alloc.leave)
