"""Control-plane decisions: forecasting, pre-warming and health come with the standby pool.
The router they use is pure and in the core (tidegate/router.py), where the API uses it too."""
