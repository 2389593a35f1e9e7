"""The bottom layer, shared by every role: the environment, the wire protocol, CURVE
authentication, the shared compression_params keys and their rules, the scheduler
client, buffer memory, tracing, rate limiting and connection striping. It imports
nothing else of bps."""
