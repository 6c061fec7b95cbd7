"""Generated from inference.proto by `make proto`; do not edit."""
