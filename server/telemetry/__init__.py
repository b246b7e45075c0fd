"""What the server tells about itself: Prometheus metrics, the access log, log lines."""
