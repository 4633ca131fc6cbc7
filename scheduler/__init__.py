"""Control-plane decisions: routing jobs to queues; forecasting, pre-warming and health
come with the standby pool."""
