"""Settings of the webhook sender (`tidegate webhooks`): its URL policy, deadlines and
retries, concurrency caps, proxy and signing secrets; and the background processes'
niceness. One group of `tidegate.settings.Settings`' fields.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator


class WebhookSettings(BaseModel):
    """The webhook sender and the background processes' niceness."""

    # Webhooks (tasks/webhooks.py, `tidegate webhooks`): the URL policy, each attempt's
    # total deadline (DNS, connect, TLS, send and read together), the first retry's delay
    # (doubling, capped at an hour, with jitter), when a delivery gives up, the delivery
    # threads, the dispatcher's period, and how long a rotated signing secret keeps
    # signing beside the new one.
    # The batch driver and the webhook sender are background work: what a hostile tenant's
    # bad batches or slow receivers cost them must come after the API's and the workers'
    # CPU on a node they share (tidegate/niceness.py).
    background_nice: int = Field(
        5, ge=0, le=19,
        description="OS niceness (0-19) of the batch driver (`tidegate batches`) and the "
        "webhook sender (`tidegate webhooks`): their CPU comes after the API's and the "
        "lanes' workers' at a lower cpu_nice on a shared node.")
    webhook_allow_private: bool = Field(
        False,
        description="Let callback URLs reach private, loopback, link-local and CGNAT addresses "
        "(the unspecified address, multicast and 240/4 never pass).")
    webhook_allow_hosts: str = Field(
        "",
        description="Comma-separated hosts allowed even on private addresses.")
    webhook_deny_hosts: str = Field(
        "",
        description="Comma-separated hosts never called.")
    webhook_timeout_s: float = Field(
        10.0, gt=0,
        description="Each webhook attempt's total deadline: DNS, connect, TLS, send and read "
        "together.")
    webhook_backoff_s: float = Field(
        5.0, gt=0,
        description="The first webhook retry's delay, doubling after each failure, capped at an "
        "hour, with jitter.")
    webhook_give_up_s: float = Field(
        86400.0, gt=0,
        description="A webhook delivery gives up (failed, gave_up) this long after its job's end.")
    webhook_concurrency: int = Field(
        16, gt=0,
        description="Delivery threads per tidegate webhooks process.")
    webhook_dispatch_s: float = Field(
        1.0, gt=0,
        description="The webhook dispatcher's period: how often due deliveries are claimed.")
    webhook_secret_overlap_s: float = Field(
        86400.0, ge=0,
        description="How long a rotated signing secret keeps signing beside the new one.")
    # Webhooks, hardened (docs/api.md, "Webhooks"): deliveries in flight at once per tenant and
    # per host across every webhook process (over a cap a delivery waits, it does not
    # fail); a proxy every delivery goes through (empty: none; the proxy then decides
    # where a delivery may go); the key(s) sealing signing secrets at rest (Fernet keys,
    # comma-separated, the first seals; empty: a development key file in data_dir,
    # tidegate/sealing.py); live signing secrets a tenant may hold (rotation ends the
    # oldest beyond it).
    webhook_tenant_concurrency: int = Field(
        8, gt=0,
        description="Webhook deliveries in flight at once per tenant, across every webhook "
        "process; over the cap a delivery waits (deferred, not failed).")
    webhook_host_concurrency: int = Field(
        8, gt=0,
        description="Webhook deliveries in flight at once per receiving host, across every "
        "webhook process; over the cap a delivery waits (deferred, not failed).")
    webhook_proxy_url: str = Field(
        "",
        description="An http:// or https:// proxy every webhook delivery goes through; the proxy "
        "then resolves names and must enforce egress itself. Empty: none.")
    webhook_secret_key: str = Field(
        "", repr=False,
        description="The Fernet key(s) sealing webhook signing secrets at rest, comma-separated; "
        "the first seals, every one opens. Required on containers and across machines; empty: a "
        "development key file in TIDEGATE_DATA_DIR.")
    webhook_max_secrets: int = Field(
        3, gt=0,
        description="Live signing secrets per tenant; a rotation ends the oldest beyond it.")

    @field_validator("webhook_proxy_url")
    @classmethod
    def _proxy_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// proxy URL")
        return v

    @field_validator("webhook_secret_key")
    @classmethod
    def _fernet_keys(cls, v: str) -> str:
        from cryptography.fernet import Fernet

        for key in filter(None, (k.strip() for k in v.split(","))):
            try:
                Fernet(key)
            except ValueError:
                raise ValueError("each key must be a Fernet key (32 url-safe base64-encoded "
                                 "bytes: Fernet.generate_key())") from None
        return v
