"""HTTP entry points: the OpenAI-compatible aiohttp app (api_server), its handlers and protocol."""
