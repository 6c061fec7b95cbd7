"""Everything that imports vLLM: the `Engine` over `AsyncLLM` (engine), phasescope's scheduler that reports
each step inside the engine core (core_telemetry), vLLM's own Prometheus logger in the pipeline (stats), the KV
connector and the CPU sampling remedy.

vLLM's request and scheduler statistics are documented as unstable interfaces;
keeping every reader of them here keeps an upgrade's blast radius to this
package (an import-linter contract in pyproject.toml holds the line).
"""

TELEMETRY_SCHEDULER = "phasescope.engine.vllm.core_telemetry.TelemetryScheduler"
"""The scheduler class each engine core loads to report its steps (`--scheduler-cls`), named without importing vLLM."""
ASYNC_TELEMETRY_SCHEDULER = "phasescope.engine.vllm.core_telemetry.AsyncTelemetryScheduler"
"""The same, under vLLM's async scheduling (`--async-scheduling`)."""
