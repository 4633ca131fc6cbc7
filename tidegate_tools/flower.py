"""Flower's login rules, shared by `tidegate flower` and `tidegate up`."""

from __future__ import annotations

# The password tidegate shipped as Flower's default until it had none: still in configs
# copied from old READMEs, and known to anyone who read them.
OLD_DEFAULT_FLOWER_PASSWORD = "tidegate"


def flower_auth_problem(user: str, password: str) -> str | None:
    """Why Flower must not start behind these credentials (None: it may). Flower shows
    every worker and task and can revoke tasks and shut workers down."""
    if not password:
        return "set TIDEGATE_FLOWER_PASSWORD; Flower does not start without a password"
    if password == OLD_DEFAULT_FLOWER_PASSWORD:
        return "TIDEGATE_FLOWER_PASSWORD is the default tidegate once shipped; choose another"
    if not user or ":" in user or "," in user + password:
        # Flower splits its credential list on commas and a credential on the first colon:
        # a comma would make part of the password a credential of its own.
        return "TIDEGATE_FLOWER_USER must be non-empty without ':' or ','; the password " \
               "without ','"
    return None
