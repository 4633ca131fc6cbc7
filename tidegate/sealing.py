"""Secrets sealed at rest: tenants' webhook signing secrets are stored encrypted with a
server key (the `cryptography` package's Fernet: AES-128-CBC with an HMAC-SHA256, so a
token altered in the database fails to open instead of signing with garbage).

    TIDEGATE_WEBHOOK_SECRET_KEY   one or more Fernet keys, comma-separated: the first
                                  seals, every one opens (add a new key first, re-seal,
                                  then drop the old one). Every process that rotates or
                                  signs (the API, `tidegate webhooks`) needs the same.
    (empty)                       a development key in <data_dir>/webhook-secret.key,
                                  made on first use: fine for processes of one machine
                                  sharing one data folder (the demo, the tests), useless
                                  across machines or containers, which must set the key.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from tidegate.settings import Settings

DEV_KEY_FILE = "webhook-secret.key"
KEY_HELP = ("set TIDEGATE_WEBHOOK_SECRET_KEY to a Fernet key, the same in every tidegate "
            "process (make one: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())')")

__all__ = ["InvalidToken", "KeyMissing", "sealer"]


class KeyMissing(RuntimeError):
    """No key to seal or open secrets with; the message says how to give one."""


def sealer(settings: Settings) -> MultiFernet:
    """The sealer of this process's settings: the keys set, or the development key."""
    keys = [k.strip() for k in settings.webhook_secret_key.split(",") if k.strip()]
    if not keys:
        keys = [_dev_key(settings.data_dir / DEV_KEY_FILE)]
    return MultiFernet([Fernet(key) for key in keys])


def _dev_key(path: Path) -> str:
    """The key in `path`, made there (readable by this user only) if there is none: the
    first process to need it writes it, the others read it."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise KeyMissing(f"cannot read the development key {path} ({exc.strerror}): "
                         f"{KEY_HELP}") from None
    # Written whole under a name of its own, then linked into place: a process never
    # reads a half-written key, and of two that race, the first link wins.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(Fernet.generate_key() + b"\n")
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first
    except OSError as exc:
        raise KeyMissing(f"no key for webhook secrets, and the development key cannot be "
                         f"made at {path} ({exc.strerror}): {KEY_HELP}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()
