import sys

from cputrain.cli import main

sys.exit(main())
