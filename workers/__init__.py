"""What runs on a GPU node: engine adapters, the engine host, the token publisher, the
Celery bootsteps and the generate task body. Only the adapters import an engine."""
