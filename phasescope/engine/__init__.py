"""The engine behind the request path, whichever protocol the request came in by.

`base` is the `Engine` protocol, `request` the request it is asked for, `vllm` its implementation
over vLLM (the only room that imports vLLM) and `default_model` the embedded default model."""
