"""The worker process: one device, one model, one engine, talking to the gateway over ZeroMQ."""
