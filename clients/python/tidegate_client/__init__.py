"""tidegate's Python SDK: `Client` / `AsyncClient` to submit jobs and stream their
tokens, typed answers, and `verify_webhook` for a webhook receiver."""

from tidegate_client.client import AsyncClient, Client, StreamError, TidegateError
from tidegate_client.models import Accepted, Event, Job
from tidegate_client.webhooks import WebhookVerificationError, verify_webhook

__all__ = ["Accepted", "AsyncClient", "Client", "Event", "Job", "StreamError",
           "TidegateError", "WebhookVerificationError", "verify_webhook"]
