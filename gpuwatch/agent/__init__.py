"""The node agent: NVML and host sampling, job discovery, durable spool, gRPC uplink."""
