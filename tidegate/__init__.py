"""tidegate: queue-based LLM inference.

This package holds what every layer shares and nothing else imports upward from:
settings, lanes, the Redis key schema and the token event model. The command line
(`tidegate_tools.cli`) is the one module here that sits on top of everything.
"""

__version__ = "0.1.0"
