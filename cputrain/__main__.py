import gc
import sys

from cputrain.cli import main

if __name__ == "__main__":  # tokenizing workers are spawned: importing this must not start a run
    code = main()
    # The process ends here: the interpreter's last garbage collection would walk every object
    # torch and transformers made (about 1.5 s at the end of every run and rank, measured), to
    # free memory the kernel takes back at once. Frozen objects are left out of it; atexit
    # handlers and the modules' teardown (which closes files) still run.
    gc.freeze()
    sys.exit(code)
