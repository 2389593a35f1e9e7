"""The bottom layer, shared by every role: the environment, the wire protocol, CURVE
authentication, compression_params validation, the scheduler client, buffer memory,
tracing, rate limiting and connection striping. It imports nothing else of bps."""
