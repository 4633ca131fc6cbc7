"""tidegate: queue-based LLM inference.

This package holds what every layer shares and nothing else imports upward from:
settings, lanes, the Redis key schema, the token event model and the router (a pure
function of the fleet it is shown, which the API and the scheduler both call). The command
line (`tidegate_tools.cli`) is the one module here that sits on top of everything.
"""

__version__ = "0.1.0"
