"""The contract between producers and workers: the Celery app, lane queues, task names
and payloads. Nothing here runs a generation; `workers/` registers the code under the
names declared here."""
