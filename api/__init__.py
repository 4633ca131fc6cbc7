"""The front door: jobs API, SSE token streams, health and metrics; and the client SDK."""
