"""tidegate's tools: the `tidegate` command, the worker supervisor, the demo, the one stack
launcher and the test-checkpoint builders.

This package sits above every layer and imports any of them; nothing in the system imports
it (tests and benchmarks do).
"""
