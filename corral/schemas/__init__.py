"""Wire models of the OpenAI protocol (pydantic) and their mapping to internal requests."""
