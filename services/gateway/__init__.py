"""Gateway role (HTTP, OpenAI API, routing, streaming, metrics): lands with the service pipeline."""
