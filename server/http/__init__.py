"""The HTTP edge: keys, CORS, body limits, request ids, disconnects, the process, errors."""
