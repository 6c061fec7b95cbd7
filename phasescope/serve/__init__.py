"""The gRPC front end: settings, admission, the request lifecycle, the protocol handlers, the server process."""
