"""The wire schema: OpenAI's request and answer models, the admin API's, tool calls."""
