"""The HTTP API: request and response models, parsing, the OpenAI routes' handlers, OpenAPI."""
