"""phasescope's gRPC front end: settings, validation, the engine adapter, the servicer and the CLI."""
