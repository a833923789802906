import sys

from cputrain.cli import main

if __name__ == "__main__":  # tokenizing workers are spawned: importing this must not start a run
    sys.exit(main())
