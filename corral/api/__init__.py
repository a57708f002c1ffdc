"""The ways in: the OpenAI-compatible server, the Python helper and the CLI."""
