"""Callback URLs: the one parser and the address policy, for the API's check at submit and
for every delivery (tasks/webhooks.py), so what was checked is what is sent to.

    parse_url      the URL, strictly: http or https, a host, no credentials, a port in
                   1-65535, a host that is a DNS name of letters, digits and hyphens, a
                   canonical IPv4 address (a.b.c.d) or a bracketed IPv6 address. Anything
                   else is `UrlMalformed` (400): `2130706433`, `0x7f000001`, `127.1`, `0`,
                   `localhost.`, `a..b`, `[::1`, `:99999`, control characters.
    refusal        why an address may not be called, or None: loopback, private,
                   link-local, CGNAT (100.64/10), multicast, reserved and documentation
                   ranges, unless TIDEGATE_WEBHOOK_ALLOW_PRIVATE (or the host is in
                   TIDEGATE_WEBHOOK_ALLOW_HOSTS); the IPv6 forms that carry an IPv4 address
                   (::ffff:a.b.c.d, ::a.b.c.d, 64:ff9b::/96 and /48, 6to4, Teredo), the
                   unspecified address, multicast and 240/4 never.
    check_url      what the API can say without DNS (a name's addresses are checked when
                   a delivery resolves it).
    vet            a delivery's addresses: the host resolved once, within the attempt's
                   deadline, every address checked; the connection goes to these and no
                   others (tasks/webhook_http.py), so DNS rebinding cannot move it.

The parse is httpx's (`httpx.URL`: IDNA, percent-encoding, control characters, IPv6
literals), with the strict rules above on what it parsed.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tidegate.settings import Settings

MAX_URL = 2048
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# getaddrinfo's signature: (host, port, family, type, proto, flags) -> [(..., sockaddr)]
Resolver = Callable[..., list[tuple[Any, ...]]]

LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# WHATWG's URL parser reads a host whose last label is a number as IPv4 (`127.1`, `0x7f`):
# such a host is an address written some other way, never a name.
NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
# IPv6 forms that carry an IPv4 address: where they lead depends on the network's
# translation, never on the address as written.
EMBEDDED_V4 = tuple(ipaddress.IPv6Network(n) for n in (
    "::ffff:0:0/96",  # IPv4-mapped
    "::/96",  # IPv4-compatible (deprecated): ::a.b.c.d
    "64:ff9b::/96", "64:ff9b:1::/48",  # NAT64, well-known and local-use
    "2002::/16",  # 6to4
    "2001::/32",  # Teredo
))
GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
NEVER_V4 = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4"))  # "this network", multicast, reserved
CGNAT = ipaddress.IPv4Network("100.64.0.0/10")


class UrlRefused(ValueError):
    """A well-formed callback URL the policy refuses (422); the message says why."""


class UrlMalformed(UrlRefused):
    """A callback URL that is not one (400): the message says what is wrong."""


@dataclass(frozen=True)
class CallbackUrl:
    """A parsed callback URL: what a delivery connects to and what it sends."""

    scheme: str  # http or https
    host: str  # the ASCII host: an IDNA name, or an address without brackets
    port: int  # the effective port (80 or 443 when the URL has none)
    target: bytes  # path and query, percent-encoded, as the request line carries them
    literal: Address | None  # the host as an address, when it is one

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def parse_url(url: str) -> CallbackUrl:
    if len(url) > MAX_URL:
        raise UrlMalformed(f"longer than {MAX_URL} characters")
    if url.count("[") != url.count("]"):
        raise UrlMalformed("unbalanced brackets (an IPv6 address is written [2001:db8::1])")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise UrlMalformed(f"not a valid URL ({_plain(str(exc))})") from None
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise UrlRefused("must be an http:// or https:// URL with a host")
    if parsed.userinfo:
        raise UrlMalformed("must not carry credentials (user:password@)")
    port = parsed.port
    if port is not None and not 1 <= port <= 65535:
        raise UrlMalformed("the port must be a number from 1 to 65535")
    host = parsed.raw_host.decode("ascii")
    return CallbackUrl(parsed.scheme, host, port or (443 if parsed.scheme == "https" else 80),
                       parsed.raw_path, _host_literal(host))


def _plain(text: str) -> str:
    """An error message without the characters it complains of."""
    return text.encode("unicode_escape").decode("ascii")[:200]


def _host_literal(host: str) -> Address | None:
    """The host as an address, None for a name; UrlMalformed for neither."""
    if ":" in host:  # httpx only lets a bracketed IPv6 literal through with a colon
        if "%" in host:
            raise UrlMalformed("an IPv6 address may not carry a zone (%)")
        return ipaddress.IPv6Address(host)
    labels = host.split(".")
    if NUMERIC_LABEL.match(labels[-1]):
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            address = None
        if address is None or str(address) != host:
            raise UrlMalformed(f"host {host!r} is an address written in a non-canonical "
                               "form; write it as a.b.c.d")
        return address
    if len(host) > 253 or not all(LABEL.match(label) for label in labels):
        raise UrlMalformed(f"host {_plain(host)!r} is not a DNS name (labels of letters, "
                           "digits and hyphens, 1-63 characters, no trailing dot)")
    return None


# -- the address policy ----------------------------------------------------------------


EMBEDDED = "an IPv6 form of an IPv4 address (write the IPv4 address itself)"


def refusal(address: Address, private_ok: bool) -> str | None:
    """Why `address` may not be called, or None. `private_ok`: loopback, private,
    link-local, CGNAT and other non-public unicast addresses may be."""
    if isinstance(address, ipaddress.IPv6Address):
        return _refusal_v6(address, private_ok)
    if any(address in net for net in NEVER_V4) or address.is_multicast:
        return "an unspecified, multicast or reserved address"
    if not private_ok and (not address.is_global or address in CGNAT):
        return "a private, loopback, link-local or otherwise non-public address"
    return None


def _refusal_v6(address: ipaddress.IPv6Address, private_ok: bool) -> str | None:
    if address.is_loopback:
        return None if private_ok else "a loopback address"
    if address.is_unspecified or address.is_multicast:
        return "an unspecified or multicast address"
    if any(address in net for net in EMBEDDED_V4):
        return EMBEDDED
    if not private_ok and not (address in GLOBAL_UNICAST_V6 and address.is_global):
        return "a private, link-local or otherwise non-public address"
    return None


def _hosts(setting: str) -> set[str]:
    return {h.strip().lower().rstrip(".") for h in setting.split(",") if h.strip()}


def _is_local_name(host: str) -> bool:
    return host == "localhost" or host.endswith(".localhost")


def private_ok(url: CallbackUrl, settings: Settings) -> bool:
    return settings.webhook_allow_private or url.host in _hosts(settings.webhook_allow_hosts)


def check_url(url: str, settings: Settings) -> CallbackUrl:
    """The URL, if the policy allows it as far as can be told without DNS; UrlMalformed
    (400) or UrlRefused (422) otherwise."""
    parsed = parse_url(url)
    check_parsed(parsed, settings)
    return parsed


def check_parsed(url: CallbackUrl, settings: Settings) -> None:
    if url.host in _hosts(settings.webhook_deny_hosts):
        raise UrlRefused(f"host {url.host!r} is denied (TIDEGATE_WEBHOOK_DENY_HOSTS)")
    allowed = private_ok(url, settings)
    if url.literal is not None:
        why = refusal(url.literal, allowed)
        if why is not None:
            raise (UrlMalformed if why == EMBEDDED else UrlRefused)(f"host {url.host!r} is {why}")
    elif _is_local_name(url.host) and not allowed:
        raise UrlRefused(f"host {url.host!r} is a loopback name")


# -- a delivery's addresses ------------------------------------------------------------


class ResolveFailed(Exception):
    """The host did not resolve (or raised while resolving: getaddrinfo raises more than
    OSError, e.g. UnicodeError); `timed_out` when the deadline passed first."""

    def __init__(self, timed_out: bool) -> None:
        super().__init__("timed out" if timed_out else "did not resolve")
        self.timed_out = timed_out


def vet(url: CallbackUrl, settings: Settings, deadline: float,
        resolve: Resolver | None = None) -> list[str]:
    """The addresses a delivery may connect to: the literal, or the host resolved once
    (before `deadline`, a time.monotonic()); UrlRefused when any of them is refused."""
    check_parsed(url, settings)
    if url.literal is not None:
        return [str(url.literal)]
    infos = _resolve_within(url.host, url.port, deadline, resolve or socket.getaddrinfo)
    addresses = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0])
                                   for info in infos))
    allowed = private_ok(url, settings)
    for address in addresses:
        why = refusal(address, allowed)
        if why is not None:  # the address stays out of the message: it goes to the tenant
            raise UrlRefused(f"host {url.host!r} resolves to {why}")
    if not addresses:
        raise ResolveFailed(timed_out=False)
    return [str(a) for a in addresses]


def _resolve_within(host: str, port: int, deadline: float,
                    resolve: Resolver) -> list[tuple[Any, ...]]:
    """getaddrinfo has no timeout: it runs on a thread of its own, waited on until the
    deadline (a resolver that hangs keeps only that thread, until the system's resolver
    gives up)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["infos"] = resolve(host, port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        except Exception:  # noqa: BLE001 - UnicodeError, OSError, ...: the host is unusable
            box["failed"] = True

    thread = threading.Thread(target=run, name="webhook-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if "infos" in box:
        return list(box["infos"])
    raise ResolveFailed(timed_out="failed" not in box)
