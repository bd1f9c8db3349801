"""Between the API and the engines: routing, the reply channel, failover, output processing."""
