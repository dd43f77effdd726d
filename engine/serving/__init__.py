"""The API-server process: HTTP and the OpenAI API, API keys and quotas, tokenization and streaming, metrics, and
the client of the engine core, which it reaches only through `kiln.engine.messages`. It never imports torch."""
