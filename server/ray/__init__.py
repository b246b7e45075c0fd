"""hotlora on Ray Serve: the Serve app, the cluster's adapter registry, the request relay."""
