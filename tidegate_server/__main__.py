"""`python -m tidegate_server ...`: the `tidegate` command."""

from tidegate_server import main

# Guarded: a process started with multiprocessing's spawn (vLLM's engine core) imports
# this module again as `__mp_main__`, which must not run the command a second time.
if __name__ == "__main__":
    main()
