"""deploy/ (Kubernetes) and docker/ (images, Compose, Prometheus, Grafana), checked without a cluster or a daemon."""
