"""Ways in: the OpenAI-compatible HTTP server (`api_server`) and the `asyncexec` command line (`cli`)."""
