"""The OpenAI Batch API: uploaded JSONL files (`files`), batch objects and their progress
(`store`), the runner duty any gateway replica can hold (`runner`, `line`), and the HTTP routes
(`routes`). docs/clients.md "Batch API" says what a client sees; docs/operations.md where it lives.
"""
