"""phasescope wire contract (generated code lives in phasescope.v1)."""
