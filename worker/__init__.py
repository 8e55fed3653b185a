"""The worker: reads requests from Redis Streams and runs them on the continuous-batching engine."""
