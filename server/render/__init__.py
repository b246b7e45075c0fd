"""Generation events in the wire shapes: chat/completions output and the Responses API's."""
