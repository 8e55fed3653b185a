"""The stateless WebSocket gateway: clients <-> Redis Streams <-> workers.

No request state lives only in a gateway process: the request stream, each request's output
stream, the client-id alias and the orphan list are in Redis, so any replica can serve a
`resume` and a replica can die without losing a token.
"""
