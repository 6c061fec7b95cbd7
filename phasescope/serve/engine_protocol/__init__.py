"""vLLM's engine protocol (vllm.grpc.engine.VllmEngine, from smg-grpc-proto) served over the shared request lifecycle.

Beside `phasescope.v1`, a phasescope worker answers the protocol the smg gateway drives vLLM's own
gRPC worker with, so the gateway drives phasescope exactly as it drives vLLM.
"""
