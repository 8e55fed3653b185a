"""The OpenAI-compatible HTTP transport (docs/clients.md): a thin adapter over the request core.

* routes.py      the `/v1/...` handlers: parse, start or resume through the core, respond;
* front.py       `HttpFront`: what the HTTP handlers may reach (built by the composition root);
* schema.py      the request bodies and their translation into `generate` fields;
* errors.py      OpenAI's error shape and the HTTP status of each gateway error code;
* session.py     one request as a session (`HttpSession`) and the ASGI response driving it;
* response.py    `OpenAIResponse`: the session's `Writer`, as SSE chunk events or one JSON body;
* choices.py     `n`: one request per choice, their seeds and the answer's usage;
* logprobs.py, structured.py, tool_calls.py   logprobs, structured output and tool calls both ways;
* tokenize.py    vLLM's `/tokenize` and `/detokenize`, a request/reply with a live worker.
"""
